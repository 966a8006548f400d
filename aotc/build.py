"""`aotc build`: model folder -> traced graphs -> compiled artifacts -> bundle."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import __version__
from .backends import Backend, get_backend
from .errors import AotcError
from .format import DEFAULT_ARTIFACTS, FORMAT_VERSION, MANIFEST, artifact_dir, bundle_writer, manifest_json, sha256_file, write_json_atomic
from .models.base import load_model
from .passes import pipeline_identity
from .trace import Shapes, TracedGraph, Variant, dtype_name, find_variants, trace

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
    backend: str = "export"
    backend_options: dict = field(default_factory=dict)

    def __post_init__(self):
        self.model_dir = Path(self.model_dir)
        if self.out is None:
            self.out = DEFAULT_ARTIFACTS / self.model_dir.resolve().name
        self.out = Path(self.out)
        if self.max_seq is not None and self.max_seq <= 0:
            raise AotcError(f"--max-seq {self.max_seq}: expected a positive integer")

    @property
    def shapes(self) -> Shapes:
        return Shapes(slots=max(self.batch_buckets) + 1, max_seq=self.max_seq)

    def buckets(self, kind: str) -> tuple[int, ...]:
        return {"batch": self.batch_buckets, "chunk": self.chunk_buckets}[kind]


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


# progress(event, **info): "entry" (id, total), "done" (id, bucket), called by build()
Progress = Callable[..., None]


def build(options: BuildOptions, progress: Progress | None = None) -> BuildResult:
    t0 = time.perf_counter()
    progress = progress or (lambda *a, **k: None)
    backend = get_backend(options.backend, **options.backend_options)
    loaded = load_model(options.model_dir, weights=False)
    if options.max_seq is None:
        options.max_seq = min(getattr(loaded.config, "max_position_embeddings", DEFAULT_MAX_SEQ), DEFAULT_MAX_SEQ)
    shapes = options.shapes
    variants = find_variants(loaded.model, shapes)
    if not variants:
        raise AotcError(f"{options.model_dir}: the model marks no entry methods (@aotc.entry); nothing to build")
    entries, artifacts = [], []
    with bundle_writer(options.out) as tmp:
        for variant in variants:
            buckets = options.buckets(variant.spec.bucket)
            progress("entry", id=variant.entry_id, total=len(buckets))
            records = []
            for bucket in buckets:
                graph = trace(variant, bucket, shapes)
                built = _compile(backend, graph, tmp)
                records.append(built.record)
                artifacts.append(built)
                progress("done", id=variant.entry_id, bucket=bucket)
            entries.append(_entry_record(variant, records, graph))
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
                "passes": pipeline_identity(),
                "graphs_traced": len(artifacts),
                "entries": entries,
            }
        )
        write_json_atomic(tmp / MANIFEST, manifest)
    return BuildResult(options.out, manifest, artifacts, len(artifacts), variants, time.perf_counter() - t0)


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


def _entry_record(variant: Variant, records: list[dict], graph: TracedGraph) -> dict:
    return {
        "id": variant.entry_id,
        "class": variant.cls.__qualname__,
        "method": variant.spec.method,
        "bucket_kind": variant.spec.bucket,
        "split": variant.spec.split,
        "variant": variant.attributes,
        "instances": [path for path, _ in variant.instances],
        "weights": [{"path": i.path, "shape": i.shape, "dtype": i.dtype} for i in graph.inputs if i.kind == "weight"],
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

