"""Loading a bundle and binding it to a model's instances.

Loading needs what running needs: the manifest reader, the backend's loader
and the model's eager code; never the tracer, the passes or a compiler.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Sequence

import torch
from torch import nn

from .. import fp8
from ..backends import Backend, Program, get_backend
from ..backends.base import Device, Weights
from ..entry import entries_of, whole_steps
from ..errors import BundleError
from ..format import MANIFEST, Manifest, WeightSpec, artifact_label, bad_file, crossed_weights, read_manifest
from ..kvcache import Regions
from ..layout import TRANSFORMS, Stored, keep_stored, stored_at
from ..models.config import ConfigReader
from ..models.loader import LoadedModel, weight_shard
from ..parallel import data_parallel, flag
from ..plugins import load_plugins
from ..scratch import own_folder, temp_error
from .dispatch import Dispatcher, StepMemo
from .resident import DeviceCaches


@dataclass
class Bundle:
    dir: Path
    manifest: Manifest
    programs: dict[tuple[str, int, int | None], Program]  # (entry id, bucket, context bucket) -> loaded artifact
    load_s: float
    backend: Backend | None = None  # the load half that made the programs (None: none loaded)
    checked: tempfile.TemporaryDirectory | None = None  # the artifacts' checked copies, removed with the bundle
    # The loaded copies between cache slots (manifest.copies), by (shape, dtype, positions dim)
    copies: dict[tuple[tuple[int, ...], str, int], Program] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(
        cls, path: Path | str, plugins: Sequence[str] = (), expect_digest: str | None = None, load_artifacts: bool = True,
        only: Collection[tuple[str, int, int | None]] | None = None,
    ) -> "Bundle":  # fmt: skip
        """Read the manifest, check every file's sha256, load every artifact.
        load_artifacts=False checks the files but loads none (aotc verify of a neuron
        bundle, where the Neuron runtime is missing or artifacts are pending). `only`:
        load just these (entry id, bucket, context) artifacts (aotc verify --entry; an
        export program of a V4 block takes seconds to deserialize); the bundle cannot
        then be bound.

        A bundle built with plugins needs them named in `plugins` (the user's
        --plugin): aotc never imports a module because a bundle names it.
        `expect_digest`: refuse any bundle whose digest differs (a pinned bundle).
        """
        t0 = time.perf_counter()
        path = Path(path)
        manifest = read_manifest(path)
        check_pin(path, manifest, expect_digest, plugins)
        load_plugins(manifest.plugins)
        pending = manifest.pending()
        if pending and load_artifacts:
            names = ", ".join(label for label, _ in pending)
            raise BundleError(
                f"{path}: {len(pending)} artifacts are pending, not compiled ({pending[0][1].pending}): {names}. "
                f"Finish them on a host with the Neuron SDK: aotc build --resume {path}"
            )
        programs, backend = {}, None
        # The bytes loaded are the bytes checked: every artifact is copied into a folder of
        # this process's own (0700), and the copy is hashed, read and loaded. The loaders
        # take paths, so a file swapped in the bundle right after its check would load.
        # The copy goes once loaded, where the backend's programs no longer read their files.
        checked = own_folder("bundle")
        if load_artifacts:
            backend = get_backend(manifest.backend.name, "load", **manifest.backend.flags)
            why = backend.incompatible(manifest)
            if why:
                raise BundleError(f"{path}: cannot run here: {why}; rebuild the bundle on this machine (aotc build)")
            backend.opening(manifest)
        for entry, art in manifest.artifacts():
            art_dir = _checked_copy(path, art, checked)
            if load_artifacts and (only is None or (entry.id, art.bucket, art.context) in only):
                _check_signature(path, artifact_label(entry.id, art.bucket, art.context), entry.weights, art, backend.signature(art_dir))
                crossed = crossed_weights(entry, backend.weight_paths(art_dir))
                if crossed:
                    raise BundleError(
                        f"{path / art.dir}: {crossed}, so {path / MANIFEST} would run it with other tensors than it was "
                        "compiled for; the bundle was altered. Rebuild it (aotc build)"
                    )
                programs[entry.id, art.bucket, art.context] = backend.load(art_dir, art)
        copies = {}
        for c in manifest.copies:  # the copies between cache slots (builder.copies): no weights
            art_dir = _checked_copy(path, c.artifact, checked)
            if load_artifacts:
                _check_signature(path, c.label, [], c.artifact, backend.signature(art_dir))
                copies[tuple(c.shape), c.dtype, c.dim] = backend.load(art_dir, c.artifact)
        if load_artifacts and not backend.reads_files_loaded:
            checked.cleanup()
            checked = None
        return cls(path, manifest, programs, time.perf_counter() - t0, backend, checked, copies)

    def checked_dir(self, art) -> Path:
        """Where the checked copy of an artifact's files is: what readers of its files
        (a backend's reference runner) read, never the bundle folder itself."""
        if self.checked is None:
            raise BundleError(f"{self.dir}: its checked copy was removed once its {self.manifest.backend.name} programs were loaded")
        return Path(self.checked.name) / art.dir

    @property
    def device(self) -> str:
        return self.manifest.backend.flags.get("device", "cpu")

    @property
    def max_batch(self) -> int:
        return max(self.manifest.shapes.batch)

    @property
    def capacity(self) -> int:
        """Requests that run at once: the largest batch bucket, on each rank where the ranks
        run data-parallel attention (each its own sequences)."""
        layout = self.manifest.parallel
        return self.max_batch * (layout.world_size if data_parallel(layout) else 1)

    @property
    def max_seq(self) -> int:
        return self.manifest.shapes.max_seq

    @property
    def cache_slots(self) -> int:
        return self.manifest.shapes.cache_slots

    def check_model(self, loaded: LoadedModel) -> None:
        """The model folder must have the config and weight shapes the bundle was built for."""
        built = self.manifest.model
        if loaded.arch.name != built.architecture:
            raise BundleError(f"{self.dir} was built for a {built.architecture} model; {loaded.dir} is {loaded.arch.name}")
        config_class = type(loaded.config)
        ours = dataclasses.asdict(loaded.config)
        theirs = config_class.from_hf(ConfigReader(built.config, f"{self.dir}/{MANIFEST}"))
        theirs = dataclasses.asdict(dataclasses.replace(theirs, kv_cache=built.kv_cache, parallel=self.manifest.parallel, rank=loaded.config.rank))
        for key in ours:
            if key in config_class.RUNTIME_ONLY:
                continue
            if ours[key] != theirs[key]:
                raise BundleError(
                    f"{loaded.dir}/config.json: {key} is {ours[key]!r}, but bundle {self.dir} was built with "
                    f"{theirs[key]!r}; rebuild the bundle for this model (aotc build {loaded.dir})"
                )

    def model_args(self, rank: int | None = 0, *, eager: bool = False) -> dict:
        """What models.loader.load_model takes, besides the model folder, to build the model
        this bundle runs: `load_model(folder, **bundle.model_args())`. Its caches' dtype,
        whose modeling code runs it, and the stored form (aotc.lowp_weights) of each weight its
        graphs take. rank: whose part of a parallel bundle (its layout and this rank);
        None: the whole model, as eager runs it. eager=True: every low-precision weight
        dequantized as well, for a model that also runs eagerly (aotc run --check, aotc verify)."""
        from ..models.loader import modeling_of

        model = self.manifest.model
        args = dict(stored=True if eager else self.stored_params(), kv_cache=model.kv_cache, modeling=modeling_of(model.architecture))
        if rank is not None:
            args.update(layout=self.manifest.parallel, rank=rank)
        return args

    def stored_params(self) -> set[str]:
        """The model parameters whose stored form (aotc.lowp_weights) the graphs take, by path:
        load_model(stored=...) keeps these as the checkpoint has them."""
        return {
            f"{path}.{name}" if path else name
            for entry in self.manifest.entries
            for path in entry.instances
            for w in entry.weights if w.stored is not None
            for name in (w.sources or [w.path])
        }  # fmt: skip

    def bind(self, model: nn.Module, *, rank: int = 0, world_size: int = 1) -> None:
        """Replace each entry method of each instance with its compiled dispatcher: every
        program bound once to that instance's weights, placed where the programs run
        (Program.bind), and the model's caches allocated there too (allocate_caches)."""
        if self.backend is None:
            raise BundleError(f"{self.dir}: loaded without its artifacts (load_artifacts=False); it cannot run")
        if len(self.programs) != len(list(self.manifest.artifacts())):
            raise BundleError(f"{self.dir}: loaded with {len(self.programs)} of its artifacts (only=); load them all to run it")
        layout = self.manifest.parallel
        if world_size != layout.world_size or model.config.parallel != layout:
            raise BundleError(
                f"{self.dir} runs on {layout.world_size} ranks ({flag(layout)}); bind(world_size={world_size}) "
                f"of a model loaded for {model.config.parallel.world_size}: load each rank's part with load_model(layout=the bundle's "
                "parallel record, rank=r) and bind it with that rank (aotc run does)"
            )
        weights = bound_weights(self.manifest, model, self.dir)
        device = self.backend.device_for(rank, world_size)
        memo = StepMemo()  # one for every dispatcher of the model: dispatch.step_memos finds it at the first
        for entry in self.manifest.entries:
            for path in entry.instances:
                found = type(model.get_submodule(path)).__name__
                if found != entry.cls:
                    raise BundleError(
                        f"{self.dir / MANIFEST}: entry {entry.id} runs {entry.cls}.{entry.method} at {path or 'the model'}, which is a {found}; "
                        "the bundle was not built for this model. Rebuild it (aotc build)"
                    )
                source = weights[entry.id, path]
                steps = {(a.context, a.bucket): self.programs[entry.id, a.bucket, a.context].bind(source, rank=rank, world_size=world_size) for a in entry.artifacts}
                setattr(model.get_submodule(path), entry.method, Dispatcher(entry, steps, device, memo))
        if device.resident:
            model.allocate_caches = DeviceAllocator(model, device)
        if self.copies:
            device.copy_with({at: program.bind(Weights([]), rank=rank, world_size=world_size) for at, program in self.copies.items()})
        # Every entry the model has must run compiled: nothing falls back to eager unseen. A bound
        # entry is the instance's own attribute (the Dispatcher set above, over the class's
        # method), so the instance's __dict__ is where Python keeps it, not a side channel.
        bound = {(type(m), method) for m in model.modules() for method, d in vars(m).items() if isinstance(d, Dispatcher)}
        # A whole step and the entries it replaces are two sides of one choice: the build made one.
        for method, replaced in whole_steps(model).items():
            bound |= replaced if (type(model), method) in bound else {(type(model), method)}
        unbound = [f"{path or type(m).__name__}.{method}" for path, m in model.named_modules() for method in entries_of(type(m)) if (type(m), method) not in bound]
        if unbound:
            Bundle.unbind(model)
            raise BundleError(
                f"{self.dir}: the manifest has no compiled entry for {', '.join(unbound[:4])}"
                f"{f' and {len(unbound) - 4} more' if len(unbound) > 4 else ''}; the bundle is incomplete. Rebuild it (aotc build)"
            )
        for module in model.modules():
            for method, spec in entries_of(type(module)).items():
                if spec.fresh is not None and isinstance(vars(module).get(method), Dispatcher):
                    vars(module)[method].fresh = vars(module)[spec.fresh]

    @staticmethod
    def unbind(model: nn.Module) -> None:
        """Restore the eager entry methods (and the eager cache allocation)."""
        for module in model.modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, (Dispatcher, DeviceAllocator)):
                    delattr(module, name)

    @staticmethod
    def wrap_steps(model: nn.Module, wrap: Callable[[Callable, tuple], Callable]) -> None:
        """Replace each bound graph's run, run(args, call=0), with wrap(run, (entry id,
        context bucket, bucket)): a profiler's hook, to time or count the graphs a bound
        model runs (bench/sections/overhead.py, context.py). unbind drops it with the rest."""
        for module in model.modules():
            for d in vars(module).values():
                if isinstance(d, Dispatcher):
                    d.steps = {
                        c: {b: dataclasses.replace(s, run=wrap(s.run, (d.entry_id, c, b))) for b, s in steps.items()} for c, steps in d.steps.items()
                    }  # fmt: skip


def check_pin(path: Path, manifest: Manifest, expect_digest: str | None, plugins: Sequence[str] = ()) -> None:
    """The bundle is the one pinned (its digest is expect_digest, where given), and every
    plugin it was built with is named: what is checked before anything of it runs (and
    before `aotc run` starts a parallel bundle's ranks)."""
    if expect_digest is not None and manifest.digest() != expect_digest.strip().lower():
        raise BundleError(
            f"{path}: digest {manifest.digest()}, expected {expect_digest.strip()} (--expect-digest); "
            "this is not the bundle you pinned. Rebuild it, or pin the new digest if you built it"
        )
    missing = [p for p in manifest.plugins if p not in plugins]
    if missing:
        raise BundleError(
            f"{path} was built with the plugin {', '.join(missing)}; pass --plugin {' --plugin '.join(missing)} to run it (aotc imports a module only when you name it)"
        )


class DeviceAllocator:
    """A bound model's allocate_caches on a resident device: each cache kind (and each region
    of a packed one) as the device's allocations, one per layer (runtime.resident)."""

    def __init__(self, model, device: Device):
        self.model, self.device = model, device

    def __call__(self, slots: int, max_seq: int, device=None, split: bool = True) -> dict:
        layouts = self.model.cache_layouts()
        caches = {}
        for kind, (shape, dtype) in self.model.cache_specs(slots, max_seq).items():
            if kind in layouts:
                layout = layouts[kind]
                caches[kind] = Regions({layout.spans[r.name]: DeviceCaches(self.device, (*shape[:-1], r.count), r.dtype) for r in layout.regions})
            else:
                caches[kind] = DeviceCaches(self.device, shape, dtype)
        return caches


def _checked_copy(bundle: Path, art, checked: tempfile.TemporaryDirectory) -> Path:
    """An artifact's files copied into the checked folder, each matching its sha256."""
    try:
        art_dir = _copy_files(bundle / art.dir, art.files, Path(checked.name) / art.dir)
    except OSError as e:  # a full temp folder
        checked.cleanup()
        raise temp_error(e) from None
    bad = bad_file(art_dir, art.files)
    if bad:
        raise BundleError(f"{bundle / art.dir / bad[0].name}: {bad[1]} in {bundle / MANIFEST}; rebuild the bundle with aotc build")
    return art_dir


def _copy_files(src: Path, files: dict[str, str], dst: Path) -> Path:
    """The named files of an artifact folder, copied into dst (a link or anything but a
    plain file is left out: the check then finds it missing)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in files:
        source = src / name
        if source.is_file() and not source.is_symlink():
            shutil.copyfile(source, dst / name)
    return dst


def _check_signature(bundle: Path, label: str, weights: list[WeightSpec], art, found) -> None:
    """The artifact's own record of its inputs must be what the manifest says it takes."""
    if found is None:
        return
    expected = [(w.shape, w.dtype) for w in weights] + [(i.shape, i.dtype) for i in art.inputs]
    if [(list(s), d) for s, d in found] != [(list(s), d) for s, d in expected]:
        diff = next(((i, e, f) for i, (e, f) in enumerate(zip(expected, found)) if list(e[0]) != list(f[0]) or e[1] != f[1]), None)
        what = f"input {diff[0]} is {diff[2]}, the manifest says {diff[1]}" if diff else f"{len(found)} inputs, the manifest says {len(expected)}"
        raise BundleError(f"{bundle / art.dir}: the artifact is not {label} as the manifest says ({what}); the bundle was altered. Rebuild it (aotc build)")


def bound_weights(manifest: Manifest, model: nn.Module, bundle: Path) -> dict[tuple[str, str], Weights]:
    """The weight inputs of each (entry id, instance path), in the manifest's order, each
    made when a program asks for it with what bind does to it done: derived weights
    made, fp8 rescaled for the target (once per instance, whichever entries read it)."""
    shared: dict = {}  # one derived or stored tensor per instance, whichever entries read it
    out = {}
    for entry in manifest.entries:
        for path in entry.instances:
            try:
                instance = model.get_submodule(path)
            except AttributeError:
                raise BundleError(f"{bundle}: entry {entry.id} is for module {path!r}, which the model does not have") from None
            for w in entry.weights:
                _check_shard(model, path, w, bundle)
            out[entry.id, path] = Weights([functools.partial(_weight, instance, path, w, bundle, shared) for w in entry.weights])
    return out


def _check_shard(model: nn.Module, path: str, spec: WeightSpec, bundle: Path) -> None:
    """The rank's part of the weight that the model loaded must be the one the graphs take."""
    if model.config.parallel.world_size == 1:
        return
    param = f"{path}.{spec.path}" if path else spec.path
    have = weight_shard(model, param, spec.stored)
    if have != spec.shard:
        raise BundleError(
            f"{bundle}: weight {param} is split {spec.shard} in the bundle, but the model loads it {have}; "
            "the bundle was built by another parallel plan. Rebuild it (aotc build --tensor-parallel N)"
        )


def _weight(instance: nn.Module, path: str, spec: WeightSpec, bundle: Path, shared: dict) -> torch.Tensor:
    key = (path, spec.path, spec.stored.part if spec.stored else None)
    if key in shared:
        t = shared[key]
    elif spec.stored is not None:
        t = shared[key] = _stored_part(instance, path, spec, bundle)
    elif spec.transform is not None:
        t = shared[key] = _derive(instance, path, spec, bundle)
    else:
        t = _tensor(instance, path, spec.path, bundle)
    if list(t.shape) != spec.shape or str(t.dtype).removeprefix("torch.") != spec.dtype:
        raise BundleError(
            f"weight {path + '.' if path else ''}{spec.path} is {list(t.shape)} {t.dtype}, but bundle {bundle} was built for {spec.shape} {spec.dtype}; rebuild the bundle for these weights' shapes"
        )
    if list(t.stride()) != spec.stride:
        # Compiled code indexes weights with the traced strides: other strides would run silently wrong.
        raise BundleError(
            f"weight {path + '.' if path else ''}{spec.path} has strides {list(t.stride())}, but bundle {bundle} was built for {spec.stride}; make it contiguous (tensor.contiguous()) before binding"
        )
    # One detached tensor per model tensor (a tied one included), whichever entries and
    # instances take it: a device places each once.
    return shared.setdefault(("detached", id(t)), (t, t.detach()))[1]


def _tensor(instance: nn.Module, path: str, name: str, bundle: Path) -> torch.Tensor:
    try:
        return instance.get_parameter(name)
    except AttributeError:
        try:
            return instance.get_buffer(name)
        except AttributeError:
            raise BundleError(f"{bundle}: {path}.{name} is a graph input but the model has no such parameter") from None


def _stored(instance: nn.Module, path: str, name: str, spec: WeightSpec, bundle: Path) -> Stored:
    """The stored form of `name`, rescaled for the target's fp8 reading once (the model
    keeps the rescaled tensors in place of the checkpoint's: memory is not doubled)."""
    stored = stored_at(instance, name)
    if stored is None or stored.format != spec.stored.format:
        raise BundleError(
            f"{bundle}: {path}.{name} is a graph input stored as {spec.stored.format}, but the model has it "
            f"{'as ' + stored.format if stored else 'dequantized'}; load the model with load_model(stored=...) "
            "from the checkpoint the bundle was built from, or rebuild the bundle for this checkpoint"
        )
    dtype = str(_tensor(instance, path, name, bundle).dtype).removeprefix("torch.")
    if dtype != spec.stored.dtype:
        raise BundleError(f"{bundle}: {path}.{name} dequantizes to {spec.stored.dtype} in the graphs, but the model's is {dtype}; rebuild the bundle for this model")
    if spec.stored.fp8_reading == "e4m3" and stored.format == "fp8" and stored.fp8_reading == "e4m3fn":
        ue8m0 = stored.scale.dtype == torch.uint8
        stored = Stored("fp8", fp8.rescale_weights(stored.values), fp8.rescale_scales(stored.scale, ue8m0), "e4m3")
        keep_stored(instance, name, stored)
    return stored


def _stored_part(instance: nn.Module, path: str, spec: WeightSpec, bundle: Path) -> torch.Tensor:
    if spec.transform is None:
        return _stored(instance, path, spec.path, spec, bundle).part(spec.stored.part)
    transform = TRANSFORMS[spec.transform]
    sources = [_stored(instance, path, s, spec, bundle) for s in spec.sources]
    part = spec.stored.part
    out = transform.apply([s.part(part) for s in sources])
    for name, source, view in zip(spec.sources, sources, transform.views(out)):
        keep_stored(instance, name, dataclasses.replace(source, **{part: view}))
    return out


def _derive(instance: nn.Module, path: str, spec: WeightSpec, bundle: Path) -> torch.Tensor:
    """Apply a derived weight's transform to its sources, once, and re-point the sources
    at views of the result: eager code reads the same values and memory is not doubled."""
    transform = TRANSFORMS[spec.transform]
    sources = [_tensor(instance, path, s, bundle) for s in spec.sources]
    full = lambda name: f"{path}.{name}" if path else name  # noqa: E731  (the model's own entry: path "")
    for name, s in zip(spec.sources, sources):
        if (s.shape, s.dtype) != (sources[0].shape, sources[0].dtype):
            raise BundleError(
                f"weight {full(name)} is {list(s.shape)} {s.dtype}, but {full(spec.sources[0])} is {list(sources[0].shape)} {sources[0].dtype}; "
                f"the weights stacked into {full(spec.path)} must agree. Rebuild the bundle for these weights"
            )
    with torch.no_grad():
        out = transform.apply([s.detach() for s in sources])
        for source, view in zip(sources, transform.views(out)):
            source.data = view
    return out
