"""Stage 4, assemble: the built artifacts and the plan -> the bundle's Manifest."""

from __future__ import annotations

import dataclasses
import platform

import torch

from .. import __version__
from ..format import FORMAT_VERSION, BackendRecord, CacheRegion, CacheSpec, EntryRecord, GenerationRecord, Manifest, ModelRecord, ShapesRecord
from ..layout import graph_weights
from ..models.generation import generation_defaults
from ..passes import pipeline_identity
from ..trace import Variant, dtype_name
from .obtain import BuiltArtifact
from .plan import Plan


def model_record(options, loaded) -> ModelRecord:
    g = generation_defaults(options.model_dir, loaded.config_dict)
    generation = GenerationRecord(list(g.eos_token_ids), g.eos_from, g.max_new_tokens, g.max_new_tokens_from)
    return ModelRecord(loaded.arch.name, type(loaded.model).__name__, str(options.model_dir.resolve()), loaded.config_dict, generation, options.hub, loaded.config.kv_cache)


def assemble_manifest(plan: Plan, built: dict[tuple[str, int, int | None], BuiltArtifact]) -> Manifest:
    options, backend, loaded, shapes = plan.options, plan.backend, plan.loaded, plan.shapes
    entries = [_entry(vs[0], [built[v.entry_id, b, v.context].record for v in vs for b in plan.buckets(v)], backend.fp8_reading()) for vs in plan.entries()]
    return Manifest(
        format_version=FORMAT_VERSION,
        aotc_version=__version__,
        created_with={"torch": str(torch.__version__), "python": platform.python_version()},
        plugins=list(options.plugins),
        model=model_record(options, loaded),
        backend=BackendRecord(backend.name, backend.version(), backend.flags()),
        shapes=ShapesRecord(
            list(options.batch_buckets),
            list(options.chunk_buckets),
            shapes.max_seq,
            shapes.slots,
            list(options.context_buckets),
            list(plan.chunk_contexts),
            list(options.first_chunk_buckets),
        ),
        parallel=options.layout,
        caches=cache_records(loaded.model, shapes.slots, shapes.max_seq),
        passes=pipeline_identity(backend),
        graphs_traced=len(plan.tasks),
        entries=entries,
        copies=[],  # builder.copies adds them
    )


def cache_records(model, slots: int, max_seq: int) -> dict[str, CacheSpec]:
    layouts = model.cache_layouts()
    out = {}
    for kind, (shape, dtype) in model.cache_specs(slots, max_seq).items():
        layout = layouts.get(kind)
        regions = [CacheRegion(r.name, dtype_name(r.dtype), *layout.spans[r.name]) for r in layout.regions] if layout else []
        out[kind] = CacheSpec(list(shape), dtype_name(dtype), regions)
    return out


def _entry(variant: Variant, records, fp8_reading: str) -> EntryRecord:
    return EntryRecord(
        id=variant.entry_id,
        cls=variant.cls.__qualname__,
        method=variant.spec.method,
        bucket_kind=variant.spec.bucket,
        split=variant.spec.split,
        context_arg=variant.spec.context,
        variant=variant.attributes,
        instances=[path for path, _ in variant.instances],
        weights=[dataclasses.replace(w, shard=variant.shards.get(w.key)) for w in graph_weights(variant.module, fp8_reading)],
        artifacts=records,
    )
