"""Stage 3b, copies: the compiled copies between cache slots of a backend whose device
copies only through a program of its own (Backend.slot_copies: neuron, whose runtime
has no device-to-device copy). The prefix cache (runtime.prefix) copies a prefix one
slot holds into another slot; on such a device each layer's allocation (or each region
of a packed one) is copied by one of these.

One graph per kind of allocation, (shape, dtype, positions dim), whatever the layer
count: traced with torch.export, keyed as the entries' graphs are, served from the
compile cache or compiled by the backend (left pending with the entries on a neuron
cross-build), and recorded in the manifest (format.CopyRecord).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..backends import Backend, Progress, Specs
from ..cache import LocalCache
from ..cache.keys import cache_key
from ..format import CacheSpec, CopyRecord, TensorSpec, copy_dir
from ..trace import dtype_name
from .assemble import cache_records
from .obtain import Compilable, artifact
from .plan import Plan


class SlotCopy(nn.Module):
    """Positions 0..n-1 along `dim` of slot src written into slot dst, in place. n is data,
    so every shape stays static: slot dst's row is rewritten whole, each position from src
    where it is below n, else its own."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, n: torch.Tensor) -> None:
        shape = [1] * cache.dim()
        shape[self.dim] = cache.shape[self.dim]
        keep = (torch.arange(cache.shape[self.dim], device=cache.device) < n).view(shape)
        cache.index_copy_(0, dst, torch.where(keep, cache.index_select(0, src), cache.index_select(0, dst)))


def allocations(caches: dict[str, CacheSpec], positions: dict[str, tuple[int, int]] | None) -> list[tuple[tuple[int, ...], str, int]]:
    """Each distinct kind of cache allocation the runtime makes (runtime.bundle.DeviceAllocator:
    a layer's slice of a kind, or of each region of a packed kind) with its positions dim,
    for the kinds the prefix cache copies (`positions`: CausalLM.cache_positions; None: none)."""
    out = []
    for kind, spec in caches.items():
        if kind not in (positions or {}):
            continue
        dim = positions[kind][0] - 1  # the root allocation's dim 0 is the layer
        parts = [((*spec.shape[1:-1], (r.end - r.start) // getattr(torch, r.dtype).itemsize), r.dtype) for r in spec.regions] or [(tuple(spec.shape[1:]), spec.dtype)]
        for shape, dtype in parts:
            if (shape, dtype, dim) not in out:
                out.append((shape, dtype, dim))
    return out


@dataclass
class _Graph:
    """What cache_key reads of a traced graph."""

    graph_module: torch.fx.GraphModule
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


def copy_graph(shape: tuple[int, ...], dtype: str, dim: int, backend: Backend, i: int) -> Compilable:
    """The copy of one allocation kind, traced and keyed, to compile into copies/<i>."""
    t0 = time.perf_counter()
    with FakeTensorMode():  # nothing of the cache's size is allocated
        index = torch.zeros(1, dtype=torch.int64)
        args = (torch.empty(shape, dtype=getattr(torch, dtype)), index, index.clone(), index.clone())
        program = torch.export.export(SlotCopy(dim), args)
    inputs = [TensorSpec(name, kind, list(a.shape), dtype_name(a.dtype), list(a.stride()), None, 0, None) for (name, kind), a in zip(
        [("cache", "cache"), ("src", "activation"), ("dst", "activation"), ("n", "activation")], args)]  # fmt: skip
    specs = Specs(inputs, [])
    key = cache_key(_Graph(program.graph_module, inputs, []), backend)
    return Compilable(f"copy{i}", {}, shape[0], key, program, specs, "static", [], time.perf_counter() - t0, dir=copy_dir(i))


def copy_graphs(plan: Plan) -> list[tuple[CopyRecord, Compilable]]:
    """The copies the plan's bundle needs (none unless its backend copies by programs): each
    record (its artifact to come) with its traced graph."""
    if not plan.backend.slot_copies:
        return []
    model = plan.loaded.model
    found = allocations(cache_records(model, plan.shapes.slots, plan.shapes.max_seq), model.cache_positions())
    return [(CopyRecord(list(shape), dtype, dim, None), copy_graph(shape, dtype, dim, plan.backend, i)) for i, (shape, dtype, dim) in enumerate(found)]


def obtain_copies(
    backend: Backend, graphs: list[tuple[CopyRecord, Compilable]], out_dir: Path | None, cache: LocalCache | None, remote_url: str | None, progress: Progress
) -> list[CopyRecord]:
    """Each copy from the cache, the remote or a compile (obtain.artifact), into out_dir when given."""
    records = []
    for record, item in graphs:
        progress("entry", id=record.label, total=1)
        built = artifact(backend, item, out_dir, cache, remote_url)
        progress("done", id=record.label, bucket=item.bucket, context=None, source=built.source, seconds=built.seconds)
        records.append(dataclasses.replace(record, artifact=built.record))
    return records
