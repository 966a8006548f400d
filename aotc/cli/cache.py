"""`aotc cache`: the compile cache's keys, contents and pruning."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
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
    _fail,
    _size,
    app,
    console,
)

cache_app = typer.Typer(help="The compile cache.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("key")
def cache_key_command(
    model_dir: str = typer.Argument(
        ..., help="What aotc build takes: a model folder, or a Hub id ORG/NAME (resolved through the Hugging Face cache; downloaded unless HF_HUB_OFFLINE=1)."
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
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of MODEL_DIR given as ORG/NAME."),
):
    """Print one key for a whole build, without compiling (a CI cache key): the same
    arguments as aotc build, so that a CI job's key step and build step take one."""
    from ..builder import build_key
    from ..models.hub import resolve_model

    try:
        model_path, hub = resolve_model(model_dir, revision)
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
            kv_cache_dtype=kv_cache_dtype,
            modeling=modeling,
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
            data_parallel_attention=data_parallel_attention,
            hub=hub,
            force=True,  # writes nothing
        )
        print(build_key(options))
    except AotcError as e:
        _fail(e)


@cache_app.command("ls")
def cache_ls(
    cache_dir: Optional[Path] = CACHE_DIR,
    filter_: Optional[str] = typer.Option(
        None, "--filter", help="Only the entries whose model, entry or backend contains this text (e.g. a model name, LlamaDecoderLayer.decode, inductor)."
    ),
):
    """List the cached artifacts: what each was compiled for (model, entry and bucket,
    backend, from the finished builds' recipes), its size and when it was last used."""
    import datetime

    from ..cache import RECORD, LocalCache
    from ..cache.recipes import served_by

    try:
        cache = LocalCache(cache_dir)
    except AotcError as e:
        _fail(e)
    served = served_by(cache)
    table = Table(title=escape(str(cache.root)))
    for col in ("key", "model", "entry", "backend", "files", "size", "last used"):
        table.add_column(col)
    total = 0
    for e in sorted(cache.entries(), key=lambda e: -(e.dir / RECORD).stat().st_mtime):
        uses = sorted(served.get(e.key, ())) or [("", "(no finished build)", "")]
        if filter_ is not None and not any(filter_ in part for use in uses for part in use):
            continue
        size = e.size
        total += size
        used = datetime.datetime.fromtimestamp((e.dir / RECORD).stat().st_mtime).strftime("%Y-%m-%d %H:%M")
        more = f" and {len(uses) - 1} more" if len(uses) > 1 else ""
        model, entry, backend = (escape(part) for part in uses[0])
        table.add_row(e.key[:16], model, entry + more, backend, escape(", ".join(e.record.files)), _size(size), used)
    console.print(table)
    console.print(f"{len(table.rows)} entries, {_size(total)}" + ("" if filter_ is None else f" matching {filter_!r}"), markup=False)


@cache_app.command("prune")
def cache_prune(
    max_size: str = typer.Option(
        ...,
        "--max-size",
        help="Keep at most this much, dropping least recently used first: decimal units as sizes are printed (2G = 2e9 bytes, 500M, 0), or binary ones spelled out (1.5GiB); at most 1000000T.",
    ),
    cache_dir: Optional[Path] = CACHE_DIR,
):
    """Shrink the cache to a size, and remove what dead builds left behind."""
    from ..cache import LocalCache, parse_size

    try:
        removed, freed = LocalCache(cache_dir).prune(parse_size(max_size))
    except AotcError as e:
        _fail(e)
    console.print(f"removed {removed} entries, freed {_size(freed)}")
