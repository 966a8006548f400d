"""Skinny matmuls on the CPU: what aotc/passes/rewrite_skinny_linears.py is for.

    python bench/skinny.py [--out bench/results/skinny.json]

A decode step multiplies a few rows by every weight. For 16 fp32 weights of
2816 x 1024 (184 MB, well beyond the caches), each compiled with
torch.compile (Inductor, the backend aotc uses), this times `F.linear` and
the form the pass rewrites it to at 1, 2, 4 and 8 rows, and reports the
weight bytes read per second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from perf import console, table, timeit  # noqa: E402

from aotc.format import encode, write_atomic  # noqa: E402
from aotc.passes.rewrite_skinny_linears import CHUNK  # noqa: E402


def linear(x, weights):
    return [F.linear(x, w) for w in weights]


def rewritten(x, weights):
    if x.shape[0] == 1:
        return [(w * x).sum(-1)[None] for w in weights]
    return [torch.cat([(w @ x[i : i + CHUNK].T).T for i in range(0, x.shape[0], CHUNK)]) for w in weights]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "skinny.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(2816, 1024, generator=g) for _ in range(16)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    rows = []
    for m in (1, 2, 4, 8):
        x = torch.randn(m, 1024, generator=g)
        row = {"rows": m}
        for name, fn in (("linear", linear), ("aotc rewrite", rewritten)):
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
            torch.testing.assert_close(compiled(x, weights)[0], F.linear(x, weights[0]), atol=1e-3, rtol=1e-3)
            row[f"{name} GB/s"] = nbytes / timeit(lambda: compiled(x, weights), min_time=1.0) / 1e9
            torch._dynamo.reset()
        row["speedup"] = row["aotc rewrite GB/s"] / row["linear GB/s"]
        rows.append(row)
    table(f"16 fp32 weights of 2816x1024 ({nbytes / 1e6:.0f} MB), compiled by Inductor", rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, encode({"weights_MB": nbytes / 1e6, "rows": rows}))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
