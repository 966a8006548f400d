"""The FX pass pipeline: one ordered list, run on every traced graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import fx

from ..format import PassIdentity, PassRecord
from .base import GraphPass, PassResult
from .reslice_cache_views import ResliceCacheViews
from .split_dtype_regions import SplitDtypeRegions
from .strip_data_dependent import StripDataDependent

if TYPE_CHECKING:
    from ..backends import Backend

PIPELINE: list[GraphPass] = [
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
STATIC_PASSES: list[GraphPass] = [StripDataDependent()]

# After the common pipeline: the passes that pay off on one backend only
# (Backend.passes(); e.g. inductor on the CPU, whose decode is bound by weight reads).


def needs_static(backend: "Backend | None") -> bool:
    """Whether graphs for this backend must have static shapes only."""
    return backend is not None and backend.static_shapes


def pipeline_for(backend: "Backend | None") -> list[GraphPass]:
    """The static-shape passes (for a backend that needs them), the common pipeline,
    then the backend's own passes; without a backend, the common pipeline."""
    if backend is None:
        return list(PIPELINE)
    return (STATIC_PASSES if backend.static_shapes else []) + PIPELINE + backend.passes()


def run_pipeline(gm: fx.GraphModule, passes: list[GraphPass] | None = None) -> list[PassRecord]:
    reports = []
    for p in PIPELINE if passes is None else passes:
        result: PassResult = p(gm)
        reports.append(PassRecord(p.name, p.uuid(), result.changes))
    return reports


def pipeline_identity(backend: "Backend | None" = None) -> list[PassIdentity]:
    """Name and source hash of each pass, in order, for cache keys and the manifest."""
    return [PassIdentity(p.name, p.uuid()) for p in pipeline_for(backend)]
