"""Which form of a linear is fastest inside a compiled fp32 prefill layer whose weights are
graph inputs, as aotc's are?

    python bench/linear_forms.py [--rounds 7] [--out bench/results/linear_forms.json]

Issue 75's fp32 time to first token needs GEMMs faster than the `F.linear` that eager and
transformers run. bench/packed_gemm.py timed the faster ones in eager, and found that
Inductor runs a packed weight only as a constant of the graph. Here, the forms a graph that
takes its weights as inputs can run: SmolLM2-135M's layer (fused_linears.Separate: its
linears, RMSNorms, SiLU and residuals; no attention) compiled by AOTInductor once per form
and row count, over 30 layers' weights:
- `F.linear`, the weight [out, in] as stored (aotc's graphs today);
- `x @ w`, the weight laid out [in, out] (a layout bind could make, in place of the other);
- an op of the script's own (`torch.library.custom_op`, which AOTInductor's graph calls
  through its proxy executor, in Python), running the weight that bind would have packed,
  found by the dense weight's address: oneDNN's (`mkldnn._linear_pointwise`) or MKL's
  (`mkl._mkl_linear`, packed for this row count; its buffer's bytes against the weight's).
At 48 and 160 rows (a chat prompt, four: the default chunk buckets); each form's output is
checked against `F.linear`'s, the forms taken in turn each round (this VM's speed drifts
within minutes), the median of the rounds of 30 layer calls.
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
from fused_linears import Separate, norm, package  # noqa: E402
from packed_gemm import HIDDEN, INTER, KV, LAYERS  # noqa: E402

ROWS = (48, 160)
PACKED: dict[int, tuple[str, torch.Tensor]] = {}  # the dense weight's address -> (kind, its packed form)


@torch.library.custom_op("aotcbench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    kind, packed = PACKED[w.data_ptr()]
    if kind == "oneDNN":
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return torch.ops.mkl._mkl_linear(x, packed, w, None, x.shape[0])


@packed_linear.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[0]))


class Op(torch.nn.Module):
    """Separate, each linear through packed_linear."""

    def forward(self, x, n1, n2, q, k, v, o, gate, up, down):
        lin = torch.ops.aotcbench.packed_linear
        h = norm(x, n1)
        a = lin(h, q) + lin(h, k).repeat(1, 3) * lin(h, v).repeat(1, 3)
        x = x + lin(a, o)
        h = norm(x, n2)
        return x + lin(F.silu(lin(h, gate)) * lin(h, up), down)


class InOut(torch.nn.Module):
    """Separate, each weight given as [in, out]."""

    def forward(self, x, n1, n2, q, k, v, o, gate, up, down):
        h = norm(x, n1)
        a = h @ q + (h @ k).repeat(1, 3) * (h @ v).repeat(1, 3)
        x = x + a @ o
        h = norm(x, n2)
        return x + (F.silu(h @ gate) * (h @ up)) @ down


def measure(rows: int, rounds: int, tmp: Path) -> dict:
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(shape, generator=g) * 0.02

    layers = [dict(n1=torch.ones(HIDDEN), n2=torch.ones(HIDDEN), q=w(HIDDEN, HIDDEN), k=w(KV, HIDDEN), v=w(KV, HIDDEN), o=w(HIDDEN, HIDDEN),
                   gate=w(INTER, HIDDEN), up=w(INTER, HIDDEN), down=w(HIDDEN, INTER)) for _ in range(LAYERS)]  # fmt: skip
    in_out = [{n: t.t().contiguous() if t.dim() == 2 else t for n, t in p.items()} for p in layers]
    matrices = [t for p in layers for t in p.values() if t.dim() == 2]
    x = torch.randn(rows, HIDDEN, generator=g)
    with torch.no_grad():
        plain = package(Separate(), (x, *layers[0].values()), tmp / f"linear-{rows}.pt2")
        transposed = package(InOut(), (x, *in_out[0].values()), tmp / f"in-out-{rows}.pt2")
        op = package(Op(), (x, *layers[0].values()), tmp / f"op-{rows}.pt2")
        packs = {
            "oneDNN": {t.data_ptr(): ("oneDNN", torch.ops.mkldnn._reorder_linear_weight(t, rows)) for t in matrices},
            "MKL": {t.data_ptr(): ("MKL", torch.ops.mkl._mkl_reorder_linear_weight(t, rows)) for t in matrices},
        }
        # An opaque tensor: its bytes are its elements' (no storage to ask)
        mkl_bytes = sum(p.numel() * p.element_size() for _, p in packs["MKL"].values()) / sum(t.nbytes for t in matrices)

        def packed(kind):
            def run(*args):
                return op(*args)

            run.kind = kind
            return run

        forms = {
            "F.linear": (plain, layers),
            "x @ w, w stored in x out": (transposed, in_out),
            "op, oneDNN packed": (packed("oneDNN"), layers),
            "op, MKL packed": (packed("MKL"), layers),
        }
        want = plain(x, *layers[0].values())
        times: dict[str, list[float]] = {k: [] for k in forms}
        for i in range(rounds + 1):  # the first round checks and warms up, and is dropped
            for name, (graph, weights) in forms.items():
                if hasattr(graph, "kind"):
                    PACKED.clear()
                    PACKED.update(packs[graph.kind])
                if i == 0:
                    torch.testing.assert_close(graph(x, *weights[0].values()), want, atol=1e-4, rtol=1e-4)
                t0 = time.perf_counter()
                for p in weights:
                    graph(x, *p.values())
                times[name].append(time.perf_counter() - t0)
    ms = {k: statistics.median(t[1:]) * 1e3 for k, t in times.items()}
    row = {"rows": rows}
    for name, value in ms.items():
        row[f"{name} ms"] = value
        if name != "F.linear":
            row[f"{name} / F.linear"] = value / ms["F.linear"]
    row["MKL packed bytes / weight bytes"] = mkl_bytes
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "linear_forms.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aotc-linear-forms-") as tmp:
        rows = [measure(r, args.rounds, Path(tmp)) for r in ROWS]
    table(
        f"{LAYERS} compiled fp32 layer calls (linears, norms, SiLU; no attention), weights as inputs, ms, median of {args.rounds} interleaved rounds "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads)",
        rows,
    )
    write_results(args.out, {"rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
