"""The FX pass pipeline: one ordered list, run on every traced graph."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from .base import GraphPass, PassResult
from .reslice_cache_views import ResliceCacheViews

PIPELINE: list[GraphPass] = [
    # First: the passes after it, and every backend, may assume that each
    # cache write is one index_put_ on a graph input.
    ResliceCacheViews(),
]


@dataclass
class PassReport:
    name: str
    uuid: str
    changes: int


def run_pipeline(gm: fx.GraphModule, passes: list[GraphPass] | None = None) -> list[PassReport]:
    reports = []
    for p in PIPELINE if passes is None else passes:
        result: PassResult = p(gm)
        reports.append(PassReport(p.name, p.uuid(), result.changes))
    return reports


def pipeline_identity() -> list[dict]:
    """Name and source hash of each pass, in order, for cache keys and the manifest."""
    return [{"name": p.name, "uuid": p.uuid()} for p in PIPELINE]
