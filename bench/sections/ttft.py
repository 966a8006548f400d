"""ttft: time to first token in a fresh process, tiny model: aotc run from a built
bundle (inductor, or --backend), the torch.compile baseline (cold and warm inductor
cache), eager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from common import HERE, Run, section, table

TTFT_TOKENS = 100


@section("ttft")
def ttft(run: Run) -> dict:
    model_dir = run.model("tiny")
    bundle = run.bundle(model_dir, "ttft", batch_buckets=(1,), chunk_buckets=(128,))
    probe = [sys.executable, str(HERE / "ttft.py")]
    n = TTFT_TOKENS
    runs = {
        f"aotc run ({run.backend} bundle)": probe + ["aotc", str(bundle), str(model_dir), str(n)],
        f"{run.baseline}, cold cache": probe + ["compile", str(model_dir), str(n), run.torch_compile_backend],
        f"{run.baseline}, warm cache": probe + ["compile", str(model_dir), str(n), run.torch_compile_backend],
        "eager": probe + ["eager", str(model_dir), str(n)],
    }
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(run.root / "inductor-cache-ttft"))
    rows, tokens = [], set()
    for label, cmd in runs.items():
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        wall = time.perf_counter() - t0
        report = json.loads(out.stdout.strip().splitlines()[-1])
        tokens.add(report["token"])
        rows.append({"what": label, "process_s": wall, "in_script_s": report["seconds"]})
    if len(tokens) != 1:
        raise SystemExit(f"ttft: the runs disagree on the first token: {tokens}")
    base = next(r["process_s"] for r in rows if r["what"] == f"{run.baseline}, cold cache")
    for r in rows:
        r[f"vs {run.baseline} cold"] = r["process_s"] / base
    table(f"time to first token in a fresh process (s), tiny model, {n}-token prompt", rows)
    return {"prompt_tokens": n, "first_token": tokens.pop(), "rows": rows}
