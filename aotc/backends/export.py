"""The reference backend: the post-pass ExportedProgram, run as an FX graph.

It runs the same aten ops as eager, everywhere, and is what the other
backends are checked against.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..format import PROGRAM, ArtifactRecord
from .base import Backend, CompileResult, Runner, register_backend
from .export_archive import check_archive, program_inputs

if TYPE_CHECKING:
    from ..trace import TracedGraph



@register_backend
class ExportBackend(Backend):
    name = "export"

    def version(self) -> str:
        return f"torch-{torch.__version__}"

    def compile(self, graph: "TracedGraph", out_dir: Path) -> CompileResult:
        program = graph.program
        # Example inputs are fake tensors (the build never reads weights);
        # they are not needed to run the program, so they are not saved.
        program.example_inputs = None
        torch.export.save(program, str(out_dir / PROGRAM))
        return CompileResult([PROGRAM])

    def load(self, art_dir: Path, record: ArtifactRecord) -> Runner:
        check_archive(art_dir / PROGRAM)  # before torch reads it: torch's loader unpickles and resolves names
        program = torch.export.load(str(art_dir / PROGRAM))
        # Every input is a user input, so the graph module takes the flat list
        # as is; this skips ExportedProgram.module()'s pytree and state handling.
        gm = program.graph_module

        def run(args: list[torch.Tensor]) -> list[torch.Tensor]:
            return list(gm(*args))

        return run

    def signature(self, art_dir: Path) -> list[tuple[list[int], str]]:
        return program_inputs(art_dir / PROGRAM)
