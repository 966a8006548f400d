"""The command line, end to end: init -> build -> run --check -> inspect."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from aotc.cli import app

from .conftest import wrap_steps

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False, env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model, bundle = root / "tiny", root / "bundle"
    r = invoke("init", "tiny", model, "--layers", 2)
    assert r.exit_code == 0, r.output
    r = invoke("build", model, "--backend", "export", "--buckets", "1,2,4", "--prefill-chunk", "16,32", "--max-seq", 192, "-o", bundle)
    assert r.exit_code == 0, r.output
    return model, bundle, r.output


def test_build_reports_graphs_and_table(built):
    model, bundle, output = built
    assert "traced 13 graphs for 4 entries serving 7 module instances" in output  # max_seq 192: one context bucket, the chunk contexts 16 and 32, and the fresh form
    assert "LlamaDecoderLayer.prefill" in output and "LMHead.forward" in output
    assert "decode: a graph per layer, not one graph for the whole step (the backend builds no loops)" in output
    assert (bundle / "manifest.json").is_file()
    files = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*.pt2"))
    assert files == sorted(
        [f"entries/LlamaDecoderLayer.decode/b{b}-c192/program.pt2" for b in (1, 2, 4)]  # context bucket: max_seq
        + [f"entries/LlamaDecoderLayer.prefill/b{b}-c{c}/program.pt2" for b in (16, 32) for c in (16, 32, 192) if c >= b]  # 16, 32: the chunk contexts
        + [f"entries/LlamaDecoderLayer.prefill_fresh/b{b}/program.pt2" for b in (16, 32)]  # the fresh form: one per chunk, on the whole cache
        + [f"entries/LMHead.forward/b{b}/program.pt2" for b in (1, 2, 4)]
    )
    assert not list(bundle.parent.glob(".bundle.tmp-*"))  # no temporary folder left behind


LONG = " ".join(["the quick brown fox jumps over the lazy dog."] * 8)  # more than 2 chunks of 32


@pytest.mark.parametrize("prompts", [["Hello"], ["Hello", "What is the capital of France?", LONG]])
def test_run_check_json(built, prompts):
    _, bundle, _ = built
    args = ["run", bundle, "--max-new-tokens", 8, "--check", "--json"]
    for p in prompts:
        args += ["--prompt", p]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert [p["prompt"] for p in report["prompts"]] == prompts
    assert report["check"]["tokens_equal"] is True
    assert report["check"]["algorithms"] == []  # the llama family compiles the algorithm it runs eagerly
    for p, c in zip(report["prompts"], report["check"]["per_prompt"]):
        assert len(p["new_ids"]) == c["tokens"] and p["new_ids"] == c["eager_new_ids"]
        assert isinstance(p["text"], str) and p["prompt_ids"]
    assert report["check"]["max_logit_diff"] < 1e-3
    t = report["timings"]  # decode tokens/s: the tokens after each prompt's first, over the decode time
    decoded = sum(len(p["new_ids"]) - 1 for p in report["prompts"])
    # The engine's schedule (runtime/engine.py), chunks of 32: the first step prefills the short
    # prompts and the long one's start; the long one's rest takes a step per chunk while the
    # short ones decode; its first token comes at step `first`, then 7 decodes each.
    rest = max(0, sum(len(p["prompt_ids"]) for p in report["prompts"]) - 32)
    first = 1 + -(-rest // 32)
    assert t["decode_steps"] == max(8, first + 7) - 1 and (len(prompts) == 1 or first > 2), (t, first)
    assert t["decode_tokens_per_s"] == pytest.approx(decoded / t["decode_s"], rel=0.02)
    assert t["prefill_tokens"] == sum(len(p["prompt_ids"]) for p in report["prompts"])
    if len(prompts) > 1:
        assert len(report["prompts"][2]["prompt_ids"]) > 64


def test_run_text_output(built):
    _, bundle, _ = built
    r = invoke("run", bundle, "--prompt", "Hello", "--max-new-tokens", 4, "--check")
    assert r.exit_code == 0, r.output
    assert "every token matches eager" in r.output and "tokens/s" in r.output


def test_inspect(built):
    _, bundle, _ = built
    r = invoke("inspect", bundle)
    assert r.exit_code == 0 and "LlamaDecoderLayer.decode" in r.output and "cache slots 5" in r.output
    r = invoke("inspect", bundle, "--json")
    manifest = json.loads(r.output)
    assert list(manifest)[0] == "format_version"
    decode = next(e for e in manifest["entries"] if e["id"] == "LlamaDecoderLayer.decode")
    assert decode["instances"] == ["model.layers.0", "model.layers.1"]
    kinds = {i["name"]: i["kind"] for i in decode["artifacts"][0]["inputs"]}
    assert kinds == {"x": "activation", "cos": "activation", "sin": "activation", "positions": "activation", "slots": "activation", "k_cache": "cache", "v_cache": "cache"}
    assert all(w["path"] for w in decode["weights"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["build", "{model}", "--buckets", "1,x"], "--buckets '1,x': expected comma-separated positive integers"),
        (["build", "{model}", "--context-buckets", "32,"], "--context-buckets '32,': an empty bucket between commas"),
        (["build", "{model}", "--prefill-chunk", "16,,64"], "--prefill-chunk '16,,64': an empty bucket between commas"),
        (["build", "{model}", "--backend", "tpu"], "unknown backend 'tpu'; known: export"),
        (["build", "{missing}"], "not a folder"),
        (["run", "{missing}"], "no manifest.json"),
        (["run", "{bundle}", "--prompt", "{long}", "--max-new-tokens", "8"], "more than the cache holds (max_seq 192)"),
        (["run", "{bundle}", "--max-batch", "8"], "--max-batch 8: the bundle's largest batch bucket is 4"),
        (["run", "{bundle}", "--threads", "0"], "Invalid value for '--threads': Input should be greater than or equal to 1"),
        (["run", "{model}", "--eager", "--check"], "--check compares a bundle with the eager model"),
        (["build", "{model}", "--shard", "3/2"], "--shard '3/2': expected I/N with 1 <= I <= N"),
        (["build", "{model}", "--backend", "inductor", "--compiler-flag", "simdlen"], "--compiler-flag 'simdlen': expected KEY=VALUE"),
        (["build", "{model}", "--backend", "inductor", "--compiler-flag", "no.such.config=1"], "--compiler-flag no.such.config: Inductor has no such config"),
        (["build", "{model}", "--backend", "inductor", "--device", "tpu"], "--device 'tpu': expected cpu or cuda"),
        (["build", "{model}", "--backend", "export", "--compiler-flag", "x=1"], "the export backend takes no compiler flags"),
        (["build", "{model}", "--backend", "export", "--device", "cuda"], "--device cuda: the export backend's artifacts run on the CPU"),
        (["build", "{model}", "--no-cache", "--require-cache"], "--no-cache cannot be combined with --require-cache"),
        (["init", "tiny", "{missing}", "--set", "hidden_size"], "--set 'hidden_size': expected KEY=VALUE"),
        (["cache", "prune", "--max-size", "5iB", "--cache-dir", "{missing}"], "--max-size '5iB': expected a size such as 500M, 2G, 1.5GiB or 0"),
        (["cache", "prune", "--max-size", "1.5Xi", "--cache-dir", "{missing}"], "--max-size '1.5Xi'"),
        (["build"], "aotc build needs MODEL_DIR (or --resume BUNDLE)"),
        (["build", "--resume", "{bundle}"], "built with the export backend, it has nothing to resume"),
    ],
)
def test_errors_exit_2_with_a_message(built, tmp_path, args, message):
    model, bundle, _ = built
    values = dict(model=model, bundle=bundle, missing=tmp_path / "nope", long=" ".join(["word"] * 400))
    r = invoke(*[a.format(**values) for a in args])
    assert r.exit_code == 2
    assert message in " ".join(r.output.split())


def test_console_script_help():
    r = subprocess.run([sys.executable, "-m", "aotc.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for command in ("init", "build", "run", "inspect"):
        assert command in r.stdout


def test_build_options_defaults_are_the_builders():
    """The CLI spells its bucket defaults as text (its modules import no torch for --help):
    they must be BuildOptions' defaults, which the Python API and the benchmark build with."""
    from aotc.builder import parse_buckets
    from aotc.builder.options import DEFAULT_BATCH_BUCKETS, DEFAULT_CHUNK_BUCKETS
    from aotc.cli.common import BUCKETS, PREFILL_CHUNK

    assert parse_buckets(BUCKETS.default, "--buckets") == DEFAULT_BATCH_BUCKETS
    assert f"default: {','.join(map(str, DEFAULT_CHUNK_BUCKETS))}, each at most --max-seq" in PREFILL_CHUNK.help


def test_build_says_which_layers_each_variant_serves(tmp_path):
    r = invoke("init", "tiny", tmp_path / "q", "--arch", "qwen2", "--layers", 3, "--set", "use_sliding_window=true", "--set", "sliding_window=16", "--set", "max_window_layers=1")
    assert r.exit_code == 0, r.output
    r = invoke("build", tmp_path / "q", "--backend", "export", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", 64, "-o", tmp_path / "b")
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "variant LlamaDecoderLayer.decode.v0 (self_attn.window=None): 1 modules, model.layers.0" in said, said
    assert "variant LlamaDecoderLayer.decode.v1 (self_attn.window=16): 2 modules, model.layers.1, model.layers.2" in said


def test_check_exits_1_when_tokens_differ(built, monkeypatch):
    """--check fails the run when the bundle's tokens are not eager's (here: a perturbed head)."""
    from aotc.runtime import Bundle

    _, bundle, _ = built
    bind = Bundle.bind

    def bind_and_perturb(self, model, **ranks):
        bind(self, model, **ranks)
        # The compiled head only: unbind restores eager. Its argmax moves.
        wrap_steps(model.head.forward, lambda context, bucket, run: lambda args: [out + torch.linspace(0, 50, out.shape[-1]) for out in run(args)])

    monkeypatch.setattr(Bundle, "bind", bind_and_perturb)
    r = invoke("run", bundle, "--prompt", "Hello", "--max-new-tokens", 4, "--check")
    assert r.exit_code == 1
    said = " ".join(r.output.split())
    assert "check prompt 0: 4 tokens differs after 0 tokens" in said and "tokens differ from eager" in said


# A plugin backend: export's, but each compile after the first waits for the file $GATE.
GATED = """
import os
import time
from pathlib import Path

from aotc.backends.registry import register_backend
from aotc.backends.export import ExportBackend


@register_backend
class GatedBackend(ExportBackend):
    name = "gated"
    compiles = 0

    def compile(self, program, specs, out_dir):
        GatedBackend.compiles += 1
        deadline = time.monotonic() + 60
        while GatedBackend.compiles > 1 and not Path(os.environ["GATE"]).exists():
            if time.monotonic() > deadline:
                raise RuntimeError("nobody read the first artifact's line")
            time.sleep(0.02)
        return super().compile(program, specs, out_dir)
"""


def test_a_build_into_a_log_prints_each_artifact_as_it_finishes(tiny_dir, tmp_path):
    """stdout not a terminal (a CI log): a plain line per artifact as it finishes. The second
    compile waits until this test has read the first artifact's line from the pipe."""
    import re

    (tmp_path / "gated.py").write_text(GATED)
    gate = tmp_path / "gate"
    argv = [sys.executable, "-m", "aotc.cli", "build", str(tiny_dir), "--plugin", "gated", "--backend", "gated", "--buckets", "1",
            "--prefill-chunk", "64", "--max-seq", "64", "--no-cache", "-o", str(tmp_path / "b")]  # fmt: skip
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path), "GATE": str(gate)}
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = re.compile(r"(\S+) bucket (\d+)( context \d+)?: uncached, \d+\.\d\d s")
    first = p.stdout.readline()
    gate.touch()
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 0 and line.fullmatch(first.strip()), (first, rest, err)
    done = [first.strip()] + [ln for ln in rest.splitlines() if line.fullmatch(ln)]
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert len(done) == sum(len(e["artifacts"]) for e in manifest["entries"]) == 4  # decode, prefill and its fresh form, head at bucket 1
    assert "━" not in err  # no progress bars off a terminal


@pytest.mark.parametrize("mask, folder, file", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_written_files_follow_the_umask(tmp_path, mask, folder, file):
    """A bundle, a model folder from init tiny and an aotc quantize output: a folder gets
    0777 and a file 0666 less the umask (a CI user builds, a service user runs), as
    mkdir and open make them; not mkdtemp's and mkstemp's 0700 and 0600."""
    import os
    import stat

    before = os.umask(mask)
    try:
        model, bundle, quantized = tmp_path / "tiny", tmp_path / "bundle", tmp_path / "fp8"
        assert invoke("init", "tiny", model, "--layers", 1).exit_code == 0
        assert invoke("build", model, "--backend", "export", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", 64, "-o", bundle).exit_code == 0
        assert invoke("quantize", model, "-o", quantized, "--format", "fp8").exit_code == 0
    finally:
        os.umask(before)
    for root in (model, bundle, quantized):
        for path in [root, *root.rglob("*")]:
            assert stat.S_IMODE(path.stat().st_mode) == (folder if path.is_dir() else file), (path, oct(path.stat().st_mode))


def test_the_default_out_replaces_only_a_bundle_of_the_same_model_and_backend(tmp_path, monkeypatch):
    """artifacts/<name> is named after the model's folder alone: a build of another folder of
    that name, or on another backend, is refused naming -o and --force; the same model and
    backend replaces it, and --force replaces either."""
    from aotc.format import read_manifest

    monkeypatch.chdir(tmp_path)
    first, other = tmp_path / "models" / "tiny", tmp_path / "elsewhere" / "tiny"
    for m in (first, other):
        assert invoke("init", "tiny", m, "--layers", 1).exit_code == 0
    args = ["--buckets", "1", "--prefill-chunk", "16", "--max-seq", 64]
    assert invoke("build", first, "--backend", "export", *args).exit_code == 0
    digest = read_manifest(tmp_path / "artifacts" / "tiny").digest()
    r = runner.invoke(app, ["build", str(other), "--backend", "export", *map(str, args)], env={"COLUMNS": "400"})
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and f"-o artifacts/tiny (the default, from the model's name) holds a bundle of {first} on export; this build is of {other} on export" in said, said
    assert "Pass -o to write it elsewhere, or --force to replace that bundle" in said
    assert read_manifest(tmp_path / "artifacts" / "tiny").digest() == digest  # untouched
    assert invoke("build", first, "--backend", "export", *args).exit_code == 0  # the same model and backend
    assert invoke("build", other, "--backend", "export", "--force", *args).exit_code == 0
    assert read_manifest(tmp_path / "artifacts" / "tiny").model.source == str(other)
    # The writers' lock is in the compile cache's locks/ (filelock never deletes one), not among the bundles.
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == ["tiny"]


def test_messages_with_square_brackets_print_whole(tmp_path):
    """rich reads [word] as a style tag: the unsupported-architecture error printed
    "installed (aotc), every decoder-only model" for "(aotc[hf])"."""
    model = tmp_path / "[odd] name"
    assert invoke("init", "tiny", model, "--layers", 1).exit_code == 0
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "no_such_model", "architectures": ["NoSuchForCausalLM"]}))
    r = runner.invoke(app, ["build", str(model), "--backend", "export", "-o", str(tmp_path / "b")], env={"COLUMNS": "400"})
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "installed (aotc[hf]), every decoder-only model transformers has" in said and f"{model}/config.json" in said, said


def test_help_lists_a_line_per_command_and_names_values_in_words():
    """The command list is one line per command (run's and verify's whole docstrings were
    45 ragged lines); options show N, TEXT or PATH for their value, and flags none (typer
    showed <int>, <str>, <bool>)."""
    import re

    said = runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    commands = [line for line in said.split("Commands")[1].splitlines() if line.startswith("│")]
    names = [line.split()[1] for line in commands]
    assert names == ["quantize", "build", "run", "serve", "verify", "bisect", "inspect", "init", "cache"], commands
    for command in ([], ["build"], ["run"], ["verify"], ["bisect"], ["inspect"], ["quantize"], ["cache", "key"], ["init", "tiny"]):
        options = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"}).output.split("Options")[1]
        shown = re.findall(r"│ (--[\w-]+)[ ,\w-]*?\s+(<[\w\[\]]+>)", options)
        assert [o for o in shown if o[0] != "--help"] == [], (command, shown)
