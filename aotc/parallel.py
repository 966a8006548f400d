"""Tensor parallelism: one SPMD graph per artifact, run by every rank.

A model with a parallel plan (`CausalLM.shard_specs`) is built at a degree N
with each rank's sizes (its heads, its rows of the MLP, its part of the
vocabulary), and its entry methods call the functional collectives below
where a rank's partial result must be summed or gathered. The build traces
it once, at rank 0, under torch's fake process group; the graph names the
group by its string name and holds no rank, so the same artifact serves every
rank (rank 1's trace is the same graph: tests check their cache keys). At run
time every rank joins a real process group of that name (gloo on the CPU),
and each loads only its own part of each checkpoint tensor (`piece`: the byte
ranges safetensors' `get_slice` reads).

The collectives stay inside the graphs on export and inductor: AOTInductor on
the CPU compiles all_reduce and wait_tensor through its C shims and
all_gather_into_tensor through its proxy executor (DESIGN.md, Facts).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Iterator

import torch

from . import quiet
from .errors import AotcError
from .format import GroupRecord, ParallelRecord, ShardSpec

SINGLE = ParallelRecord(world_size=1, tensor_parallel=1, expert_parallel=1, attention="replicated", gather="collectives", groups=[], collectives="none")
# Every wait on other ranks lasts at most this long: meeting them (the rendezvous), a
# collective on a rank that died, stopped or hangs, and (the launcher's) the other ranks'
# ends after one has ended. The launcher ends the others first, within a second, when it
# sees a rank die.
TIMEOUT_ENV = "AOTC_RANK_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0


def rank_timeout() -> datetime.timedelta:
    """AOTC_RANK_TIMEOUT seconds (default 60): every wait on other ranks."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise AotcError(f"{TIMEOUT_ENV}={text!r}: expected a positive number of seconds (every wait on other ranks; default {DEFAULT_TIMEOUT_S:.0f})")
    return datetime.timedelta(seconds=seconds)


def record(degree: int, experts: int = 1, data_parallel_attention: bool = False, gather: str = "collectives") -> ParallelRecord:
    """The layout of a build at tensor-parallel degree `degree`, or expert-parallel degree
    `experts` (one of them 1; with data_parallel_attention, each rank its own sequences):
    one group of every rank, named as torch names the default group (the graphs'
    collectives carry the name). gather: the backend's way to gather and scatter rows."""
    world = degree * experts
    if world == 1:
        return SINGLE
    attention = "data-parallel" if data_parallel_attention else "replicated"
    return ParallelRecord(
        world_size=world, tensor_parallel=degree, expert_parallel=experts, attention=attention, gather=gather,
        groups=[GroupRecord("0", list(range(world)))], collectives="in-graph",
    )  # fmt: skip


def flag(layout: ParallelRecord) -> str:
    """The build options that made a layout, as a user gave them."""
    if layout.expert_parallel > 1:
        return f"--expert-parallel {layout.expert_parallel}" + (" --data-parallel-attention" if data_parallel(layout) else "")
    return f"--tensor-parallel {layout.tensor_parallel}"


def data_parallel(layout: ParallelRecord) -> bool:
    """Whether each rank runs its own sequences in its own cache slots (the engine steps the
    ranks in lockstep; runtime.engine), rather than every rank every row."""
    return layout.attention == "data-parallel"


def group_name(layout: ParallelRecord) -> str | None:
    """The group a model's collectives run on; None for one rank (no collective at all)."""
    return layout.groups[0].name if layout.world_size > 1 else None


def all_reduce(x: torch.Tensor, group: str | None) -> torch.Tensor:
    """The sum of every rank's x (a row-parallel product's partial sums)."""
    if group is None:
        return x
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group)  # waited for where it is first read (wait_tensor in a graph)


def reduce_scatter(x: torch.Tensor, group: str | None, rank: torch.Tensor | None = None) -> torch.Tensor:
    """Rank r's block of dim 0 (its 1/N of the rows) of the sum of every rank's x: the
    parts that the ranks computed for every rank's rows, summed and sent to the rows' owner.
    rank: this rank's index, [1] int64 (a value of the graph's weights, never a constant),
    where the layout gathers by all-reduce (ParallelRecord.gather): the whole sum, and
    this rank's block of it."""
    if group is None:
        return x
    from torch.distributed import _functional_collectives as funcol

    if rank is None:
        return funcol.reduce_scatter_single(x, "sum", 0, group)
    ways = torch.distributed.get_world_size()  # the group is every rank's (record())
    whole = funcol.all_reduce(x, "sum", group)
    return whole.view(ways, -1, *x.shape[1:]).index_select(0, rank)[0]


def all_gather_rows(x: torch.Tensor, group: str | None, rank: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's rows (dim 0), concatenated in rank order. rank: as reduce_scatter's,
    where the layout gathers by all-reduce: each rank's rows placed at its block of zeros,
    summed (adding zeros changes no value)."""
    if group is None:
        return x
    if rank is None:
        return all_gather(x, 0, group)
    from torch.distributed import _functional_collectives as funcol

    ways = torch.distributed.get_world_size()
    placed = x.new_zeros((ways, *x.shape)).index_copy(0, rank, x[None])
    return funcol.all_reduce(placed, "sum", group).flatten(0, 1)


def all_gather(x: torch.Tensor, dim: int, group: str | None) -> torch.Tensor:
    """Every rank's x, concatenated along `dim` in rank order (a vocabulary-split head's logits)."""
    if group is None:
        return x
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_gather_single(x, dim, group)


# -- shards --------------------------------------------------------------------


def split(dim: int, size: int, ways: int, unit: int = 1) -> ShardSpec:
    return ShardSpec("split", dim, [size], ways, unit)


FIRST = ShardSpec("first", 0, [], 1, 1)


def experts(count: int, ways: int) -> ShardSpec:
    """A layer's `count` routed experts, whole, in `ways` equal parts of their stack."""
    return ShardSpec("experts", 0, [count], ways, 1)


def fits(spec: ShardSpec) -> bool:
    """Whether each block divides into `ways` parts of whole units."""
    return spec.kind == "first" or all(b % (spec.ways * spec.unit) == 0 for b in spec.blocks)


def full_shape(spec: ShardSpec | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint tensor's shape of a rank's part of `shape` (an expert's tensor is whole)."""
    if spec is None or spec.kind != "split":
        return tuple(shape)
    return tuple(sum(spec.blocks) if d == spec.dim else n for d, n in enumerate(shape))


def rank_shape(spec: ShardSpec | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a rank's part of a checkpoint tensor of `shape` (an expert's tensor is whole)."""
    if spec is None or spec.kind != "split":
        return tuple(shape)
    return tuple(sum(b // spec.ways for b in spec.blocks) if d == spec.dim else n for d, n in enumerate(shape))


def ranges(spec: ShardSpec, rank: int, world_size: int) -> list[tuple[int, int]]:
    """The index ranges along spec.dim that rank `rank` takes, one per block."""
    part = rank * spec.ways // world_size
    out, at = [], 0
    for block in spec.blocks:
        size = block // spec.ways
        out.append((at + part * size, at + (part + 1) * size))
        at += block
    return out


def piece(read, *, spec: ShardSpec | None, rank: int, world_size: int) -> torch.Tensor:
    """A rank's part of one checkpoint tensor: read(index) reads the tensor's elements at a
    tuple of slices, read(None) all of them (safetensors' get_slice: only those bytes)."""
    if spec is None or spec.kind == "experts":  # an expert this rank holds: its tensor whole
        return read(None)
    if spec.kind == "first":
        first = read(None)
        return first if rank == 0 else torch.zeros_like(first)
    lead = (slice(None),) * spec.dim
    parts = [read((*lead, slice(start, end))) for start, end in ranges(spec, rank, world_size)]
    # A part along an inner dim is a strided view; graphs take weights with their traced strides.
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=spec.dim)


def scaled(spec: ShardSpec | None, block: int) -> ShardSpec | None:
    """The shard of a block-scale tensor (a scale per `block` elements along each dim) that
    goes with its values' `spec`; None where the values' parts split a block."""
    if spec is None or spec.kind != "split":  # whole tensors: their scales whole too
        return spec
    if any((b // spec.ways) % block for b in spec.blocks):
        return None
    return ShardSpec("split", spec.dim, [b // block for b in spec.blocks], spec.ways, 1)


def spec_of(specs: dict[str, ShardSpec], param: str) -> ShardSpec | None:
    """The shard of parameter `param` in a plan whose names hold `*` for a layer index."""
    if param in specs:
        return specs[param]
    for pattern, spec in specs.items():
        if "*" in pattern and re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), param):
            return spec
    return None


def misfit(specs: dict[str, ShardSpec], degree: int) -> str | None:
    """What does not split at `degree`, or None: each block in `ways` parts of whole units,
    the ranks a multiple of the parts."""
    for name, s in specs.items():
        if s.kind == "split" and (not fits(s) or degree % s.ways):
            what = f"{sum(s.blocks)} rows" + (f" ({sum(s.blocks) // s.unit} heads of {s.unit})" if s.unit > 1 else "")
            return f"{name} has {what} along dim {s.dim}, which do not split into {degree} equal parts"
        if s.kind == "experts" and (not fits(s) or degree % s.ways):
            return f"{name}: {sum(s.blocks)} routed experts (n_routed_experts) do not split into {degree} equal parts"
    return None


def valid_degrees(specs_at, limit: int = 64) -> list[int]:
    """The degrees up to `limit` at which every shard fits: specs_at(degree) -> {name: spec}."""
    return [d for d in range(1, limit + 1) if misfit(specs_at(d), d) is None]


# -- process groups ------------------------------------------------------------


@contextlib.contextmanager
def tracing(layout: ParallelRecord, rank: int = 0) -> Iterator[None]:
    """torch's fake process group at `rank` of the layout's world, for tracing (and
    compiling) graphs that hold collectives: no store, no peer, no communication."""
    if layout.world_size == 1:
        yield
        return
    import torch.distributed as dist

    # Importing it registers the "fake" backend; torch 2.13 has no public module that does.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise AotcError("--tensor-parallel: this process already joined a process group; build in a process of its own")
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    try:
        check_groups(layout)
        yield
    finally:
        dist.destroy_process_group()


def check_groups(layout: ParallelRecord) -> None:
    """The process group this process joined must be the one the graphs name."""
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    if name != layout.groups[0].name or dist.get_world_size() != layout.world_size:
        raise AotcError(
            f"the process group is {name!r} of {dist.get_world_size()} ranks, but the bundle's graphs run on group "
            f"{layout.groups[0].name!r} of {layout.world_size}; start the ranks with aotc run (or torchrun) and nothing else "
            "creating groups first"
        )


def joined_rank() -> tuple[int, int] | None:
    """(rank, world size) where this process is one rank of a launch (aotc run's own, or
    torchrun's: RANK and WORLD_SIZE set), else None."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise AotcError(
            f"RANK={os.environ.get('RANK')!r} WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}: a rank of a launch needs both, "
            "as integers (torchrun sets them); unset both to let aotc run start the ranks itself"
        ) from None
    if not 0 <= rank < world:
        raise AotcError(f"RANK={rank} WORLD_SIZE={world}: expected 0 <= RANK < WORLD_SIZE")
    check_launch_environment(world)
    return rank, world


def check_launch_environment(world: int) -> None:
    """What torch's rendezvous reads, checked as arguments are: MASTER_ADDR set,
    MASTER_PORT a port, LOCAL_WORLD_SIZE and LOCAL_RANK counts that fit the world."""
    env = os.environ
    fix = "torchrun sets them; unset RANK and WORLD_SIZE to let aotc run start the ranks itself"
    if not env.get("MASTER_ADDR", "").strip():
        raise AotcError(f"MASTER_ADDR is not set: every rank of a launch meets rank 0's host at MASTER_ADDR:MASTER_PORT ({fix})")
    port = env.get("MASTER_PORT", "")
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise AotcError(f"MASTER_PORT={port!r}: expected the port (1 to 65535) where rank 0 listens ({fix})")
    local = env.get("LOCAL_WORLD_SIZE")
    if local is not None and not (local.isdigit() and 1 <= int(local) <= world):
        raise AotcError(f"LOCAL_WORLD_SIZE={local!r}: expected the ranks on this host, 1 to WORLD_SIZE ({world}) ({fix})")
    local_rank = env.get("LOCAL_RANK")
    if local_rank is not None and not (local_rank.isdigit() and int(local_rank) < int(local or world)):
        raise AotcError(f"LOCAL_RANK={local_rank!r}: expected this rank's index on its host, 0 to {int(local or world) - 1} ({fix})")
    rank_timeout()


def join(layout: ParallelRecord, rank: int, device: str) -> None:
    """Join the launch's process group (MASTER_ADDR and MASTER_PORT from the environment):
    gloo on the CPU, nccl where the graphs run on CUDA (each rank on its local GPU)."""
    import torch.distributed as dist

    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        backend = "nccl"
    timeout = rank_timeout()
    try:
        with _cpp_log_held():
            dist.init_process_group(backend, rank=rank, world_size=layout.world_size, timeout=timeout)
    except (RuntimeError, OSError, ValueError) as e:  # torch's store and rendezvous errors (DistError is a RuntimeError)
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        raise AotcError(
            f"rank {rank} of {layout.world_size} could not meet the other ranks at {where} within {timeout.total_seconds():g} s "
            f"({TIMEOUT_ENV}): {first}. Start every rank of the launch, each with its own RANK, and MASTER_ADDR:MASTER_PORT "
            "where rank 0 can listen and the others reach it"
        ) from None
    check_groups(layout)


@contextlib.contextmanager
def _cpp_log_held():
    """Hold what is written to file descriptor 2 meanwhile (torch's C++ log of the store's
    retries, each with a C++ stack, which no Python setting silences once torch is
    imported): given back if the body succeeds, dropped if it raises, since the error
    then says it in one line; `aotc --verbose` gives it back either way."""
    sys.stderr.flush()
    saved = os.dup(2)
    held = tempfile.TemporaryFile()
    os.dup2(held.fileno(), 2)
    ok = False
    try:
        yield
        ok = True
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        with held:
            if ok or os.environ.get(quiet.VERBOSE_ENV) == "1":
                held.seek(0)
                with open(2, "wb", closefd=False) as err:
                    shutil.copyfileobj(held, err)


SETTLE_LIMIT = 10.0  # seconds


def settled(*tensors: torch.Tensor) -> None:
    """Return once no gloo worker thread holds any of these tensors (each held by Python
    alone), the GIL released meanwhile; call it on what a collective took or gave back.

    A gloo worker lets go of a finished collective's tensors just after it wakes the
    thread that waits for it; letting go of a tensor that Python holds takes the GIL
    (TensorImpl.decref_pyobject). An AOTInductor graph runs holding the GIL, and waits
    inside it for its own collectives: entered in that moment, it waits for a worker that
    waits for the GIL, and every rank hangs until the group's timeout. Seen on gloo with
    torch 2.13: a Python-side all-gather followed by a graph with collectives, or a graph
    that returns a collective's buffer, then the next graph."""
    deadline = None
    for t in tensors:
        while t._use_count() > 1:
            if deadline is None:
                deadline = time.monotonic() + SETTLE_LIMIT
            elif time.monotonic() > deadline:
                raise AotcError(f"a collective's tensor {tuple(t.shape)} is still held by another thread after {SETTLE_LIMIT:.0f} s")
            time.sleep(0)  # lets the worker take the GIL


def rank0_address(key: str) -> str:
    """A "host:port" that rank 0 of the joined process group can listen on, the same on
    every rank: rank 0 finds a free port and publishes it in torch's store under `key`
    (a runtime's coordinator, such as JAX's or the Neuron runtime's root)."""
    import socket

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    if dist.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        store.set(key, f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}")
    return store.get(key).decode()
