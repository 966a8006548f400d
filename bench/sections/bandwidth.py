"""bandwidth: decode of the ~100M model (tiny under --quick) at every batch bucket
against the roofline, max(weight bytes / copy bandwidth, FLOPs / GEMM peak): copy
bandwidth is bytes read per second by a streaming sum over 1 GiB, GEMM peak a 2048^3
fp32 matmul, both measured in the same run; issue 19's targets (>= 0.7 of the roofline,
<= 0.4x eager)."""

from __future__ import annotations

from common import BUCKETS, Run, copy_bandwidth, gemm_peak, print_misses, section, table

from aotc.models.loader import load_model
from aotc.runtime import Bundle
from sections.decode import decode_times

# Issue 19's targets, per batch bucket 1-8: aotc decode within 0.4x eager's step time, and at
# least 70% of the roofline.
DECODE_TARGETS = {"of_eager": 0.4, "of_roofline": 0.7}
# How the CPU decode path reads each weight, at every batch bucket (rewrite_skinny_linears).
SKINNY_PATH = "a mul + sum per row, fused by Inductor into one pass over each weight"


def decode_weights(model) -> list:
    """What a decode step reads in full: every weight but the embedding table (one row)."""
    return [p for n, p in model.named_parameters() if not n.startswith("model.embed_tokens")]


@section("bandwidth")
def bandwidth(run: Run) -> dict:
    """Weight bytes: every weight but the embedding table; FLOPs: 2 x those weights x
    rows (the linear layers; attention at position 128 adds under 1%)."""
    name = run.main
    model = load_model(run.model(name)).model
    bundle = Bundle.load(run.bundle(run.model(name), batch_buckets=BUCKETS, chunk_buckets=(128,)))
    weights = decode_weights(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    buffer = (256 if run.quick else 1024) << 20  # still far beyond the caches under --quick
    copy = copy_bandwidth(buffer, min_time=run.times(3.0))
    peak = gemm_peak(min_time=run.times(2.0))
    rows = []
    for step in decode_times(run, model, {run.backend: bundle}, torch_compile=False):
        batch, ours, eager = step["batch"], step[run.aotc], step["eager"]
        flops = 2 * sum(p.numel() for p in weights) * batch
        roofline = max(weight_bytes / copy, flops / peak)
        row = {
            "batch": batch, "roofline ms": roofline * 1e3, "bound by": "memory" if weight_bytes / copy >= flops / peak else "compute",
            f"{run.aotc} ms": ours * 1e3, "of roofline": roofline / ours, "eager ms": eager * 1e3, "aotc / eager": ours / eager,
            "weight GB/s": weight_bytes / ours / 1e9,
        }  # fmt: skip
        row["targets met"] = row["of roofline"] >= DECODE_TARGETS["of_roofline"] and row["aotc / eager"] <= DECODE_TARGETS["of_eager"]
        rows.append(row)
    misses = [
        f"batch {r['batch']}: {r['of roofline']:.2f} of the roofline ({r['bound by']}-bound; weights read at {r['weight GB/s']:.1f} GB/s, "
        f"copy {copy / 1e9:.1f}), {r['aotc / eager']:.2f}x eager"
        for r in rows if not r["targets met"]
    ]  # fmt: skip
    table(
        f"decode against the roofline, {name} model ({weight_bytes / 1e6:.0f} MB of weights; copy {copy / 1e9:.1f} GB/s read, "
        f"GEMM {peak / 1e9:.0f} GFLOP/s; targets: >= 0.7 of the roofline, <= 0.4x eager)",
        rows,
    )
    print_misses(misses)
    return {
        "model": name, "weight_bytes": weight_bytes, "copy_GBps": copy / 1e9, "gemm_peak_GFLOPs": peak / 1e9,
        "definitions": {
            "copy bandwidth": f"bytes read per second by a streaming sum over a {buffer >> 20} MiB fp32 buffer, best of 10, this run",
            "roofline": "max(weight bytes / copy bandwidth, FLOPs / GEMM peak); GEMM peak: a 2048^3 fp32 matmul, this run",
        },
        "decode path": SKINNY_PATH, "targets": DECODE_TARGETS, "misses": misses, "rows": rows,
    }  # fmt: skip
