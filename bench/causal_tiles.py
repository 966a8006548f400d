"""What does a long prefill chunk's attention save when its query rows attend in tiles?

    python bench/causal_tiles.py [--out bench/results/causal_tiles.json]

A row of a packed chunk attends to no later row of it (models/packing.py), so a tile of
rows needs the keys up to its own last row only: packing.attend_in_tiles. Here
SmolLM2-135M's heads (9 query heads, 3 KV heads of 64), 30 layers, fp32, a fresh chunk
(its own rows only) of one sequence: `softmax_attend` over the whole chunk, as aotc's
prefill graph computed it before the tiles, against attend_in_tiles at tiles of 16 to 128
rows, each compiled by torch.compile (as Inductor compiles aotc's graphs) and checked
against the untiled result. The best of 5 runs (common.timeit) of 30 layer calls, ms, and
each tiling over the untiled time. packing.TILE is the tile aotc uses; attend_in_tiles
runs a chunk of at most two tiles untiled (so tiles of 128 at 160 and 256 rows are the
untiled call).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import table, timeit, write_results  # noqa: E402

from aotc.models import packing  # noqa: E402
from aotc.models.llama import softmax_attend  # noqa: E402
from aotc.models.packing import attend_in_tiles, packed_bias  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
ROWS = (160, 192, 256, 512)
TILES = (16, 32, 64, 128)


def measure(rows: int) -> dict:
    g = torch.Generator().manual_seed(0)
    rep = HEADS // KV_HEADS
    q = torch.randn(KV_HEADS, rep, rows, HEAD_DIM, generator=g)
    keys, values = (torch.randn(KV_HEADS, rows, HEAD_DIM, generator=g) for _ in range(2))
    positions = torch.arange(rows)
    bias = packed_bias(positions, torch.zeros(rows, dtype=torch.long), 0)
    attend = functools.partial(softmax_attend, scale=HEAD_DIM**-0.5)

    def untiled(q, keys, values, bias):
        return attend(q.reshape(KV_HEADS, rep * rows, HEAD_DIM), keys, values, bias.repeat(rep, 1)).view(q.shape)

    want = untiled(q, keys, values, bias)
    row = {"rows": rows}
    forms = {"untiled": untiled}
    for tile in TILES:
        if tile < rows:
            forms[f"tiles of {tile}"] = functools.partial(attend_in_tiles, attend, cached=0, tile=tile)
    for name, fn in forms.items():
        compiled = torch.compile(fn)
        torch.testing.assert_close(compiled(q, keys, values, bias), want, atol=1e-4, rtol=1e-4)
        row[f"{name} ms"] = timeit(lambda: [compiled(q, keys, values, bias) for _ in range(LAYERS)], best=True) * 1e3
        torch._dynamo.reset()
    for tile in TILES:
        if f"tiles of {tile} ms" in row:
            row[f"tiles of {tile} / untiled"] = row[f"tiles of {tile} ms"] / row["untiled ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "causal_tiles.json")
    args = ap.parse_args()
    rows = [measure(r) for r in ROWS]
    table(
        f"{LAYERS} layers' attention of a fresh prefill chunk, fp32, SmolLM2-135M's heads, ms (torch {torch.__version__}, {torch.get_num_threads()} threads; aotc's tile: {packing.TILE})",
        rows,
    )
    write_results(args.out, {"tile": packing.TILE, "rows": rows})


if __name__ == "__main__":
    main()
