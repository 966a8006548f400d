"""`aotc build`: a model's entries traced and compiled into a bundle."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import AotcError
from .common import (
    BACKEND,
    BUCKETS,
    CACHE_DIR,
    COMPILER_FLAG,
    CONTEXT_BUCKETS,
    DATA_PARALLEL_ATTENTION,
    DEVICE,
    EXPERT_PARALLEL,
    FIRST_CHUNK,
    KV_CACHE_DTYPE,
    MAX_SEQ,
    MODELING,
    PLUGIN,
    PREFILL_CHUNK,
    TENSOR_PARALLEL,
    _build_options,
    _disk_error,
    _fail,
    _print_lint,
    _size,
    _stop_on_sigterm,
    app,
    console,
    err_console,
)


@app.command(short_help="Trace and compile a model's entries, once per bucket, into a bundle.")
def build(
    model_dir: Optional[str] = typer.Argument(
        None, help="Hugging Face model folder (config.json, *.safetensors), or a Hub id ORG/NAME (resolved through the Hugging Face cache; downloaded unless HF_HUB_OFFLINE=1)."
    ),
    buckets: str = BUCKETS,
    prefill_chunk: Optional[str] = PREFILL_CHUNK,
    first_chunk: Optional[str] = FIRST_CHUNK,
    max_seq: Optional[int] = MAX_SEQ,
    context_buckets: Optional[str] = CONTEXT_BUCKETS,
    backend: Optional[str] = BACKEND,
    device: str = DEVICE,
    compiler_flag: list[str] = COMPILER_FLAG,
    plugin: list[str] = PLUGIN,
    kv_cache_dtype: str = KV_CACHE_DTYPE,
    modeling: str = MODELING,
    tensor_parallel: int = TENSOR_PARALLEL,
    expert_parallel: int = EXPERT_PARALLEL,
    data_parallel_attention: bool = DATA_PARALLEL_ATTENTION,
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="Parallel compile processes, at most the machine's CPUs (default: from cores and free memory)."),
    out: Optional[Path] = typer.Option(
        None, "-o", "--out", help="Bundle folder (default: artifacts/<model folder name>): new, empty, or an aotc bundle to replace; never the model folder."
    ),
    cache_dir: Optional[Path] = CACHE_DIR,
    no_cache: bool = typer.Option(False, "--no-cache", help="Compile everything; neither read nor fill the compile cache."),
    require_cache: bool = typer.Option(False, "--require-cache", help="Fail, naming them, if any artifact is not cached (deploy jobs)."),
    remote_cache: Optional[str] = typer.Option(None, "--remote-cache", help="s3://bucket/prefix: read-through, write-back remote cache."),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: compile only this shard's artifacts into the cache; no bundle."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="BUNDLE: compile the pending artifacts of a neuron cross-build (needs neuronx-cc)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of MODEL_DIR given as ORG/NAME."),
    force: bool = typer.Option(False, "--force", help="Without -o: replace the bundle at the default artifacts/<model name> even when it is of another model or backend."),
):
    """Trace and compile every entry of a model once per bucket into a bundle."""
    from ..backends import get_backend_class
    from ..builder import build as run_build
    from ..builder import parse_shard

    _stop_on_sigterm()

    if resume is not None:
        return _resume(resume, jobs)
    if model_dir is None:
        _fail(AotcError("aotc build needs MODEL_DIR (or --resume BUNDLE)"))
    options = None
    try:
        from ..models.hub import resolve_model

        model_path, hub = resolve_model(model_dir, revision)  # a Hub id may download: interruptible
        options = _build_options(
            model_path,
            buckets,
            prefill_chunk,
            max_seq,
            backend,
            device,
            compiler_flag,
            plugin,
            context_buckets,
            first_chunk,
            out=out,
            jobs=jobs,
            cache_dir=cache_dir,
            use_cache=not no_cache,
            require_cache=require_cache,
            remote_cache=remote_cache,
            shard=parse_shard(shard) if shard else None,
            hub=hub,
            kv_cache_dtype=kv_cache_dtype,
            modeling=modeling,
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
            data_parallel_attention=data_parallel_attention,
            force=force,
        )
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        # Off a terminal rich's live bars render only at exit: a CI log (stdout to a file or a
        # pipe) gets a plain line per artifact as it finishes instead, and the bars are drawn
        # only where stderr is a terminal.
        with Progress(*columns, console=err_console, transient=False, disable=not err_console.is_terminal) as progress:
            tasks = {}

            def report(event, **info):
                if event == "entry":
                    tasks[info["id"]] = progress.add_task(info["id"], total=info["total"])
                    return
                progress.advance(tasks[info["id"]])
                if not console.is_terminal:
                    context = "" if info["context"] is None else f" context {info['context']}"
                    console.print(f"{info['id']} bucket {info['bucket']}{context}: {info['source']}, {info['seconds']:.2f} s", highlight=False, markup=False)
                    console.file.flush()

            result = run_build(options, progress=report)
    except AotcError as e:
        _fail(e)
    except OSError as e:  # a full or read-only disk under -o: the bundle writer removed its temporary folder
        _fail(_disk_error(e))
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM: the bundle writer has removed its temporary folder
        where = "nothing was written" if options is None else f"{options.out or 'the cache'} is as it was before this build"
        err_console.print(f"interrupted: {escape(where)}", highlight=False)
        raise typer.Exit(130) from None
    where = result.out if result.out else f"cache {result.cache_dir} (shard {shard})"
    table = Table(title=f"{escape(str(where))}  ({options.backend}, {result.jobs} job{'s' if result.jobs > 1 else ''})")
    for col in ("entry", "bucket", "context", "from", "seconds", "size"):
        table.add_column(col, justify="left" if col in ("entry", "from") else "right")
    for a in result.artifacts:
        table.add_row(a.entry_id, str(a.bucket), "" if a.context is None else str(a.context), a.source, f"{a.seconds:.2f}", _size(a.size))
    console.print(table)
    entries = {v.entry_id: v for v in result.variants}  # an entry traced per context bucket is one entry
    for v in entries.values():
        if v.attributes:  # one class's instances split into variants: say which and why
            attrs = ", ".join(f"{k}={val!r}" for k, val in v.attributes.items())
            paths = [p for p, _ in v.instances]
            console.print(f"variant {v.entry_id} ({escape(attrs)}): {len(paths)} modules, {', '.join(paths[:4])}{' ...' if len(paths) > 4 else ''}", highlight=False)
    if result.per_layer is not None:
        console.print(f"decode: a graph per layer, not one graph for the whole step ({escape(result.per_layer)})", highlight=False)
    if result.graphs_traced:
        layers = len({(path, v.spec.method) for v in result.variants for path, _ in v.instances})  # context buckets: one instance
        console.print(
            f"traced {result.graphs_traced} graphs for {len(entries)} entries serving {layers} module instances in {result.seconds:.1f} s -> {where}",
            markup=False,
        )
    else:
        console.print(f"assembled {len(result.artifacts)} cached artifacts without tracing in {result.seconds:.1f} s -> {where}", markup=False)
    if result.manifest is not None:
        # A bundle is code: pin this to run exactly what was built (aotc run --expect-digest).
        console.print(f"bundle digest {result.manifest.digest()}", highlight=False)
    if result.cache_dir:
        line = f"cache: {result.count('cache')} hits, {result.count('compiled')} misses compiled"
        if remote_cache:
            line += f", {result.count('remote')} from {remote_cache}"
        console.print(line + f" ({result.cache_dir})", markup=False)
    pending = result.manifest.pending() if result.manifest is not None else [(None, a.record) for a in result.artifacts if a.record.pending]
    if pending:
        console.print(
            f"[yellow]{len(pending)} artifacts are pending:[/] {pending[0][1].pending}. "
            f"Each has its HLO and command.txt; on a host with the Neuron SDK run: aotc build --resume {result.out}",
            highlight=False,
        )
    kind = get_backend_class(options.backend)
    _print_lint(options.backend, [f for a in result.artifacts for f in kind.findings(a.record.extra)], f"aotc verify {result.out} --json")
    for note in result.notes:
        console.print(f"[yellow]warning:[/] {escape(note)}", highlight=False)
    for note in result.cache_notes:
        console.print(f"[yellow]cache:[/] {escape(note)}", highlight=False)
    if result.remote_errors:
        console.print(f"[yellow]remote cache unavailable, build went on without it:[/] {escape(result.remote_errors[0])}", highlight=False)


def _resume(bundle: Path, jobs: Optional[int]) -> None:
    from ..builder import resume

    try:
        done = resume(bundle, jobs)
    except AotcError as e:
        _fail(e)
    if not done:
        console.print(f"{bundle}: nothing pending", markup=False)
        return
    console.print(f"compiled {len(done)} pending artifacts: {', '.join(done)}; {bundle} is ready to run", markup=False)
