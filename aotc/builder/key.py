"""Stage 2, key: each (variant, bucket) traced and passed exactly once, and keyed.

The traced graph and its key travel together to the obtain stage; nothing
after this stage traces again, and each key is computed once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..backends import Backend
from ..cache.keys import cache_key
from ..errors import AotcError
from ..format import ArtifactRecord, EntryRecord, Form, Manifest, artifact_label
from ..passes.unbacked_ops import unbacked_in
from ..trace import TracedGraph, Variant, trace
from .options import BuildOptions
from .plan import Plan, make_plan


@dataclass
class KeyedGraph:
    variant: Variant
    bucket: int
    graph: TracedGraph
    key: str

    @property
    def entry_id(self) -> str:
        return self.variant.entry_id

    @property
    def id(self) -> tuple[str, int, int | None]:
        """(entry id, bucket, context bucket): the artifact this graph becomes."""
        return self.variant.entry_id, self.bucket, self.variant.context


def key_graphs(plan: Plan, tasks: list[tuple[Variant, int]]) -> list[KeyedGraph]:
    keyed = []
    for variant, bucket in tasks:
        graph = trace(variant, bucket, plan.shapes, plan.backend)
        keyed.append(KeyedGraph(variant, bucket, graph, cache_key(graph, plan.backend, code=plan.code)))
    return keyed


def graph_form(graph: TracedGraph) -> Form:
    """ "unbacked" when some size in the graph depends on data (nonzero, .item()), else "static"."""
    return "unbacked" if any(unbacked_in(n) for n in graph.graph_module.graph.nodes) else "static"


def retrace(manifest: Manifest, entry: EntryRecord, art: ArtifactRecord, model_dir: Path, backend: Backend) -> KeyedGraph:
    """The graph of one artifact of a bundle, traced again from the model folder with the
    options the manifest records (aotc bisect). It must have the artifact's own cache
    key: any other graph is not the one that was compiled."""
    options = BuildOptions.of_manifest(manifest, model_dir)
    plan = make_plan(options, backend)
    variant = next((v for v in plan.variants if v.entry_id == entry.id and v.context == art.context), None)
    label = artifact_label(entry.id, art.bucket, art.context)
    if variant is None:
        raise AotcError(f"{model_dir} traces no entry {entry.id} today; the model changed since the bundle was built. Pass --model with the folder it was built from")
    graph = trace(variant, art.bucket, plan.shapes, backend)
    # Keyed with the compiler version the bundle was built with: bisect may run another.
    keyed = KeyedGraph(variant, art.bucket, graph, cache_key(graph, backend, manifest.backend.version, code=plan.code))
    if keyed.key != art.cache_key:
        raise AotcError(
            f"{label} traced from {model_dir} today has cache key {keyed.key[:12]}, but the bundle's artifact has "
            f"{art.cache_key[:12]}: it is not the graph that was compiled (the model folder, aotc or torch changed since). "
            "Pass --model with the folder it was built from, or rebuild the bundle and bisect that"
        )
    return keyed
