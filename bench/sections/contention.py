"""contention: batch-1 decode tokens/s of `generate` through an aotc bundle (tiny and
~100M; tiny under --quick), alone and next to a CPU-bound busy loop, with torch's
threads fixed at the CPU count and with aotc's default (runtime/threads.py: the CPUs
other processes leave free); issue 20's target (busy >= 1/3 of quiet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from common import BUCKETS, Run, print_misses, section, table

CONTENTION_TOKENS, CONTENTION_TARGET = 200, 1 / 3
# A fresh process per measurement: its thread count and OpenMP pool start clean.
_PROBE = """
import json, statistics, sys, torch
from aotc.models.loader import load_model
from aotc.runtime import Bundle, generate
bundle, model_dir, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
b = Bundle.load(bundle)
model = load_model(model_dir).model
b.bind(model)
runs = [generate(model, [[5, 6, 7, 8]], new, max_batch=1, max_seq=b.max_seq, slots=b.cache_slots, stop_at_eos=False,
                 threads=None if threads == "auto" else int(threads)).decode_tokens_per_s for _ in range(3)]
print(json.dumps(statistics.median(runs)))
"""


@section("contention")
def contention(run: Run) -> dict:
    cpus = os.cpu_count() or 1
    rows = []
    for name in run.names:
        model_dir = run.model(name)
        bundle = run.bundle(model_dir, batch_buckets=BUCKETS, chunk_buckets=(128,))
        new = CONTENTION_TOKENS // (4 if run.quick or name != "tiny" else 1)
        for policy in (str(cpus), "auto"):
            row = {"model": name, "bundle": run.aotc, "threads": f"{policy} (fixed)" if policy != "auto" else "aotc default (free CPUs)"}
            for busy in (0, 1):
                loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
                try:
                    time.sleep(0.5)
                    out = subprocess.run([sys.executable, "-c", _PROBE, str(bundle), str(model_dir), str(new), policy], capture_output=True, text=True, check=True)
                finally:
                    for loop in loops:
                        loop.kill()
                        loop.wait()
                row["busy loop" if busy else "alone"] = json.loads(out.stdout.strip().splitlines()[-1])
            row["with / alone"] = row["busy loop"] / row["alone"]
            row["target met"] = row["with / alone"] >= CONTENTION_TARGET
            rows.append(row)
    misses = [f"{r['model']}, threads {r['threads']}: {r['with / alone']:.2f} of its quiet speed" for r in rows if not r["target met"]]
    table(f"batch-1 decode tokens/s, alone and next to one busy loop ({cpus} CPUs); target >= 1/3 of alone", rows)
    print_misses(misses)
    return {
        "unit": "decode tokens/s, batch 1", "cpus": cpus, "busy": "one `while True: pass` process",
        "target": "tokens/s next to the busy loop >= 1/3 of alone", "misses": misses, "rows": rows,
    }  # fmt: skip
