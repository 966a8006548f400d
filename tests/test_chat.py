"""render_user_turn: where the chat template comes from, and how it renders (as
transformers' apply_chat_template renders it: its globals and filters, trimmed blocks)."""

from __future__ import annotations

import json

import pytest

from aotc.chat import render_user_turn
from aotc.errors import ConfigError

TURN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def folder(tmp_path, config=None, jinja=None):
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def test_the_template_of_tokenizer_config_renders_one_user_turn(tmp_path):
    assert render_user_turn(folder(tmp_path, {"chat_template": TURN}), "hi") == "<user>hi</user><assistant>"


@pytest.mark.parametrize("config", [None, {"bos_token": "<s>"}], ids=["no-tokenizer-config", "config-without-template"])
def test_chat_template_jinja_is_read_where_tokenizer_config_has_none(tmp_path, config):
    """Newer transformers save the template as chat_template.jinja beside the config."""
    assert render_user_turn(folder(tmp_path, config, jinja=TURN), "hi") == "<user>hi</user><assistant>"


def test_tokenizer_config_template_wins_over_the_jinja_file(tmp_path):
    assert render_user_turn(folder(tmp_path, {"chat_template": "[{{ messages[0].content }}]"}, jinja=TURN), "hi") == "[hi]"


def test_named_templates_render_the_default_one(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, "not a record", {"name": "default", "template": TURN}]
    assert render_user_turn(folder(tmp_path, {"chat_template": named}), "hi") == "<user>hi</user><assistant>"
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: no chat_template \(and no chat_template.jinja beside it\)"):
        render_user_turn(folder(tmp_path, {"chat_template": [{"name": "tool_use", "template": "tools"}]}), "hi")


def test_special_tokens_reach_the_template_as_strings(tmp_path):
    config = {"chat_template": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}", "bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "pad_token": None}
    assert render_user_turn(folder(tmp_path, config), "hi") == "<s>|</s>|None"


def test_transformers_globals_and_filters(tmp_path):
    config = {"chat_template": "{{ messages | tojson }}"}
    assert render_user_turn(folder(tmp_path, config), "café") == '[{"role": "user", "content": "café"}]'  # non-ASCII kept
    config = {"chat_template": "{{ strftime_now('%Y') | length }}"}
    assert render_user_turn(folder(tmp_path, config), "hi") == "4"
    config = {"chat_template": "{% for m in messages %}{{ m.role }}{% break %}{% endfor %}x"}  # loop controls
    assert render_user_turn(folder(tmp_path, config), "hi") == "userx"
    config = {"chat_template": "{{ raise_exception('only user and assistant roles') }}"}
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: its chat_template failed to render: only user and assistant roles"):
        render_user_turn(folder(tmp_path, config), "hi")


def test_blocks_are_trimmed_as_transformers_renders_them(tmp_path):
    """trim_blocks and lstrip_blocks: a tag's own line leaves no newline or indent behind."""
    config = {"chat_template": "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"}
    assert render_user_turn(folder(tmp_path, config), "hi") == "[hi]\n"


def test_a_template_that_is_not_text_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"no chat_template"):
        render_user_turn(folder(tmp_path, {"chat_template": 42}), "hi")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no chat_template"):
        render_user_turn(folder(tmp_path / "empty"), "hi")


def test_each_template_is_compiled_once(tmp_path):
    """A batch of --chat prompts renders one template: Jinja compiles it once."""
    from aotc.chat import _compiled

    assert _compiled(TURN) is _compiled(TURN) and _compiled(TURN) is not _compiled(TURN + " ")
