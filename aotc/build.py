"""`aotc build`: model folder -> traced graphs -> compiled artifacts -> bundle.

Every (entry, bucket) artifact has a cache key; compiled artifacts live in the
content-addressed cache (aotc/cache.py, optionally backed by a remote), and a
bundle is assembled from cache entries. A sharded build compiles its share of
the keys into the cache and writes no bundle.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import multiprocessing
import os
import platform
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import __version__
from .backends import Backend, get_backend
from .backends.base import get_backend_class
from .cache import CacheError, LocalCache
from .errors import AotcError
from .format import DEFAULT_ARTIFACTS, FORMAT_VERSION, MANIFEST, artifact_dir, bundle_writer, manifest_json, sha256_file, write_json_atomic
from .models.base import load_model, parse_config
from .passes import pipeline_identity
from .plugins import load_plugins
from .trace import Shapes, TracedGraph, Variant, dtype_name, find_variants, trace, weights_of

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)
DEFAULT_CHUNK_BUCKETS = (128,)
DEFAULT_MAX_SEQ = 1024


def parse_buckets(text: str, option: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); errors name the option."""
    try:
        values = [int(v) for v in str(text).replace(" ", "").split(",") if v]
    except ValueError:
        raise AotcError(f"{option} {text!r}: expected comma-separated positive integers, e.g. 1,2,4,8") from None
    if not values or any(v <= 0 for v in values):
        raise AotcError(f"{option} {text!r}: expected comma-separated positive integers, e.g. 1,2,4,8")
    return tuple(sorted(set(values)))


def parse_shard(text: str) -> tuple[int, int]:
    """'2/4' -> (2, 4): the second of four shards."""
    try:
        i, n = (int(v) for v in str(text).split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise AotcError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. 1/2")
    return i, n


def parse_flags(items: list[str], option: str) -> dict:
    """['cpp.simdlen=256', 'x=true'] -> {'cpp.simdlen': 256, 'x': True}; values are JSON where they parse."""
    flags = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise AotcError(f"{option} {item!r}: expected KEY=VALUE")
        try:
            flags[key] = json.loads(value)
        except json.JSONDecodeError:
            flags[key] = value
    return flags


@dataclass
class BuildOptions:
    model_dir: Path
    out: Path | None = None
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    chunk_buckets: tuple[int, ...] = DEFAULT_CHUNK_BUCKETS
    max_seq: int | None = None  # default: min(max_position_embeddings, DEFAULT_MAX_SEQ)
    backend: str | None = None  # default: inductor where a C++ compiler is present, else export
    device: str = "cpu"
    compiler_flags: dict = field(default_factory=dict)  # backend options (inductor: inductor configs)
    jobs: int | None = None  # default: from cores and free memory (inductor), 1 (export)
    cache_dir: Path | None = None  # default: $AOTC_CACHE_DIR or ~/.cache/aotc
    use_cache: bool = True
    require_cache: bool = False  # fail on any miss instead of compiling
    remote_cache: str | None = None  # s3://bucket/prefix
    shard: tuple[int, int] | None = None  # (i, n): compile the i-th of n shares into the cache, no bundle
    plugins: tuple[str, ...] = ()  # modules that register architectures (--plugin)

    def __post_init__(self):
        self.model_dir = Path(self.model_dir)
        if self.out is None:
            self.out = DEFAULT_ARTIFACTS / self.model_dir.resolve().name
        self.out = Path(self.out)
        if self.max_seq is not None and self.max_seq <= 0:
            raise AotcError(f"--max-seq {self.max_seq}: expected a positive integer")
        if self.jobs is not None and self.jobs <= 0:
            raise AotcError(f"--jobs {self.jobs}: expected a positive integer")
        if not self.use_cache and (self.require_cache or self.remote_cache or self.shard):
            raise AotcError("--no-cache cannot be combined with --require-cache, --remote-cache or --shard")

    @property
    def shapes(self) -> Shapes:
        return Shapes(slots=max(self.batch_buckets) + 1, max_seq=self.max_seq, device=self.device)

    def buckets(self, kind: str) -> tuple[int, ...]:
        return {"batch": self.batch_buckets, "chunk": self.chunk_buckets}[kind]

    def make_backend(self) -> Backend:
        if self.backend == "inductor":
            return get_backend("inductor", device=self.device, config=self.compiler_flags)
        if self.backend == "neuron":
            return get_backend("neuron", **self.compiler_flags)
        if self.compiler_flags:
            raise AotcError(f"--compiler-flag: the {self.backend} backend takes no compiler flags")
        return get_backend(self.backend)


def default_backend() -> tuple[str, str | None]:
    """inductor where it can compile here, else export with the reason."""
    why = get_backend_class("inductor")().unavailable()
    return ("export", why) if why else ("inductor", None)


def default_jobs(tasks: int, backend: str) -> int:
    """Parallel compile processes: bounded by cores and by free memory (about 2 GB per compile)."""
    if backend == "export" or tasks <= 1:
        return 1  # a compile is a file write: processes would cost more than they save
    if backend == "neuron":
        from .backends.neuron import default_jobs as neuron_jobs

        return neuron_jobs(tasks)
    cores = os.cpu_count() or 1
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, min(cores, free // (2 << 30), tasks))


@dataclass
class BuiltArtifact:
    entry_id: str
    bucket: int
    seconds: float  # this build's time for it: compile on a miss, fetch and check on a hit
    size: int
    record: dict
    source: str  # "compiled" | "cache" | "remote" | "uncached"
    remote_errors: list[str] = field(default_factory=list)


@dataclass
class BuildResult:
    out: Path | None  # None for a shard build: it fills the cache only
    manifest: dict | None
    artifacts: list[BuiltArtifact]
    graphs_traced: int
    variants: list[Variant]
    seconds: float
    jobs: int
    cache_dir: Path | None = None

    def count(self, source: str) -> int:
        return sum(a.source == source for a in self.artifacts)

    @property
    def remote_errors(self) -> list[str]:
        return [e for a in self.artifacts for e in a.remote_errors]


# progress(event, **info): "entry" (id, total), "done" (id, bucket), called by build()
Progress = Callable[..., None]


@dataclass
class _Plan:
    options: BuildOptions
    backend: Backend
    loaded: object
    variants: list[Variant]
    tasks: list[tuple[Variant, int]]


def _resolve(options: BuildOptions) -> tuple[dict, object]:
    """Fill in the defaults that depend on the machine and the config; (config dict, architecture)."""
    load_plugins(options.plugins)
    config_dict, arch, config = parse_config(options.model_dir)
    if options.backend is None:
        options.backend, _ = default_backend()
    if options.max_seq is None:
        options.max_seq = min(getattr(config, "max_position_embeddings", DEFAULT_MAX_SEQ), DEFAULT_MAX_SEQ)
    return config_dict, arch


def _plan(options: BuildOptions) -> _Plan:
    _resolve(options)
    backend = options.make_backend()
    loaded = load_model(options.model_dir, weights=False)
    variants = find_variants(loaded.model, options.shapes)
    if not variants:
        raise AotcError(f"{options.model_dir}: the model marks no entry methods (@aotc.entry); nothing to build")
    tasks = [(v, b) for v in variants for b in options.buckets(v.spec.bucket)]
    return _Plan(options, backend, loaded, variants, tasks)


def build(options: BuildOptions, progress: Progress | None = None) -> BuildResult:
    t0 = time.perf_counter()
    progress = progress or (lambda *a, **k: None)
    cache = LocalCache(options.cache_dir) if options.use_cache else None
    recipe = None
    if cache is not None and not options.shard:
        recipe = recipe_key(options)
        done = _from_recipe(options, cache, recipe, t0)
        if done is not None:
            return done
    plan = _plan(options)
    backend, shapes, tasks = plan.backend, options.shapes, plan.tasks
    if options.shard:
        i, n = options.shard
        tasks = sorted(tasks, key=lambda t: (t[0].entry_id, t[1]))[i - 1 :: n]
    if options.require_cache:
        _check_all_cached(plan, tasks, cache)
    jobs = options.jobs or default_jobs(len(tasks), backend.name)
    for v in plan.variants:
        total = sum(1 for t in tasks if t[0] is v)
        if total:
            progress("entry", id=v.entry_id, total=total)
    built: dict[tuple[str, int], BuiltArtifact] = {}

    def compile_all(out_dir: Path | None) -> None:
        # Cache hits are served here; only misses go to worker processes.
        misses = []
        for variant, bucket in tasks:
            graph = trace(variant, bucket, shapes, backend.pass_target())
            key = cache_key(graph, backend)
            if jobs > 1 and (cache is None or not cache.has(key)):
                misses.append((variant, bucket))
                continue
            built[variant.entry_id, bucket] = _artifact(backend, graph, key, out_dir, cache, options.remote_cache)
            progress("done", id=variant.entry_id, bucket=bucket)
        if not misses:
            return
        # Each worker traces its own graphs from the model folder (tracing is
        # cheap and deterministic) and compiles them; nothing large crosses processes.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(misses)), mp_context=ctx) as pool:
            futures = {pool.submit(_task, options, v.entry_id, b, out_dir): (v.entry_id, b) for v, b in misses}
            for future in as_completed(futures):
                entry_id, bucket = futures[future]
                built[entry_id, bucket] = future.result()
                progress("done", id=entry_id, bucket=bucket)

    if options.shard:
        compile_all(None)
        artifacts = [built[v.entry_id, b] for v, b in tasks]
        return BuildResult(None, None, artifacts, len(tasks), plan.variants, time.perf_counter() - t0, jobs, cache.root)
    with bundle_writer(options.out) as tmp:
        compile_all(tmp)
        artifacts = [built[v.entry_id, b] for v, b in tasks]
        manifest = _manifest(plan, built)
        write_json_atomic(tmp / MANIFEST, manifest)
    if recipe is not None:
        _save_recipe(cache, recipe, manifest)
    return BuildResult(options.out, manifest, artifacts, len(tasks), plan.variants, time.perf_counter() - t0, jobs, cache.root if cache else None)


def _manifest(plan: _Plan, built: dict) -> dict:
    options, backend, loaded = plan.options, plan.backend, plan.loaded
    shapes = options.shapes
    entries = [
        _entry_record(v, [built[v.entry_id, b].record for b in options.buckets(v.spec.bucket)])
        for v in plan.variants
    ]
    return manifest_json(
        {
            "aotc_version": __version__,
            "created_with": {"torch": torch.__version__, "python": platform.python_version()},
            "plugins": list(options.plugins),
            "model": {
                "architecture": loaded.arch.name,
                "class": type(loaded.model).__name__,
                "source": str(options.model_dir.resolve()),
                "config": loaded.config_dict,
            },
            "backend": {"name": backend.name, "version": backend.version(), "flags": backend.flags()},
            "shapes": {
                "batch": list(options.batch_buckets),
                "chunk": list(options.chunk_buckets),
                "max_seq": shapes.max_seq,
                "cache_slots": shapes.slots,
            },
            "caches": {
                kind: {"shape": list(shape), "dtype": dtype_name(dtype)}
                for kind, (shape, dtype) in loaded.model.cache_specs(shapes.slots, shapes.max_seq).items()
            },
            "passes": pipeline_identity(backend.pass_target()),
            "graphs_traced": len(plan.tasks),
            "entries": entries,
        }
    )


_WORKER_VARIANTS: dict = {}


def _task(options: BuildOptions, entry_id: str, bucket: int, out_dir: Path | None) -> BuiltArtifact:
    """Worker process: trace one (entry, bucket) from the model folder and build it."""
    key = (str(options.model_dir), options.shapes)
    if key not in _WORKER_VARIANTS:
        load_plugins(options.plugins)
        loaded = load_model(options.model_dir, weights=False)
        _WORKER_VARIANTS[key] = {v.entry_id: v for v in find_variants(loaded.model, options.shapes)}
    variant = _WORKER_VARIANTS[key][entry_id]
    backend = options.make_backend()
    cache = LocalCache(options.cache_dir) if options.use_cache else None
    graph = trace(variant, bucket, options.shapes, backend.pass_target())
    return _artifact(backend, graph, cache_key(graph, backend), out_dir, cache, options.remote_cache)


def _artifact(backend: Backend, graph: TracedGraph, key: str, out_dir: Path | None, cache: LocalCache | None, remote_url: str | None) -> BuiltArtifact:
    """Get one artifact, from the cache when its key is there, else by compiling; copy it into the bundle."""
    t0 = time.perf_counter()
    rel = artifact_dir(graph.variant.entry_id, graph.bucket)
    remote = _remote(remote_url) if remote_url else None
    errors_before = len(remote.errors) if remote else 0
    if cache is None:
        src = out_dir / rel
        src.mkdir(parents=True)
        record, source = _compile(backend, graph, src, key), "uncached"
    else:
        with cache.lock(key):
            entry, source = cache.get(key), "cache"
            if entry is None and remote is not None:
                entry, source = cache.put(key, lambda tmp: remote.fetch(key, tmp)), "remote"
            if entry is None:
                entry, source = cache.put(key, lambda tmp: _compile(backend, graph, tmp, key)), "compiled"
                if remote is not None:
                    remote.store(key, entry.dir, entry.record)
        record, src = entry.record, entry.dir
        if out_dir is not None:
            (out_dir / rel).mkdir(parents=True)
            for name in record["files"]:
                shutil.copyfile(src / name, out_dir / rel / name)
    size = sum((src / name).stat().st_size for name in record["files"])
    manifest_record = {"bucket": graph.bucket, "dir": rel, **record, "served": source}
    errors = remote.errors[errors_before:] if remote else []
    return BuiltArtifact(graph.variant.entry_id, graph.bucket, time.perf_counter() - t0, size, manifest_record, source, errors)


@functools.lru_cache(maxsize=None)
def _remote(url: str):
    # One client per process and URL, so a remote found down is not asked again in this build.
    from .remote import RemoteCache

    return RemoteCache(url)


def _compile(backend: Backend, graph: TracedGraph, out: Path, key: str) -> dict:
    """Compile into the folder `out`; the artifact's record (what the manifest keeps of it)."""
    t0 = time.perf_counter()
    result = backend.compile(graph, out)
    return {
        "files": {f: sha256_file(out / f) for f in result.files},
        "inputs": [dataclasses.asdict(i) for i in graph.inputs if i.kind != "weight"],
        "outputs": [dataclasses.asdict(o) for o in graph.outputs],
        "export_s": round(graph.export_s, 4),
        "compile_s": round(time.perf_counter() - t0, 4),
        "cache_key": key,
        "passes": {p.name: p.changes for p in graph.passes},
        **({"extra": result.extra} if result.extra else {}),
    }


def _entry_record(variant: Variant, records: list[dict]) -> dict:
    return {
        "id": variant.entry_id,
        "class": variant.cls.__qualname__,
        "method": variant.spec.method,
        "bucket_kind": variant.spec.bucket,
        "split": variant.spec.split,
        "variant": variant.attributes,
        "instances": [path for path, _ in variant.instances],
        "weights": [
            {"path": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype), "stride": list(t.stride())}
            for name, t in weights_of(variant.module)
        ],
        "artifacts": records,
    }


def cache_key(graph: TracedGraph, backend: Backend) -> str:
    """What determines the compiled code and nothing else (../shared/DESIGN.md):
    the graph after passes, input metadata, backend and compiler version,
    normalized flags, torch version, target. Never paths or weight values."""
    payload = {
        "format": FORMAT_VERSION,
        "graph": graph.graph_module.code,
        "inputs": [(i.kind, i.shape, i.dtype, i.stride, i.pad) for i in graph.inputs],
        "outputs": [(o.shape, o.dtype) for o in graph.outputs],
        "backend": backend.name,
        "backend_version": backend.version(),
        "flags": backend.flags(),
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def build_keys(options: BuildOptions) -> list[tuple[str, int, str]]:
    """(entry id, bucket, cache key) of every artifact of a build, without compiling."""
    plan = _plan(options)
    return [(v.entry_id, b, cache_key(trace(v, b, options.shapes, plan.backend.pass_target()), plan.backend)) for v, b in plan.tasks]


def build_key(options: BuildOptions) -> str:
    """One key for a whole build: changes exactly when some artifact's key changes."""
    keys = build_keys(options)
    return hashlib.sha256(json.dumps(keys).encode()).hexdigest()


def _check_all_cached(plan: _Plan, tasks, cache: LocalCache) -> None:
    """--require-cache: every artifact must be in the local cache (or fetched from the remote)."""
    missing = []
    remote = _remote(plan.options.remote_cache) if plan.options.remote_cache else None
    for v, b in tasks:
        key = cache_key(trace(v, b, plan.options.shapes, plan.backend.pass_target()), plan.backend)
        with cache.lock(key):
            found = cache.get(key) or (remote and cache.put(key, lambda tmp: remote.fetch(key, tmp)))
        if not found:
            missing.append(f"{v.entry_id} bucket {b} (key {key[:12]})")
    if missing:
        where = f"the cache {cache.root}" + (f" or {plan.options.remote_cache}" if remote else "")
        raise CacheError(
            f"--require-cache: {len(missing)} of {len(tasks)} artifacts are not in {where}: "
            + "; ".join(missing)
            + ". Build them first with the same cache (aotc build, or aotc build --shard I/N for each shard)."
        )


# -- build recipes: warm rebuilds without tracing ---------------------------------
#
# A recipe key hashes what a build's graphs are made from: config.json, the
# build options, the backend, torch and Python versions, and the source of
# aotc and of the model's package. Once a build with that recipe has
# finished, its manifest is kept in the cache, and a rebuild whose artifacts
# are all still cached assembles the bundle from it without loading torch's
# tracer: a second or two instead of a trace per graph.


def recipe_key(options: BuildOptions) -> str:
    config_dict, arch = _resolve(options)
    backend = options.make_backend()
    payload = {
        "format": FORMAT_VERSION,
        "aotc": __version__,
        "config": config_dict,
        "batch": options.batch_buckets,
        "chunk": options.chunk_buckets,
        "max_seq": options.max_seq,
        "backend": [backend.name, backend.version(), backend.flags(), backend.pass_target()],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "sources": _source_digest(Path(__file__).parent) + _source_digest(_package_dir(arch.model_class)),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _package_dir(cls: type) -> Path:
    import importlib

    top = cls.__module__.split(".")[0]
    return Path(importlib.import_module(top).__file__).parent


@functools.lru_cache(maxsize=None)
def _source_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(folder.rglob("*.py")):
        h.update(file.relative_to(folder).as_posix().encode() + b"\0" + file.read_bytes())
    return h.hexdigest()


def _recipe_file(cache: LocalCache, recipe: str) -> Path:
    return cache.root / "builds" / f"{recipe}.json"


def _save_recipe(cache: LocalCache, recipe: str, manifest: dict) -> None:
    _recipe_file(cache, recipe).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(_recipe_file(cache, recipe), manifest)


def _from_recipe(options: BuildOptions, cache: LocalCache, recipe: str, t0: float) -> BuildResult | None:
    file = _recipe_file(cache, recipe)
    if not file.is_file():
        return None
    manifest = json.loads(file.read_text())
    entries = {}
    for e in manifest["entries"]:
        for art in e["artifacts"]:
            entry = cache.get(art["cache_key"])
            if entry is None:
                return None  # pruned since: build the normal way
            entries[art["cache_key"]] = entry
    artifacts = []
    with bundle_writer(options.out) as tmp:
        for e in manifest["entries"]:
            for art in e["artifacts"]:
                entry = entries[art["cache_key"]]
                (tmp / art["dir"]).mkdir(parents=True)
                for name in art["files"]:
                    shutil.copyfile(entry.dir / name, tmp / art["dir"] / name)
                art["served"] = "cache"
                artifacts.append(BuiltArtifact(e["id"], art["bucket"], 0.0, entry.size, art, "cache"))
        manifest["model"]["source"] = str(options.model_dir.resolve())
        write_json_atomic(tmp / MANIFEST, manifest)
    return BuildResult(options.out, manifest, artifacts, 0, [], time.perf_counter() - t0, 1, cache.root)


# -- neuron: finishing a cross-build ----------------------------------------------


def resume(bundle: Path, jobs: int | None = None, progress: Progress | None = None) -> list[tuple[str, int]]:
    """Compile the pending artifacts of a bundle built where neuronx-cc was missing.

    Each pending artifact's command.txt is run in its folder; the manifest is
    rewritten (atomically) once every compile succeeded. Returns the (entry,
    bucket) pairs compiled.
    """
    import shlex
    from concurrent.futures import ThreadPoolExecutor

    from .backends import neuron
    from .runtime.bundle import read_manifest

    progress = progress or (lambda *a, **k: None)
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    if manifest["backend"]["name"] != "neuron":
        raise AotcError(f"--resume {bundle}: built with the {manifest['backend']['name']} backend, it has nothing to resume; only neuron bundles do")
    pending = [(e, a) for e in manifest["entries"] for a in e["artifacts"] if a.get("extra", {}).get("pending")]
    if not pending:
        return []
    version = neuron.compiler_version()
    if version is None:
        raise AotcError(f"--resume {bundle}: {neuron.COMPILER} is not on PATH; run this on a host with the Neuron SDK")
    for e, a in pending:
        progress("entry", id=f"{e['id']} b{a['bucket']}", total=1)

    def compile_one(item):
        e, a = item
        folder = bundle / a["dir"]
        neuron.run_compiler(shlex.split((folder / neuron.COMMAND).read_text()), folder)
        progress("done", id=f"{e['id']} b{a['bucket']}", bucket=a["bucket"])
        return item

    workers = jobs or neuron.default_jobs(len(pending))
    with ThreadPoolExecutor(max_workers=workers) as pool:  # each compile is a subprocess
        list(pool.map(compile_one, pending))
    for _, a in pending:
        folder = bundle / a["dir"]
        for name in (neuron.NEFF, neuron.LOG):
            a["files"][name] = sha256_file(folder / name)
        del a["extra"]["pending"]
        # The artifact now depends on the compiler too.
        a["cache_key"] = hashlib.sha256(f"{a['cache_key']}:{neuron.COMPILER}-{version}".encode()).hexdigest()
    manifest["backend"]["version"] = manifest["backend"]["version"].replace("neuronx-cc-absent", f"neuronx-cc-{version}")
    write_json_atomic(bundle / MANIFEST, manifest)
    return [(e["id"], a["bucket"]) for e, a in pending]
