"""`aotc run --chat`: a prompt as the model's chat template renders one user turn.

The template is Jinja, from tokenizer_config.json's `chat_template` (or the
chat_template.jinja file that newer transformers writes beside it). It is
data from the model folder, so it renders in jinja2's immutable sandbox, with
the globals and filters that transformers' `apply_chat_template` gives
templates: `raise_exception`, `strftime_now`, and a `tojson` that keeps
non-ASCII text. The result is then tokenized without adding special tokens:
the template writes its own.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from .errors import ConfigError
from .models.config import model_file, read_json_object


def _read(model_dir: Path) -> tuple[str, dict, Path]:
    """The chat template, the special tokens it is given, and the file it came from."""
    path = model_file(model_dir, "tokenizer_config.json")
    config = read_json_object(path) if path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t.get("template") for t in template if isinstance(t, dict) and isinstance(t.get("name"), str)}
        template = named.get("default")
    jinja_file = model_file(model_dir, "chat_template.jinja")
    source = path
    if template is None and jinja_file.is_file():
        source = jinja_file
        try:
            template = jinja_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{jinja_file}: not UTF-8 text ({e}); a chat template is a UTF-8 Jinja file") from None
    if not isinstance(template, str):
        raise ConfigError(
            f"{path}: no chat_template (and no chat_template.jinja beside it); --chat needs the model's chat template. Run without --chat to send the prompt as plain text"
        )
    specials = {}
    for key, value in config.items():  # bos_token, eos_token, ...: a string or an AddedToken record
        if key.endswith("_token"):
            specials[key] = value.get("content") if isinstance(value, dict) else value
    return template, specials, source


def has_chat_template(model_dir: Path) -> bool:
    """Whether the folder carries a chat template (what --chat would render through)."""
    try:
        _read(model_dir)
    except ConfigError:
        return False
    return True


# Limits on rendering a chat template, data from the model folder: its time, its output,
# and what one `*` or `**` may make. A chat turn renders in milliseconds, to kilobytes.
RENDER_SECONDS = 5.0
RENDER_CHARS = 1 << 24
_deadline = threading.local()  # per thread: a library caller may render from several


class _Limit(Exception):
    pass


def _sandbox():
    from jinja2 import FunctionLoader, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    def no_other_templates(name):
        raise TemplateError(f"it includes, imports or extends {name!r}; a chat template is one self-contained template")

    class Sandbox(ImmutableSandboxedEnvironment):
        """jinja2's immutable sandbox, with a deadline checked at every call, attribute,
        item and arithmetic operation (a loop of nothing but those is bounded by them),
        `*` and `**` bounded in what they make, and an unsafe attribute an error."""

        intercepted_binops = frozenset({"*", "**"})

        def tick(self):
            if time.monotonic() > getattr(_deadline, "at", float("inf")):
                raise _Limit(f"it took more than {RENDER_SECONDS:g} s")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            __self.tick()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            self.tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self.tick()
            return super().getitem(obj, argument)

        def unsafe_undefined(self, obj, attribute):
            # jinja2 renders an unsafe attribute as an empty Undefined; say so instead
            raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")

        def call_binop(self, context, operator, left, right):
            self.tick()
            if operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > RENDER_CHARS:
                    raise _Limit(f"a repetition of {len(seq)} x {n} items is more than {RENDER_CHARS}")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(right) > 64 and abs(left) > 1:
                raise _Limit(f"{left} ** {right} is larger than a chat template needs")
            return super().call_binop(context, operator, left, right)

    return Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], loader=FunctionLoader(no_other_templates))


@lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2 import TemplateError

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = _sandbox()
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def render_user_turn(model_dir: Path, text: str) -> str:
    """The template's rendering of one user message, with the assistant's turn opened,
    within the limits above."""
    return render_messages(model_dir, [{"role": "user", "content": text}])


def render_messages(model_dir: Path, messages: list[dict]) -> str:
    """The template's rendering of a conversation (system, user and assistant turns, as
    transformers' apply_chat_template takes them), with the assistant's turn opened,
    within the limits above."""
    template, specials, source = _read(model_dir)
    _deadline.at = time.monotonic() + RENDER_SECONDS
    out, size = [], 0
    try:
        for chunk in _compiled(template).generate(messages=messages, add_generation_prompt=True, **specials):
            size += len(chunk)
            if size > RENDER_CHARS:
                raise _Limit(f"its output is longer than {RENDER_CHARS} characters")
            out.append(chunk)
    except Exception as e:  # the template is data: whatever it does wrong, name it (SecurityError, range's cap, 1/0, ...)
        what = str(e) if isinstance(e, _Limit) or type(e).__module__.startswith("jinja2") else f"{type(e).__name__}: {e}"
        raise ConfigError(f"{source}: its chat_template failed to render: {what}") from None
    finally:
        _deadline.at = float("inf")
    return "".join(out)


ROLES = ("system", "user", "assistant")


def read_messages(path: Path) -> list[dict]:
    """A conversation from a JSON file: the OpenAI message list, [{"role": "system" |
    "user" | "assistant", "content": TEXT}, ...] (aotc run --messages)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"--messages {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f'--messages {path}: not JSON ({e}); expected a list of {{"role": ..., "content": ...}} messages') from None
    if not isinstance(data, list) or not data:
        raise ConfigError(f"--messages {path}: expected a non-empty JSON list of messages, got {type(data).__name__}")
    for i, m in enumerate(data):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ConfigError(f'--messages {path}: message {i} is {json.dumps(m)[:80]}; expected {{"role": one of {", ".join(ROLES)}, "content": text}}')
    return data
