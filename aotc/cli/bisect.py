"""`aotc bisect`: a compiler failure shrunk to its smallest failing run of nodes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import AotcError
from .common import CONTEXT, PLUGIN, _fail, app, console, err_console


@app.command(short_help="Shrink a compiler failure to the smallest failing run of nodes.")
def bisect(
    path: Path = typer.Argument(..., help="Bundle folder (xla or neuron) whose artifact fails to compile."),
    entry: str = typer.Option(..., "--entry", help="Entry id, as aotc inspect lists it (e.g. LlamaDecoderLayer.decode)."),
    bucket: int = typer.Option(..., "--bucket", help="The artifact's bucket."),
    context: Optional[int] = CONTEXT,
    model: Optional[Path] = typer.Option(None, "--model", help="Model folder to trace again (default: the one the bundle was built from)."),
    compiler: Optional[str] = typer.Option(
        None,
        "--compiler",
        help="CMD run in place of neuronx-cc, with the same argv (compile hlo.pb ... --output model.neff): any HLO checker that fails with a non-zero exit works, an NCC_ code in its output naming the failure.",
    ),
    work: Optional[Path] = typer.Option(None, "--work", help="Folder for the attempts (default: a new temporary folder); kept for inspection."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
    plugin: list[str] = PLUGIN,
):
    """Shrink a compiler failure to the smallest run of graph nodes that fails the same way:
    the artifact's graph is traced again, cut into node ranges that are compiled alone
    (about 2 log2(nodes) compiler runs), and the result names each node's source line,
    with the minimal HLO and a command that reproduces it."""
    from ..bisect import bisect as run_bisect
    from ..format import artifact_label
    from ..plugins import load_plugins

    try:
        load_plugins(plugin)
        with err_console.status("bisecting") as status:
            result = run_bisect(path, entry, bucket, context, model_dir=model, compiler=compiler, work=work, progress=lambda line: status.update(line))
    except AotcError as e:
        _fail(e)
    if as_json:
        print(json.dumps(dataclasses.asdict(result)))
        return
    console.print(
        f"{artifact_label(result.entry, result.bucket, result.context)} fails with {result.code}; the smallest failing range is {len(result.nodes)} of {result.total_nodes} nodes ({result.runs} compiler runs):",
        highlight=False,
        markup=False,
    )
    for node, source in zip(result.nodes, result.sources):
        console.print(f"  {node}    {source}", highlight=False, markup=False)
    console.print(f"minimal HLO: {result.hlo}\nlog: {result.log}\nreproduce: {result.command}\nwork folder: {result.work}", highlight=False, markup=False)
