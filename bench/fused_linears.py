"""Do fused linears make a compiled prefill layer faster? q, k and v as one weight, gate and
up as another, in an AOTInductor graph that takes its weights as inputs (as aotc's do).

    python bench/fused_linears.py [--rounds 7] [--out bench/results/fused_linears.json]

Issue 75's one GEMM lever that fits aotc's design (bench/packed_gemm.py: packed weights must
be graph constants in torch 2.13; fused ones need only a layout that bind could make, each
layer's weights as views of one allocation). A SmolLM2-135M layer's linears (hidden 576,
intermediate 1536, 3 KV heads of 64) with what joins them in a layer (RMSNorm, SiLU x up,
the residuals; attention left out, as it does not change with the fusion), compiled once per
form and row count, run over 30 layers' weights so that each call streams its layer's
weights from memory. At 48 and 160 rows (a chat turn, four: the default chunk buckets), in
fp32 and bf16: the fused graph's output checked against the separate one's, then the two
taken in turn each round (this VM's speed drifts within minutes), the median of the rounds
of 30 layer calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import table, write_results  # noqa: E402
from packed_gemm import HIDDEN, INTER, KV, LAYERS  # noqa: E402  SmolLM2-135M's linear shapes, one place

ROWS = (48, 160)


def norm(x, w):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * w


class Separate(torch.nn.Module):
    def forward(self, x, n1, n2, q, k, v, o, gate, up, down):
        h = norm(x, n1)
        a = F.linear(h, q) + F.linear(h, k).repeat(1, 3) * F.linear(h, v).repeat(1, 3)  # every output used, no attention
        x = x + F.linear(a, o)
        h = norm(x, n2)
        return x + F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)


class Fused(torch.nn.Module):
    def forward(self, x, n1, n2, qkv, o, gate_up, down):
        h = norm(x, n1)
        q, k, v = F.linear(h, qkv).split([HIDDEN, KV, KV], dim=-1)
        a = q + k.repeat(1, 3) * v.repeat(1, 3)
        x = x + F.linear(a, o)
        h = norm(x, n2)
        gate, up = F.linear(h, gate_up).split([INTER, INTER], dim=-1)
        return x + F.linear(F.silu(gate) * up, down)


def package(module, args, path: Path):
    program = torch.export.export(module, args)
    return torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(program, package_path=str(path)))


def measure(dtype, rows: int, rounds: int, tmp: Path) -> dict:
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(shape, generator=g) * 0.02).to(dtype)

    layers = [dict(n1=torch.ones(HIDDEN, dtype=dtype), n2=torch.ones(HIDDEN, dtype=dtype), q=w(HIDDEN, HIDDEN), k=w(KV, HIDDEN), v=w(KV, HIDDEN), o=w(HIDDEN, HIDDEN),
                   gate=w(INTER, HIDDEN), up=w(INTER, HIDDEN), down=w(HIDDEN, INTER)) for _ in range(LAYERS)]  # fmt: skip
    # The fused layout: each layer's q, k, v (and gate, up) one allocation, as bind would lay them out
    fused = [dict(n1=p["n1"], n2=p["n2"], qkv=torch.cat([p["q"], p["k"], p["v"]]), o=p["o"], gate_up=torch.cat([p["gate"], p["up"]]), down=p["down"]) for p in layers]
    x = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    name = f"{str(dtype).removeprefix('torch.')}-{rows}"
    with torch.no_grad():
        separate_graph = package(Separate(), (x, *layers[0].values()), tmp / f"separate-{name}.pt2")
        fused_graph = package(Fused(), (x, *fused[0].values()), tmp / f"fused-{name}.pt2")
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(fused_graph(x, *fused[0].values()), separate_graph(x, *layers[0].values()), **tol)
        runs = {"separate": (separate_graph, layers), "fused": (fused_graph, fused)}
        times = {k: [] for k in runs}
        for _ in range(rounds + 1):  # the first round warms up, and is dropped
            for k, (graph, weights) in runs.items():
                t0 = time.perf_counter()
                for p in weights:
                    graph(x, *p.values())
                times[k].append(time.perf_counter() - t0)
    ms = {k: statistics.median(t[1:]) * 1e3 for k, t in times.items()}
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows, "separate ms": ms["separate"], "fused ms": ms["fused"], "fused / separate": ms["fused"] / ms["separate"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fused_linears.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aotc-fused-") as tmp:
        rows = [measure(dtype, r, args.rounds, Path(tmp)) for dtype in (torch.float32, torch.bfloat16) for r in ROWS]
    table(
        f"{LAYERS} compiled layer calls (linears, norms, SiLU; no attention), ms, median of {args.rounds} interleaved rounds (torch {torch.__version__}, {torch.get_num_threads()} threads)",
        rows,
    )
    write_results(args.out, {"rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
