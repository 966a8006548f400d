"""resident: xla decode at position 128 (context bucket 256), ~100M model (tiny under
--quick), in a max_seq-4096 bundle (1024 under --quick) against a max_seq-256 bundle:
step times, and the bytes a step copies: cache buffers that moved over 32 steps (each
buffer's unsafe_buffer_pointer before and after) and the host<->device transfers the
device counts; eager beside them. Issue 31's target: no cache byte copied."""

from __future__ import annotations

import math

import torch
from common import MAX_SEQ, POSITION, Run, print_misses, section, table, timeit

from aotc.models.loader import load_model
from aotc.runtime import Bundle, tolerance_for

RESIDENT_MAX_SEQ, RESIDENT_STEPS = 4096, 32  # max_seq 1024 under --quick


@section("resident")
def resident(run: Run) -> dict:
    """Caches are the device's arrays, donated to each call. Logits are checked against
    eager's before timing."""
    from aotc.runtime.resident import buffers

    name = run.main
    long_seq = 1024 if run.quick else RESIDENT_MAX_SEQ
    model_dir = run.model(name)
    model = load_model(model_dir).model
    prompt = torch.randint(3, 512, (POSITION,), generator=torch.Generator().manual_seed(0))
    ids, pos = torch.tensor([7]), torch.tensor([POSITION])
    repeats = dict(min_time=run.times(1.0))
    eager = model.allocate_caches(2, long_seq)
    model.prefill(prompt, 0, eager)
    expected = model.decode(ids, pos, eager)
    rows = [{"run": "eager", "max_seq": long_seq, "step ms": timeit(lambda: model.decode(ids, pos, eager).argmax(-1), **repeats) * 1e3}]
    tolerance = tolerance_for("xla")
    for n in (long_seq, MAX_SEQ):
        bundle = Bundle.load(run.bundle(model_dir, f"resident-{n}", backend="xla", batch_buckets=(1,), chunk_buckets=(128,), max_seq=n))
        bundle.bind(model)
        device = bundle.backend.device_for()
        caches = model.allocate_caches(bundle.cache_slots, n)
        model.prefill(prompt, 0, caches)
        torch.testing.assert_close(model.decode(ids, pos, caches), expected, atol=tolerance, rtol=tolerance)
        held = [(b, b.value.unsafe_buffer_pointer()) for b in buffers(caches)]
        sent, received = device.sent, device.received
        step = lambda: model.decode(ids, pos, caches).argmax(-1)  # noqa: E731  (a step reads its logits, as generate does)
        for _ in range(RESIDENT_STEPS):
            step()
        moved = sum(math.prod(b.shape) * b.dtype.itemsize for b, p in held if b.value.unsafe_buffer_pointer() != p)
        row = {
            "run": "aotc xla", "max_seq": n, "positions read": next(c for c in bundle.manifest.shapes.context if c > POSITION),
            "cache bytes copied / step": moved / RESIDENT_STEPS, "cache bytes": sum(math.prod(b.shape) * b.dtype.itemsize for b, _ in held),
            "host->device B / step": (device.sent - sent) / RESIDENT_STEPS, "device->host B / step": (device.received - received) / RESIDENT_STEPS,
            "weights placed B": device.placed,
        }  # fmt: skip
        row["step ms"] = timeit(step, **repeats) * 1e3
        rows.append(row)
        Bundle.unbind(model)
    long, short = rows[1], rows[2]
    long[f"{long_seq} bundle / {MAX_SEQ} bundle"] = long["step ms"] / short["step ms"]
    for row in rows[1:]:
        row["aotc/eager"] = row["step ms"] / rows[0]["step ms"]
    misses = [f"max_seq {r['max_seq']}: {r['cache bytes copied / step']:.0f} cache bytes copied a step (target 0)" for r in rows[1:] if r["cache bytes copied / step"]]
    table(f"xla decode at position {POSITION}, {name} model: caches on the device, donated (bytes a step copies)", rows)
    print_misses(misses)
    return {
        "model": name, "unit": "ms per batch-1 decode step at position 128", "steps counted": RESIDENT_STEPS, "target": "no cache byte copied",
        "misses": misses, "rows": rows,
    }  # fmt: skip
