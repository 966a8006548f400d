"""Stage 2, key: each (variant, bucket) traced and passed exactly once, and keyed.

The traced graph and its key travel together to the obtain stage; nothing
after this stage traces again, and each key is computed once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.keys import cache_key
from ..format import Form
from ..passes.strip_data_dependent import unbacked_in
from ..trace import TracedGraph, Variant, trace
from .plan import Plan


@dataclass
class KeyedGraph:
    variant: Variant
    bucket: int
    graph: TracedGraph
    key: str

    @property
    def entry_id(self) -> str:
        return self.variant.entry_id


def key_graphs(plan: Plan, tasks: list[tuple[Variant, int]]) -> list[KeyedGraph]:
    keyed = []
    for variant, bucket in tasks:
        graph = trace(variant, bucket, plan.shapes, plan.backend)
        keyed.append(KeyedGraph(variant, bucket, graph, cache_key(graph, plan.backend)))
    return keyed


def graph_form(graph: TracedGraph) -> Form:
    """"unbacked" when some size in the graph depends on data (nonzero, .item()), else "static"."""
    return "unbacked" if any(unbacked_in(n) for n in graph.graph_module.graph.nodes) else "static"
