"""The FX pass pipeline: one ordered list, run on every traced graph."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..format import PassIdentity, PassRecord
from .base import Pass, ProgramPass, loop_bodies
from .reslice_cache_views import ResliceCacheViews
from .split_dtype_regions import SplitDtypeRegions
from .strip_data_dependent import StripDataDependent

if TYPE_CHECKING:
    from ..backends import Backend

PIPELINE: list[Pass] = [
    # Packed caches become one input per dtype region: no input is viewed as
    # another dtype after this, so the writes into it are plain views to reslice.
    SplitDtypeRegions(),
    # The passes after it, and every backend, may assume that each cache write
    # is one index_put_ on a graph input.
    ResliceCacheViews(),
]

# Before the common pipeline, for backends whose compilers need every size static
# (Backend.static_shapes: no nonzero, no .item()): the passes after it then see
# static shapes only (ResliceCacheViews refuses views of data-dependent size).
# The others keep unbacked graphs (AOTInductor compiles them).
STATIC_PASSES: list[Pass] = [StripDataDependent()]

# After the common pipeline: the passes that pay off on one backend only
# (Backend.passes(); e.g. inductor on the CPU, whose decode is bound by weight reads).


def needs_static(backend: "Backend | None") -> bool:
    """Whether graphs for this backend must have static shapes only."""
    return backend is not None and backend.static_shapes


def pipeline_for(backend: "Backend | None") -> list[Pass]:
    """The static-shape passes (for a backend that needs them), the common pipeline,
    then the backend's own passes; without a backend, the common pipeline."""
    if backend is None:
        return list(PIPELINE)
    return (STATIC_PASSES if backend.static_shapes else []) + PIPELINE + backend.passes()


@dataclass
class PipelineResult:
    program: torch.export.ExportedProgram
    reports: list[PassRecord]
    # For each input of `program`, in order: (its position among the exported program's
    # inputs, the tag of the ProgramPass that put it there, or None: the input as exported).
    inputs: list[tuple[int, object]]


def run_pipeline(program: torch.export.ExportedProgram, passes: list[Pass] | None = None) -> PipelineResult:
    """Run the passes in order (default: the common pipeline) on the program. A
    ProgramPass hands back a re-signed program; a GraphPass must leave the inputs be."""
    reports = []
    inputs: list[tuple[int, object]] = [(i, None) for i in range(len(_placeholders(program)))]
    for p in PIPELINE if passes is None else passes:
        if isinstance(p, ProgramPass):
            result = p(program)
            program, changes = result.program, result.changes
            inputs = [(at, tag) for i, (at, old) in enumerate(inputs) for tag in result.replaced.get(i, [old])]
        else:
            before = _placeholders(program)
            # A loop's body (a whole step's layers) is a graph of its own: the pass runs there too.
            changes = sum(p(gm).changes for gm in (program.graph_module, *loop_bodies(program.graph_module)))
            if _placeholders(program) != before:  # the program's signature would no longer be its graph's
                raise RuntimeError(f"pass {p.name} changed the graph's inputs; a pass that does is a ProgramPass")
            _rename_outputs(program)
        reports.append(PassRecord(p.name, p.uuid(), changes))
    return PipelineResult(program, reports, inputs)


def _rename_outputs(program: torch.export.ExportedProgram) -> None:
    """Point the signature's outputs at the nodes the output now returns: a GraphPass that
    replaced a node the graph returns (a linear that is the whole entry) renamed it."""
    out = next(n for n in reversed(program.graph_module.graph.nodes) if n.op == "output")
    for spec, node in zip(program.graph_signature.output_specs, out.args[0]):
        if isinstance(node, torch.fx.Node) and hasattr(spec.arg, "name"):
            spec.arg.name = node.name


def _placeholders(program: torch.export.ExportedProgram) -> list:
    return [n for n in program.graph_module.graph.nodes if n.op == "placeholder"]


def pipeline_identity(backend: "Backend | None" = None) -> list[PassIdentity]:
    """Name and source hash of each pass, in order, for cache keys and the manifest."""
    return [PassIdentity(p.name, p.uuid()) for p in pipeline_for(backend)]
