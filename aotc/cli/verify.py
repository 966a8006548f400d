"""`aotc verify`: every artifact of a bundle against eager."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import AotcError
from .common import CONTEXT, PLUGIN, _fail, _print_algorithms, _print_lint, app, console


@app.command(short_help="Run every artifact against eager, on the model's own inputs.")
def verify(
    path: Path = typer.Argument(..., help="Bundle folder written by aotc build."),
    model: Optional[Path] = typer.Option(
        None, "--model", help="Model folder with the weights (default: the one the bundle was built from, if it is still there; else random weights of the right shapes)."
    ),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Also fail on neuron lint findings: dynamic dimensions, f64, 64-bit integers, custom calls in the HLO, and ops that neuronx-cc list-operators does not list (where it is installed).",
    ),
    entry: Optional[str] = typer.Option(None, "--entry", help="Check this entry's artifacts only (an id as aotc inspect lists it, e.g. LlamaDecoderLayer.decode)."),
    bucket: Optional[int] = typer.Option(None, "--bucket", help="With --entry: the artifact of this bucket only."),
    context: Optional[int] = CONTEXT,
    plugin: list[str] = PLUGIN,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
):
    """Run every artifact (or the one --entry, --bucket and --context choose) once against the eager entry method, on inputs the model's own
    decode and prefill make (rows one under the bucket where that still maps to it, so
    padding runs), caches filled with random values. Passes when each output and each
    cache entry eager wrote keep to the fidelity rule (where eager wrote is what its write
    ops touched, not where values changed), every other cache entry is unchanged but the
    scratch slot's, and, for xla and neuron bundles, hlo.pb (the file neuronx-cc
    compiles), compiled as it is by XLA's CPU client, agrees with model.jax
    (xla) or eager (neuron). The rule: float32 models, error within 1e-3 of eager
    (x5 on xla and neuron); lower precision (bf16 or fp8 weights, fp8 caches), error
    against the same call by a float32 twin of the weights at most max(2 x eager's own,
    1e-3); error = max |diff| / (1 + |reference|). Exit 1 on any mismatch. Lists each
    module class whose compiled form runs another algorithm than the eager method it is
    compared with."""
    from ..format import artifact_label
    from ..runtime.verify import verify as run_verify

    try:
        report = run_verify(path, model, plugin, strict, entry, bucket, context)
    except AotcError as e:
        _fail(e)
    if as_json:
        data = dataclasses.asdict(report)
        data["passed"] = report.passed
        print(json.dumps(data))
    else:
        table = Table(title=f"{escape(str(report.bundle))}  ({report.backend}, weights: {escape(str(report.weights))})")
        for col in ("entry", "bucket", "context", "rows", "max abs", "max rel", "error", "allowed", "reference", "result"):
            table.add_column(col, justify="left" if col in ("entry", "reference", "result") else "right", no_wrap=col == "entry")
        for a in report.artifacts:
            ref = "" if a.reference_vs is None else f"{a.reference} vs {a.reference_vs} {a.reference_max_abs:.2g}"
            table.add_row(
                a.entry,
                str(a.bucket),
                "" if a.context is None else str(a.context),
                str(a.rows),
                f"{a.max_abs:.2g}",
                f"{a.max_rel:.2g}",
                f"{a.error:.2g}",
                f"{a.allowed:.2g}",
                ref,
                "[green]ok[/]" if a.passed else "[red]FAIL[/]",
            )
        console.print(table)
        for a in report.artifacts:
            for problem in a.problems:
                console.print(f"[red]{artifact_label(a.entry, a.bucket, a.context)}:[/] {escape(problem)}", highlight=False)
        lint = _print_lint(report.backend, [f for a in report.artifacts for f in a.lint], "--json")
        failed = sum(not a.passed for a in report.artifacts)
        precision = report.artifacts[0].precision if report.artifacts else "float32"
        rule = "match eager" if precision == "float32" else f"keep within 2 x eager {precision}'s error against a float32 twin (or 1e-3)"
        console.print(f"{len(report.artifacts) - failed} of {len(report.artifacts)} artifacts {rule}" + (f"; {len(lint)} lint findings" if lint else ""))
        _print_algorithms([dataclasses.asdict(a) for a in report.algorithms], "verify compares")
    if not report.passed:
        raise typer.Exit(1)
