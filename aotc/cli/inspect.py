"""`aotc inspect`: a bundle's manifest, or one entry's artifacts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..errors import AotcError
from .common import CONTEXT, PLUGIN, _fail, app, console


@app.command(short_help="Show a bundle's manifest, or one entry's artifacts.")
def inspect(
    bundle: Path = typer.Argument(..., help="Bundle folder."),
    entry: Optional[str] = typer.Option(None, "--entry", help="Show this entry's artifacts only."),
    bucket: Optional[int] = typer.Option(None, "--bucket", help="With --entry: the artifact of this bucket only."),
    context: Optional[int] = CONTEXT,
    as_json: bool = typer.Option(False, "--json", help="Print manifest.json."),
    plugin: list[str] = PLUGIN,
):
    """Show a bundle's manifest (or, with --entry, --bucket and --context, one entry's artifacts)."""
    from ..format import as_dict, read_manifest
    from ..parallel import flag
    from ..plugins import load_plugins

    try:
        load_plugins(plugin)  # a bundle of a plugin's backend is read with that backend's record
        m = read_manifest(bundle)
        shown = m.select(entry, bucket, context)
    except AotcError as e:
        _fail(e)
    if as_json:
        print(json.dumps(as_dict(m), indent=2))
        return
    s = m.shapes
    console.print(
        f"[bold]{bundle}[/]  format {m.format_version}  {m.model.model_class} ({m.model.architecture})  "
        f"backend {m.backend.name} {m.backend.version}\n"
        f"batch buckets {s.batch}  prefill chunks {s.chunk}  first chunks {s.first}  max_seq {s.max_seq}  context buckets {s.context}  "
        f"cache slots {s.cache_slots} (last is scratch)  graphs {m.graphs_traced}\n"
        f"kv cache {m.model.kv_cache.dtype}{f' (max {m.model.kv_cache.fp8_max:g})' if m.model.kv_cache.dtype == 'fp8' else ''}  "
        + (f"{flag(m.parallel).lstrip('-').replace('-', ' ')} (collectives {m.parallel.collectives}; shapes per rank)  " if m.parallel.world_size > 1 else "")
        + f"digest {m.digest()}"
    )
    table = Table()
    for col in ("entry", "modules", "bucket", "context", "form", "inputs w/c/a", "outputs", "compile s", "cache key"):
        table.add_column(col, no_wrap=col == "entry")
    for e, art in shown:
        kinds = [i.kind for i in art.inputs]
        inputs = f"{len(e.weights)}/{kinds.count('cache')}/{kinds.count('activation')}"
        outs = " ".join("x".join(map(str, o.shape)) for o in art.outputs)
        table.add_row(
            e.id, str(len(e.instances)), str(art.bucket), "" if art.context is None else str(art.context), art.form, inputs, outs, f"{art.compile_s:.2f}", art.cache_key[:8]
        )
    console.print(table)
    for c in m.copies if entry is None else []:  # the prefix cache's copies between cache slots (neuron)
        console.print(f"{c.label}: {c.artifact.dir}, compile {c.artifact.compile_s:.2f} s, cache key {c.artifact.cache_key[:8]}", highlight=False, markup=False)
