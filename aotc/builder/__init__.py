"""`aotc build`: model folder -> bundle, in four stages.

    plan      (plan.py: make_plan)              model -> variants x buckets
    key       (key.py: key_graphs)              each (variant, bucket) traced and passed once, and keyed
    obtain    (obtain.py: obtain_artifacts)     each key's artifact from the cache, the remote, or a compile
    assemble  (assemble.py: assemble_manifest)  the artifacts -> the bundle's manifest

A rebuild whose recipe is cached skips all four (aotc/cache/recipes.py); a
sharded build stops after obtain: it fills the cache and writes no bundle.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import parallel
from ..backends import Backend, Progress
from ..backends.registry import get_backend_class
from ..cache import LocalCache
from ..cache.keys import build_key as _build_key
from ..cache.keys import recipe_key
from ..cache.local import CacheError
from ..cache.recipes import load_recipe, recipe_file, save_recipe
from ..entry import whole_steps
from ..errors import AotcError, BundleError
from ..format import Manifest, artifact_label, bundle_writer, check_replaceable, crossed_weights, read_manifest, write_manifest
from ..models.loader import load_model, memory_shortfall
from ..trace import Variant, whole_step_refusal
from .assemble import assemble_manifest, model_record
from .copies import copy_graphs, obtain_copies
from .key import key_graphs
from .obtain import BuiltArtifact, copy_files, obtain_artifacts, remote_client
from .options import BuildOptions, check_jobs, default_backend, default_jobs, parse_buckets, parse_flags, parse_shard
from .plan import make_plan, resolve, shard_of

__all__ = [
    "BuildOptions", "BuildResult", "BuiltArtifact", "build", "build_key", "build_keys", "default_backend",
    "parse_buckets", "parse_flags", "parse_shard", "resume",
]  # fmt: skip


@dataclass
class BuildResult:
    out: Path | None  # None for a shard build: it fills the cache only
    manifest: Manifest | None
    artifacts: list[BuiltArtifact]
    graphs_traced: int
    variants: list[Variant]
    seconds: float
    jobs: int
    cache_dir: Path | None = None
    notes: list[str] = field(default_factory=list)  # warnings: the cache cannot be written, the caches would not fit here
    per_layer: str | None = None  # the model has a whole step and the build made none: why (trace.whole_step_refusal)

    def count(self, source: str) -> int:
        return sum(a.source == source for a in self.artifacts)

    @property
    def remote_errors(self) -> list[str]:
        return [e for a in self.artifacts for e in a.remote_errors]

    @property
    def cache_notes(self) -> list[str]:
        return [n for a in self.artifacts for n in a.cache_notes]


def _quiet(*args, **kwargs) -> None:
    pass


def _refuse_in_a_starting_worker() -> None:
    """A compile worker is a spawned process, which first imports the main module of the
    program that started it (multiprocessing's spawn). A script that calls build() at
    its top level, not under `if __name__ == "__main__":`, calls it again there, and that
    call would wait forever for the bundle's writer lock, which the parent holds while it
    waits for the worker. `_inheriting` is what multiprocessing's own check of this case
    reads (spawn._check_not_importing_main): true only while the child imports that module."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise AotcError(
            "build() was called while a compile worker was starting: the worker imports your program's main module, "
            'which calls build() at its top level. Put that call under `if __name__ == "__main__":`'
        )


def build(options: BuildOptions, progress: Progress | None = None) -> BuildResult:
    _refuse_in_a_starting_worker()
    t0 = time.perf_counter()
    progress = progress or _quiet
    cache = LocalCache(options.cache_dir) if options.use_cache else None
    notes = []
    why = cache.writable() if cache is not None else None
    if why:
        if options.require_cache or options.shard:
            raise CacheError(f"the compile cache cannot be written ({why}); --require-cache and --shard need it. Pass a writable --cache-dir")
        notes.append(f"the compile cache cannot be written ({why}); building without it")
        cache, options = None, dataclasses.replace(options, use_cache=False)
    config_dict, model_class, backend = resolve(options)
    if not options.shard:
        check_replaceable(options.out)  # before any work: aotc replaces only its own bundles
    recipe = None
    if cache is not None and not options.shard:
        recipe = recipe_key(options, config_dict, model_class, backend)
        try:
            done = _from_recipe(options, cache, recipe, backend, t0)
        except CacheError as e:  # a corrupt recipe: a miss, said so; the build writes a new one
            notes.append(f"{e}; built the normal way")
            done = None
        if done is not None:
            return done
    # Graphs with collectives trace and compile under torch's fake process group (aotc.parallel).
    with parallel.tracing(options.layout):
        return _build(options, backend, cache, recipe, notes, progress, t0)


def _build(options: BuildOptions, backend: Backend, cache: LocalCache | None, recipe: str | None, notes: list[str], progress: Progress, t0: float) -> BuildResult:
    p = make_plan(options, backend)
    per_layer = whole_step_refusal(p.loaded.model, backend.loops) if whole_steps(p.loaded.model) else None
    short = memory_shortfall(p.loaded.model, p.shapes.slots, p.shapes.max_seq)
    if short:  # bundles are often built for larger hosts: a warning here, an error at run
        notes.append(f"this bundle will not run on this machine: {short}")
    tasks = shard_of(p.tasks, options.shard) if options.shard else p.tasks
    keyed = key_graphs(p, tasks)
    # The copies between cache slots of a backend that needs them: in the bundle's build, or
    # the first shard's (a --require-cache build then finds them too).
    copies = copy_graphs(p)
    if options.shard and options.shard[0] != 1:
        copies = []
    if options.require_cache:
        _check_all_cached(options, [(artifact_label(*k.id), k.key) for k in keyed] + [(r.label, c.key) for r, c in copies], cache)
    jobs = options.jobs or default_jobs(len(tasks), backend)
    for variants in p.entries():
        total = sum(1 for t in tasks if any(t[0] is v for v in variants))
        if total:
            progress("entry", id=variants[0].entry_id, total=total)
    if options.shard:
        built = obtain_artifacts(options, backend, keyed, None, cache, jobs, progress)
        obtain_copies(backend, copies, None, cache, options.remote_cache, progress)
        artifacts = [built[k.id] for k in keyed]
        return BuildResult(None, None, artifacts, len(tasks), p.variants, time.perf_counter() - t0, jobs, cache.root, per_layer=per_layer)
    with bundle_writer(options.out, bundle_locks(options)) as tmp:
        built = obtain_artifacts(options, backend, keyed, tmp, cache, jobs, progress)
        manifest = assemble_manifest(p, built)
        manifest.copies = obtain_copies(backend, copies, tmp, cache, options.remote_cache, progress)
        write_manifest(tmp, manifest)
    if recipe is not None:
        try:
            save_recipe(cache, recipe, manifest)
        except OSError as e:  # the bundle is whole; only the next build's shortcut is missing
            notes.append(f"the compile cache cannot be written ({e.filename or cache.root}: {e.strerror or e}); this build's recipe was not stored")
    artifacts = [built[k.id] for k in keyed]
    return BuildResult(options.out, manifest, artifacts, len(tasks), p.variants, time.perf_counter() - t0, jobs, cache.root if cache else None, notes, per_layer)


def build_keys(options: BuildOptions) -> list[tuple[str, int, int | None, str]]:
    """(entry id, bucket, context bucket, cache key) of every artifact of a build, the cache
    copies' (label, slots, None, key) last, without compiling."""
    with parallel.tracing(options.layout):
        p = make_plan(options)
        return [(*k.id, k.key) for k in key_graphs(p, p.tasks)] + [(r.label, c.bucket, None, c.key) for r, c in copy_graphs(p)]


def build_key(options: BuildOptions) -> str:
    """One key for a whole build: changes exactly when some artifact's key changes."""
    return _build_key(build_keys(options))


def _check_all_cached(options: BuildOptions, keyed: list[tuple[str, str]], cache: LocalCache) -> None:
    """--require-cache: every artifact (label, key) must be in the local cache (or fetched from the remote)."""
    missing = []
    remote = remote_client(options.remote_cache) if options.remote_cache else None
    for label, key in keyed:
        with cache.lock(key):
            found = cache.get(key) or (remote and cache.put(key, lambda tmp: remote.fetch(key, tmp)))
        if not found:
            missing.append(f"{label} (key {key[:12]})")
    if missing:
        where = f"the cache {cache.root}" + (f" or {options.remote_cache}" if remote else "")
        raise CacheError(
            f"--require-cache: {len(missing)} of {len(keyed)} artifacts are not in {where}: "
            + "; ".join(missing)
            + ". Build them first with the same cache (aotc build, or aotc build --shard I/N for each shard)."
        )


def _from_recipe(options: BuildOptions, cache: LocalCache, recipe: str, backend: Backend, t0: float) -> BuildResult | None:
    found = load_recipe(cache, recipe)
    if found is None:
        return None
    # The recipe says what the graphs are; the model folder must still be what they
    # are for: every safetensors header checked against the model (headers only).
    manifest, entries = found
    loaded = load_model(options.model_dir, weights=False, kv_cache=manifest.model.kv_cache, modeling=options.modeling)
    artifacts = []
    with bundle_writer(options.out, bundle_locks(options)) as tmp:
        for c in manifest.copies:  # no weights to check
            copy_files(entries[c.artifact.cache_key].dir, tmp / c.artifact.dir, c.artifact.files)
            c.artifact.served = "cache"
        for e, art in manifest.artifacts():
            entry = entries[art.cache_key]
            copy_files(entry.dir, tmp / art.dir, art.files)
            # Each artifact's own record of its weights, as Bundle.load checks it: a recipe
            # whose weights are crossed is a miss (CacheError), never a bundle.
            try:
                crossed = crossed_weights(e, backend.weight_paths(tmp / art.dir))
            except BundleError as error:
                crossed = str(error)
            if crossed:
                raise CacheError(f"{recipe_file(cache, recipe)}: {artifact_label(e.id, art.bucket, art.context)}: {crossed}")
            art.served = "cache"
            artifacts.append(BuiltArtifact(e.id, art.bucket, art.context, 0.0, entry.size, art, "cache"))
        manifest.model = model_record(options, loaded)  # this folder's, not the recipe's
        write_manifest(tmp, manifest)
    return BuildResult(options.out, manifest, artifacts, 0, [], time.perf_counter() - t0, 1, cache.root)


def bundle_locks(options: BuildOptions) -> Path | None:
    """Where a bundle's writers take turns (cache.writer_locks)."""
    from ..cache.local import writer_locks

    return writer_locks(options.cache_dir)


def resume(bundle: Path, jobs: int | None = None, progress: Progress | None = None) -> list[str]:
    """Complete what the build machine could not (a neuron cross-build's compiles),
    through the backend's `finish` hook; the manifest is rewritten once all succeeded."""
    bundle = Path(bundle)
    check_jobs(jobs)
    manifest = read_manifest(bundle)
    backend_class = get_backend_class(manifest.backend.name)
    if backend_class.finish is Backend.finish:
        raise AotcError(f"--resume {bundle}: built with the {manifest.backend.name} backend, it has nothing to resume; only neuron bundles do")
    if not manifest.pending():
        return []
    try:
        backend = backend_class(**manifest.backend.flags)
    except TypeError as e:
        raise AotcError(f"--resume {bundle}: backend.flags do not fit the {manifest.backend.name} backend ({e}); rebuild the bundle") from None
    names = {id(a): label for label, a in manifest.compiled()}
    done = backend.finish(bundle, manifest, jobs, progress or _quiet)
    write_manifest(bundle, manifest)
    return [names[id(a)] for a in done]
