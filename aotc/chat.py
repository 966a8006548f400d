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
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from .errors import ConfigError
from .models.config import read_json_object


def _read(model_dir: Path) -> tuple[str, dict]:
    path = Path(model_dir) / "tokenizer_config.json"
    config = read_json_object(path) if path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = Path(model_dir) / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    if not isinstance(template, str):
        raise ConfigError(
            f"{path}: no chat_template (and no chat_template.jinja beside it); --chat needs the model's chat "
            "template. Run without --chat to send the prompt as plain text"
        )
    specials = {}
    for key, value in config.items():  # bos_token, eos_token, ...: a string or an AddedToken record
        if key.endswith("_token"):
            specials[key] = value.get("content") if isinstance(value, dict) else value
    return template, specials


def has_chat_template(model_dir: Path) -> bool:
    """Whether the folder carries a chat template (what --chat would render through)."""
    try:
        _read(model_dir)
    except ConfigError:
        return False
    return True


@lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def render_user_turn(model_dir: Path, text: str) -> str:
    """The template's rendering of one user message, with the assistant's turn opened."""
    from jinja2 import TemplateError

    template, specials = _read(model_dir)
    try:
        return _compiled(template).render(messages=[{"role": "user", "content": text}], add_generation_prompt=True, **specials)
    except TemplateError as e:
        raise ConfigError(f"{Path(model_dir) / 'tokenizer_config.json'}: its chat_template failed to render: {e}") from None
