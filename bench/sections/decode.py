"""decode: step latency per batch bucket, aotc export and inductor (--backend) against
eager and torch.compile of a gpt-fast style static-cache model."""

from __future__ import annotations

import torch
from common import BUCKETS, MAX_SEQ, POSITION, Run, section, table, timeit
from gptfast import from_aotc

from aotc.models.loader import load_model
from aotc.runtime import Bundle


def decode_times(run: Run, model, bundles: dict[str, Bundle], batches=BUCKETS, *, torch_compile: bool = True) -> list[dict]:
    """Seconds per decode step at POSITION, per batch: eager, each bundle bound ("aotc
    BACKEND", named by what its manifest says it was built with) and torch.compile of the
    gpt-fast model; every way's logits are checked against eager's first."""
    base = from_aotc(model) if torch_compile else None
    rows = []
    for batch in batches:
        ids = torch.randint(3, 500, (batch,), generator=torch.Generator().manual_seed(batch))
        positions = torch.full((batch,), POSITION)
        caches = model.allocate_caches(max(batches) + 1, MAX_SEQ)
        times = {"eager": timeit(lambda: model.decode(ids, positions, caches), min_time=run.times(1.0))}
        expected = model.decode(ids, positions, caches)
        for bundle in bundles.values():
            bundle.bind(model)
            try:
                torch.testing.assert_close(model.decode(ids, positions, caches), expected, atol=1e-3, rtol=1e-3)
                times[f"aotc {bundle.manifest.backend.name}"] = timeit(lambda: model.decode(ids, positions, caches), min_time=run.times(1.0))
            finally:
                Bundle.unbind(model)
        if base is not None:
            base.setup_caches(batch, MAX_SEQ)
            step = run.compile(base, fullgraph=True, dynamic=False)
            pos = torch.tensor([POSITION])
            with torch.no_grad():
                torch.testing.assert_close(step(ids[:, None], pos)[:, 0], expected, atol=1e-3, rtol=1e-3)
                times[run.baseline] = timeit(lambda: step(ids[:, None], pos), min_time=run.times(1.0))
            torch._dynamo.reset()
        rows.append({"batch": batch, **times})
    return rows


@section("decode")
def decode(run: Run) -> dict:
    rows = []
    for name in run.names:
        model_dir = run.model(name)
        bundles = {b: Bundle.load(run.bundle(model_dir, backend=b, batch_buckets=BUCKETS, chunk_buckets=(128,))) for b in dict.fromkeys(("export", run.backend))}
        for times in decode_times(run, load_model(model_dir).model, bundles):
            row = {"model": name, "batch": times.pop("batch"), **{k: v * 1e3 for k, v in times.items()}}
            row[f"{run.backend}/eager"] = row[run.aotc] / row["eager"]
            row[f"{run.backend}/{run.baseline}"] = row[run.aotc] / row[run.baseline]
            rows.append(row)
    table("decode step (ms), max_seq %d, position %d" % (MAX_SEQ, POSITION), rows)
    return {"unit": "ms per decode step", "max_seq": MAX_SEQ, "position": POSITION, "rows": rows}
