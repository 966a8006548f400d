"""context: batch-1 decode step at positions 128 and 4000, ~100M model (tiny under
--quick), in a max_seq-4096 bundle (default context buckets 256, 1024, 4096) against a
max_seq-256 bundle, eager and torch.compile (4096 caches); issue 20's targets (<= 1.2x
the 256 bundle at 128, <= 1.1x eager at 4000)."""

from __future__ import annotations

import torch
from common import MAX_SEQ, Run, print_misses, section, table, timeit
from gptfast import from_aotc

from aotc.models.loader import load_model
from aotc.runtime import Bundle, tolerance_for

CONTEXT_MAX_SEQ, CONTEXT_POSITIONS = 4096, (128, 4000)
CONTEXT_TARGETS = {"long/short bundle at 128": 1.2, "aotc/eager at 4000": 1.1}


@section("context")
def context(run: Run) -> dict:
    """Each way's logits are checked against eager's on the same caches before timing."""
    name = run.main
    model_dir = run.model(name)
    model = load_model(model_dir).model
    bundles = {n: run.bundle(model_dir, f"context-{n}", batch_buckets=(1,), chunk_buckets=(128,), max_seq=n) for n in (CONTEXT_MAX_SEQ, MAX_SEQ)}
    g = torch.Generator().manual_seed(0)
    caches = {n: {k: torch.randn(v.shape, generator=g) for k, v in model.allocate_caches(2, n).items()} for n in bundles}
    base = from_aotc(model)
    base.setup_caches(1, CONTEXT_MAX_SEQ)
    step = run.compile(base, fullgraph=True, dynamic=False)
    ids, tolerance = torch.tensor([7]), tolerance_for(run.backend)
    repeats = dict(min_time=run.times(1.0))
    rows = []
    for position in CONTEXT_POSITIONS:
        pos = torch.tensor([position])
        row = {"position": position}
        expected = {n: model.decode(ids, pos, caches[n]) for n in bundles if position < n}
        row["eager ms"] = timeit(lambda: model.decode(ids, pos, caches[CONTEXT_MAX_SEQ]), **repeats) * 1e3
        with torch.no_grad():
            step(ids[:, None], pos)  # compile outside the timing; its caches are its own (zeros)
            row[f"{run.baseline} ms"] = timeit(lambda: step(ids[:, None], pos), **repeats) * 1e3
        for n, out in bundles.items():
            if position >= n:
                continue
            bundle = Bundle.load(out)
            bundle.bind(model)
            ran = set()  # the context buckets of the graphs the checked step ran
            Bundle.wrap_steps(model, lambda fn, key: lambda args, call=0: (ran.add(key[1]), fn(args, call))[1])
            torch.testing.assert_close(model.decode(ids, pos, caches[n]), expected[n], atol=tolerance, rtol=0)
            Bundle.unbind(model)
            bundle.bind(model)  # timed unwrapped
            row[f"{run.aotc} max_seq {n} ms"] = timeit(lambda: model.decode(ids, pos, caches[n]), **repeats) * 1e3
            if n == CONTEXT_MAX_SEQ:
                row["positions read (4096 bundle)"] = ",".join(str(c) for c in sorted(ran, key=lambda c: c or 0) if c is not None)
            Bundle.unbind(model)
        long = row[f"{run.aotc} max_seq {CONTEXT_MAX_SEQ} ms"]
        row["aotc/eager"] = long / row["eager ms"]
        row[f"aotc/{run.baseline}"] = long / row[f"{run.baseline} ms"]
        if f"{run.aotc} max_seq {MAX_SEQ} ms" in row:
            row["4096 bundle / 256 bundle"] = long / row[f"{run.aotc} max_seq {MAX_SEQ} ms"]
        rows.append(row)
    torch._dynamo.reset()
    short, long = rows
    checks = {
        "long/short bundle at 128": (short["4096 bundle / 256 bundle"], "the max_seq-4096 bundle's step at 128 against the max_seq-256 bundle's"),
        "aotc/eager at 4000": (long["aotc/eager"], "the max_seq-4096 bundle's step at 4000 against eager's"),
    }
    misses = [f"{what}: {value:.2f}x (target <= {CONTEXT_TARGETS[key]}x)" for key, (value, what) in checks.items() if value > CONTEXT_TARGETS[key]]
    table(f"batch-1 decode step by position, {name} model (ms); targets: 4096 bundle <= 1.2x the 256 bundle at 128, <= 1.1x eager at 4000", rows)
    print_misses(misses)
    return {
        "model": name, "unit": "ms per batch-1 decode step", "max_seq": CONTEXT_MAX_SEQ, "targets": CONTEXT_TARGETS,
        "figures": {key: value for key, (value, _) in checks.items()}, "misses": misses, "rows": rows,
    }  # fmt: skip
