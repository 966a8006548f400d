"""memory: peak RSS of a weight-free build of a 32-layer hidden-1024 model (under
--quick: 32 layers of the tiny model's shape) against loading its weights."""

from __future__ import annotations

import json
import subprocess
import sys

from common import M100, MAX_SEQ, Run, section, table

from aotc.models.tiny import write_tiny

LAYERS = 32
_RSS = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"


@section("memory")
def memory(run: Run) -> dict:
    model_dir = write_tiny(run.root / "mem", layers=LAYERS, **({} if run.quick else M100))
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    weights = (model_dir / "model.safetensors").stat().st_size
    cmds = {
        "aotc build (weight-free)": [sys.executable, "-m", "aotc.cli", "build", str(model_dir), "--backend", "export", "--no-cache", "--buckets", "1", "--prefill-chunk", "128", "--max-seq", str(MAX_SEQ), "-o", str(run.root / "mem-bundle")],
        "floor: python + import torch, aotc": [sys.executable, "-c", "import torch, aotc.builder"],
        "eager model, weights in memory": [sys.executable, "-c", f"from aotc.models.loader import load_model; m = load_model({str(model_dir)!r}).model; [p.sum() for p in m.parameters()]"],
    }  # fmt: skip
    rows = []
    for label, cmd in cmds.items():
        out = subprocess.run([sys.executable, "-c", _RSS, *cmd], check=True, capture_output=True, text=True)
        rss = int(out.stdout.strip()) * 1024
        rows.append({"what": label, "peak RSS MB": rss / 1e6, "of weight bytes": rss / weights})
    table(f"peak RSS, {LAYERS} layers x hidden {hidden} ({weights / 1e6:.0f} MB of weights)", rows)
    return {"layers": LAYERS, "hidden": hidden, "weight_MB": weights / 1e6, "rows": rows}
