"""`aotc build`: model folder -> traced graphs -> compiled artifacts -> bundle."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import __version__
from .backends import Backend, get_backend
from .backends.base import get_backend_class
from .errors import AotcError
from .format import DEFAULT_ARTIFACTS, FORMAT_VERSION, MANIFEST, artifact_dir, bundle_writer, manifest_json, sha256_file, write_json_atomic
from .models.base import load_model
from .passes import pipeline_identity
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


@dataclass
class BuildOptions:
    model_dir: Path
    out: Path | None = None
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    chunk_buckets: tuple[int, ...] = DEFAULT_CHUNK_BUCKETS
    max_seq: int | None = None  # default: min(max_position_embeddings, DEFAULT_MAX_SEQ)
    backend: str | None = None  # default: inductor where a C++ compiler is present, else export
    device: str = "cpu"
    jobs: int | None = None  # default: from cores and free memory (inductor), 1 (export)

    def __post_init__(self):
        self.model_dir = Path(self.model_dir)
        if self.out is None:
            self.out = DEFAULT_ARTIFACTS / self.model_dir.resolve().name
        self.out = Path(self.out)
        if self.max_seq is not None and self.max_seq <= 0:
            raise AotcError(f"--max-seq {self.max_seq}: expected a positive integer")
        if self.jobs is not None and self.jobs <= 0:
            raise AotcError(f"--jobs {self.jobs}: expected a positive integer")

    @property
    def shapes(self) -> Shapes:
        return Shapes(slots=max(self.batch_buckets) + 1, max_seq=self.max_seq, device=self.device)

    def buckets(self, kind: str) -> tuple[int, ...]:
        return {"batch": self.batch_buckets, "chunk": self.chunk_buckets}[kind]

    def backend_options(self) -> dict:
        return {"device": self.device} if self.backend == "inductor" else {}


def default_backend() -> tuple[str, str | None]:
    """inductor where it can compile here, else export with the reason."""
    why = get_backend_class("inductor")().unavailable()
    return ("export", why) if why else ("inductor", None)


def default_jobs(tasks: int, backend: str) -> int:
    """Parallel compile processes: bounded by cores and by free memory (about 2 GB per compile)."""
    if backend == "export" or tasks <= 1:
        return 1  # a compile is a file write: processes would cost more than they save
    cores = os.cpu_count() or 1
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, min(cores, free // (2 << 30), tasks))


@dataclass
class BuiltArtifact:
    entry_id: str
    bucket: int
    seconds: float
    size: int
    record: dict


@dataclass
class BuildResult:
    out: Path
    manifest: dict
    artifacts: list[BuiltArtifact]
    graphs_traced: int
    variants: list[Variant]
    seconds: float
    jobs: int


# progress(event, **info): "entry" (id, total), "done" (id, bucket), called by build()
Progress = Callable[..., None]


def build(options: BuildOptions, progress: Progress | None = None) -> BuildResult:
    t0 = time.perf_counter()
    progress = progress or (lambda *a, **k: None)
    if options.backend is None:
        options.backend, _ = default_backend()
    backend = get_backend(options.backend, **options.backend_options())
    loaded = load_model(options.model_dir, weights=False)
    if options.max_seq is None:
        options.max_seq = min(getattr(loaded.config, "max_position_embeddings", DEFAULT_MAX_SEQ), DEFAULT_MAX_SEQ)
    shapes = options.shapes
    variants = find_variants(loaded.model, shapes)
    if not variants:
        raise AotcError(f"{options.model_dir}: the model marks no entry methods (@aotc.entry); nothing to build")
    tasks = [(v, b) for v in variants for b in options.buckets(v.spec.bucket)]
    jobs = options.jobs or default_jobs(len(tasks), backend.name)
    for v in variants:
        progress("entry", id=v.entry_id, total=len(options.buckets(v.spec.bucket)))
    built: dict[tuple[str, int], BuiltArtifact] = {}
    with bundle_writer(options.out) as tmp:
        if jobs == 1:
            for variant, bucket in tasks:
                built[variant.entry_id, bucket] = _compile(backend, trace(variant, bucket, shapes, backend.pass_target()), tmp)
                progress("done", id=variant.entry_id, bucket=bucket)
        else:
            # Each worker traces its own graphs from the model folder (tracing is
            # cheap and deterministic) and compiles them; nothing large crosses processes.
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
                futures = {pool.submit(_compile_task, options, v.entry_id, b, tmp): (v.entry_id, b) for v, b in tasks}
                for future in as_completed(futures):
                    entry_id, bucket = futures[future]
                    built[entry_id, bucket] = future.result()
                    progress("done", id=entry_id, bucket=bucket)
        artifacts = [built[v.entry_id, b] for v, b in tasks]
        entries = [
            _entry_record(v, [built[v.entry_id, b].record for b in options.buckets(v.spec.bucket)], loaded.model)
            for v in variants
        ]
        manifest = manifest_json(
            {
                "aotc_version": __version__,
                "created_with": {"torch": torch.__version__, "python": platform.python_version()},
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
                "graphs_traced": len(artifacts),
                "entries": entries,
            }
        )
        write_json_atomic(tmp / MANIFEST, manifest)
    return BuildResult(options.out, manifest, artifacts, len(artifacts), variants, time.perf_counter() - t0, jobs)


_WORKER_VARIANTS: dict = {}


def _compile_task(options: BuildOptions, entry_id: str, bucket: int, bundle_dir: Path) -> BuiltArtifact:
    """Worker process: trace one (entry, bucket) from the model folder and compile it."""
    key = (str(options.model_dir), options.shapes)
    if key not in _WORKER_VARIANTS:
        loaded = load_model(options.model_dir, weights=False)
        _WORKER_VARIANTS[key] = {v.entry_id: v for v in find_variants(loaded.model, options.shapes)}
    variant = _WORKER_VARIANTS[key][entry_id]
    backend = get_backend(options.backend, **options.backend_options())
    return _compile(backend, trace(variant, bucket, options.shapes, backend.pass_target()), bundle_dir)


def _compile(backend: Backend, graph: TracedGraph, bundle_dir: Path) -> BuiltArtifact:
    rel = artifact_dir(graph.variant.entry_id, graph.bucket)
    out = bundle_dir / rel
    out.mkdir(parents=True)
    key = cache_key(graph, backend)
    t0 = time.perf_counter()
    result = backend.compile(graph, out)
    seconds = time.perf_counter() - t0
    files = {f: sha256_file(out / f) for f in result.files}
    size = sum((out / f).stat().st_size for f in result.files)
    record = {
        "bucket": graph.bucket,
        "dir": rel,
        "files": files,
        "inputs": [dataclasses.asdict(i) for i in graph.inputs if i.kind != "weight"],
        "outputs": [dataclasses.asdict(o) for o in graph.outputs],
        "export_s": round(graph.export_s, 4),
        "compile_s": round(seconds, 4),
        "cache_key": key,
        "passes": {p.name: p.changes for p in graph.passes},
        **({"extra": result.extra} if result.extra else {}),
    }
    return BuiltArtifact(graph.variant.entry_id, graph.bucket, seconds, size, record)


def _entry_record(variant: Variant, records: list[dict], model) -> dict:
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
    """What determines the compiled code and nothing else (../shared/DESIGN.md)."""
    gm = graph.graph_module
    payload = {
        "format": FORMAT_VERSION,
        "graph": gm.code,
        "inputs": [(i.kind, i.shape, i.dtype, i.stride) for i in graph.inputs],
        "outputs": [(o.shape, o.dtype) for o in graph.outputs],
        "backend": backend.name,
        "backend_version": backend.version(),
        "flags": backend.flags(),
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

