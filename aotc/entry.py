"""Marking the methods of a model's own classes as compiled entries.

    class DecoderLayer(nn.Module):
        @aotc.entry(bucket="batch", caches=("k_cache", "v_cache"), pad={"slots": -1})
        def decode(self, x, cos, sin, positions, slots, k_cache, v_cache): ...

An entry method takes tensors and returns a tensor or a tuple of tensors.
Every argument that is not named in `caches` is an activation whose dim 0 is
the bucketed dimension: the runtime pads it up to the bucket (with `pad[name]`,
default 0) and slices the outputs back. Caches are passed through untouched
and written in place by the graph.

`context="positions"` names the activation that holds each row's position in
its sequence: such an entry is built per context bucket C (`--context-buckets`),
each graph taking the first C positions of every cache (a view of the same
allocation), and the runtime picks the smallest C above the largest position.
The method reads cache lengths from its caches' shapes, so it is unchanged. The instance's parameters and buffers
become graph inputs, so one graph serves every instance of the class.

`fresh="prefill_fresh"` on a split entry names another entry of the class, with the
same arguments and `bucket="first"`, that runs a call's first chunk in its place when
that chunk's first row is at position 0: a packed prefill chunk (models/packing.py)
whose every sequence starts in it, which then needs none of the cache's earlier
positions. It is built per first-chunk bucket (`--first-chunk`: the chunk buckets and
finer ones, as a new prompt pads to them) on the whole cache, with no context buckets.

The class also provides `example_inputs(method, bucket, shapes)` returning the
arguments (in signature order) that the tracer exports with.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

from .errors import TraceError

BUCKET_KINDS = ("batch", "chunk", "first")


@dataclass(frozen=True)
class EntrySpec:
    method: str
    # "batch": rows are sequences; "chunk": rows are tokens of one sequence or more, packed;
    # "first": a call's first chunk from position 0 (a fresh form's rows)
    bucket: str
    caches: tuple[str, ...] = ()
    pad: dict = field(default_factory=dict)
    # The rows may run as consecutive calls, in order (the runtime picks the calls that
    # pad least). True for prefill (a long prompt runs chunk by chunk), False for decode.
    split: bool = False
    params: tuple[str, ...] = ()  # argument names, in order
    context: str | None = None  # the positions argument, for an entry built per context bucket
    fresh: str | None = None  # the entry that runs a first chunk starting at position 0 (module docstring)

    def __hash__(self):
        return hash((self.method, self.bucket, self.caches))


def entry(*, bucket: str, caches: tuple[str, ...] = (), pad: dict | None = None, split: bool = False, context: str | None = None, fresh: str | None = None) -> Callable:
    """Mark a method as a compiled entry; see the module docstring."""
    if bucket not in BUCKET_KINDS:
        raise TraceError(f"@entry(bucket={bucket!r}): expected one of {', '.join(BUCKET_KINDS)}")

    def mark(fn):
        params = tuple(inspect.signature(fn).parameters)[1:]
        for name in (*caches, *(pad or {}), *([context] if context else [])):
            if name not in params:
                raise TraceError(f"@entry on {fn.__qualname__}: {name!r} is not an argument; its arguments are {', '.join(params)}")
        if context in caches:
            raise TraceError(f"@entry on {fn.__qualname__}: context={context!r} must name the positions argument, not a cache")
        kinds = {p.kind for p in list(inspect.signature(fn).parameters.values())[1:]}
        if kinds - {inspect.Parameter.POSITIONAL_OR_KEYWORD}:
            raise TraceError(f"@entry on {fn.__qualname__}: use plain positional arguments only (no *args, **kwargs)")
        if fresh is not None and not (split and context and bucket == "chunk"):
            raise TraceError(f"@entry on {fn.__qualname__}: fresh={fresh!r} is for a split entry with context buckets (a prefill), which this is not")
        fn.__aotc_entry__ = EntrySpec(fn.__name__, bucket, tuple(caches), dict(pad or {}), split, params, context, fresh)
        return fn

    return mark


# How the tracer groups layers by an attribute that is no plain value: {type: value -> a
# plain value}. Instances whose attributes freeze equal share a graph, so a freezer must
# map values that give different graphs to different results (a config to its JSON's hash).
FREEZERS: dict[type, Callable] = {}


def freezer(cls: type, freeze: Callable) -> None:
    """Group layers by freeze(value) for attributes that are instances of cls."""
    FREEZERS[cls] = freeze


def entries_of(cls: type) -> dict[str, EntrySpec]:
    """The entry methods of a class, its bases included."""
    found = {}
    for klass in reversed(cls.__mro__):
        for name, fn in vars(klass).items():
            spec = getattr(fn, "__aotc_entry__", None)
            if spec is not None:
                found[name] = spec
    for spec in (s for s in found.values() if s.fresh):
        other = found.get(spec.fresh)
        if other is None or (other.bucket, other.params, other.caches, other.split, other.context) != ("first", spec.params, spec.caches, False, None):
            raise TraceError(
                f'{cls.__qualname__}.{spec.method}: fresh={spec.fresh!r} must name an entry of the class with bucket="first" and the same arguments and '
                f"caches, neither split nor built per context bucket ({', '.join(sorted(found))} are its entries)"
            )
    named = {s.fresh for s in found.values()}
    for name in (n for n, s in found.items() if s.bucket == "first" and n not in named):
        # Only a chunk entry's fresh= runs it: built alone, it would never be called.
        raise TraceError(f'{cls.__qualname__}.{name}: bucket="first" is for the fresh form of a prefill entry, but no entry of the class names it in fresh=')
    return found


def whole_steps(model) -> dict[str, set[tuple[type, str]]]:
    """The model's whole steps, each with the entries it replaces
    (CausalLM.whole_step_replaces); none for a module that is not a CausalLM."""
    replaces = getattr(model, "whole_step_replaces", None)
    return replaces() if replaces is not None else {}
