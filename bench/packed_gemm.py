"""Can a prefill graph's linears run faster than eager's? Packed weights, and fused ones.

    python bench/packed_gemm.py [--out bench/results/packed_gemm.json]

Issue 75's lever for time to first token: GEMMs faster than the `F.linear` that eager and
transformers run. SmolLM2-135M's linear shapes (hidden 576, intermediate 1536, 3 KV heads
of 64), 30 layers' weights, so that each call streams its layer's weights from memory as a
prefill step does. At 38, 64 and 152 rows (one chat prompt, a chunk, four prompts), in
fp32 and bf16, the best of 5 (common.timeit) of all seven linears of every layer:
- `F.linear`, the weights as stored;
- q, k and v fused into one weight, gate and up into another (gpt-fast's wqkv);
- oneDNN's packed weight (`mkldnn._reorder_linear_weight`, then `_linear_pointwise`);
- MKL's packed weight (fp32 only: `mkl._mkl_reorder_linear_weight`, then `_mkl_linear`),
  with its buffer's bytes against the weight's.
Each packed or fused result is checked against `F.linear`'s. Then whether an exported
graph that takes the oneDNN-packed weight as an input (as aotc's graphs take every weight:
one graph serves all layers of a class) compiles with AOTInductor.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import console, table, timeit, write_results  # noqa: E402

HIDDEN, INTER, KV, LAYERS = 576, 1536, 192, 30
SHAPES = {"q": (HIDDEN, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
ROWS = (38, 64, 152)


def layers(dtype):
    g = torch.Generator().manual_seed(0)
    return [{n: (torch.randn(s, generator=g) * 0.02).to(dtype) for n, s in SHAPES.items()} for _ in range(LAYERS)]


def measure(dtype, rows: int, weights) -> dict:
    x = torch.randn(rows, HIDDEN).to(dtype)
    h = torch.randn(rows, INTER).to(dtype)
    inputs = {n: h if n == "down" else x for n in SHAPES}
    row = {"dtype": str(dtype).removeprefix("torch."), "rows": rows}
    plain = lambda: [F.linear(inputs[n], w[n]) for w in weights for n in SHAPES]  # noqa: E731
    row["F.linear ms"] = timeit(plain, best=True) * 1e3
    want = [F.linear(inputs[n], weights[0][n]) for n in SHAPES]
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)

    fused = [{"qkv": torch.cat([w["q"], w["k"], w["v"]]), "o": w["o"], "gate_up": torch.cat([w["gate"], w["up"]]), "down": w["down"]} for w in weights]
    fused_inputs = {"qkv": x, "o": x, "gate_up": x, "down": h}
    got = F.linear(x, fused[0]["qkv"])
    torch.testing.assert_close(got, torch.cat(want[:3], dim=1), **tol)
    row["fused ms"] = timeit(lambda: [F.linear(fused_inputs[n], w[n]) for w in fused for n in fused_inputs], best=True) * 1e3

    packed = [{n: torch.ops.mkldnn._reorder_linear_weight(w[n], rows) for n in SHAPES} for w in weights]
    torch.testing.assert_close(torch.ops.mkldnn._linear_pointwise(x, packed[0]["q"], None, "none", [], ""), want[0], **tol)
    row["oneDNN packed ms"] = timeit(lambda: [torch.ops.mkldnn._linear_pointwise(inputs[n], w[n], None, "none", [], "") for w in packed for n in SHAPES], best=True) * 1e3

    if dtype == torch.float32:
        mkl = [{n: torch.ops.mkl._mkl_reorder_linear_weight(w[n], rows) for n in SHAPES} for w in weights]
        torch.testing.assert_close(torch.ops.mkl._mkl_linear(x, mkl[0]["q"], weights[0]["q"], None, rows), want[0], **tol)
        row["MKL packed ms"] = timeit(lambda: [torch.ops.mkl._mkl_linear(inputs[n], m[n], w[n], None, rows) for m, w in zip(mkl, weights) for n in SHAPES], best=True) * 1e3
        # An opaque tensor: its bytes are its elements' (no storage to ask)
        packed_bytes = sum(t.numel() * t.element_size() for t in mkl[0].values())
        row["MKL packed bytes / weight bytes"] = packed_bytes / sum(t.numel() * t.element_size() for t in weights[0].values())
    for k in ("fused", "oneDNN packed", "MKL packed"):
        if f"{k} ms" in row:
            row[f"{k} / F.linear"] = row[f"{k} ms"] / row["F.linear ms"]
    return row


class PackedInput(torch.nn.Module):
    def forward(self, x, w):
        return F.silu(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))


def packed_as_input(tmp: Path) -> str:
    """Whether AOTInductor compiles a graph that takes a oneDNN-packed weight as an input."""
    x, w = torch.randn(64, HIDDEN, dtype=torch.bfloat16), torch.randn(INTER, HIDDEN, dtype=torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    try:
        program = torch.export.export(PackedInput(), (x, packed))
    except Exception as e:  # noqa: BLE001 - the finding is which step refuses, and its words
        return f"export refused: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    try:
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp / "packed.pt2"))
    except Exception as e:  # noqa: BLE001
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        where = traceback.extract_tb(cause.__traceback__)[-1]
        return f"AOTInductor refused: {type(e).__name__} at {Path(where.filename).name}:{where.lineno} ({where.line})"
    got = torch._inductor.aoti_load_package(path)(x, packed)
    torch.testing.assert_close(got, F.silu(F.linear(x, w)), atol=2e-2, rtol=2e-2)
    return "compiled, equal"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "packed_gemm.json")
    args = ap.parse_args()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        weights = layers(dtype)
        rows += [measure(dtype, r, weights) for r in ROWS]
        del weights
    table(f"all seven linears of {LAYERS} SmolLM2-135M layers, ms (torch {torch.__version__}, {torch.get_num_threads()} threads)", rows)
    with tempfile.TemporaryDirectory(prefix="aotc-packed-") as tmp:
        verdict = packed_as_input(Path(tmp))
    console.print(f"a graph taking a oneDNN-packed weight as an input: {verdict}", highlight=False)
    write_results(args.out, {"rows": rows, "packed weight as a graph input": verdict})


if __name__ == "__main__":
    main()
