"""fp8 weight rescaling for trn2 on the host: the lookup table against tensor ops.

    python bench/fp8.py [--elements 1000000000] [--out bench/results/fp8.json]

Both rewrite e4m3fn weight bytes as the bytes of value/2 (aotc/fp8.py), in
chunks of 64M elements: the 256-entry numpy lookup table (aotc), and torch
ops on the host (decode to float32, halve, encode). The outputs must agree
on every byte that is not NaN.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import table, write_results  # noqa: E402

from aotc.fp8 import rescale_weights  # noqa: E402

CHUNK = 1 << 26


def torch_ops(w: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(w)
    flat_in, flat_out = w.view(-1), out.view(-1)
    for start in range(0, flat_in.numel(), CHUNK):
        part = flat_in[start : start + CHUNK].view(torch.float8_e4m3fn).float() / 2
        flat_out[start : start + CHUNK] = part.to(torch.float8_e4m3fn).view(torch.uint8)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=10**9)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fp8.json")
    args = ap.parse_args()
    w = torch.from_numpy(np.random.default_rng(0).integers(0, 256, size=args.elements, dtype=np.uint8))
    t0 = time.perf_counter()
    ours = rescale_weights(w)
    lut_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = torch_ops(w)
    ops_s = time.perf_counter() - t0
    nan = (w & 0x7F) == 0x7F
    assert torch.equal(ours[~nan], theirs[~nan]), "the two rescalings disagree"
    rows = [
        {"method": "aotc lookup table (numpy)", "seconds": lut_s, "Gelem/s": args.elements / lut_s / 1e9},
        {"method": "torch ops on the host", "seconds": ops_s, "Gelem/s": args.elements / ops_s / 1e9, "vs aotc": ops_s / lut_s},
    ]
    table(f"rescale {args.elements:,} e4m3fn weights to trn2's e4m3 (value/2)", rows)
    write_results(args.out, {"elements": args.elements, "rows": rows})


if __name__ == "__main__":
    main()
