"""What `aotc run` prints around the generated text: how each sequence ended, and timings."""

from __future__ import annotations

import json
import shutil

from tokenizers import Tokenizer
from typer.testing import CliRunner

from aotc.cli import _Stream, app
from aotc.runtime.generate import Sequence

runner = CliRunner()
TURN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"


def eager(model, *args):
    r = runner.invoke(app, ["run", str(model), "--eager", "--prompt", "Hello", *map(str, args)])
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split())


def greedy(model, n):
    return json.loads(runner.invoke(app, ["run", str(model), "--eager", "--prompt", "Hello", "--max-new-tokens", str(n), "--json"]).output)["prompts"][0]["new_ids"]


def test_a_cut_at_the_token_limit_is_noted_and_a_stop_is_not(tiny_dir, tmp_path):
    model = shutil.copytree(tiny_dir, tmp_path / "m")
    ids = greedy(model, 4)
    assert "note: prompt 0 stopped at 4 new tokens (--max-new-tokens) before a stop token; --max-new-tokens N generates more" in eager(model, "--max-new-tokens", 4)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[2], "max_new_tokens": 2}))
    assert "note: prompt 0 stopped at 2 new tokens (generation_config.json's max_new_tokens) before a stop token" in eager(model)
    assert "stopped at" not in eager(model, "--max-new-tokens", 4)  # the third token is a stop token


def test_a_stop_token_first_without_chat_names_the_folder_s_chat_template(tiny_dir, tmp_path):
    model = shutil.copytree(tiny_dir, tmp_path / "m")
    (model / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))  # aotc init tiny writes a template: none here
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": greedy(model, 1)[0]}))
    assert "chat template" not in eager(model)  # none in the folder
    (model / "chat_template.jinja").write_text(TURN)
    said = eager(model)
    assert f"note: the model answered with a stop token at once; {model} has a chat template: run with --chat to send each prompt as a user turn" in said
    assert "answered with a stop token" not in eager(model, "--chat")


def test_an_eager_run_reports_no_bundle_load(tiny_dir):
    said = eager(tiny_dir, "--max-new-tokens", 2)
    assert "eager: time to first token" in said and "bundle load" not in said


def test_a_streamed_prompt_prints_no_stop_token(tiny_dir, capsys):
    """The batch view and --json's text decode without special tokens; a single streamed
    prompt printed the stop token (`... Paris.<|im_end|>`)."""
    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    words = tokenizer.encode("one two", add_special_tokens=False).ids
    seq = Sequence(prompt_ids=[1, 5])
    with _Stream(["hi"], [seq.prompt_ids], tokenizer, []) as stream:
        for t in [*words, tokenizer.token_to_id("</s>")]:
            seq.new_ids.append(t)
            stream.token(0, seq)
    out = capsys.readouterr().out
    assert out.rstrip().endswith(tokenizer.decode(words)) and "</s>" not in out


def test_messages_files_are_conversations_through_the_chat_template(tiny_bundle, tiny_dir, tmp_path):
    """--messages FILE.json: the OpenAI message list (a system prompt, earlier turns), one
    prompt each, rendered as transformers' apply_chat_template renders it; after the
    --prompt ones. A file that is not such a list is refused naming it and the message."""
    from transformers import AutoTokenizer

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    r = runner.invoke(app, ["run", str(tiny_bundle.out), "--prompt", "Hello", "--messages", str(tmp_path / "chat.json"), "--max-new-tokens", "3", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    expected = AutoTokenizer.from_pretrained(tiny_dir).apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    assert [p["prompt"] for p in report["prompts"]] == ["Hello", "Bye"] and report["prompts"][1]["prompt_ids"] == expected
    (tmp_path / "bad.json").write_text(json.dumps([{"role": "user", "content": "Hi"}, {"role": "robot", "content": "x"}]))
    r = runner.invoke(app, ["run", str(tiny_bundle.out), "--messages", str(tmp_path / "bad.json")], env={"COLUMNS": "400"})
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and f"--messages {tmp_path / 'bad.json'}: message 1 is" in said and "one of system, user, assistant" in said, said
