"""The compile cache, measured: cold build, warm rebuild, 2-way sharded build.

    python bench/cache.py [--out bench/results/cache.json]

All builds are `aotc build` processes of the embedded default model with the
inductor backend and the default buckets, each with its own fresh Inductor
cache unless said otherwise, so "cold" means cold:
  cold, 1 job        one process compiles everything
  warm rebuild       the same build again: every artifact is a cache hit
  2-way sharded      two shard processes at once (as two CI runners, one core
                     each, separate caches), then a --require-cache assembly
                     from their merged caches; wall time of the whole
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import table, write_results  # noqa: E402

from aotc.format import read_manifest  # noqa: E402
from aotc.models.tiny import write_tiny  # noqa: E402


def aotc(*args, cache: Path, inductor_cache: Path) -> subprocess.Popen:
    env = dict(os.environ, AOTC_CACHE_DIR=str(cache), TORCHINDUCTOR_CACHE_DIR=str(inductor_cache))
    return subprocess.Popen([sys.executable, "-m", "aotc.cli", *map(str, args)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait(*procs) -> None:
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"aotc failed: {err[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "cache.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="aotc-bench-cache-") as tmp:
        root = Path(tmp)
        model = write_tiny(root / "tiny")
        build = ["build", model, "--backend", "inductor"]

        t0 = time.perf_counter()
        wait(aotc(*build, "--jobs", "1", "-o", root / "cold", cache=root / "c", inductor_cache=root / "i"))
        cold = time.perf_counter() - t0
        graphs = read_manifest(root / "cold").graphs_traced
        rows.append({"build": "cold, 1 job", "seconds": cold, "vs cold": 1.0})

        t0 = time.perf_counter()
        wait(aotc(*build, "--jobs", "1", "-o", root / "warm", cache=root / "c", inductor_cache=root / "i"))
        warm = time.perf_counter() - t0
        rows.append({"build": "warm rebuild (all hits)", "seconds": warm, "vs cold": warm / cold})

        t0 = time.perf_counter()
        shards = [aotc(*build, "--jobs", "1", "--shard", f"{i}/2", cache=root / f"s{i}", inductor_cache=root / f"i{i}") for i in (1, 2)]
        wait(*shards)
        for i in (1, 2):
            shutil.copytree(root / f"s{i}" / "entries", root / "merged" / "entries", dirs_exist_ok=True)
        wait(aotc(*build, "--require-cache", "-o", root / "sharded", cache=root / "merged", inductor_cache=root / "i3"))
        sharded = time.perf_counter() - t0
        rows.append({"build": "2-way sharded + assemble", "seconds": sharded, "vs cold": sharded / cold})
    table(f"aotc build, embedded default model, inductor, buckets 1,2,4,8 + chunk 128 ({graphs} graphs)", rows)
    write_results(args.out, {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "graphs": graphs, "rows": rows})


if __name__ == "__main__":
    main()
