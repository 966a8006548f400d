"""Bound bundles on every backend: `aotc run --check` and `aotc verify` for the llama family
and DeepSeek V4, at batch 1 and 3, with a sequence that crosses the first context bucket.
One cell runs in CI (llama on export); the rest are `slow`."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer
from typer.testing import CliRunner

from aotc.cli import app
from aotc.models.tiny import write_tiny

from .conftest import LOGIT_ATOL

CELLS = [(arch, backend) for arch in ("llama", "deepseek_v4") for backend in ("export", "inductor", "xla")]
IN_CI = {("llama", "export")}
CONTEXT, MAX_SEQ, NEW = 64, 128, 12  # decode reads 64 positions, then all 128


def _words(tokenizer: Tokenizer, n: int) -> str:
    """A prompt of n tokens or a few more: the crossing prompt."""
    text = ""
    while len(tokenizer.encode(text).ids) < n:
        text += " one two three four five six seven"
    return text


@pytest.mark.parametrize("arch, backend", [pytest.param(a, b, marks=() if (a, b) in IN_CI else pytest.mark.slow) for a, b in CELLS])
def test_a_bound_bundle_runs_check_and_verify_across_two_context_buckets(arch, backend, tmp_path):
    model = write_tiny(tmp_path / arch, arch=arch, layers=2 if arch == "llama" else 3)
    out = tmp_path / "bundle"
    runner = CliRunner()
    r = runner.invoke(app, [
        "build", str(model), "--backend", backend, "--buckets", "1,4", "--prefill-chunk", "32", "--max-seq", str(MAX_SEQ),
        "--context-buckets", str(CONTEXT), "--no-cache", "-o", str(out),
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    crossing = _words(tokenizer, CONTEXT - NEW // 2)  # its decode passes position 64
    assert len(tokenizer.encode(crossing).ids) < CONTEXT < len(tokenizer.encode(crossing).ids) + NEW
    for prompts in (["Hello there"], ["Hello there", crossing, "the quick brown fox"]):
        asked = [a for p in prompts for a in ("--prompt", p)]
        r = runner.invoke(app, ["run", str(out), "--check", "--json", "--max-new-tokens", str(NEW), "--max-batch", "3", *asked])
        assert r.exit_code == 0, r.output
        check = json.loads(r.output)["check"]
        assert check["passed"] and check["tokens_equal"], check["per_prompt"]
        assert check["max_logit_diff"] <= LOGIT_ATOL[backend], check["max_logit_diff"]
    r = runner.invoke(app, ["verify", str(out), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    decode = {
        (a["context"], a["rows"]) for a in report["artifacts"] if a["context"] is not None and a["entry"].endswith((".decode", ".decode_step"))
    }  # (V4's sliding layers read their window only; inductor's llama: the whole step)
    # Every decode graph of both context buckets, at 1 row and at 3 (padded to bucket 4).
    assert {rows for _, rows in decode} == {1, 3} and {c for c, _ in decode} == {CONTEXT, MAX_SEQ}
