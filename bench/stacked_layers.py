"""Can one compiled call run every layer? torch.while_loop over stacked layer weights, each
iteration writing its layer's slice of the caches in place, against one call per layer.

    python bench/stacked_layers.py [--out bench/results/stacked_layers.json]

Issue 75's lever for the decode step's host work: one call per step for all the layers of
a class, one graph whose build does not grow with the layer count. The layer here is an
attention block cut down to what the question needs (a key projection written into the
cache at each row's position, attention over the cache, an output projection), 4 layers of
width 256, the caches [layers, 9 slots, positions, 256] fp32. For 256 and 1024 cached
positions, and for two ways of writing the cache in the loop (through the layer's slice of
the allocation, as aotc's per-layer graphs write theirs, or into the whole allocation at the
layer's index): whether torch.export takes the loop with grad enabled and under no_grad;
the AOTInductor package's result and caches against four calls of the one-layer package;
and the time of one call of the loop against those four calls, best of 5 (common.timeit). A loop that wrote
the caches in place would not grow with the cache's positions more than the calls do.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import console, table, timeit, write_results  # noqa: E402

LAYERS, WIDTH, SLOTS = 4, 256, 9


def attend(x, cache, wo):
    """cache [SLOTS, positions, WIDTH]: the rows' slots' keys, attended over whole."""
    keys = cache[: x.shape[0]]
    attention = torch.softmax(x[:, None, :] @ keys.transpose(1, 2) / WIDTH**0.5, -1) @ keys
    return x + attention[:, 0] @ wo.t()


class One(torch.nn.Module):
    """One layer, as aotc's graphs take it: x [rows, WIDTH], its slice of the caches, row i's
    key written at slot i, position positions[i]."""

    def forward(self, x, positions, cache, wk, wo):
        cache.index_put_((torch.arange(x.shape[0]), positions), x @ wk.t())
        return attend(x, cache, wo)


class Stacked(torch.nn.Module):
    """Every layer in one graph: a while_loop whose body takes layer i's weights and cache.
    `write`: "slice" writes through the layer's slice of the caches (a view), as One does;
    "root" indexes the whole allocation with the layer's index."""

    def __init__(self, write: str):
        super().__init__()
        self.write = write

    def forward(self, x, positions, caches, wk, wo):
        def more(i, x):
            return i < LAYERS

        def body(i, x):
            j = i.item()
            torch._check(j >= 0)
            torch._check(j < LAYERS)
            rows, keys = torch.arange(x.shape[0]), x @ wk.select(0, j).t()
            if self.write == "slice":
                caches.select(0, j).index_put_((rows, positions), keys)
            else:
                caches.index_put_((i.expand(x.shape[0]), rows, positions), keys)
            return i + 1, attend(x, caches.select(0, j), wo.select(0, j))

        return torch.while_loop(more, body, (torch.zeros((), dtype=torch.long), x))[1]


def package(module, args, path: Path):
    return torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(torch.export.export(module, args), package_path=str(path)))


def measure(positions_n: int, tmp: Path) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    wk, wo = (torch.randn(LAYERS, WIDTH, WIDTH, generator=g) / WIDTH**0.5 for _ in range(2))
    x, positions = torch.randn(1, WIDTH, generator=g), torch.tensor([3])
    caches = torch.zeros(LAYERS, SLOTS, positions_n, WIDTH)
    rows = []
    with torch.no_grad():
        one = package(One(), (x, positions, caches[0], wk[0], wo[0]), tmp / f"one-{positions_n}.pt2")
        expected_caches, expected = caches.clone(), x
        for i in range(LAYERS):
            expected = one(expected, positions, expected_caches[i], wk[i], wo[i])

        def per_layer():
            y = x
            for i in range(LAYERS):
                y = one(y, positions, caches[i], wk[i], wo[i])

        per_layer_s = timeit(per_layer, best=True)
    for write in ("slice", "root"):
        row = {"cached positions": positions_n, "cache MB": caches.nbytes / 1e6, "loop writes": write}
        try:
            torch.export.export(Stacked(write), (x, positions, caches.clone(), wk, wo))
            row["export, grad on"] = "taken"
        except Exception as e:  # what torch says is the finding
            said = [line.strip() for line in str(e).splitlines() if "mutation" in line]
            row["export, grad on"], row["why"] = "refused", said[0] if said else type(e).__name__
        with torch.no_grad():
            mine = caches.clone()
            stacked = package(Stacked(write), (x, positions, mine, wk, wo), tmp / f"stacked-{write}-{positions_n}.pt2")
            torch.testing.assert_close(stacked(x, positions, mine, wk, wo), expected)
            torch.testing.assert_close(mine, expected_caches)  # written in place, through the loop's own input
            row["export, no_grad"] = "taken, equal"
            row["a call per layer us"] = per_layer_s * 1e6
            row["one loop call us"] = timeit(lambda: stacked(x, positions, mine, wk, wo), best=True) * 1e6
        row["loop / per layer"] = row["one loop call us"] / row["a call per layer us"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "stacked_layers.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aotc-stacked-") as tmp:
        rows = [row for n in (256, 1024) for row in measure(n, Path(tmp))]
    table(f"{LAYERS} layers in one while_loop call against a call per layer (torch {torch.__version__}, {torch.get_num_threads()} threads)", [
        {k: v for k, v in r.items() if k != "why"} for r in rows])  # fmt: skip
    console.print(f"with grad enabled: {rows[0].get('why', 'taken')}")
    write_results(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
