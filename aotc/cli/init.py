"""`aotc init`: model folders to start from."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import AotcError
from .common import PLUGIN, _disk_error, _fail, app, console

init_app = typer.Typer(help="Create model folders.", no_args_is_help=True)
app.add_typer(init_app, name="init")


MAX_TINY_LAYERS = 256  # more than any released model has; a test model with more only fills the disk


@init_app.command("tiny")
def init_tiny(
    out: Path = typer.Argument(..., help="Folder to write: new or empty (with --force, replaced)."),
    arch: str = typer.Option("llama", "--arch", help="llama | qwen2 | mistral | deepseek_v4 (or an architecture a --plugin registers)."),
    layers: int = typer.Option(4, "--layers", min=1, max=MAX_TINY_LAYERS, help=f"Number of decoder layers (at most {MAX_TINY_LAYERS})."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    set_field: list[str] = typer.Option([], "--set", help="KEY=VALUE: override a config.json field (VALUE is JSON where it parses), e.g. --set sliding_window=16; repeatable."),
    force: bool = typer.Option(False, "--force", help="Replace OUT even if it holds files."),
    quantize: str = typer.Option(
        "none",
        "--quantize",
        help="none | fp8 (the decoder layers' linear weights as float8_e4m3fn, a scale per 128x128 block) | fp4-experts (also routed experts as packed fp4, an E8M0 scale per 32: DeepSeek V4) | int8 (the decoder layers' linear weights as int8, a float32 scale per 32 inputs).",
    ),
    checkpoint_layout: str = typer.Option("hf", "--checkpoint-layout", help="hf (Hugging Face names, float32 weight_scale_inv) | deepseek (DeepSeek's names, E8M0 .scale)."),
    plugin: list[str] = PLUGIN,
):
    """Write a small random model in the Hugging Face layout (the defaults make the embedded default model)."""
    from ..builder import parse_flags
    from ..models.tiny import write_tiny
    from ..plugins import load_plugins

    try:
        load_plugins(plugin)
        path = write_tiny(out, arch=arch, layers=layers, seed=seed, force=force, quantize=quantize, layout=checkpoint_layout, **parse_flags(set_field, "--set"))
    except AotcError as e:
        _fail(e)
    except OSError as e:  # a full or read-only disk: write_tiny writes a temporary folder, renamed when whole
        _fail(_disk_error(e))
    console.print(f"wrote {arch} model with {layers} layers{'' if quantize == 'none' else f', {quantize} weights'} to {path}", markup=False)
