"""generic: the generic path (transformers' own modeling code) against aotc's hand-written
one and against transformers. The 100m llama (the tiny one under --quick) built both
ways, `--modeling aotc` and `--modeling transformers`, decode at batch 1 and 4 at
position 128, with the build times; and a qwen3 of the same shapes (which the llama
path cannot run: its q and k norms) through the generic path against transformers' own
eager model and cache."""

from __future__ import annotations

import time

import torch
from common import M100, Run, console, section, table, timeit, transformers_decode_step, transformers_model

from aotc.models.loader import load_model
from aotc.runtime import Bundle, tolerance_for

BATCHES = (1, 4)
POSITION = 128
MAX_SEQ = 256
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512)


def decode_times(run: Run, model_dir, modeling: str, chunk: int, prompts, step_ids, hf=None) -> dict:
    """Build `model_dir` with `modeling` (cold: no compile cache), then time the bundle's
    decode at each batch, and transformers' where `hf` is given; each step's logits
    against the first path's (aotc's eager model)."""
    t0 = time.perf_counter()
    bundle = Bundle.load(run.bundle(model_dir, f"generic-{modeling}", batch_buckets=BATCHES, chunk_buckets=(chunk,), max_seq=MAX_SEQ, modeling=modeling, use_cache=False))
    build_s = time.perf_counter() - t0
    loaded = load_model(model_dir, modeling=modeling)
    if loaded.arch.name != {"aotc": "llama", "transformers": "transformers"}[modeling]:
        raise SystemExit(f"generic: {model_dir.name} --modeling {modeling} loaded {loaded.arch.name}")
    model = loaded.model
    caches = model.allocate_caches(bundle.cache_slots, MAX_SEQ)
    bundle.bind(model)
    for slot in range(max(BATCHES)):
        for start in range(0, POSITION, chunk):
            model.prefill(prompts[slot, start : start + chunk], slot, caches, start)
    repeats = dict(min_time=run.times(2.0), repeats=3)
    out = {"build_s": build_s, "arch": loaded.arch.name}
    for b in BATCHES:
        ids, positions = step_ids[:b], torch.full((b,), POSITION)
        out[f"b{b} logits"] = model.decode(ids, positions, caches)
        out[f"b{b} ms"] = timeit(lambda: model.decode(ids, positions, caches), **repeats) * 1e3
        if hf is not None:
            step = transformers_decode_step(hf, prompts[:b], ids)
            out[f"b{b} transformers logits"] = step()
            out[f"b{b} transformers ms"] = timeit(step, **repeats) * 1e3
    Bundle.unbind(model)
    return out


@section("generic")
def generic(run: Run) -> dict:
    import transformers

    llama_dir = run.model(run.main)
    shapes = TINY if run.quick else M100
    layers = 4 if run.quick else 8
    qwen3_dir = transformers_model(run.root / "models" / f"qwen3-{run.main}", "Qwen3Config", "Qwen3ForCausalLM", **shapes, num_hidden_layers=layers, max_position_embeddings=1024)
    chunk = 16 if run.quick else 64
    tolerance = tolerance_for(run.backend)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 500, (max(BATCHES), POSITION), generator=g)
    step_ids = torch.randint(3, 500, (max(BATCHES),), generator=g)

    own = decode_times(run, llama_dir, "aotc", chunk, prompts, step_ids)
    via = decode_times(run, llama_dir, "transformers", chunk, prompts, step_ids)
    rows = []
    for b in BATCHES:
        torch.testing.assert_close(
            via[f"b{b} logits"], own[f"b{b} logits"], atol=tolerance, rtol=tolerance, msg=f"llama batch {b}: the generic path's logits differ from the llama path's"
        )
        rows.append({
            "model": f"llama {run.main}", "batch": b, f"{run.aotc} llama path ms": own[f"b{b} ms"], f"{run.aotc} generic path ms": via[f"b{b} ms"],
            "generic / llama path": via[f"b{b} ms"] / own[f"b{b} ms"],
        })  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    qwen3 = decode_times(run, qwen3_dir, "transformers", chunk, prompts, step_ids, hf=hf)
    qrows = []
    for b in BATCHES:
        torch.testing.assert_close(
            qwen3[f"b{b} logits"], qwen3[f"b{b} transformers logits"], atol=tolerance, rtol=tolerance, msg=f"qwen3 batch {b}: logits differ from transformers'"
        )
        qrows.append({
            "model": f"qwen3 {run.main}", "batch": b, f"{run.aotc} generic path ms": qwen3[f"b{b} ms"], "transformers ms": qwen3[f"b{b} transformers ms"],
            "vs transformers": qwen3[f"b{b} transformers ms"] / qwen3[f"b{b} ms"],
        })  # fmt: skip
    table(f"llama {run.main}: decode at position {POSITION} (ms), aotc's hand-written llama path against the generic path", rows)
    table(f"qwen3 {run.main} (the llama shapes, with q/k norms): decode at position {POSITION} (ms), the generic path against transformers", qrows)
    builds = {"llama path": own["build_s"], "generic path (llama)": via["build_s"], "generic path (qwen3)": qwen3["build_s"]}
    console.print("cold builds (no compile cache): " + ", ".join(f"{k} {v:.0f} s" for k, v in builds.items()), highlight=False)
    return {"position": POSITION, "max_seq": MAX_SEQ, "chunk": chunk, "unit": "ms", "llama": rows, "qwen3": qrows, "build_s": builds}
