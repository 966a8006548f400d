"""smollm2: a real pretrained chat model (SmolLM2-135M-Instruct, bench/smollm2.py) in
float32 and bfloat16: greedy generation with --chat prompts at batch 1 and 4 through
the bundle, aotc's eager model and transformers at the same precision (tokens/s of
the whole generation, and the ratios); and the fidelity rule's figures (error, the
eager twin's, the bound) with whether the bundle's tokens are transformers' float32
ones."""

from __future__ import annotations

import time

import torch
from common import Run, section, table
from smollm2 import smollm2

from aotc.chat import render_user_turn
from aotc.models.loader import load_model
from aotc.runtime import Bundle, check_generation, generate

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a compiler does in one sentence.",
    "Name three prime numbers.",
)


@section("smollm2")
def smollm2_section(run: Run) -> dict:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    new = 8 if run.quick else 48
    folders = {dtype: smollm2(dtype) for dtype in ("float32", "bfloat16")}
    tokenizer = Tokenizer.from_file(str(folders["float32"] / "tokenizer.json"))
    prompts = [tokenizer.encode(render_user_turn(folders["float32"], p), add_special_tokens=False).ids for p in PROMPTS]
    # transformers' float32 answers, each up to its stop token (timed runs force all `new`).
    golden = _transformers(AutoModelForCausalLM.from_pretrained(folders["float32"], dtype=torch.float32).eval(), prompts, new, stop=True)[0]
    rows, fidelity = [], []
    for dtype, folder in folders.items():
        bundle_dir = run.bundle(folder, "smollm2", batch_buckets=(1, 4), chunk_buckets=(64,))
        bundle = Bundle.load(bundle_dir)
        loaded = load_model(folder, **bundle.model_args())
        ran = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
        if ran != dtype:  # a row labelled bf16 must run bf16 weights
            raise SystemExit(f"smollm2: the {dtype} folder loaded {ran} weights")
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        for batch in (1, 4):
            kw = dict(max_batch=batch, max_seq=bundle.max_seq, slots=bundle.cache_slots, stop_at_eos=False)
            bundle.bind(loaded.model)
            t0 = time.perf_counter()
            gen = generate(loaded.model, prompts, new, keep_logits=batch == 4, **kw)
            aotc_s = time.perf_counter() - t0
            Bundle.unbind(loaded.model)
            t0 = time.perf_counter()
            generate(loaded.model, prompts, new, **kw)
            eager_s = time.perf_counter() - t0
            hf_s = _transformers(hf, prompts, new, batch)[1]
            total = len(prompts) * new
            rows.append({
                "model": f"SmolLM2-135M {dtype}", "batch": batch, f"{run.aotc} tok/s": total / aotc_s, "eager tok/s": total / eager_s,
                "transformers tok/s": total / hf_s, "vs eager": eager_s / aotc_s, "vs transformers": hf_s / aotc_s,
            })  # fmt: skip
            if batch == 4:
                report = check_generation(loaded.model, gen, new, bundle.manifest.backend.name, **kw)
                fidelity.append({
                    "model": f"SmolLM2-135M {dtype}", "check": "pass" if report.passed else "FAIL", "error": max(p.error for p in report.per_prompt),
                    "eager twin error": max((p.twin_error for p in report.per_prompt if p.twin_error is not None), default=0.0),
                    "bound": max(p.bound for p in report.per_prompt),
                    "prompts equal to transformers fp32": sum(s.new_ids[: len(g)] == g for s, g in zip(gen.sequences, golden)),
                })  # fmt: skip
    table(f"SmolLM2-135M-Instruct, {len(PROMPTS)} chat prompts x {new} new tokens, whole generation (tokens/s)", rows)
    table("SmolLM2-135M-Instruct: the fidelity rule (runtime.check), batch 4", fidelity)
    return {"new_tokens": new, "prompts": list(PROMPTS), "rows": rows, "fidelity": fidelity}


@torch.no_grad()
def _transformers(hf, prompts: list[list[int]], new: int, batch: int = 1, stop: bool = False) -> tuple[list[list[int]], float]:
    """Greedy generation of `new` tokens per prompt (stop: or up to the stop token),
    `batch` prompts at a time (left-padded, as transformers batches); (new tokens per
    prompt, seconds)."""
    out, t0 = [], time.perf_counter()
    for g in range(0, len(prompts), batch):
        group = prompts[g : g + batch]
        width = max(map(len, group))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        got = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=1 if stop else new, do_sample=False, pad_token_id=0)
        eos = set(hf.generation_config.eos_token_id if isinstance(hf.generation_config.eos_token_id, list) else [hf.generation_config.eos_token_id])
        for row in got[:, width:].tolist():  # up to and with the first stop token (transformers pads after it)
            out.append(row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] if stop else row)
    return out, time.perf_counter() - t0
