"""The FX pass pipeline: one ordered list, run on every traced graph."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from .base import GraphPass, PassResult
from .decode_fp8_bits import DecodeFp8Bits
from .reslice_cache_views import ResliceCacheViews
from .rewrite_skinny_linears import RewriteSkinnyLinears, RewriteSkinnyMatmuls
from .split_dtype_regions import SplitDtypeRegions
from .strip_data_dependent import StripDataDependent

PIPELINE: list[GraphPass] = [
    # Packed caches become one input per dtype region: no input is viewed as
    # another dtype after this, so the writes into it are plain views to reslice.
    SplitDtypeRegions(),
    # The passes after it, and every backend, may assume that each cache write
    # is one index_put_ on a graph input.
    ResliceCacheViews(),
]

# Targets whose compilers need every size static (no nonzero, no .item()).
STATIC_TARGETS = ("static", "xla", "neuron")

# Before the common pipeline, for static targets: the passes after it then see
# static shapes only (ResliceCacheViews refuses views of data-dependent size).
# Export and inductor keep unbacked graphs: AOTInductor compiles them.
STATIC_PASSES: list[GraphPass] = [StripDataDependent()]

# Passes that only pay off on some backends run after the common pipeline.
BACKEND_PASSES: dict[str, list[GraphPass]] = {
    # CPU code is bound by weight reads in decode; accelerators want the matmul, and
    # convert fp8 themselves.
    "inductor-cpu": [RewriteSkinnyLinears(), RewriteSkinnyMatmuls(), DecodeFp8Bits()],
}


@dataclass
class PassReport:
    name: str
    uuid: str
    changes: int


def needs_static(target: str | None) -> bool:
    """Whether graphs for this backend target must have static shapes only."""
    return target in STATIC_TARGETS


def pipeline_for(target: str | None) -> list[GraphPass]:
    """The static-shape passes (static targets), the common pipeline, then the
    passes of one backend target (e.g. "inductor-cpu")."""
    first = STATIC_PASSES if needs_static(target) else []
    return first + PIPELINE + BACKEND_PASSES.get(target or "", [])


def run_pipeline(gm: fx.GraphModule, passes: list[GraphPass] | None = None) -> list[PassReport]:
    reports = []
    for p in PIPELINE if passes is None else passes:
        result: PassResult = p(gm)
        reports.append(PassReport(p.name, p.uuid(), result.changes))
    return reports


def pipeline_identity(target: str | None = None) -> list[dict]:
    """Name and source hash of each pass, in order, for cache keys and the manifest."""
    return [{"name": p.name, "uuid": p.uuid()} for p in pipeline_for(target)]
