"""Model folders as people have them: Hub ids through the Hugging Face cache,
generation_config.json, chat templates, streaming, smoke prompts that fit, and a
CLI that shows no third-party warnings unless asked."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aotc.builder import BuildOptions, build
from aotc.chat import render_user_turn
from aotc.cli import app
from aotc.models.generation import generation_defaults
from aotc.runtime import generate

from .conftest import assert_check_report

runner = CliRunner()
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# Two real template styles, as their models ship them (tokenizer_config.json's chat_template).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def aotc(*args, env=None, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "aotc.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )  # fmt: skip


def hf_cache(home: Path, repo: str, model: Path) -> Path:
    """A Hugging Face cache holding `model` as huggingface_hub lays it out: blobs named by
    their hash, a snapshot folder of symlinks into them, and refs/main naming the commit."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for f in model.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, root / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("../..") / "blobs" / digest)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_hub_id_resolves_through_the_cache_offline(tiny_dir, tmp_path):
    home = tmp_path / "hf"
    snapshot = hf_cache(home, "acme/tiny-chat", tiny_dir)
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    r = aotc("build", "acme/tiny-chat", "--backend", "export", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", "64", "--no-cache", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    bundle = tmp_path / "artifacts" / "tiny-chat"  # -o defaults to the model's name, not the commit
    model = json.loads((bundle / "manifest.json").read_text())["model"]
    assert model["hub"] == {"repo_id": "acme/tiny-chat", "commit": COMMIT} and model["source"] == str(snapshot)
    # On a host where the build's folder is gone, the run finds the same commit in its cache.
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["model"]["source"] = str(tmp_path / "gone")
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    r = aotc("run", bundle, "--check", "--json", "--prompt", "Hello", "--max-new-tokens", 4, env=env)
    assert r.returncode == 0, r.stderr
    assert_check_report(json.loads(r.stdout), "export")
    r = aotc("run", bundle, "--model", "acme/tiny-chat", "--revision", COMMIT, "--json", "--prompt", "Hello", "--max-new-tokens", 4, env=env)
    assert r.returncode == 0, r.stderr


def test_cache_key_takes_a_hub_id_as_build_does(tiny_dir, tmp_path, monkeypatch):
    """A CI job's key step takes what its build step takes: a Hub id (here resolved from a
    Hugging Face cache in this process), keyed as the graphs of its snapshot."""
    from huggingface_hub import constants

    snapshot = hf_cache(tmp_path / "hf", "acme/tiny-chat", tiny_dir)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    key_args = ["--backend", "export", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", "64"]
    r = runner.invoke(app, ["cache", "key", "acme/tiny-chat", "--revision", COMMIT, *key_args])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == runner.invoke(app, ["cache", "key", str(snapshot), *key_args]).output.strip()


def test_unknown_hub_id_offline_says_what_was_tried(tmp_path):
    r = aotc("build", "acme/no-such-model", "--backend", "export", env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    said = " ".join(r.stderr.split())
    assert r.returncode == 2 and "acme/no-such-model: no such folder, and not in the Hugging Face cache" in said, said
    assert "HF_HUB_OFFLINE is set, so not downloaded" in said and "Traceback" not in said


def test_revision_of_a_folder_is_an_error(tiny_dir):
    r = runner.invoke(app, ["build", str(tiny_dir), "--revision", "main"])
    assert r.exit_code == 2 and "--revision main: applies to a Hugging Face Hub id" in " ".join(r.output.split())


@pytest.fixture(scope="module")
def small_bundle(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "bundle"
    return build(BuildOptions(tiny_dir, out=out, batch_buckets=(1, 2), chunk_buckets=(16,), max_seq=128, backend="export")).out


def run_json(*args):
    r = runner.invoke(app, ["run", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_generation_config_sets_stop_tokens_and_length(tiny_dir, small_bundle, tmp_path):
    free = run_json(small_bundle, "--prompt", "Hello", "--max-new-tokens", 12)["prompts"][0]["new_ids"]
    stop = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])  # first seen at step i >= 2
    model = tmp_path / "instruct"
    shutil.copytree(tiny_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [500, stop], "max_new_tokens": 20}))
    report = run_json(small_bundle, "--model", model, "--prompt", "Hello")
    assert report["prompts"][0]["new_ids"] == free[: free.index(stop) + 1]  # stopped at the listed eos
    assert report["generation"] == {
        "eos_token_ids": [500, stop],
        "eos_from": "generation_config.json",
        "max_new_tokens": 20,
        "max_new_tokens_from": "generation_config.json",
        "chat": False,
    }
    # A single id, and the flag over the file's length.
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 499}))
    report = run_json(small_bundle, "--model", model, "--prompt", "Hello", "--max-new-tokens", 5)
    assert report["generation"]["eos_token_ids"] == [499] and report["generation"]["max_new_tokens_from"] == "--max-new-tokens"
    assert generation_defaults(tiny_dir, json.loads((tiny_dir / "config.json").read_text())).eos_from == "config.json"


def test_manifest_records_the_generation_defaults(small_bundle):
    model = json.loads((small_bundle / "manifest.json").read_text())["model"]
    assert model["generation"] == {"eos_token_ids": [2], "eos_from": "config.json", "max_new_tokens": 32, "max_new_tokens_from": "aotc default"}
    assert model["hub"] is None


@pytest.mark.parametrize("template", [LLAMA3, CHATML], ids=["llama3", "chatml"])
def test_chat_template_renders_as_transformers_does(tiny_dir, small_bundle, tmp_path, template):
    PreTrainedTokenizerFast = pytest.importorskip("transformers").PreTrainedTokenizerFast

    model = tmp_path / "instruct"
    shutil.copytree(tiny_dir, model)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    hf.chat_template = template
    message = "What is the capital of France?"
    expected = hf.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert render_user_turn(model, message) == hf.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False)
    report = run_json(small_bundle, "--model", model, "--chat", "--prompt", message, "--max-new-tokens", 4)
    assert report["prompts"][0]["prompt_ids"] == expected and report["generation"]["chat"]


def test_chat_template_is_sandboxed_and_missing_one_is_named(tiny_dir, small_bundle, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    (model / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))  # aotc init tiny writes one: a folder without
    r = runner.invoke(app, ["run", str(small_bundle), "--model", str(model), "--chat", "--prompt", "hi"])
    assert r.exit_code == 2 and "tokenizer_config.json: no chat_template" in " ".join(r.output.split())
    # A template reaching for Python internals is stopped by the sandbox.
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": evil}))
    r = runner.invoke(app, ["run", str(small_bundle), "--model", str(model), "--chat", "--prompt", "hi"])
    assert r.exit_code == 2 and "its chat_template failed to render" in " ".join(r.output.split()), r.output


def test_default_smoke_prompts_are_cut_to_the_bundle_and_said(small_bundle):
    report = run_json(small_bundle, "--max-new-tokens", 8, "--max-batch", 2)
    assert [len(p["prompt_ids"]) for p in report["prompts"]][3] == 120  # max_seq 128 - 8 new tokens
    assert report["notes"] == [  # before the text, then after it (the random model never stops)
        "smoke prompt 3 cut from 412 to 120 tokens to fit the bundle's max_seq 128 with 8 new tokens",
        "prompts 0, 1, 2, 3 stopped at 8 new tokens (--max-new-tokens) before a stop token; --max-new-tokens N generates more",
    ]
    r = runner.invoke(app, ["run", str(small_bundle), "--max-new-tokens", "8", "--check"])
    assert r.exit_code == 0 and "smoke prompt 3 cut from 412 to 120 tokens" in " ".join(r.output.split())
    r = runner.invoke(app, ["run", str(small_bundle), "--max-new-tokens", "8", "--prompt", "word " * 200])
    assert r.exit_code == 2 and "more than the cache holds" in r.output  # a prompt the user wrote is never cut


def test_single_prompt_streams_each_token_as_it_comes(tiny_dir, small_bundle):
    from aotc.models.loader import load_model
    from aotc.runtime import Bundle

    loaded = load_model(tiny_dir)
    bundle = Bundle.load(small_bundle)
    bundle.bind(loaded.model)
    seen = []
    gen = generate(
        loaded.model, [[5, 6, 7], [8, 9]], 6, max_batch=2, max_seq=128, slots=bundle.cache_slots, stop_at_eos=False, on_token=lambda i, s: seen.append((i, list(s.new_ids)))
    )
    assert seen[:2] == [(0, gen.sequences[0].new_ids[:1]), (1, gen.sequences[1].new_ids[:1])]  # both prefills' tokens first
    assert [n for i, n in seen if i == 0] == [gen.sequences[0].new_ids[:k] for k in range(1, 7)]  # one call per token, in order
    text = run_json(small_bundle, "--prompt", "Hello", "--max-new-tokens", 6)["prompts"][0]["text"]
    r = runner.invoke(app, ["run", str(small_bundle), "--prompt", "Hello", "--max-new-tokens", "6"])
    assert r.exit_code == 0 and f"  -> {text}\n" in r.output


@pytest.mark.slow  # 40 s here: a build and a verbose build in processes of their own
def test_build_shows_no_third_party_warnings_unless_verbose(tiny_dir, tmp_path):
    args = ["build", tiny_dir, "--backend", "xla", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", "64", "--no-cache"]
    quiet = aotc(*args, "-o", tmp_path / "a")
    assert quiet.returncode == 0, quiet.stderr
    assert "Warning" not in quiet.stderr + quiet.stdout, quiet.stderr
    loud = aotc("--verbose", *args, "-o", tmp_path / "b")
    assert loud.returncode == 0 and "FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated" in loud.stderr, loud.stderr


def test_a_warning_aotc_does_not_know_still_shows(tmp_path):
    (tmp_path / "noisy_plugin.py").write_text("import warnings\nwarnings.warn('a FutureWarning aotc has not seen', FutureWarning)\n")
    r = aotc("init", "tiny", tmp_path / "m", "--layers", 1, "--plugin", "noisy_plugin", env={"PYTHONPATH": str(tmp_path)})
    assert "noisy_plugin.py:2: FutureWarning: a FutureWarning aotc has not seen" in r.stderr, r.stderr
    assert r.returncode == 2 and "noisy_plugin: imported, but it registered no architecture" in r.stderr


@pytest.mark.parametrize("text, said", [
    ('{"eos_token_id": "</s>"}', "generation_config.json: field 'eos_token_id' is '</s>'; expected a token id or a list of token ids"),
    ('{"max_new_tokens": 0}', "generation_config.json: field 'max_new_tokens' is 0; expected a positive integer"),
    ("{not json", "generation_config.json: not valid JSON"),
])  # fmt: skip
def test_bad_generation_config_is_named(tiny_dir, small_bundle, tmp_path, text, said):
    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    (model / "generation_config.json").write_text(text)
    r = runner.invoke(app, ["run", str(small_bundle), "--model", str(model), "--prompt", "hi"])
    assert r.exit_code == 2 and said in " ".join(r.output.split()), r.output


def test_a_batch_on_a_terminal_is_a_live_view_with_a_line_per_sequence(small_bundle, monkeypatch):
    import io

    from rich.console import Console

    from aotc.cli import run

    screen = io.StringIO()
    monkeypatch.setattr(run, "console", Console(file=screen, force_terminal=True, width=200))
    report = run_json(small_bundle, "--prompt", "Hello", "--prompt", "What is the capital of France?", "--max-new-tokens", 6)
    r = runner.invoke(app, ["run", str(small_bundle), "--prompt", "Hello", "--prompt", "What is the capital of France?", "--max-new-tokens", "6"])
    assert r.exit_code == 0, r.output
    shown = screen.getvalue()
    assert "\x1b[?25l" in shown  # a live view (it hides the cursor while it redraws in place)
    final = shown.rsplit("prompt 0", 1)[1]  # the last drawing of the view
    for p in report["prompts"]:
        assert f"  -> {p['text']}" in final


@pytest.mark.parametrize("repo", ["org/..", "org/tïny", "org/-tiny", "org/tiny.git", "org/" + "t" * 300])
def test_a_name_that_is_no_hub_id_is_refused_naming_it(repo, tmp_path):
    r = runner.invoke(app, ["build", repo, "--backend", "export"], env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and f"{repo}: not a folder, and not a Hugging Face Hub id" in said and "Traceback" not in said, said


def test_an_empty_revision_is_refused(tmp_path):
    r = runner.invoke(app, ["build", "acme/tiny-chat", "--revision", "", "--backend", "export"], env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 2 and "--revision '': expected a branch, tag or commit of acme/tiny-chat" in " ".join(r.output.split()), r.output


def test_a_ref_that_leads_outside_the_cache_is_refused(tiny_dir, tmp_path):
    """refs/main naming ../../../../outside/x made the build read that folder and record
    hub.commit "x"."""
    home = tmp_path / "hf"
    hf_cache(home, "acme/tiny-chat", tiny_dir)
    outside = tmp_path / "outside" / "x"
    shutil.copytree(tiny_dir, outside)
    (home / "hub" / "models--acme--tiny-chat" / "refs" / "main").write_text("../../../../outside/x")
    r = aotc("build", "acme/tiny-chat", "--backend", "export", "-o", tmp_path / "b", env={"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    said = " ".join(r.stderr.split())
    assert r.returncode == 2 and "which is not a snapshot folder of" in said and "Traceback" not in said and not (tmp_path / "b").exists(), said
