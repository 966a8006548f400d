"""`aotc verify`: every artifact of a bundle against the eager entry method.

For each (entry, bucket) artifact, one call of the entry's first instance, with
as many rows as map to that bucket (one fewer than the bucket where that still
maps to it, so that padding runs too). The inputs are what the model's own
orchestration makes, never unconstrained random integers (XLA clamps an index
out of range where eager raises): `decode` for batch entries, `prefill` for
chunk entries, with token ids inside the vocabulary, positions inside the
cache, the model's own slots, and caches filled with random values first.
That call is recorded in eager (inputs before, outputs, caches after); the
artifact then runs on the same inputs through the dispatcher, which pads rows
to the bucket, the padding rows writing the scratch slot.

Compared, at the tolerance for the dtype and backend (`check.tolerance_for`),
as |compiled - eager| <= tol + tol * |eager|:
  * the outputs (max absolute and relative difference reported);
  * each cache: close where eager wrote; unchanged everywhere else, but for
    the scratch slot (dim 0, the last slot), which takes the padding writes;
  * xla and neuron: `hlo.pb`, the file neuronx-cc compiles, deserialized and
    compiled by XLA's CPU client as it is (no re-lowering), on the same inputs:
    against model.jax's results (xla), or against eager (neuron, where no NEFF
    can run here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .. import quant
from ..entry import entries_of
from ..format import HLO_PROTO, Manifest, read_manifest
from ..layout import Stored, keep_stored
from ..models.base import load_model
from ..models.config import ConfigReader
from ..models.registry import get_architecture
from .bundle import Bundle, bound_weights
from .check import close, tolerance_for
from ..kvcache import Regions
from .dispatch import Dispatcher

SEED = 0


@dataclass
class ArtifactCheck:
    entry: str
    bucket: int
    rows: int
    instance: str
    tolerance: float
    max_abs: float = 0.0
    max_rel: float = 0.0
    hlo: str | None = None  # what hlo.pb was run against: "model.jax" or "eager"
    hlo_max_abs: float | None = None
    problems: list[str] = field(default_factory=list)
    lint: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


@dataclass
class VerifyReport:
    bundle: str
    backend: str
    weights: str  # the model folder, or "random"
    artifacts: list[ArtifactCheck]
    strict: bool = False

    @property
    def passed(self) -> bool:
        return all(a.passed for a in self.artifacts) and not (self.strict and any(a.lint for a in self.artifacts))


@torch.no_grad()
def verify(path: Path | str, model_dir: Path | str | None = None, plugins: Sequence[str] = (), strict: bool = False) -> VerifyReport:
    path = Path(path)
    manifest = read_manifest(path)
    name = manifest.backend.name
    # A NEFF runs only through the Neuron runtime: elsewhere a neuron bundle is checked through hlo.pb.
    runnable = name != "neuron" or (not manifest.pending() and _neuron_loads())
    bundle = Bundle.load(path, plugins=plugins, load_artifacts=runnable)
    if model_dir is None and Path(manifest.model.source).is_dir():
        model_dir = manifest.model.source
    if model_dir is not None:
        loaded = load_model(model_dir, stored=True, kv_cache=manifest.model.kv_cache)
        bundle.check_model(loaded)
        model, weights = loaded.model, str(model_dir)
    else:
        model, weights = _random_model(manifest), "random"
    generator = torch.Generator().manual_seed(SEED)
    caches = model.allocate_caches(manifest.shapes.cache_slots, manifest.shapes.max_seq)
    layouts = model.cache_layouts()
    for kind, t in caches.items():  # a packed cache: each region filled as its own dtype
        for view in layouts[kind].views(t).values() if kind in layouts else [t]:
            if view.dtype.is_floating_point:
                view.copy_(torch.randn(view.shape, generator=generator).to(view.dtype))
    bound = bound_weights(manifest, model, path)
    dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
    checks = []
    for entry, art in manifest.artifacts():
        instance_path = entry.instances[0]
        instance = model.get_submodule(instance_path)
        n = _rows(art.bucket, manifest.shapes.buckets(entry.bucket_kind))
        check = ArtifactCheck(entry.id, art.bucket, n, instance_path, tolerance_for(dtype, name), lint=list(getattr(art.extra, "lint", [])))
        checks.append(check)
        call = _record(model, instance, entry.method, lambda: _drive(model, entry.bucket_kind, n, art, caches, manifest, generator))
        if call is None:
            check.problems.append(f"the model's {'decode' if entry.bucket_kind == 'batch' else 'prefill'} never called {instance_path}.{entry.method}")
            continue
        before, eager_out, eager_after = call
        spec = entries_of(type(instance))[entry.method]
        cache_at = [i for i, p in enumerate(spec.params) if p in spec.caches]
        weights_in = bound[entry.id, instance_path]
        runs = {}
        if runnable:
            runs[name] = _run(entry, art.bucket, bundle.runners[entry.id, art.bucket], weights_in, before)
        if name in ("xla", "neuron"):
            runs[HLO_PROTO] = _run(entry, art.bucket, hlo_runner(path / art.dir / HLO_PROTO, art.extra.mutated), weights_in, before)
        first = next(iter(runs))
        out, after = runs[first]
        check.max_abs, check.max_rel = _compare(out, eager_out, check, f"{first} output")
        _compare_caches(after, before, eager_after, cache_at, manifest.shapes.cache_slots - 1, n < art.bucket, check, first)
        if HLO_PROTO in runs and first != HLO_PROTO:
            check.hlo = "model.jax"
            hlo_out, hlo_after = runs[HLO_PROTO]
            check.hlo_max_abs, _ = _compare(hlo_out, out, check, "hlo.pb output against model.jax")
            for i in cache_at:
                if not close(hlo_after[i], after[i], check.tolerance):
                    check.problems.append(f"hlo.pb and model.jax write cache {i} differently")
        elif HLO_PROTO in runs:
            check.hlo, check.hlo_max_abs = "eager", check.max_abs
    return VerifyReport(str(path), name, weights, checks, strict)


def _neuron_loads() -> bool:
    from ..backends.neuron import NeuronBackend

    return NeuronBackend().can_load() is None


def _rows(bucket: int, buckets: list[int]) -> int:
    """Rows that run in `bucket`: one fewer where that still maps to it (padding runs)."""
    below = max((b for b in buckets if b < bucket), default=0)
    return bucket - 1 if bucket - 1 > below else bucket


def _drive(model, kind: str, n: int, art, caches: dict, manifest: Manifest, g: torch.Generator) -> None:
    vocab, max_seq, bucket = model.config.vocab_size, manifest.shapes.max_seq, art.bucket
    ids = torch.randint(0, vocab, (n,), generator=g)
    if kind == "batch":  # positions that the artifact's context bucket holds
        model.decode(ids, torch.randint(1, art.dims.get("context", max_seq), (n,), generator=g), caches)
    else:  # a chunk after a first one, where it fits: the call also reads what the cache holds
        model.prefill(ids, 0, caches, start=bucket if bucket + n <= max_seq else 0)


def _record(model, instance, method: str, drive):
    """Run `drive` eagerly; return the first call of instance.method: (inputs before,
    outputs, inputs after), cloned. The model's other modules run as they are."""
    calls = []
    eager = getattr(type(instance), method)

    def recorder(*args):
        if calls:
            return eager(instance, *args)
        before = [a.clone() for a in args]
        out = eager(instance, *args)
        calls.append((before, _clone(out), [a.clone() for a in args]))
        return out

    setattr(instance, method, recorder)
    try:
        drive()
    finally:
        delattr(instance, method)
    return calls[0] if calls else None


def _clone(out):
    return tuple(o.clone() for o in out) if isinstance(out, tuple) else (out.clone(),)


def _run(entry, bucket: int, runner, weights, before):
    """The artifact on a copy of the eager inputs; a packed cache goes in as its regions,
    each a copy of its own, and comes back packed, to compare byte for byte."""
    args = [a.clone() for a in before]
    dispatcher = Dispatcher([(entry, {bucket: runner})], weights)
    spans: dict[str, dict] = {}
    for spec in entry.artifacts[0].inputs:
        if spec.region is not None:
            spans.setdefault(spec.region.of, {})[(spec.region.start, spec.region.end)] = getattr(torch, spec.dtype)
    given = [Regions.unpack(a, spans[name]) if name in spans else a for name, a in zip(dispatcher.names, args)]
    out = dispatcher(*given)
    for a, g in zip(args, given):
        if isinstance(g, Regions):
            g.pack_into(a)
    return _clone(out), args


def _compare(got, want, check: ArtifactCheck, what: str) -> tuple[float, float]:
    worst_abs = worst_rel = 0.0
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            check.problems.append(f"{what} {i} has shape {list(a.shape)}, eager's {list(b.shape)}")
            continue
        diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        scale = b.float().abs().max().item() if b.numel() else 0.0
        worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, diff / scale if scale else diff)
        if not close(a, b, check.tolerance):
            check.problems.append(f"{what} {i} differs by up to {diff:.3g} (tolerance {check.tolerance:g} + {check.tolerance:g} x |eager|)")
    return worst_abs, worst_rel


def _compare_caches(after, before, eager_after, cache_at, scratch: int, padded: bool, check: ArtifactCheck, what: str) -> None:
    touched = False  # did padding rows write the scratch slot of some cache
    for i in cache_at:
        written = eager_after[i] != before[i]
        moved = after[i] != before[i]
        in_scratch = torch.zeros_like(moved)
        in_scratch[scratch] = True
        stray = moved & ~written & ~in_scratch
        if stray.any():
            where = tuple(int(x) for x in stray.nonzero()[0])
            check.problems.append(f"{what} wrote cache {i} at {where} (slot {where[0]}), where eager wrote nothing: padding rows must write only the scratch slot {scratch}")
        if not close(after[i][written], eager_after[i][written], check.tolerance):
            check.problems.append(f"{what} wrote cache {i} differently from eager where eager wrote")
        touched |= bool((moved & in_scratch).any())
    # Not every cache takes a write per row (a compressor's entries come every few
    # positions), but some cache does: padding rows that write none went elsewhere.
    if padded and cache_at and not touched:
        check.problems.append(f"{what}: the padding rows wrote nothing into any cache's scratch slot {scratch}")


# -- hlo.pb on XLA's CPU client ----------------------------------------------------


def hlo_runner(hlo_pb: Path, mutated: list[int]):
    """hlo.pb compiled as it is by XLA's CPU client (a private jaxlib API: the jax range
    aotc tests is pinned in pyproject); a runner like the backends' own."""
    import jax
    import numpy as np
    from jax._src import xla_bridge
    from jax._src.lib import _jax, xla_client

    client = xla_bridge.get_backend("cpu")
    device = client.local_devices()[0]
    executable = client.compile_and_load(_jax.mlir.hlo_to_stablehlo(hlo_pb.read_bytes()), xla_client.DeviceList((device,)), xla_client.CompileOptions())

    def run(args: list[torch.Tensor]) -> list[torch.Tensor]:
        outs = executable.execute([jax.device_put(_to_numpy(a), device) for a in args])
        outs = [_to_torch(np.asarray(o)) for o in outs]
        for position, new in zip(mutated, outs):
            args[position].copy_(new)
        return outs[len(mutated) :]

    return run


def _to_numpy(t: torch.Tensor):
    import ml_dtypes

    t = t.detach().contiguous()
    if t.dtype == torch.int64:  # JAX lowers without x64: the HLO takes int32 (xla.lower)
        return t.to(torch.int32).numpy()
    special = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16), torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn)}
    if t.dtype in special:
        raw, np_dtype = special[t.dtype]
        return t.view(raw).numpy().view(np_dtype)
    return t.numpy()


def _to_torch(a) -> torch.Tensor:
    import ml_dtypes
    import numpy as np

    special = {np.dtype(ml_dtypes.bfloat16): (np.int16, torch.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn)}
    if a.dtype in special:
        raw, dtype = special[a.dtype]
        return torch.from_numpy(a.view(raw).copy()).view(dtype)
    return torch.from_numpy(a.copy())


# -- without a model folder: random weights of the right shapes -----------------------


def _random_model(manifest: Manifest):
    arch = get_architecture(manifest.model.architecture)
    config = arch.model_class.config_class.from_hf(ConfigReader(manifest.model.config, "manifest.json: model.config"))
    config = dataclasses.replace(config, kv_cache=manifest.model.kv_cache)
    model = arch.model_class(config).eval()
    model.init_random(torch.Generator().manual_seed(SEED))
    # Weights the graphs take as stored: quantized to the recorded format, and the
    # parameter set to what they dequantize to, so eager reads the same values.
    done = set()
    for entry in manifest.entries:
        scale_dtypes = {w.path: w.dtype for w in entry.weights if w.stored and w.stored.part == "scale"}
        for w in entry.weights:
            if w.stored is None or w.stored.part != "values":
                continue
            for instance in entry.instances:
                for name in w.sources or [w.path]:
                    full = f"{instance}.{name}" if instance else name
                    if full in done:
                        continue
                    done.add(full)
                    param = model.get_parameter(full)
                    values, scale = quant.quantize(w.stored.format, param.detach(), e8m0=scale_dtypes[w.path] == "uint8")
                    keep_stored(model, full, Stored(w.stored.format, values, scale))
                    param.data = quant.dequantize(w.stored.format, values, scale, param.dtype)
    return model
