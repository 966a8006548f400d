"""Stage 1, plan: model folder -> variants x buckets.

Loads the model with fake weights (the checkpoint is checked from its
headers, no value is read), finds each entry's variants, and lists the
(variant, bucket) tasks that the later stages trace, key and compile.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from .. import parallel
from ..backends import Backend
from ..errors import AotcError
from ..format.records import bucket_contexts
from ..layout import graph_weights
from ..models.loader import LoadedModel, load_model, parse_config, weight_shard
from ..plugins import load_plugins
from ..shapes import Shapes
from ..trace import Variant, find_variants
from .options import DEFAULT_MAX_SEQ, BuildOptions


@dataclass
class Plan:
    options: BuildOptions
    backend: Backend
    loaded: LoadedModel
    shapes: Shapes
    variants: list[Variant]
    tasks: list[tuple[Variant, int]]  # every (variant, bucket) of the build, in manifest order
    chunk_contexts: tuple[int, ...] = ()  # contexts only chunk entries are built at (_chunk_contexts)

    @functools.cached_property  # once per build: on the generic path it hashes the modeling source
    def code(self) -> dict:
        """What makes the model's graphs beyond aotc's own source (transformers' version and
        modeling source, on the generic path): part of every graph's cache key."""
        return self.loaded.arch.model_class.code_identity(self.loaded.config_dict)

    def buckets(self, v: Variant) -> list[int]:
        return variant_buckets(v, self.options, self.chunk_contexts)

    def entries(self) -> list[list[Variant]]:
        """The variants of each entry, in manifest order: one, or one per context bucket."""
        grouped: dict[str, list[Variant]] = {}
        for v in self.variants:
            grouped.setdefault(v.entry_id, []).append(v)
        return list(grouped.values())


def resolve(options: BuildOptions) -> tuple[dict, type, Backend]:
    """Fill in what depends on the config; (config dict, model class, backend). Cheap: no torch model."""
    load_plugins(options.plugins)
    config_dict, arch, config = parse_config(options.model_dir, modeling=options.modeling, layout=options.layout)
    positions = getattr(config, "max_position_embeddings", None)
    if options.max_seq is None:
        options.max_seq = min(positions or DEFAULT_MAX_SEQ, DEFAULT_MAX_SEQ)
    elif positions is not None and options.max_seq > positions:
        raise AotcError(
            f"--max-seq {options.max_seq}: {options.model_dir / 'config.json'}'s max_position_embeddings is {positions}, where the "
            f"model's positions end (its rotary tables and trained range), as an eager run's do; give at most {positions}"
        )
    options.resolve_chunks()
    options.resolve_contexts()
    return config_dict, arch.model_class, options.make_backend()


def make_plan(options: BuildOptions, backend: Backend | None = None) -> Plan:
    if backend is None:
        _, _, backend = resolve(options)
    loaded = load_model(options.model_dir, weights=False, kv_cache=options.kv_cache(backend), modeling=options.modeling, layout=options.layout)
    shapes = Shapes.of(loaded.model, max(options.batch_buckets) + 1, options.max_seq, options.device)
    variants = find_variants(loaded.model, shapes, loops=backend.loops)
    if not variants:
        raise AotcError(f"{options.model_dir}: the model marks no entry methods (@aotc.entry); nothing to build")
    _first_chunks(options, variants)
    chunk_contexts = _chunk_contexts(options, loaded.model)
    variants = per_context([with_shards(v, loaded.model) for v in variants], _contexts(options, loaded.model), chunk_contexts)
    tasks = [(v, b) for v in variants for b in variant_buckets(v, options, chunk_contexts)]
    return Plan(options, backend, loaded, shapes, variants, tasks, chunk_contexts)


def _first_chunks(options: BuildOptions, variants: list[Variant]) -> None:
    """A model without a fresh form (an entry bucketed by "first") builds no first chunks: its
    first-chunk buckets are its chunk buckets, and --first-chunk given for it is an error."""
    if any(v.spec.bucket == "first" for v in variants) or options.first_chunk_buckets == options.chunk_buckets:
        return
    if options.first_chunk_given is not None:
        raise AotcError(
            f"--first-chunk {','.join(map(str, options.first_chunk_given))}: {options.model_dir}'s model has no fresh form of its prefill "
            '(an entry with bucket="first"), so nothing would run these; leave --first-chunk out'
        )
    options.first_chunk_buckets = options.chunk_buckets


def variant_buckets(v: Variant, options: BuildOptions, chunk_contexts: tuple[int, ...]) -> list[int]:
    """The buckets a variant is built at: every bucket of its kind, where its context is
    one of those the bucket has (format.bucket_contexts: a chunk context, only the
    chunk buckets it is at least as long as)."""
    kind = v.spec.bucket
    return [b for b in options.buckets(kind) if v.context is None or v.context in bucket_contexts(kind, b, chunk_contexts, options.context_buckets)]


def with_shards(variant: Variant, model) -> Variant:
    """The variant with its layout and how each rank takes each of its weights (keyed by
    WeightSpec.key; a stored weight's scales with its values' shard in blocks)."""
    layout = model.config.parallel
    if layout.world_size == 1:
        return variant
    path = variant.instances[0][0]
    shards = {}
    for w in graph_weights(variant.module):
        names = w.sources or [w.path]
        specs = [weight_shard(model, f"{path}.{n}" if path else n, w.stored) for n in names]
        if w.transform is not None and any(specs):
            # A stack of whole experts is split by experts (its own spec); no other derived weight splits.
            if not all(s is not None and s.kind == "experts" for s in specs):
                raise AotcError(
                    f"{parallel.flag(layout)}: {variant.entry_id}'s weight {w.path} is derived ({w.transform}) from tensors the plan splits; aotc splits plain weights only"
                )
            specs = [weight_shard(model, f"{path}.{w.path}" if path else w.path, w.stored)]
        if specs[0] is not None:
            shards[w.key] = specs[0]
    return dataclasses.replace(variant, layout=layout, shards=shards)


def shard_of(tasks: list[tuple[Variant, int]], shard: tuple[int, int]) -> list[tuple[Variant, int]]:
    """The i-th of n shares of the tasks: a stable split that every shard computes alike."""
    i, n = shard
    return sorted(tasks, key=lambda t: (t[0].entry_id, t[1], t[0].context or 0))[i - 1 :: n]


def _contexts(options: BuildOptions, model) -> tuple[int, ...]:
    """The context buckets, each a cache length the model can take (some need multiples of a block)."""
    for c in options.context_buckets:
        if c != options.max_seq and model.round_max_seq(c) != c:  # max_seq has its own check
            raise AotcError(
                f"--context-buckets: {c} is not a cache length {type(model).__name__} can take; the nearest above is "
                f"{model.round_max_seq(c)}. Give multiples of {model.round_max_seq(1)}"
            )
    return options.context_buckets


def _chunk_contexts(options: BuildOptions, model) -> tuple[int, ...]:
    """The contexts only chunk entries are built at, each a cache length the model takes:
    the chunk buckets below every context bucket, and the doublings of each context bucket
    below the next (256 -> 512 below 1024). A chunk graph reads all of its context's
    positions, masked or not, and a chunk of many rows pays for each: SmolLM2 bf16, a
    500-token prompt in chunks of 128, 550 ms with contexts 256 and 1024, 303 ms with 512
    too (bench/chunk_buckets.py). Decode's few rows read few keys: it has none of these.
    Each chunk bucket is built at those at least as long as itself (bucket_contexts)."""
    contexts = options.context_buckets
    below = [c for c in options.chunk_buckets if c < contexts[0]]
    between = [a * 2**k for a, b in zip(contexts, contexts[1:]) for k in range(1, 32) if a * 2**k < b]
    return tuple(c for c in (*below, *between) if model.round_max_seq(c) == c)


def per_context(variants: list[Variant], contexts: tuple[int, ...], chunk_contexts: tuple[int, ...] = ()) -> list[Variant]:
    """A variant whose entry reads positions (EntrySpec.context) once per context bucket:
    the same entry, traced at each (its artifacts' dims["context"]); an entry bucketed by
    chunk also at the chunk contexts (_chunk_contexts; each bucket at those it fits, as
    the plan's tasks say), decode not (its rows read few keys)."""
    out = []
    for v in variants:
        if v.spec.context is None:
            out.append(v)
            continue
        extra = chunk_contexts if v.spec.bucket == "chunk" else ()
        out += [dataclasses.replace(v, context=c) for c in (*extra, *contexts)]
    return out
