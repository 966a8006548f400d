"""build: build time at 2, 8, 32 layers of one layer shape (2, 4 under --quick): aotc
(inductor, or --backend) against whole-model torch.compile and the whole model through
aotc's backend's compiler (AOTInductor; torch.export.save for export), and sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from common import HERE, MAX_SEQ, Run, section, table

from aotc.format import read_manifest
from aotc.models.tiny import write_tiny

_WHOLE = r"""
import sys, time, json, torch
sys.path.insert(0, sys.argv[1])
from gptfast import from_aotc
from aotc.models.loader import load_model
mode, model_dir, out, backend = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
t0 = time.perf_counter()
model = from_aotc(load_model(model_dir).model)
model.setup_caches(1, %(max_seq)d)
decode = (torch.randint(3, 500, (1, 1)), torch.tensor([0]))
prefill = (torch.randint(3, 500, (1, 128)), torch.arange(128))
size = 0
with torch.no_grad():
    if mode == "compile":
        step = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
        step(*decode); step(*prefill)
    else:
        import os
        for name, args in (("decode", decode), ("prefill", prefill)):
            ep = torch.export.export(model, args, strict=False)
            path = f"{out}-{name}.pt2"
            if mode == "aoti":
                torch._inductor.aoti_compile_and_package(ep, package_path=path)
            else:
                torch.export.save(ep, path)
            size += os.path.getsize(path)
print(json.dumps({"seconds": time.perf_counter() - t0, "size": size}))
""" % {"max_seq": MAX_SEQ}
# The whole model through the compiler of aotc's backend: (mode of _WHOLE, label)
WHOLE = {"inductor": ("aoti", "whole-model AOTI"), "export": ("export", "whole-model export")}


@section("build")
def build_time(run: Run) -> dict:
    if run.backend not in WHOLE:
        raise SystemExit(f"build: --backend {run.backend} has no whole-model counterpart; run it with {' or '.join(WHOLE)}")
    whole = WHOLE[run.backend]
    rows = []
    for layers in (2, 4) if run.quick else (2, 8, 32):
        model_dir = write_tiny(run.root / f"build-{layers}", layers=layers)
        row = {"layers": layers}
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(run.root / f"inductor-cache-build-{layers}"))
        t0 = time.perf_counter()
        out = run.root / f"build-{layers}-bundle"
        subprocess.run(
            [sys.executable, "-m", "aotc.cli", "build", str(model_dir), "--backend", run.backend, "--no-cache", "--buckets", "1", "--prefill-chunk", "128", "--max-seq", str(MAX_SEQ), "-o", str(out)],
            env=env, check=True, capture_output=True,
        )  # fmt: skip
        row[f"{run.aotc} s"] = time.perf_counter() - t0
        row["aotc graphs"] = read_manifest(out).graphs_traced
        row["aotc bundle MB"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
        for mode, label in (("compile", run.baseline), whole):
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(run.root / f"inductor-cache-{mode}-{layers}"))
            t0 = time.perf_counter()
            argv = [sys.executable, "-c", _WHOLE, str(HERE), mode, str(model_dir), str(run.root / f"whole-{layers}"), run.torch_compile_backend]
            proc = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
            row[f"{label} s"] = time.perf_counter() - t0
            if mode != "compile":
                row[f"{label} MB"] = json.loads(proc.stdout.strip().splitlines()[-1])["size"] / 1e6
        rows.append(row)
    first = rows[0]
    for r in rows:
        r["aotc vs 2 layers"] = r[f"{run.aotc} s"] / first[f"{run.aotc} s"]
    table("build time (s, fresh process, cold inductor cache) and size (MB)", rows)
    return {
        "graphs": "decode b1 + prefill 128 (+ prefill 128 at its chunk context 128, its fresh form at 128 and head b1 for aotc)",
        "cold inductor cache each": True,
        "rows": rows,
    }
