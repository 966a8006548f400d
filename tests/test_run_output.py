"""What `aotc run` prints around the generated text: how each sequence ended, and timings."""

from __future__ import annotations

import json
import shutil

from tokenizers import Tokenizer
from typer.testing import CliRunner

from aotc.cli import app
from aotc.cli.run import _Stream
from aotc.runtime.completion import token_events
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
    with _Stream(["hi"], [seq.prompt_ids], []) as stream:
        emit, _ = token_events(tokenizer, 1, 8, [tokenizer.token_to_id("</s>")], (), stream.event)
        for t in [*words, tokenizer.token_to_id("</s>")]:
            seq.new_ids.append(t)
            emit(0, seq)
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


def test_run_samples_with_a_seed_and_cuts_at_a_stop_string(tiny_bundle, tiny_dir):
    """--temperature/--top-p/--top-k/--min-p/--seed pass through, on a bundle and with
    --eager alike; --stop cuts the text before the string; greedy stays the default and
    --check stays greedy. Errors name the option."""
    run = lambda *a: runner.invoke(app, ["run", str(tiny_bundle.out), "--prompt", "Hello", "--max-new-tokens", "10", "--json", *map(str, a)])  # noqa: E731
    ids = lambda r: json.loads(r.output)["prompts"][0]["new_ids"]  # noqa: E731
    sampled = [run("--temperature", "1.0", "--top-p", "0.95", "--top-k", "40", "--min-p", "0.01", "--seed", s) for s in (5, 5, 6)]
    assert all(r.exit_code == 0 for r in sampled), sampled[0].output
    greedy = run()
    assert ids(sampled[0]) == ids(sampled[1]) != ids(sampled[2]) and ids(sampled[0]) != ids(greedy)
    eager_run = runner.invoke(
        app,
        [
            "run",
            str(tiny_dir),
            "--eager",
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "10",
            "--json",
            "--temperature",
            "1.0",
            "--top-p",
            "0.95",
            "--top-k",
            "40",
            "--min-p",
            "0.01",
            "--seed",
            "5",
        ],
    )
    assert ids(eager_run) == ids(sampled[0])  # the same stream of draws over the same logits
    text = json.loads(greedy.output)["prompts"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    cut = json.loads(run("--stop", stop).output)["prompts"][0]
    assert cut["text"] == text[: text.find(stop)] and cut["finish_reason"] == "stop", (cut, stop)
    streamed = runner.invoke(app, ["run", str(tiny_bundle.out), "--prompt", "Hello", "--max-new-tokens", "10", "--stop", stop])
    assert streamed.exit_code == 0 and stop not in streamed.output.split("->", 1)[1].split("\n")[0], streamed.output
    assert "--top-p: 0.0; expected a number in (0, 1]" in " ".join(run("--top-p", "0").output.split())
    r = run("--check", "--temperature", "0.7")
    assert r.exit_code == 2 and "--check compares greedy decoding" in r.output
