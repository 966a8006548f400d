"""The per-instance dispatcher that stands in for an entry method.

It picks the smallest bucket that fits the rows, pads the activations (dim 0)
up to it with each input's pad value (padding rows' cache writes go to the
scratch slot), calls the compiled artifact with this instance's weights, and
slices the outputs back. An entry built per context bucket runs the graph of
the smallest context, of those its bucket was built at, that holds the largest
position, on views of its caches' first positions. An entry that allows it
(prefill chunks) runs its rows as consecutive calls: whole largest buckets,
then the rest at the least cost (rows computed plus a call's fixed cost,
_covers); for any other, rows beyond the largest bucket are an error; each
call runs at the context its rows need.

A packed cache (aotc.kvcache) that the graph takes as one input per region
arrives as `Regions`, one allocation per region; each goes to its input.

The dispatcher calls bound steps (`Program.bind`), which take the method's
arguments only: the weights are already where the graphs run. On a resident
device (runtime.resident) activations are put there once per step (shared
ones once for every layer), caches are the device's allocations, and outputs
stay there as `Resident` tensors until torch reads them.

The dispatchers of one bound model share a `StepMemo`, so that a step's host
work does not grow with the layer count: an input every layer takes (RoPE
tables, positions, slots) is padded once, the context bucket of a positions
tensor is found once per bucket, and a padded call's output feeds the next call
as the bucket-sized tensor it is (its padding rows are padding rows' results, which
never reach real rows: rows are independent sequences, or tokens that come
before them). Where the engine made a step's positions from Python ints it says
their largest (known_top), and the context bucket is found from that, not by
reading the tensor.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from ..backends.base import HOST, Device, DeviceBuffer, Step
from ..errors import BundleError
from ..format import EntryRecord
from ..kvcache import Regions
from .resident import Resident


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BundleError(f"manifest.json: input dtype {name!r} is not a torch dtype; rebuild the bundle")
    return dtype


class StepMemo:
    """What dispatchers make once and share, by the tensor it was made from (the same
    object, unchanged in place since). It holds a reference to each such tensor, so that
    its id is not reused while remembered, and past LIMIT entries forgets the one used
    least recently (a step's entries are the newest: clearing all at once would drop
    them mid-step)."""

    LIMIT = 32

    def __init__(self):
        self.made: dict[tuple[int, object], tuple[torch.Tensor, int, object]] = {}
        self.outputs: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # the last padded call's
        self.reach = 0  # positions every call's context bucket holds at least (context_floor)
        # A positions tensor, its version then, and its largest value, as the engine that
        # made it from Python ints knows it (known_top): its context bucket is found without
        # reading the tensor, while the tensor is unchanged.
        self.top: tuple[torch.Tensor, int, int] | None = None

    def get(self, t: torch.Tensor, what):
        key = (id(t), what)
        hit = self.made.get(key)
        if hit is None or hit[0] is not t or hit[1] != t._version:
            return None
        self.made[key] = self.made.pop(key)  # the newest again: used this step
        return hit[2]

    def put(self, t: torch.Tensor, what, value):
        if len(self.made) >= self.LIMIT:
            del self.made[next(iter(self.made))]  # dicts keep insertion order: the oldest
        self.made[(id(t), what)] = (t, t._version, value)
        return value

    def sliced(self, outs: list[torch.Tensor], n: int) -> list[torch.Tensor]:
        """The first n rows of a padded call's outputs, remembering the whole of each."""
        views = [o[:n] for o in outs]
        self.outputs = {id(v): (v, v._version, o) for v, o in zip(views, outs)}
        return views

    def whole(self, t: torch.Tensor, bucket: int) -> torch.Tensor | None:
        """The bucket-sized output that `t` is the first rows of, if the last call made it."""
        hit = self.outputs.get(id(t))
        if hit is not None and hit[0] is t and hit[1] == t._version and hit[2].shape[0] == bucket:
            return hit[2]
        return None


class Dispatcher:
    """One instance's entry method, run compiled. `steps`: the entry's programs bound to
    this instance's weights, by (context bucket, bucket) as its artifacts' dims say
    (context None for an entry without), all on `device`. `memo`: shared by the
    dispatchers of one model."""

    def __init__(self, entry: EntryRecord, steps: dict[tuple[int | None, int], Step], device: Device = HOST, memo: StepMemo | None = None):
        self.memo = memo or StepMemo()
        self.entry_id = entry.id
        self.split = entry.split
        self.device = device
        self.resident = device.resident
        inputs = entry.artifacts[0].inputs
        # Outputs' trailing dims and dtypes: a resident output's shape is known without reading it.
        self.outputs = [(tuple(o.shape[1:]), _dtype(o.dtype)) for o in entry.artifacts[0].outputs]
        # The method's arguments, in order; a packed cache's regions are consecutive inputs.
        self.names = list(dict.fromkeys(a.region.of if a.region else a.name for a in inputs))
        position = {name: i for i, name in enumerate(self.names)}
        self.arg_of = [position[a.region.of if a.region else a.name] for a in inputs]
        self.span = [(a.region.start, a.region.end) if a.region else None for a in inputs]
        self.is_cache = [a.kind == "cache" for a in inputs]
        self.arg_is_cache = [False] * len(self.names)
        for i, cache in zip(self.arg_of, self.is_cache):
            self.arg_is_cache[i] = cache
        self.pads = [a.pad for a in inputs]
        self.dtypes = [_dtype(a.dtype) for a in inputs]
        self.single = len(entry.artifacts[0].outputs) == 1
        self.first_act = self.arg_is_cache.index(False)
        if entry.context_arg is not None and entry.context_arg not in position:
            raise BundleError(f"manifest.json: entry {entry.id}: context_arg {entry.context_arg!r} is not one of its arguments; rebuild the bundle")
        self.context_at = position.get(entry.context_arg)
        # By context bucket (None: the entry has none): the steps by bucket, and each
        # cache input's (shape, stride) in those graphs: the first positions of the cache
        # (or all of it, where the graph slices it: a backend without views).
        self.steps, self.layouts = {}, {}
        for art in entry.artifacts:
            self.steps.setdefault(art.context, {})[art.bucket] = steps[art.context, art.bucket]
            self.layouts[art.context] = [(torch.Size(a.shape), tuple(a.stride)) if a.kind == "cache" else None for a in art.inputs]
        self.buckets = sorted({a.bucket for a in entry.artifacts})
        # contexts[bucket]: the contexts the entry was built at for that bucket, in increasing order
        # (a chunk bucket also at the chunk contexts at least as long as itself: format.bucket_contexts).
        self.contexts = {b: sorted((a.context for a in entry.artifacts if a.bucket == b), key=lambda c: c or 0) for b in self.buckets}
        # bucket_for[n]: the smallest bucket holding n rows
        self.bucket_for = [None] + [min(b for b in self.buckets if b >= n) for n in range(1, self.buckets[-1] + 1)]
        # A split entry's rows past the last whole largest bucket, r of them: the row counts of
        # the calls that run them at the least cost (_covers).
        self.cover = _covers(tuple(self.buckets)) if self.split else {}
        # Per graph input: (argument index, region span, is a cache, dtype, pad value)
        self.plan = list(zip(self.arg_of, self.span, self.is_cache, self.dtypes, self.pads))
        # The same instance's dispatcher of the entry's fresh form (EntrySpec.fresh), if it has one: Bundle.bind links it.
        self.fresh: Dispatcher | None = None

    def __call__(self, *args):
        if len(args) != len(self.names):
            raise TypeError(f"{self.entry_id} takes {len(self.names)} arguments ({', '.join(self.names)}), got {len(args)}")
        n = args[self.first_act].shape[0]
        largest = self.buckets[-1]
        if not self.split:
            if n > largest:
                raise BundleError(f"{self.entry_id}: {n} rows but the largest bucket is {largest}; run at most {largest} rows per call, or rebuild with a larger bucket")
            return self._run(args, n)
        # A first chunk from position 0 (every sequence starts in it) runs the entry's fresh
        # form, which reads no earlier cache positions, at its own (finer) buckets; the
        # chunks after it continue it.
        fresh = self.fresh is not None and self._starts_fresh(args)
        first = self.fresh if fresh else self
        rows = self.pieces(n, fresh)
        if len(rows) == 1:
            return first._run(args, n)
        pieces, start = [], 0
        for i, m in enumerate(rows):
            part = [a if cache else self._rows(a, i, rows, start, m) for a, cache in zip(args, self.arg_is_cache)]
            # Each call at the context bucket of its own rows: a long prompt's first chunks read fewer positions.
            pieces.append((first if i == 0 else self)._run(part, m, i))
            start += m
        join = Resident.joined if self.resident else torch.cat
        if self.single:
            return join(pieces)
        return tuple(join(list(outs)) for outs in zip(*pieces))

    def _rows(self, a, i: int, rows: list[int], start: int, m: int):
        """Rows start:start+m of an argument, the i-th of calls of `rows` rows: on a resident
        device, the i-th piece of the previous layer's output as it is, where it was cut alike."""
        if isinstance(a, Resident) and a.unchanged() and [r for _, r, _ in a.parts] == rows:
            return a.piece(i)
        # The same view for every layer, so that what is made from it (padded, put) is made once.
        found = self.memo.get(a, ("rows", start, m))
        return found if found is not None else self.memo.put(a, ("rows", start, m), a[start : start + m])

    def pieces(self, n: int, fresh: bool = False) -> list[int]:
        """The rows of each consecutive call for n rows of a split entry: whole largest
        buckets, then the rest at the least cost (_covers: a prompt's tail of 203 tokens
        with chunks 128 and 512 as two calls of 128, not one of 512; 40 tokens with chunks
        16 and 64 as one call of 64, not three of 16). `fresh`: the first call runs the
        fresh form at its buckets, so n rows that fit one of those run as that one call
        where it costs least (38 rows in a first chunk of 40, not 48)."""
        largest = self.buckets[-1]
        whole, rest = divmod(n, largest)
        rows = [largest] * whole + (self.cover[rest] if rest else [])
        if not fresh or whole or len(rows) == 1:
            return rows
        first = self.fresh.bucket_for
        if first[n] + CALL_ROWS <= first[rows[0]] + sum(self.bucket_for[m] for m in rows[1:]) + CALL_ROWS * len(rows):
            return [n]
        return rows

    def _starts_fresh(self, args) -> bool:
        """Whether the rows' first position is 0, found once per positions tensor. Not where
        ranks in lockstep must run one graph (context_floor): another rank's chunk may continue."""
        if self.memo.reach:
            return False
        positions = args[self.context_at]
        found = self.memo.get(positions, "fresh")
        return found if found is not None else self.memo.put(positions, "fresh", int(positions[0]) == 0)

    def _context(self, args, bucket: int) -> int | None:
        """The smallest context the bucket's graphs have that holds every row's position."""
        if self.context_at is None:
            return None
        positions, reach = args[self.context_at], self.memo.reach
        top = self.memo.top
        if top is not None and top[0] is positions and top[1] == positions._version:
            # The caller's word, not a reduction and a read of the tensor each step. A word
            # too small runs a context that misses rows' positions: the graph's index checks
            # refuse the write (test_runtime::test_a_wrong_known_top_is_refused_by_the_graph).
            need = max(top[2] + 1, reach)
            for c in self.contexts[bucket]:
                if c >= need:
                    return c
        found = self.memo.get(positions, ("context", reach, bucket))
        if found is not None and bucket in self.steps.get(found, ()):  # another entry's choice: its own contexts
            return found
        need = max(int(positions.max()) + 1, reach)
        for c in self.contexts[bucket]:
            if c >= need:
                return self.memo.put(positions, ("context", reach, bucket), c)
        raise BundleError(f"{self.entry_id}: position {need - 1} is beyond the cache (max_seq {self.contexts[bucket][-1]}); rebuild with a larger --max-seq")

    def _run(self, args, n: int, call: int = 0):
        bucket = self.bucket_for[n]
        context = self._context(args, bucket)
        layout = self.layouts[context]
        flat = []  # the step takes the list over
        for i, (arg, span, cache, dtype, pad) in enumerate(self.plan):
            a = args[arg] if span is None else self._region(args[arg], arg, span)
            if a.dtype != dtype:
                raise BundleError(f"{self.entry_id}: argument {self.names[arg]!r} is {a.dtype}, the graph takes {dtype}")
            if cache:
                a = self._positions_of(a, arg, *layout[i])
            elif self.resident:
                a = self._on_device(a, bucket, pad, (i, call))
            else:
                if isinstance(a, Resident):  # another device's output: through the host
                    a = a.host()
                if n != bucket:
                    a = self._padded(a, bucket, pad)
                elif not a.is_contiguous():
                    a = a.contiguous()
            flat.append(a)
        outs = self.steps[context][bucket].run(flat, call) if call else self.steps[context][bucket].run(flat)
        if self.resident:
            outs = [Resident(self.device, [(o, n, bucket)], (n, *trailing), dtype) for o, (trailing, dtype) in zip(outs, self.outputs)]
        elif n != bucket:
            outs = self.memo.sliced(outs, n)
        return outs[0] if self.single else tuple(outs)

    def _on_device(self, a, bucket: int, pad, key):
        """An activation as the device's value at this bucket: a resident output of the same
        device as it is (its padding rows are padding's own results where the pad value is
        the default 0, as in StepMemo.whole), else the host tensor padded and put, once per
        tensor that several calls take."""
        if isinstance(a, Resident):
            if a.on is self.device and a.unchanged() and len(a.parts) == 1:
                array, rows, whole = a.parts[0]
                if whole == bucket and (rows == bucket or pad == 0):
                    return array
            a = a.host()
        if a.shape[0] != bucket:
            a = self._padded(a, bucket, pad)
        elif not a.is_contiguous():
            a = a.contiguous()
        found = self.memo.get(a, "put")
        if found is not None:
            return found
        return self.memo.put(a, "put", self.device.put(a, (self.entry_id, key, bucket)))

    def _padded(self, a: torch.Tensor, bucket: int, pad) -> torch.Tensor:
        """`a` with padding rows up to the bucket: made once per tensor that several calls
        take; an output of the last call as the whole it was sliced from, where the pad
        value is the default 0 (the rows are padding's own, no value is owed them)."""
        whole = self.memo.whole(a, bucket) if pad == 0 else None
        if whole is not None:
            return whole
        found = self.memo.get(a, (bucket, pad))
        if found is not None:
            return found
        out = a.new_empty((bucket, *a.shape[1:]))
        out[: a.shape[0]] = a
        out[a.shape[0] :] = pad
        return self.memo.put(a, (bucket, pad), out)

    def _positions_of(self, cache, arg: int, shape: torch.Size, stride: tuple):
        """The view of `cache` the graph takes: its first positions (a context bucket's), or all
        of it. A context bucket's view is made once per cache and kept on it. A device's
        allocation goes as it is: its graphs take it whole."""
        if isinstance(cache, DeviceBuffer):
            if cache.shape != shape or cache.device is not self.device:
                raise BundleError(
                    f"{self.entry_id}: cache {self.names[arg]!r} is a {list(cache.shape)} allocation on another device or of "
                    f"another shape; the graph takes the whole layer cache, {list(shape)}, allocated for this bundle"
                )
            return cache
        # A memo of this cache's own views, kept on it (kvcache.layer_views says why), not state.
        views = getattr(cache, "_aotc_first", None)
        if views is not None and shape in views:
            return views[shape]
        if cache.shape == shape and cache.stride() == stride:
            return cache
        if cache.stride() != stride or len(cache.shape) != len(shape) or any(have < want for have, want in zip(cache.shape, shape)):
            # A cache with other strides than at export would run silently wrong in compiled code.
            raise BundleError(
                f"{self.entry_id}: cache {self.names[arg]!r} has shape {list(cache.shape)} strides {list(cache.stride())}, "
                f"the graph was built for shape {list(shape)} strides {list(stride)}; pass the cache allocated for this "
                "bundle (model.allocate_caches), or to a layer's entry the layer's contiguous slice of it"
            )
        view = cache.as_strided(shape, stride)
        cache._aotc_first = {**(views or {}), shape: view}  # the memo above
        return view

    def _region(self, arg, index: int, span: tuple[int, int]) -> torch.Tensor:
        region = arg.tensors.get(span) if isinstance(arg, Regions) else None
        if region is None:
            raise BundleError(
                f"{self.entry_id}: cache {self.names[index]!r} is packed, and the graph takes its bytes {span[0]}:{span[1]} "
                f"as an allocation of their own; got {type(arg).__name__}. Allocate the caches with "
                "model.allocate_caches(..., split=True), as aotc.runtime.generate does for a bound model"
            )
        return region

    def __repr__(self):
        return f"Dispatcher({self.entry_id}, buckets={self.buckets})"


# What a call costs beyond its rows, in rows: a prefill call of few rows is bound by
# reading the layer's weights once (SmolLM2-135M, 2 CPU threads, a layer: fp32 1.53 ms
# for 16 rows and 2.94 ms for 64, about 36 rows' worth a call; bf16 on AMX about 80); so
# with chunks 16 and 64, 38 rows run as one call of 64, not three of 16. A GPU's call
# costs more rows still.
CALL_ROWS = 48


@functools.cache  # one per bucket set, not per layer's dispatcher
def _covers(buckets: tuple[int, ...]) -> dict[int, list[int]]:
    """For r from 1 to the largest bucket - 1: the row counts of consecutive calls that
    run r rows at the least cost (rows computed, buckets padded, plus CALL_ROWS a call),
    then with the fewest rows computed."""
    best: dict[int, tuple[int, int, list[int]]] = {}
    for r in range(1, buckets[-1]):
        options = [(b + CALL_ROWS, b, [r]) for b in buckets if b >= r]
        options += [(b + CALL_ROWS + best[r - b][0], b + best[r - b][1], [b] + best[r - b][2]) for b in buckets if b < r]
        best[r] = min(options, key=lambda o: o[:2])
    return {r: calls for r, (_, _, calls) in best.items()}


def _dispatchers(model: torch.nn.Module) -> Iterator[Dispatcher]:
    """A bound model's dispatchers, in module order (the first within a few modules)."""
    return (d for m in model.modules() for d in vars(m).values() if isinstance(d, Dispatcher))


def step_memos(model: torch.nn.Module) -> list[StepMemo]:
    """The StepMemos of a bound model's dispatchers (none for an eager model): the one that
    Bundle.bind gives them all, found at the first (walking all 367 modules of a 30-layer
    model took 1.2 ms, once per generate call)."""
    first = next(_dispatchers(model), None)
    return [] if first is None else [first.memo]


@contextlib.contextmanager
def context_floor(memos: list[StepMemo], reach: int) -> Iterator[None]:
    """Within it, every entry of the bound model whose `memos` (step_memos) these are, that
    has context buckets, runs at one that holds `reach` positions at least, whatever its
    rows' positions: ranks in lockstep run the same graph, though each rank's own rows
    reach other positions. An eager model reads its whole caches: nothing to do."""
    for memo in memos:
        memo.reach = reach
    try:
        yield
    finally:
        for memo in memos:
            memo.reach = 0


def known_top(memos: list[StepMemo], positions: torch.Tensor, top: int) -> None:
    """Tell the entries of the bound model whose `memos` these are that `positions`' largest
    value is `top` (the engine made it from Python ints): until another call says otherwise,
    they find its context bucket from `top`, not by reading the tensor (while it is not
    changed in place)."""
    for memo in memos:
        memo.top = (positions, positions._version, top)


def largest_chunk(model: torch.nn.Module) -> int | None:
    """The most rows one call of a bound model's chunked entries (prefill) runs: the
    largest chunk bucket, the bundle's one for every chunk entry (None for an eager model,
    or one without)."""
    return next((d.buckets[-1] for d in _dispatchers(model) if d.split), None)


def is_bound(model: torch.nn.Module) -> bool:
    """Whether the model's entries run compiled (Bundle.bind)."""
    return any(isinstance(v, Dispatcher) for m in model.modules() for v in vars(m).values())
