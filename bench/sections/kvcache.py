"""kvcache: fp8 KV caches against full precision, ~100M model (tiny under --quick) in a
max_seq-4096 bundle (1024 under --quick): cache bytes per token, batch-1 decode at position 4000 (aotc
inductor or --backend, and eager, each cache dtype), and eager fp8 cache against eager
full precision (max logit difference, greedy agreement over 200 tokens)."""

from __future__ import annotations

import torch
from common import Run, section, table, timeit

from aotc import kvcache as kv
from aotc.models.loader import load_model
from aotc.runtime import Bundle, generate

KV_MAX_SEQ, KV_POSITION, KV_TOKENS = 4096, 4000, 200  # max_seq 1024, position 1000 under --quick


@section("kvcache")
def kvcache(run: Run) -> dict:
    name = run.main
    model_dir = run.model(name)
    max_seq, position = (1024, 1000) if run.quick else (KV_MAX_SEQ, KV_POSITION)
    ids, positions = torch.tensor([7]), torch.tensor([position])
    rows, eager = [], {}
    for dtype in ("auto", "fp8", "fp8-values"):
        bundle = Bundle.load(run.bundle(model_dir, f"kv-{dtype}", batch_buckets=(1,), chunk_buckets=(128,), max_seq=max_seq, kv_cache_dtype=dtype))
        model = load_model(model_dir, **bundle.model_args()).model
        eager[dtype] = model
        caches = model.allocate_caches(bundle.cache_slots, max_seq)
        for kind, t in caches.items():  # a filled context: random keys and values (fp8: quantized as the model writes them)
            full = torch.randn(*t.shape[:-1], model.config.head_dim, generator=torch.Generator().manual_seed(0))
            kv.store(model.cache_rows().get(kind), t, (), full)
        times = {"eager": timeit(lambda: model.decode(ids, positions, caches), min_time=run.times(2.0))}
        expected = model.decode(ids, positions, caches)
        bundle.bind(model)
        layouts = model.cache_layouts()  # the same bytes, as the graphs take them
        regions = {kind: layouts[kind].unpack(t) if kind in layouts else t for kind, t in caches.items()}
        torch.testing.assert_close(model.decode(ids, positions, regions), expected, atol=1e-3, rtol=1e-3)
        times[run.aotc] = timeit(lambda: model.decode(ids, positions, regions), min_time=run.times(2.0))
        Bundle.unbind(model)
        # What the graphs were given: a packed cache's regions (fp8 values, float32 scales) or the tensor
        stored = sorted({str(r.dtype).removeprefix("torch.") for t in regions.values() for r in (t.tensors.values() if isinstance(t, kv.Regions) else [t])})
        per_token = model.cache_bytes(1, max_seq) / max_seq
        rows.append({
            "cache": {"auto": "full precision (fp32)", "fp8": "fp8", "fp8-values": "fp8 values, bf16 keys"}[dtype], "dtypes stored": ",".join(stored), "bytes per token": per_token,
            **{f"{k} ms": v * 1e3 for k, v in times.items()},
        })  # fmt: skip
    for r in rows:
        r["full / this, bytes"] = rows[0]["bytes per token"] / r["bytes per token"]
        r["full / this, aotc ms"] = rows[0][f"{run.aotc} ms"] / r[f"{run.aotc} ms"]
    results = {"model": name, "batch": 1, "max_seq": max_seq, "position": position, "rows": rows}
    table(f"KV cache dtype, {name} model, batch-1 decode at position {position} of max_seq {max_seq}", rows)

    # Eager fp8 cache against eager full precision: greedy from one prompt, then teacher-forced.
    tokens = 20 if run.quick else KV_TOKENS
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = {k: generate(m, [prompt], tokens, max_batch=1, max_seq=len(prompt) + tokens, stop_at_eos=False).sequences[0].new_ids for k, m in eager.items()}
    first_diff = next((i for i, (a, b) in enumerate(zip(runs["auto"], runs["fp8"])) if a != b), tokens)
    seq = torch.tensor(prompt + runs["auto"])
    a = eager["auto"].prompt_logits(seq)[len(prompt) - 1 : -1]
    b = eager["fp8"].prompt_logits(seq)[len(prompt) - 1 : -1]
    fidelity = {
        "tokens": tokens, "max_logit_diff": (a - b).abs().max().item(), "logit_range": (a.max() - a.min()).item(),
        "greedy_equal_before_first_difference": first_diff, "teacher_forced_top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }  # fmt: skip
    results["eager_fp8_vs_full"] = fidelity
    table(f"eager fp8 cache against eager full precision, {tokens} greedy tokens", [fidelity])
    return results
