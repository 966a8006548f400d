"""`aotc quantize`: a low-precision checkpoint of a model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import AotcError
from .common import PLUGIN, _disk_error, _fail, _size, _stop_on_sigterm, app, console


@app.command(short_help="Write a low-precision (fp8, fp4, int8) checkpoint of a model folder.")
def quantize(
    model: str = typer.Argument(..., help="A bf16 or fp32 model folder, or a Hugging Face Hub id (ORG/NAME) in the local cache."),
    out: Path = typer.Option(..., "-o", "--out", help="Folder to write: new or empty, outside MODEL."),
    fmt: str = typer.Option(
        "fp8",
        "--format",
        help="fp8 (the decoder layers' linear weights as float8_e4m3fn, a float32 scale per 128x128 block) | fp4-experts (also the routed experts as packed fp4, an E8M0 scale per 32) | int8 (the decoder layers' linear weights and the LM head as int8, a float32 scale per 32 inputs: llama.cpp's Q8_0 grid, activations unrounded).",
    ),
    head: Optional[str] = typer.Option(
        None,
        "--head",
        help="keep (the LM head at the source precision; fp8's default) | fp8 | int8 (the head in the layers' format, as llama.cpp's Q8_0 does; int8's default; a head tied to the embedding is written as its own tensor, the embedding kept).",
    ),
    revision: Optional[str] = typer.Option(None, "--revision", help="With a Hub id: a branch, tag or commit."),
    plugin: list[str] = PLUGIN,
):
    """Write a low-precision checkpoint of a model folder, in the formats aotc builds from (see docs/low-precision.md)."""
    from ..models.hub import resolve_model
    from ..plugins import load_plugins
    from ..quantize_checkpoint import quantize_model

    _stop_on_sigterm()  # SIGTERM mid-write: the temporary folder is removed as for Ctrl-C
    try:
        load_plugins(plugin)
        source, _ = resolve_model(model, revision)
        done = quantize_model(source, out, fmt, head)
    except AotcError as e:
        _fail(e)
    except OSError as e:  # a full or read-only disk: the folder is written under a temporary name, renamed when whole
        _fail(_disk_error(e))
    counts = {f: sum(1 for v in done.tensors.values() if v == f) for f in ("fp8", "fp4", "int8")}
    what = " and ".join(f"{n} tensors to {f}" for f, n in counts.items() if n)
    console.print(
        f"quantized {what} ({_size(done.bytes_in)} -> {_size(done.bytes_out)} with their scales); {len(done.kept)} tensors kept as they were", highlight=False, markup=False
    )
    console.print(f"LM head: {done.head}", highlight=False, markup=False)
    console.print(f"wrote {done.out}", highlight=False, markup=False)
