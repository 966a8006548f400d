"""Stage 3, obtain: each keyed graph's artifact from the cache, the remote, or a compile.

Hits are served in this process. Misses compile here, or with `--jobs N` in
worker processes that receive the traced graph itself (serialized with
torch.export.save: about 0.15 s a graph, against about 1.3 s for a worker to
load the model and find its variants before it could re-trace one).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import multiprocessing
import os
import shutil
import signal
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import parallel
from ..backends import Backend, Progress, Specs
from ..backends.export import load_program, save_program
from ..cache import LocalCache
from ..cache.local import CacheError
from ..errors import AotcError
from ..format import ArtifactRecord, CompiledRecord, Form, PassRecord, Served, artifact_dir, convert, sha256_file
from ..quiet import silence_third_party_warnings
from .key import KeyedGraph, graph_form
from .options import BuildOptions


@dataclass
class BuiltArtifact:
    entry_id: str
    bucket: int
    context: int | None  # the context bucket; None for an entry without
    seconds: float  # this build's time for it: compile on a miss, fetch and check on a hit
    size: int
    record: ArtifactRecord
    source: Served
    remote_errors: list[str] = field(default_factory=list)
    cache_notes: list[str] = field(default_factory=list)  # corrupt entries found, compiled again


def obtain_artifacts(
    options: BuildOptions, backend: Backend, keyed: list[KeyedGraph], out_dir: Path | None, cache: LocalCache | None, jobs: int, progress: Progress
) -> dict[tuple[str, int, int | None], BuiltArtifact]:
    """Every keyed graph's artifact, copied into out_dir (the bundle being written) when given."""
    built: dict[tuple[str, int, int | None], BuiltArtifact] = {}  # by KeyedGraph.id
    misses = []
    for k in keyed:
        hit = cache is not None and cache.has(k.key)
        if jobs > 1 and not hit:
            misses.append(k)
            continue
        built[k.id] = artifact(backend, _compilable(k) if hit else _received(_portable(k)), out_dir, cache, options.remote_cache)
        _done(progress, built[k.id])
    if not misses:
        return built
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(misses)), mp_context=ctx, initializer=_die_with_parent, initargs=(os.getpid(),))
    try:
        futures = {pool.submit(_worker, options, _portable(k), out_dir): k for k in misses}
        for future in as_completed(futures):
            k = futures[future]
            built[k.id] = future.result()
            _done(progress, built[k.id])
    except BaseException as e:
        # Interrupted or failed: stop the compiles now rather than wait for them, each
        # worker with its whole process group (the C++ compilers it started).
        pool.shutdown(wait=False, cancel_futures=True)
        for child in multiprocessing.active_children():
            _kill_group(child)
            child.join(timeout=5)  # dead, so that the locks it held are free
        if cache is not None:  # the killed workers' half-written entries
            cache.abandon([k.key for k in misses if k.id not in built])
        if isinstance(e, BrokenProcessPool):
            raise AotcError(
                "a compile worker ended before its graph was compiled (killed, out of memory, or failed as it started: its own error, if it printed one, is above)"
            ) from e
        raise
    pool.shutdown()
    return built


def _done(progress: Progress, a: BuiltArtifact) -> None:
    progress("done", id=a.entry_id, bucket=a.bucket, context=a.context, source=a.source, seconds=a.seconds)


def _kill_group(child) -> None:
    """SIGKILL to a worker's process group (itself and the compilers it runs), or to the
    worker alone where it has not made its group yet."""
    try:
        if os.getpgid(child.pid) == child.pid:
            os.killpg(child.pid, signal.SIGKILL)
            return
    except (ProcessLookupError, PermissionError):
        pass
    child.kill()


def _die_with_parent(parent: int) -> None:
    """Worker initializer: a build stopped in any way, SIGKILL included, takes its workers
    and their compilers with it. Each worker leads a process group of its own, which the
    g++ and cc1plus it starts join, and asks the kernel (Linux: PR_SET_PDEATHSIG) for a
    SIGTERM when the parent dies, on which it kills that group, itself included. A
    SIGKILL would end the worker alone: its compilers would run on."""
    import ctypes

    os.setpgid(0, 0)  # also: a terminal's Ctrl-C reaches the build, which stops the groups
    signal.signal(signal.SIGTERM, lambda signum, frame: os.killpg(0, signal.SIGKILL))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: workers end when the pool's pipe closes
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.killpg(0, signal.SIGKILL)


@dataclass
class Compilable:
    """What compiling one artifact takes, and what its record says of it: the post-pass
    program and its typed inputs and outputs, where it goes, and its key."""

    entry_id: str
    dims: dict[str, int]  # the bucket's named dimensions: {"batch": 4, "context": 1024}
    bucket: int
    key: str
    program: torch.export.ExportedProgram
    specs: Specs
    form: Form
    passes: list[PassRecord]
    export_s: float
    dir: str | None = None  # relative to the bundle; None: the entry's artifact_dir


def _compilable(k: KeyedGraph) -> Compilable:
    graph = k.graph
    dims = {k.variant.spec.bucket: k.bucket} | ({"context": k.variant.context} if k.variant.context else {})
    return Compilable(k.entry_id, dims, k.bucket, k.key, graph.program, Specs(graph.inputs, graph.outputs), graph_form(graph), list(graph.passes), graph.export_s)


@dataclass
class _Portable:
    """A compilable as it crosses to a worker process: the program as bytes (no modules)."""

    item: Compilable  # its program None
    program: bytes


def _portable(k: KeyedGraph) -> _Portable:
    item = _compilable(k)
    buf = io.BytesIO()
    save_program(item.program, buf, item.specs.weight_paths)  # the worker remakes the example inputs
    return _Portable(dataclasses.replace(item, program=None), buf.getvalue())


def _received(portable: _Portable) -> Compilable:
    """The compilable as a worker reads it back. A build without workers compiles this form
    too: the program as the parent traced it carries the symbols its tracing made, whose
    names (u7 against u6) reach a whole step's generated code, so the two builds' packages
    differed."""
    program = load_program(portable.program)
    # AOTInductor wants example inputs: the placeholders' fake values are what the parent had.
    program.example_inputs = (tuple(n.meta["val"] for n in program.graph.nodes if n.op == "placeholder"), {})
    return dataclasses.replace(portable.item, program=program)


def _worker(options: BuildOptions, portable: _Portable, out_dir: Path | None) -> BuiltArtifact:
    """Worker process: compile one handed-over graph (or take it from the cache, if another build just did)."""
    silence_third_party_warnings()  # a spawned process starts with the default filters
    cache = LocalCache(options.cache_dir) if options.use_cache else None
    with parallel.tracing(options.layout):  # inductor resolves the collectives' group while compiling
        return artifact(options.make_backend(), _received(portable), out_dir, cache, options.remote_cache)


def artifact(backend: Backend, item: Compilable, out_dir: Path | None, cache: LocalCache | None, remote_url: str | None) -> BuiltArtifact:
    """Get one artifact, from the cache when its key is there, else by compiling; copy it into the bundle."""
    t0 = time.perf_counter()
    key = item.key
    rel = item.dir or artifact_dir(item.entry_id, item.bucket, item.dims.get("context"))
    remote = remote_client(remote_url) if remote_url else None
    errors_before = len(remote.errors) if remote else 0
    notes: list[str] = []
    source: Served

    def uncached():
        out = out_dir / rel
        out.mkdir(parents=True)
        return compile_graph(backend, item, out), out

    if cache is None:
        (record, src), source = uncached(), "uncached"
    else:
        with cache.lock(key):
            try:
                entry, source = cache.get(key), "cache"
            except CacheError as e:  # a corrupt entry is a miss: compiled again, and said so
                notes.append(f"{e}; compiled again")
                entry = None
            if entry is None and remote is not None:
                entry, source = cache.put(key, lambda tmp: remote.fetch(key, tmp)), "remote"
            if entry is None:
                try:
                    entry, source = cache.put(key, lambda tmp: compile_graph(backend, item, tmp)), "compiled"
                except OSError as e:  # a full or read-only cache disk: build without it, as when it is found so at the start
                    if out_dir is None:
                        raise
                    notes.append(f"the compile cache cannot be written ({e.filename or cache.root}: {e.strerror or e}); this artifact was built without it")
                    (record, src), source = uncached(), "uncached"
                if entry is not None and remote is not None:
                    remote.store(key, entry.dir, entry.record)
        if entry is not None:
            record, src = entry.record, entry.dir
            if out_dir is not None:
                copy_files(src, out_dir / rel, record.files)
    size = sum((src / name).stat().st_size for name in record.files)
    fields = {f: getattr(record, f) for f in CompiledRecord.__dataclass_fields__}
    if not isinstance(record.extra, backend.extra_type):  # read back from a cache record: JSON data
        fields["extra"] = convert(record.extra or {}, backend.extra_type, f"cache entry {key}: extra", CacheError)
    art = ArtifactRecord(**fields, bucket=item.bucket, dims=item.dims, dir=rel, served=source)
    errors = remote.errors[errors_before:] if remote else []
    return BuiltArtifact(item.entry_id, item.bucket, art.context, time.perf_counter() - t0, size, art, source, errors, notes)


def copy_files(src: Path, dst: Path, files) -> None:
    dst.mkdir(parents=True)
    for name in files:
        shutil.copyfile(src / name, dst / name)


@functools.lru_cache(maxsize=None)
def remote_client(url: str):
    # One client per process and URL, so a remote found down is not asked again in this build.
    from ..cache.remote import RemoteCache

    return RemoteCache(url)


def compile_graph(backend: Backend, item: Compilable, out: Path) -> CompiledRecord:
    """Compile into the folder `out`; the artifact's record (what the cache and the manifest keep of it)."""
    t0 = time.perf_counter()
    result = backend.compile(item.program, item.specs, out)
    return CompiledRecord(
        files={f: sha256_file(out / f) for f in result.files},
        inputs=[s for s in item.specs.inputs if s.kind != "weight"],  # the weights are the entry's
        outputs=list(item.specs.outputs),
        form=item.form,
        export_s=round(item.export_s, 4),
        compile_s=round(time.perf_counter() - t0, 4),
        cache_key=item.key,
        passes=list(item.passes),
        extra=result.extra,
    )
