"""`aotc verify`: every artifact of a bundle against the eager entry method.

For each artifact (an entry at a bucket and context bucket), or the one that
--entry/--bucket/--context choose, one call of the entry's first instance, with
as many rows as map to that bucket (one fewer than the bucket where that still
maps to it, so that padding runs too). The inputs are what the model's own
orchestration makes, never unconstrained random integers (XLA clamps an index
out of range where eager raises): `decode` for batch entries, `prefill` for
chunk entries, with token ids inside the vocabulary, positions inside the
cache, the model's own slots, and caches filled with random values first.
That call is recorded in eager (inputs before, outputs, caches after); the
artifact then runs on the same inputs through the dispatcher, which pads rows
to the bucket, the padding rows writing the scratch slot.

Compared under the fidelity rule (runtime.check): for a float32 model, within
the fp32 tolerance of eager (|compiled - eager| <= tol + tol * |eager|); for a
lower-precision one, against the same call by the model's float32 twin
(models.loader.reference_model; inputs upcast, packed fp8 caches read back to
float32 rows), within max(2 x eager's error, tol):
  * the outputs (max absolute and relative difference reported);
  * each cache: where eager wrote, which is what its write ops touched (`Writes`:
    each in-place op on a cache runs again on a byte mask of it), not where values
    changed (a bf16 value equal to the one already there is written all the same);
    unchanged everywhere else, but for the scratch slot (dim 0, the last slot),
    which takes the padding writes;
  * where the backend has a reference runner of its own files
    (`Backend.reference`; xla and neuron: `hlo.pb`, the file neuronx-cc
    compiles, compiled as it is by XLA's CPU client), that runner on the same
    inputs: against the loaded program's results, or against eager where no
    program loads here (a NEFF without the Neuron runtime).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import lowp_weights
from ..backends import Backend, get_backend_class
from ..backends.base import DeviceBuffer
from ..entry import entries_of
from ..errors import AotcError, BundleError
from ..format import Manifest, read_manifest
from ..kvcache import Fp8Rows, Regions
from ..layout import CompiledForm, Stored, compiled_forms, keep_stored
from ..models.config import ConfigReader
from ..models.loader import full_precision, get_architecture, load_model, memory_shortfall, reference_model
from ..parallel import flag
from ..plugins import load_plugins
from .bundle import Bundle, bound_weights
from .check import bound, error, near_tie, precision, tolerance_for
from .dispatch import Dispatcher

SEED = 0


@dataclass
class ArtifactCheck:
    entry: str
    bucket: int
    context: int | None  # the context bucket; None for an entry without
    rows: int
    instance: str
    tolerance: float
    max_abs: float = 0.0
    max_rel: float = 0.0
    reference: str | None = None  # the backend's reference runner (what it runs: "hlo.pb")
    reference_vs: str | None = None  # what it was compared with: the loaded program ("model.jax") or "eager"
    reference_max_abs: float | None = None
    problems: list[str] = field(default_factory=list)
    lint: list[str] = field(default_factory=list)
    precision: str = "float32"  # what the model computes in (runtime.check.precision)
    # The rule's figures (runtime.check): the worst error against the reference and the
    # error allowed there; lower precision: eager's own worst error, and each bound.
    error: float = 0.0
    allowed: float = 0.0
    twin_error: float | None = None
    bounds: list[float] = field(default_factory=list)

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
    # The module classes whose compiled graphs run another algorithm than the eager method
    # they are compared with (aotc.layout.compiled_forms).
    algorithms: list[CompiledForm] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(a.passed for a in self.artifacts) and not (self.strict and any(a.lint for a in self.artifacts))


@torch.no_grad()
def verify(
    path: Path | str, model_dir: Path | str | None = None, plugins: Sequence[str] = (), strict: bool = False,
    entry_id: str | None = None, bucket: int | None = None, context: int | None = None,
) -> VerifyReport:  # fmt: skip
    """Every artifact, or with entry_id the one at `bucket` and `context` (default: the
    entry's smallest context bucket), or with entry_id alone all of that entry's."""
    path = Path(path)
    load_plugins(plugins)  # a plugin may register the bundle's backend
    manifest = read_manifest(path)
    if manifest.parallel.world_size > 1:
        raise BundleError(
            f"{path} runs on {manifest.parallel.world_size} ranks ({flag(manifest.parallel)}): its graphs "
            "sum and gather across ranks, which one process cannot run alone. Check it with aotc run --check, which starts the "
            "ranks and compares them with the whole eager model"
        )
    chosen = manifest.select(entry_id, bucket, context)
    name = manifest.backend.name
    backend = get_backend_class(name)(**manifest.backend.flags)
    # Where the artifacts cannot run here (a NEFF without the Neuron runtime, or still
    # pending), the backend's reference runner is checked against eager alone.
    runnable = not manifest.pending() and backend.can_load() is None
    has_reference = type(backend).reference is not Backend.reference
    # Without a reference to check instead, loading is tried anyway: it says what is missing.
    bundle = Bundle.load(path, plugins=plugins, load_artifacts=runnable or not has_reference, only={(e.id, a.bucket, a.context) for e, a in chosen})
    if model_dir is None and Path(manifest.model.source).is_dir():
        model_dir = manifest.model.source
    if model_dir is not None:
        loaded = load_model(model_dir, **bundle.model_args(None, eager=True))
        bundle.check_model(loaded)
        model, weights = loaded.model, str(model_dir)
    else:
        model, weights = _random_model(manifest), "random"
    short = memory_shortfall(model, manifest.shapes.cache_slots, manifest.shapes.max_seq)
    if short:  # before allocating what the manifest says
        raise AotcError(f"aotc verify {path}: {short}; verify it on a machine with the memory the bundle was built for")
    generator = torch.Generator().manual_seed(SEED)
    caches = model.allocate_caches(manifest.shapes.cache_slots, manifest.shapes.max_seq)
    layouts = model.cache_layouts()
    for kind, t in caches.items():  # a packed cache: each region filled as its own dtype
        for view in layouts[kind].views(t).values() if kind in layouts else [t]:
            if view.dtype.is_floating_point:
                view.copy_(torch.randn(view.shape, generator=generator).to(view.dtype))
    placed = bound_weights(manifest, model, path)
    tolerance = tolerance_for(name)
    # A lower-precision model's calls are measured against its float32 twin (runtime.check).
    reference = None if full_precision(model) else reference_model(model)
    rows = model.cache_rows()  # the packed kinds, read back to float32 rows for the reference
    checks = []
    for entry, art in chosen:
        instance_path = entry.instances[0]
        instance = model.get_submodule(instance_path)
        n = _rows(art.bucket, manifest.shapes.buckets(entry.bucket_kind))
        check = ArtifactCheck(entry.id, art.bucket, art.context, n, instance_path, tolerance, lint=backend.findings(art.extra), precision=precision(model))
        checks.append(check)
        general = _general_of(type(instance), entry.method)
        call = _record(model, instance, entry.method, general, lambda: _drive(model, entry.bucket_kind, n, art, caches, manifest, generator, general is not None), caches)
        if call is None:
            check.problems.append(f"the model's {'decode' if entry.bucket_kind == 'batch' else 'prefill'} never called {instance_path}.{entry.method}")
            continue
        spec = entries_of(type(instance))[entry.method]
        names = {i: spec.params[i] for i in call.written}
        weights_in = placed[entry.id, instance_path]
        programs = [bundle.programs[entry.id, art.bucket, art.context]] if bundle.programs else []
        # On the copy whose hash was checked (kept after load where a reference reads it).
        runner = backend.reference(bundle.checked_dir(art), art) if bundle.checked is not None else None
        if runner is not None:
            programs.append(runner)
        if not programs:
            check.problems.append(f"nothing here runs the artifact: {backend.can_load() or 'it is pending'}, and the backend's reference runner cannot run here either")
            continue
        runs = [(p.label, _run(entry, art, p, weights_in, call.before)) for p in programs]
        first, (out, after) = runs[0]
        truth_out, truth_after = (None, None) if reference is None else _reference_call(reference, instance_path, entry.method, call, rows)
        check.max_abs, check.max_rel = _compare(out, call.out, check, f"{first} output", truth_out)
        _compare_caches(after, call, names, manifest.shapes.cache_slots - 1, n < art.bucket, check, first, rows, truth_after, entry.slot_dim)
        if runner is not None:
            check.reference = runner.label
            if len(runs) > 1:
                check.reference_vs = first
                ref_out, ref_after = runs[1][1]
                # Two runs of one program's files: within the error the artifact was allowed.
                between = max([check.tolerance, *check.bounds])
                check.reference_max_abs = max(((a.float() - b.float()).abs().max().item() for a, b in zip(ref_out, out) if a.numel()), default=0.0)
                for i, (a, b) in enumerate(zip(ref_out, out)):
                    if error(a, b) > between:
                        diff = (a.float() - b.float()).abs().max().item()
                        check.problems.append(f"{runner.label} output against {first} {i} differs by up to {diff:.3g} (error allowed {between:.3g})")
                for i, cache in names.items():
                    kind_rows = rows.get(call.kinds[i])
                    if error(_values(ref_after[i], kind_rows), _values(after[i], kind_rows)) > between:
                        check.problems.append(f"{runner.label} and {first} write {cache} differently")
            else:
                check.reference_vs, check.reference_max_abs = "eager", check.max_abs
    algorithms = compiled_forms(*(model.get_submodule(p) for entry, _ in chosen for p in entry.instances))
    return VerifyReport(str(path), name, weights, checks, strict, algorithms)


def _rows(bucket: int, buckets: list[int]) -> int:
    """Rows that run in `bucket`: one fewer where that still maps to it (padding runs)."""
    below = max((b for b in buckets if b < bucket), default=0)
    return bucket - 1 if bucket - 1 > below else bucket


def _drive(model, kind: str, n: int, art, caches: dict, manifest: Manifest, g: torch.Generator, fresh: bool) -> None:
    vocab, bucket = model.config.vocab_size, art.bucket
    context = art.dims.get("context", manifest.shapes.max_seq)  # positions the artifact's context bucket holds
    ids = torch.randint(0, vocab, (n,), generator=g)
    if kind == "batch":
        model.decode(ids, torch.randint(1, context, (n,), generator=g), caches)
    else:  # a chunk after a first one, where it fits: the call also reads what the cache holds (a fresh form's: from position 0)
        model.prefill(ids, 0, caches, start=bucket if bucket + n <= context and not fresh else 0)


def _general_of(cls: type, method: str) -> str | None:
    """The entry of `cls` whose fresh form (EntrySpec.fresh) `method` is, if any."""
    return next((s.method for s in entries_of(cls).values() if s.fresh == method), None)


def _record(model, instance, method: str, general: str | None, drive, caches: dict) -> Call | None:
    """Run `drive` eagerly; return the first call of instance.method, cloned, with where
    it wrote each of its caches (the model's `caches`). The model's other modules run as
    they are."""
    calls = []
    eager = getattr(type(instance), method)
    spec = entries_of(type(instance))[method]
    kinds = {_storage(t): kind for kind, t in caches.items()}
    # An entry's fresh form is no call of the eager model's: its `general` entry's first call
    # (driven from position 0) is recorded, with the form's eager output on those arguments.
    called = general or method

    def recorder(*args):
        if calls:
            return getattr(type(instance), called)(instance, *args)
        cache_at = [i for i, p in enumerate(spec.params) if p in spec.caches]
        before = [a.clone() for a in args]
        with Writes([args[i] for i in cache_at]) as writes:
            out = eager(instance, *args)
        after = [a.clone() for a in args]
        calls.append(Call(before, _clone(out), after, {i: writes.mask(args[i]) for i in cache_at}, {i: kinds[_storage(args[i])] for i in cache_at}))
        return out

    setattr(instance, called, recorder)
    try:
        drive()
    finally:
        delattr(instance, called)
    return calls[0] if calls else None


class Writes(TorchDispatchMode):
    """Where eager code writes into the storages of some tensors, whatever values it
    writes (a bf16 value equal to the one already there is written all the same): each
    op whose schema marks an argument written, and that writes one of those storages,
    runs again on a byte mask of the storage with every floating input NaN, so each
    element it writes comes out non-zero."""

    _INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def __init__(self, tensors: Sequence[torch.Tensor]):
        super().__init__()
        self.masks = {_storage(t): torch.zeros(t.untyped_storage().nbytes(), dtype=torch.uint8) for t in tensors}

    def mask(self, t: torch.Tensor) -> torch.Tensor:
        """Bool [t.shape]: the elements of t written."""
        return self._view(t).view(self._INT[t.dtype.itemsize]) != 0

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        """The mask bytes under t, as a tensor of t's dtype, shape and strides."""
        return self.masks[_storage(t)].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        names = [a.name for a in func._schema.arguments]
        named = dict(zip(names, args)) | kwargs
        written = {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        hit = [n for n, v in named.items() if n in written and isinstance(v, torch.Tensor) and _storage(v) in self.masks]
        if hit:

            def again(n, v):
                return self._view(v) if n in hit else _nan(v)

            func(*(again(n, v) for n, v in zip(names, args)), **{n: again(n, v) for n, v in kwargs.items()})
            for n in hit:  # every byte of each element written, so any view of the storage sees it
                bits = self._view(named[n]).view(self._INT[named[n].dtype.itemsize])
                bits.masked_fill_(bits != 0, -1)
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _nan(v):
    """A floating input as NaN (a tensor of the same shape, or the scalar); others as they are."""
    if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
        return torch.full_like(v, float("nan"))
    if isinstance(v, float):
        return float("nan")
    if isinstance(v, (list, tuple)):
        return type(v)(_nan(x) for x in v)
    return v


def _clone(out):
    return tuple(o.clone() for o in out) if isinstance(out, tuple) else (out.clone(),)


def _run(entry, art, program, weights, before):
    """The artifact on a copy of the eager inputs; a packed cache goes in as its regions,
    each a copy of its own, and comes back packed, to compare byte for byte."""
    args = [a.clone() for a in before]
    step = program.bind(weights)
    device = step.device
    # A dispatcher of this one artifact: it pads the rows as the runtime does.
    dispatcher = Dispatcher(dataclasses.replace(entry, artifacts=[art]), {(art.context, art.bucket): step}, device)
    spans: dict[str, dict] = {}
    for spec in art.inputs:
        if spec.region is not None:
            spans.setdefault(spec.region.of, {})[(spec.region.start, spec.region.end)] = getattr(torch, spec.dtype)
    given = [Regions.unpack(a, spans[name]) if name in spans else a for name, a in zip(dispatcher.names, args)]
    if device.resident:  # caches go in as the device's allocations and come back as host copies
        given = [_on(device, g) if cache else g for g, cache in zip(given, dispatcher.arg_is_cache)]
    out = dispatcher(*given)
    for a, g in zip(args, given):
        if isinstance(g, Regions):
            Regions({span: t.to_host() if isinstance(t, DeviceBuffer) else t for span, t in g.tensors.items()}).pack_into(a)
        elif isinstance(g, DeviceBuffer):
            a.copy_(g.to_host())
    return _clone(out), args


def _on(device, cache):
    """A host cache (or its regions) as allocations of the device, holding its values."""
    if isinstance(cache, Regions):
        return Regions({span: _on(device, t) for span, t in cache.tensors.items()})
    return DeviceBuffer(device, device.hold(cache), tuple(cache.shape), cache.dtype)


def _compare(got, want, check: ArtifactCheck, what: str, truth=None) -> tuple[float, float]:
    """The artifact's outputs against eager's (`want`); with `truth` (a lower-precision
    model's float32 reference outputs) both against it, under runtime.check's rule."""
    worst_abs = worst_rel = 0.0
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            check.problems.append(f"{what} {i} has shape {list(a.shape)}, eager's {list(b.shape)}")
            continue
        j = _argmax_of(want, i)
        if j is not None:  # token choices: compared as runtime.check compares a run's tokens
            ref = want[j] if truth is None else truth[j]
            allowed = check.tolerance if truth is None else bound(error(want[j], truth[j]), check.tolerance)
            why = _judge_choices(a, ref, allowed)
            if why:
                check.problems.append(f"{what} {i} {why}")
            continue
        ref = b if truth is None else truth[i]
        diff = (a.float() - ref.float()).abs().max().item() if a.numel() else 0.0
        scale = ref.float().abs().max().item() if ref.numel() else 0.0
        worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, diff / scale if scale else diff)
        why = _judge(check, a, b, None if truth is None else truth[i])
        if why:
            check.problems.append(f"{what} {i} {why}")
    return worst_abs, worst_rel


def _argmax_of(outs, i: int) -> int | None:
    """The float output [..., V] of eager's call whose argmax its integer output i [...] is
    (decode_step's tokens beside their logits), found on eager's own outputs; else None."""
    ids = outs[i]
    if ids.is_floating_point():
        return None
    for j, logits in enumerate(outs):
        if logits.is_floating_point() and logits.shape[:-1] == ids.shape and logits.numel() and torch.equal(logits.argmax(dim=-1), ids):
            return j
    return None


def _judge_choices(chosen: torch.Tensor, ref: torch.Tensor, allowed: float) -> str | None:
    """Token ids [...] against the reference's logits [..., V]: each its argmax, or a near-tie
    with it within the error allowed at that logit (runtime.check's rule). None, or how not."""
    ref, chosen = ref.reshape(-1, ref.shape[-1]).float(), chosen.reshape(-1)
    outside = ((chosen < 0) | (chosen >= ref.shape[-1])).nonzero().flatten().tolist()
    if outside:
        return f"chose token {int(chosen[outside[0]])} at row {outside[0]}, outside the {ref.shape[-1]} logits"
    for row in (chosen != ref.argmax(dim=-1)).nonzero().flatten().tolist():
        if near_tie(ref[row], int(chosen[row]), allowed) is None:
            top = int(ref[row].argmax())
            gap = (ref[row, top] - ref[row, int(chosen[row])]).item()
            return f"chose token {int(chosen[row])} at row {row} where the reference's is {top}, {gap:.3g} above it (a near-tie is within {allowed:g} x (1 + |top logit|))"
    return None


def _judge(check: ArtifactCheck, got: torch.Tensor, eager: torch.Tensor, truth: torch.Tensor | None) -> str | None:
    """One tensor under the rule: within the fp32 tolerance of eager (full precision), or
    within max(2 x eager's error, the fp32 tolerance) of the float32 reference. None, or
    how it differs."""
    if truth is None:
        err, allowed = error(got, eager), check.tolerance
        rule = f"tolerance {check.tolerance:g} + {check.tolerance:g} x |eager|"
    else:
        twin = error(eager, truth)
        err, allowed = error(got, truth), bound(twin, check.tolerance)
        check.twin_error = max(check.twin_error or 0.0, twin)
        check.bounds.append(allowed)
        rule = f"error against the float32 reference {err:.3g}, eager {check.precision}'s {twin:.3g}, allowed {allowed:.3g}"
    if allowed and err / allowed > (check.error / check.allowed if check.allowed else -1):
        check.error, check.allowed = err, allowed
    if err <= allowed:
        return None
    diff = (got.float() - (eager if truth is None else truth).float()).abs().max().item() if got.numel() else 0.0
    return f"differs by up to {diff:.3g} ({rule})"


def _values(t: torch.Tensor, rows: Fp8Rows | None) -> torch.Tensor:
    """A cache's values as float32: a packed fp8 one read back to its plain rows."""
    return t.float() if rows is None else rows.read(t, (...,), torch.float32)


def _compare_caches(after, call: Call, names: dict[int, str], scratch: int, padded: bool, check: ArtifactCheck, what: str, rows: dict, truth=None, slot_dim: int = 0) -> None:
    touched = False  # did padding rows write the scratch slot of some cache
    for i, cache in names.items():
        written = call.written[i]
        moved = after[i] != call.before[i]
        in_scratch = torch.zeros_like(moved)
        in_scratch.select(slot_dim, scratch).fill_(True)
        stray = moved & ~written & ~in_scratch
        if stray.any():
            where = tuple(int(x) for x in stray.nonzero()[0])
            check.problems.append(f"{what} wrote {cache} at {where} (slot {where[slot_dim]}), where eager wrote nothing: padding rows must write only the scratch slot {scratch}")
        kind_rows = rows.get(call.kinds[i])
        # A packed cache is compared as the values its rows hold, each row written whole.
        at = written if kind_rows is None else written.any(dim=-1)
        got, eager = _values(after[i], kind_rows)[at], _values(call.after[i], kind_rows)[at]
        why = _judge(check, got, eager, None if truth is None else truth[i][at])
        if why:
            check.problems.append(f"{what} wrote {cache} differently from eager where eager wrote: it {why}")
        touched |= bool((moved & in_scratch).any())
    # Not every cache takes a write per row (a compressor's entries come every few
    # positions), but some cache does: padding rows that write none went elsewhere.
    if padded and names and not touched:
        check.problems.append(f"{what}: the padding rows wrote nothing into any cache's scratch slot {scratch}")


@dataclass
class Call:
    """One eager call of an entry method, as _record saw it."""

    before: list[torch.Tensor]  # the inputs, before the call
    out: tuple[torch.Tensor, ...]
    after: list[torch.Tensor]  # the inputs after it (the caches written)
    written: dict[int, torch.Tensor]  # by cache input position: where eager wrote it (bool)
    kinds: dict[int, str]  # by cache input position: the cache kind


def _reference_call(reference, instance_path: str, method: str, call: Call, rows: dict) -> tuple[tuple, list]:
    """The same call by the float32 reference model: its inputs upcast, packed caches read
    back to plain float32 ones; its outputs and its inputs after the call."""
    args = [_values(a, rows.get(call.kinds[i])) if i in call.kinds else a.float() if a.is_floating_point() else a.clone() for i, a in enumerate(call.before)]
    instance = reference.get_submodule(instance_path)
    out = getattr(type(instance), method)(instance, *args)
    return _clone(out), args


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
                    values, scale = lowp_weights.quantize(w.stored.format, param.detach(), e8m0=scale_dtypes[w.path] == "uint8")
                    keep_stored(model, full, Stored(w.stored.format, values, scale))
                    param.data = lowp_weights.dequantize(w.stored.format, values, scale, param.dtype)
    return model
