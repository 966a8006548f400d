"""Where a batch-1 decode step goes, graph by graph: SmolLM2-135M-Instruct in fp32 and int8.

    python bench/step_split.py [--out bench/results/step_split.json]

Builds an inductor bundle (batch 1, chunk 64, max_seq 256) of SmolLM2's fp32 folder
and of the int8 checkpoint `aotc quantize --format int8` makes of it (bench/smollm2.py
makes the folder offline), wraps each bound graph's run with a timer
(Bundle.wrap_steps), and generates 128 tokens greedily from a 38-token prompt, best of
3 by decode time. Per step: each entry's time and the weight bytes it reads per second,
and the host loop (the step less its graphs). Then the head graph alone, called in a
loop with its weights warm in the caches, and after 200 MB have streamed through them
between calls, as a step's other weights do.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import table, timeit, write_results  # noqa: E402
from smollm2 import smollm2  # noqa: E402

from aotc.builder import BuildOptions, build  # noqa: E402
from aotc.models.loader import load_model  # noqa: E402
from aotc.quantize_checkpoint import quantize_model  # noqa: E402
from aotc.runtime import Bundle, generate  # noqa: E402
from aotc.runtime.bundle import bound_weights  # noqa: E402

PROMPT, NEW = list(range(100, 138)), 128


def split(folder: Path, out: Path, label: str) -> tuple[list[dict], dict]:
    bundle = Bundle.load(build(BuildOptions(folder, out=out, batch_buckets=(1,), chunk_buckets=(64,), max_seq=256, backend="inductor")).out)
    model = load_model(folder, **bundle.model_args()).model
    bundle.bind(model)
    per_entry: dict = collections.Counter()  # weight bytes an entry's calls read in one step, every instance once
    for (entry_id, _), weights in bound_weights(bundle.manifest, model, bundle.dir).items():
        per_entry[entry_id] += sum(weights.tensor(i).nbytes for i in range(len(weights)))
    times: dict = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def wrap(run, key):
        def timed(args, call=0):
            t0 = time.perf_counter()
            result = run(args, call)
            times[key[0]] += time.perf_counter() - t0
            calls[key[0]] += 1
            return result

        return timed

    Bundle.wrap_steps(model, wrap)
    kw = dict(max_batch=1, max_seq=256, slots=2, stop_at_eos=False)
    generate(model, [PROMPT], 8, **kw)  # warm
    best = None
    for _ in range(3):
        times.clear()
        calls.clear()
        g = generate(model, [PROMPT], NEW, **kw)
        if best is None or g.decode_s < best[0]:
            best = (g.decode_s, dict(times), dict(calls))
    decode_s, t, c = best
    steps = NEW - 1
    step_ms = decode_s / steps * 1e3
    rows = []
    for entry in sorted(t):
        if ".prefill" in entry:
            continue  # before the first token: not in the decode time
        ms = t[entry] / steps * 1e3
        nbytes = per_entry.get(entry)
        rows.append({"weights": label, "part": entry, "calls per step": c[entry] / steps, "ms per step": ms, "share": ms / step_ms,
                     "weight MB per step": nbytes / 1e6 if nbytes else None, "GB/s": nbytes / ms / 1e6 if nbytes else None})  # fmt: skip
    graphs = sum(r["ms per step"] for r in rows)
    rows.append({"weights": label, "part": "host loop (step less its graphs)", "ms per step": step_ms - graphs, "share": (step_ms - graphs) / step_ms})
    rows.append({"weights": label, "part": "whole step", "ms per step": step_ms, "share": 1.0})
    Bundle.unbind(model)  # the head alone, without the timers
    bundle.bind(model)
    head = next(m for m in model.modules() if type(m).__name__ == "LMHead")
    x = torch.randn(1, head.lm_head.in_features)
    warm = timeit(lambda: head(x), min_time=2.0)
    flush = torch.empty(200_000_000, dtype=torch.uint8)

    def streamed():
        flush.add_(1)
        t0 = time.perf_counter()
        head(x)
        return time.perf_counter() - t0

    cold = min(streamed() for _ in range(30))
    return rows, {"weights": label, "head warm ms": warm * 1e3, "head after 200 MB streamed ms": cold * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "step_split.json")
    args = ap.parse_args()
    fp32 = smollm2("float32")
    with tempfile.TemporaryDirectory(prefix="aotc-step-split-") as tmp:
        int8 = Path(tmp) / "int8"
        quantize_model(fp32, int8, "int8", head="int8")
        rows, heads = [], []
        for label, folder in (("fp32", fp32), ("int8", int8)):
            r, h = split(folder, Path(tmp) / f"bundle-{label}", label)
            rows += r
            heads.append(h)
    table(f"SmolLM2-135M-Instruct, batch-1 decode step by graph ({torch.get_num_threads()} threads, {NEW} tokens, best of 3)", rows)
    table("the head graph alone: weights warm in the caches, and after 200 MB streamed through them", heads)
    write_results(args.out, {"rows": rows, "head": heads})


if __name__ == "__main__":
    main()
