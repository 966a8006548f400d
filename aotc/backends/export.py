"""The reference backend: the post-pass ExportedProgram, run as an FX graph.

It runs the same aten ops as eager, everywhere, and is what the other
backends are checked against.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..format import ArtifactRecord
from .base import HOST, Backend, CompileResult, Program, Specs, Step, Weights, one_device, register_backend
from .export_archive import WEIGHTS_MEMBER, check_archive, program_inputs, program_weights

if TYPE_CHECKING:
    from torch.export import ExportedProgram

PROGRAM = "program.pt2"  # the ExportedProgram, saved by torch.export.save


class GraphProgram(Program):
    label = PROGRAM

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm

    def bind(self, weights: Weights, *, rank: int = 0, world_size: int = 1) -> Step:
        one_device(ExportBackend.name, rank, world_size)
        gm, tensors = self.gm, weights.tensors()  # the model's own tensors: the host runs the graph
        return Step(HOST, lambda args, call=0: list(gm(*tensors, *args)), tensors)


def save_program(program: "ExportedProgram", f, weights: list[str]) -> None:
    """torch.export.save without the example inputs: they are fake tensors (the build
    never reads weights), which do not serialize, and running needs none. `weights`:
    which tensor each weight input is (Specs.weight_paths), kept in the archive, since
    its inputs are named flat_0, flat_1..."""
    example, program.example_inputs = program.example_inputs, None
    try:
        torch.export.save(program, f, extra_files={WEIGHTS_MEMBER: json.dumps(weights)})
    finally:
        program.example_inputs = example


@register_backend
class ExportBackend(Backend):
    name = "export"
    files = (PROGRAM,)

    def version(self) -> str:
        return f"torch-{torch.__version__}"

    def compile(self, program: "ExportedProgram", specs: Specs, out_dir: Path) -> CompileResult:
        save_program(program, str(out_dir / PROGRAM), specs.weight_paths)
        return CompileResult([PROGRAM])

    def load(self, art_dir: Path, record: ArtifactRecord) -> Program:
        check_archive(art_dir / PROGRAM)  # before torch reads it: torch's loader unpickles and resolves names
        program = torch.export.load(str(art_dir / PROGRAM))
        # Every input is a user input, so the graph module takes the flat list
        # as is; this skips ExportedProgram.module()'s pytree and state handling.
        return GraphProgram(program.graph_module)

    def signature(self, art_dir: Path) -> list[tuple[list[int], str]]:
        return program_inputs(art_dir / PROGRAM)

    def weight_paths(self, art_dir: Path) -> list[str]:
        return program_weights(art_dir / PROGRAM)
