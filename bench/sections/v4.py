"""v4: DeepSeek V4 of ~100M parameters (3 tiny layers under --quick): decode at batch 1
and 4, prefill of a 715-token prompt in chunks of 128 (40 in chunks of 16 under
--quick), aotc inductor (or --backend) against eager and torch.compile of the eager
model; batch-1 decode's bytes of the weights it uses (the chosen experts and the rest)
against copy bandwidth."""

from __future__ import annotations

import time

import torch
from common import Run, console, copy_bandwidth, section, table, timeit

from aotc.models.loader import load_model
from aotc.models.tiny import write_tiny
from aotc.runtime import Bundle, tolerance_for

# ~100M-parameter DeepSeek V4, fp32: 93M in total, 27M active per token. 6 layers (each
# attention kind twice), hidden 512, 16 routed experts of 512 at top-2 and a shared one.
V4_100M = dict(
    hidden_size=512, moe_intermediate_size=512, n_routed_experts=16, num_experts_per_tok=2, num_attention_heads=8, head_dim=64,
    q_lora_rank=256, o_lora_rank=128, o_groups=4, index_n_heads=8, index_head_dim=64, index_topk=16, vocab_size=8192, sliding_window=128,
)  # fmt: skip
V4_BUCKETS = (1, 4)
# (prompt tokens, prefill chunk, max_seq); --quick: 40 tokens in chunks of 16
V4_SHAPES = {False: (715, 128, 1024), True: (40, 16, 64)}
# The targets: aotc / eager for decode and prefill, and batch-1 decode's share of copy bandwidth
V4_TARGETS = {"decode": 0.5, "prefill": 0.5, "bandwidth": 0.6}


def v4_weight_bytes(model) -> dict[str, int]:
    """Parameter counts, and the weight bytes a batch-1 decode step reads: every weight
    but the embedding table (one row is read) and the routed experts, of which each MoE
    layer reads the k chosen."""
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    routed = {n: p for n, p in model.named_parameters() if ".ffn.experts." in n}
    per_expert = sum(p.numel() * p.element_size() for p in routed.values()) // (c.num_hidden_layers * c.n_routed_experts)
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in routed and not n.startswith("model.embed_tokens"))
    active = total - sum(p.numel() for p in routed.values()) * (1 - c.num_experts_per_tok / c.n_routed_experts)
    return {
        "params": total, "active_params": int(active), "expert_bytes_read": c.num_hidden_layers * c.num_experts_per_tok * per_expert,
        "other_bytes_read": rest,
    }  # fmt: skip


@section("v4")
def v4(run: Run) -> dict:
    name = "v4-tiny" if run.quick else "v4-100m"
    model_dir = write_tiny(run.root / name, arch="deepseek_v4", layers=3 if run.quick else 6, **({} if run.quick else V4_100M))
    prompt_len, chunk, max_seq = V4_SHAPES[run.quick]
    t0 = time.perf_counter()
    # A cold build (no compile cache), to set beside torch.compile's compiling first calls
    bundle = Bundle.load(run.bundle(model_dir, batch_buckets=V4_BUCKETS, chunk_buckets=(chunk,), max_seq=max_seq, use_cache=False))
    build_s = time.perf_counter() - t0
    model = load_model(model_dir).model
    sizes = v4_weight_bytes(model)
    tolerance = tolerance_for(run.backend)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 500, (prompt_len,), generator=g)
    caches = model.allocate_caches(max(V4_BUCKETS) + 1, max_seq)
    decode_ids = {b: torch.randint(3, 500, (b,), generator=g) for b in V4_BUCKETS}
    position = {b: torch.full((b,), prompt_len) for b in V4_BUCKETS}
    repeats = dict(min_time=run.times(2.0), repeats=3)

    def prefill(fn, slot=0):
        for start in range(0, prompt_len, chunk):
            logits = fn(prompt[start : start + chunk], slot, caches, start)
        return logits

    def timed(label: str, prefill_fn, decode_fn) -> dict:
        """Time one way of running the model; its outputs against eager's (the first run)."""
        t0 = time.perf_counter()  # the first calls: torch.compile compiles in them
        prefill(prefill_fn)
        for b in V4_BUCKETS:
            decode_fn(decode_ids[b], position[b], caches)
        first_calls[label] = time.perf_counter() - t0
        out = {"prefill": timeit(lambda: prefill(prefill_fn), **repeats)}
        got = {"prefill": prefill(prefill_fn)}
        for b in V4_BUCKETS:
            out[f"decode b{b}"] = timeit(lambda: decode_fn(decode_ids[b], position[b], caches), **repeats)
            got[f"decode b{b}"] = decode_fn(decode_ids[b], position[b], caches)
        if reference:
            for k, v in got.items():
                torch.testing.assert_close(v, reference[k], atol=tolerance, rtol=0, msg=f"{label}, {k}: logits differ from eager")
        else:
            reference.update(got)
        console.print(f"  {name} {label}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in out.items()), highlight=False)
        return out

    copy_first = copy_bandwidth(min_time=run.times(3.0))
    reference: dict = {}
    first_calls: dict = {}
    for slot in range(1, max(V4_BUCKETS)):  # the other rows of batch 4 attend to the prompt too; every run reads these
        prefill(model.prefill, slot)
    times = {"eager": timed("eager", model.prefill, model.decode)}
    bundle.bind(model)
    times[run.aotc] = timed(run.aotc, model.prefill, model.decode)
    Bundle.unbind(model)
    # The MoE's nonzero captured (unbacked), as aotc does: by default each expert's row
    # count would be a graph break and a recompile per count, until dynamo gives up.
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        compiled = run.compile(model.prefill, dynamic=False), run.compile(model.decode, dynamic=False)
        times[run.baseline] = timed(run.baseline, *compiled)
    torch._dynamo.reset()
    rows = []
    for what in times["eager"]:
        row = {"what": what, **{f"{k} ms": v[what] * 1e3 for k, v in times.items()}}
        row["aotc/eager"] = times[run.aotc][what] / times["eager"][what]
        row[f"aotc/{run.baseline}"] = times[run.aotc][what] / times[run.baseline][what]
        row["target aotc/eager"] = V4_TARGETS["prefill" if what == "prefill" else "decode"]
        rows.append(row)
    copy = max(copy_first, copy_bandwidth(min_time=run.times(3.0)))  # the better of two: the share is not flattered by a slow copy
    used = sizes["expert_bytes_read"] + sizes["other_bytes_read"]
    step = times[run.aotc]["decode b1"]
    bandwidth = {"bytes_read": used, "GBps": used / step / 1e9, "copy_GBps": copy / 1e9, "of_copy": used / step / copy, "target": V4_TARGETS["bandwidth"]}
    table(
        f"DeepSeek V4 {name} ({sizes['params'] / 1e6:.0f}M params, {sizes['active_params'] / 1e6:.0f}M active): "
        f"prefill of {prompt_len} tokens in chunks of {chunk}, decode at position {prompt_len} (ms)",
        rows,
    )
    table(
        f"DeepSeek V4 {name} batch-1 decode: bytes of the weights it uses (the {model.config.num_experts_per_tok} chosen experts "
        "per layer and the rest) per step time, versus copy bandwidth",
        [{"what": f"{run.aotc} decode b1", "MB read": used / 1e6, "GB/s": bandwidth["GBps"], "of copy bandwidth": bandwidth["of_copy"], "target": bandwidth["target"]},
         {"what": "memory copy", "GB/s": copy / 1e9, "of copy bandwidth": 1.0}],
    )  # fmt: skip
    console.print(
        f"aotc build (cold, {len(V4_BUCKETS)} decode buckets + prefill {chunk}): {build_s:.0f} s; first calls (prefill + each decode bucket): "
        + ", ".join(f"{k} {v:.1f} s" for k, v in first_calls.items()),
        highlight=False,
    )
    return {
        "model": name, "config": V4_100M if not run.quick else "tiny", **sizes, "prompt_tokens": prompt_len, "chunk": chunk,
        "max_seq": max_seq, "decode_position": prompt_len, "build_s": build_s, "first_calls_s": first_calls, "unit": "ms", "rows": rows, "bandwidth": bandwidth,
    }  # fmt: skip
