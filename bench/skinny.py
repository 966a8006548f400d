"""Skinny matmuls on the CPU: what aotc/passes/rewrite_skinny_linears.py is for.

    python bench/skinny.py [--out bench/results/skinny.json]

A decode step multiplies a few rows by every weight. For 16 fp32 weights of
2816 x 1024 (184 MB, well beyond the caches), each compiled with
torch.compile (Inductor, the backend aotc uses), this times `F.linear` and
the graph the pass makes of it at 1, 2, 4 and 8 rows, and reports the weight
bytes read per second against the roofline: max(bytes / copy bandwidth,
FLOPs / GEMM peak), both measured in the same run as bench/perf.py does.
All 16 share x, so Inductor reads them in one loop, an accumulator per weight
and row.

Then the same weights at 1 row stored as fp8 with a scale per 128 x 128 block
(aotc.lowp_weights): decoded by the fp8 -> float32 conversion (what the export and
xla graphs run), and in integer arithmetic (what aotc/passes/decode_fp8_bits.py makes
of that conversion on the CPU), against fp32. Bytes per second count the bytes
stored (1 per fp8 weight, 4 per fp32 one).

Then the same weights stored as int8 with a scale per 32 inputs (aotc.lowp_weights,
Q8_0's grid) at 1, 2, 4 and 8 rows, activations in fp32: dequantized inside
rewrite_skinny_linears' mul+sum, as aotc's CPU graphs run them, and the same
with the weights laid out in 16-row panels [N/16, K, 16] summed over their
inputs (vectorized across the panel's rows: ../shared/research/cpu-int8.md's
proposal, which aotc does not ship: on this host it ran no faster at 1 row and
slower at 8), against fp32's mul+sum. Bytes per second count the bytes stored
(1 per int8 weight plus a 4-byte scale per 32).

Then the same weights (fp32 and int8), each on an input of its own, so that each
is a loop of its own as a decode step's projections are: read in stripes of
their output rows, as the pass reads them (4 at 1 to 4 rows, 2 at 8), against
one stripe.

Then decode attention (what rewrite_skinny_matmuls is for): 8 layers of one
sequence's GQA attention, 4 KV heads x 4096 cached positions x 64, at 1, 2,
4 and 8 query heads per KV head: q @ k^T, softmax, p @ v as torch.compile
makes them (MKL batched matmuls) against the graph the pass makes; bytes
per second count the keys and values read.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import copy_bandwidth, gemm_peak, table, timeit, write_results  # noqa: E402

from aotc import lowp_weights  # noqa: E402
from aotc.passes import rewrite_skinny_linears  # noqa: E402
from aotc.passes.rewrite_skinny_linears import RewriteSkinnyLinears  # noqa: E402
from aotc.passes.rewrite_skinny_matmuls import MATMUL_ROWS, RewriteSkinnyMatmuls  # noqa: E402


class Linears(torch.nn.Module):
    def __init__(self, weights):
        super().__init__()
        self.weights = torch.nn.ParameterList(weights)

    def forward(self, x):
        return [F.linear(x, w) for w in self.weights]


def one_stripe():
    """The pass as it was before it read weights in stripes: one reduction per row."""
    return mock.patch.object(rewrite_skinny_linears, "MAX_STRIPES", 1)


def rewritten(module: Linears, x: torch.Tensor) -> torch.fx.GraphModule:
    """The exported graph after the pass, as aotc's inductor pipeline gets it."""
    gm = torch.export.export(module, (x,), strict=False).module()
    assert RewriteSkinnyLinears()(gm).changes == len(module.weights)
    return gm


def rewritten_form(x, weights):
    """What the pass makes of F.linear(x, w) at 1 row, written out for the fp8 rows below."""
    return [(w * x).sum(-1)[None] for w in weights]


def fp8_converted(x, stored):
    return [(lowp_weights.dequantize("fp8", q, s, torch.float32) * x).sum(-1)[None] for q, s in stored]


def _bits(q):
    """The ops decode_fp8_bits puts in place of q.to(float32)."""
    i = q.view(torch.int8).to(torch.int32)
    e, m = (i & 0x7F) >> 3, i & 7
    f = torch.where(e > 0, (m + 8) << e, m << 1).to(torch.float32) * 2.0**-10
    return torch.where(i < 0, -f, f)


def fp8_bits(x, stored):
    return [((_bits(q) * lowp_weights._expand(lowp_weights.scale_factors(s), *q.shape, lowp_weights.FP8_BLOCK)) * x).sum(-1)[None] for q, s in stored]


def bench_fp8(weights, g) -> list[dict]:
    stored = [lowp_weights.quantize_fp8_blocks(w) for w in weights]
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    fp8_bytes = sum(q.numel() + s.numel() * 4 for q, s in stored)
    x = torch.randn(1, weights[0].shape[1], generator=g)
    reference = fp8_converted(x, stored)[0]
    rows = []
    for name, fn, args, nbytes in (
        ("fp32, mul + sum", rewritten_form, weights, fp32_bytes),
        ("fp8, converted", fp8_converted, stored, fp8_bytes),
        ("fp8, integer decode (decode_fp8_bits)", fp8_bits, stored, fp8_bytes),
    ):
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        if name.startswith("fp8"):  # both fp8 forms give the same floats
            torch.testing.assert_close(compiled(x, args)[0], reference, atol=1e-4, rtol=1e-4)
        seconds = timeit(lambda: compiled(x, args), min_time=1.0)
        rows.append({"weights": name, "ms": seconds * 1e3, "MB stored": nbytes / 1e6, "GB/s": nbytes / seconds / 1e9})
        torch._dynamo.reset()
    for r in rows:
        r["fp32 ms / this"] = rows[0]["ms"] / r["ms"]
    table("1 row, the same 16 weights stored as fp8 (a scale per 128x128 block), compiled by Inductor", rows)
    return rows


class Int8Linears(torch.nn.Module):
    """Linear layers on int8 weights as aotc's graphs take them (checkpoint.stored_dtype)."""

    def __init__(self, weights):
        super().__init__()
        for i, w in enumerate(weights):
            values, scale = lowp_weights.quantize_int8(w)
            self.register_buffer(f"v{i}", values)
            self.register_buffer(f"s{i}", scale)
        self.n = len(weights)

    def forward(self, x):
        return [F.linear(x, lowp_weights.dequantize("int8", getattr(self, f"v{i}"), getattr(self, f"s{i}"), x.dtype)) for i in range(self.n)]


PANEL = 16


class Int8Panels(torch.nn.Module):
    """The proposal: int8 values [N/16, K, 16] and scales [N/16, K/32, 16], each output a
    sum over the inputs of a panel's 16 rows side by side (written as its own graph)."""

    def __init__(self, weights):
        super().__init__()
        for i, w in enumerate(weights):
            values, scale = lowp_weights.quantize_int8(w)
            lay = lambda t: t.reshape(t.shape[0] // PANEL, PANEL, t.shape[1]).transpose(1, 2).contiguous()  # noqa: E731
            self.register_buffer(f"v{i}", lay(values))
            self.register_buffer(f"s{i}", lay(scale))
        self.n = len(weights)

    def forward(self, x):
        out = []
        for i in range(self.n):
            v, s = getattr(self, f"v{i}"), getattr(self, f"s{i}")
            panels, k, _ = v.shape
            w = (v.to(torch.float32).view(panels, k // 32, 32, PANEL) * s[:, :, None, :]).view(panels, k, PANEL)
            out.append(torch.stack([(w * row.view(1, k, 1)).sum(1).reshape(-1) for row in x]))
        return out


def bench_int8(weights, g) -> list[dict]:
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    int8_bytes = sum(w.numel() + w.numel() // lowp_weights.INT8_BLOCK[1] * 4 for w in weights)
    forms = {  # (module, the pass aotc runs on it, or None, bytes stored)
        "fp32, mul + sum": (Linears(weights).requires_grad_(False), RewriteSkinnyLinears, fp32_bytes),
        "int8, mul + sum (aotc)": (Int8Linears(weights), RewriteSkinnyLinears, int8_bytes),
        "int8 in 16-row panels": (Int8Panels(weights), None, int8_bytes),
    }
    rows = []
    for m in (1, 2, 4, 8):
        x = torch.randn(m, weights[0].shape[1], generator=g)
        reference = Int8Linears(weights[:1])(x)[0]
        for name, (module, rewrite, nbytes) in forms.items():
            gm = torch.export.export(module, (x,), strict=False).module()
            assert rewrite is None or rewrite()(gm).changes == len(weights)
            compiled = torch.compile(gm, fullgraph=True, dynamic=False)
            if name.startswith("int8"):  # both int8 forms compute the same weights
                torch.testing.assert_close(compiled(x)[0], reference, atol=1e-3, rtol=1e-3)
            seconds = timeit(lambda: compiled(x), min_time=1.0)
            rows.append({"rows": m, "weights": name, "ms": seconds * 1e3, "MB stored": nbytes / 1e6, "GB/s": nbytes / seconds / 1e9})
            torch._dynamo.reset()
    for r in rows:
        r["fp32 ms / this"] = next(f["ms"] for f in rows if f["rows"] == r["rows"]) / r["ms"]
    table("the same 16 weights stored as int8 (a float32 scale per 32 inputs), fp32 activations, compiled by Inductor", rows)
    return rows


class Attention(torch.nn.Module):
    """Decode attention of one sequence, layer after layer: q [1, kv, rep, hd] against
    each layer's k, v [1, kv, S, hd] (the shapes of aotc's Llama decode graphs)."""

    def forward(self, q, ks, vs):
        return [torch.softmax(q @ k.transpose(-1, -2) * 0.125, dim=-1) @ v for k, v in zip(ks, vs)]


class Apart(torch.nn.Module):
    """Each weight of `module` (Linears or Int8Linears) on an input of its own: each its own
    loop in Inductor, as a decode step's projections are (linears that share an input and
    a weight shape share one loop: the tables above)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *xs):
        m = self.module
        if isinstance(m, Linears):
            return [F.linear(x, w) for x, w in zip(xs, m.weights)]
        return [F.linear(x, lowp_weights.dequantize("int8", getattr(m, f"v{i}"), getattr(m, f"s{i}"), x.dtype)) for i, x in enumerate(xs)]


def bench_stripes(weights, g) -> list[dict]:
    """rewrite_skinny_linears reads each weight in stripes of its output rows (4 at 1 to 4
    rows, 2 at 8), each its own accumulator and stream, against one stripe, on weights that
    each have a loop of their own."""
    forms = {"fp32": (Linears(weights).requires_grad_(False), sum(w.numel() * 4 for w in weights)),
             "int8": (Int8Linears(weights), sum(w.numel() + w.numel() // lowp_weights.INT8_BLOCK[1] * 4 for w in weights))}  # fmt: skip
    rows = []
    for m in (1, 2, 4, 8):
        xs = tuple(torch.randn(m, weights[0].shape[1], generator=g) for _ in weights)
        for name, (module, nbytes) in forms.items():
            row = {"rows": m, "weights": name}
            expected = None
            for label, striped in (("stripes", True), ("one stripe", False)):
                gm = torch.export.export(Apart(module), xs, strict=False).module()
                with contextlib.nullcontext() if striped else one_stripe():
                    assert RewriteSkinnyLinears()(gm).changes == len(weights)
                compiled = torch.compile(gm, fullgraph=True, dynamic=False)
                out = compiled(*xs)[0]
                expected = out if expected is None else expected
                torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)
                seconds = timeit(lambda: compiled(*xs), min_time=1.0)
                row[f"{label} GB/s"] = nbytes / seconds / 1e9
                torch._dynamo.reset()
            row["stripes / one stripe"] = row["stripes GB/s"] / row["one stripe GB/s"]
            rows.append(row)
    table("the same 16 weights, each on an input of its own (its own loop), read in stripes and in one stripe", rows)
    return rows


def bench_attention(g, layers: int = 8, kv: int = 4, positions: int = 4096) -> list[dict]:
    ks = [torch.randn(1, kv, positions, 64, generator=g) for _ in range(layers)]
    vs = [torch.randn(1, kv, positions, 64, generator=g) for _ in range(layers)]
    nbytes = 2 * layers * kv * positions * 64 * 4
    rows = []
    for rep in (1, 2, 4, 8):
        q = torch.randn(1, kv, rep, 64, generator=g)
        gm = torch.export.export(Attention(), (q, ks, vs), strict=False).module()
        # The pass rewrites 2 to 4 query rows (MATMUL_ROWS); at 1 and 8 both columns are the matmul.
        assert RewriteSkinnyMatmuls()(gm).changes == (2 * layers if rep in MATMUL_ROWS else 0)
        row = {"query heads per KV head": rep}
        expected = Attention()(q, ks, vs)[0]
        for name, fn in (("matmul (MKL)", Attention()), ("aotc rewrite", gm)):
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
            torch.testing.assert_close(compiled(q, ks, vs)[0], expected, atol=1e-4, rtol=1e-4)
            seconds = timeit(lambda: compiled(q, ks, vs), min_time=1.0)
            row[f"{name} ms"] = seconds * 1e3
            row[f"{name} GB/s"] = nbytes / seconds / 1e9
            torch._dynamo.reset()
        row["speedup"] = row["matmul (MKL) ms"] / row["aotc rewrite ms"]
        rows.append(row)
    table(f"decode attention, {layers} layers x {kv} KV heads x {positions} positions x 64 ({nbytes / 1e6:.0f} MB of k, v), compiled by Inductor", rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "skinny.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(2816, 1024, generator=g) for _ in range(16)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    module = Linears(weights).requires_grad_(False)
    copy, peak = copy_bandwidth(), gemm_peak()
    rows = []
    for m in (1, 2, 4, 8):
        x = torch.randn(m, 1024, generator=g)
        roofline = max(nbytes / copy, 2 * nbytes / 4 * m / peak)
        row = {"rows": m, "roofline GB/s": nbytes / roofline / 1e9}
        for name, fn in (("linear", module), ("aotc rewrite", rewritten(module, x))):
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
            torch.testing.assert_close(compiled(x)[0], F.linear(x, weights[0]), atol=1e-3, rtol=1e-3)
            seconds = timeit(lambda: compiled(x), min_time=1.0)
            row[f"{name} GB/s"] = nbytes / seconds / 1e9
            row[f"{name} of roofline"] = roofline / seconds
            torch._dynamo.reset()
        row["speedup"] = row["aotc rewrite GB/s"] / row["linear GB/s"]
        rows.append(row)
    table(
        f"16 fp32 weights of 2816x1024 ({nbytes / 1e6:.0f} MB), compiled by Inductor; copy {copy / 1e9:.1f} GB/s read, GEMM {peak / 1e9:.0f} GFLOP/s",
        rows,
    )
    fp8_rows = bench_fp8(weights, g)
    int8_rows = bench_int8(weights, g)
    stripe_rows = bench_stripes(weights, g)
    attention_rows = bench_attention(g)
    write_results(args.out, {
        "weights_MB": nbytes / 1e6, "copy_GBps": copy / 1e9, "gemm_peak_GFLOPs": peak / 1e9, "rows": rows, "fp8_1_row": fp8_rows, "int8": int8_rows,
        "stripes": stripe_rows, "attention": attention_rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
