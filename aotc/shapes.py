"""The static sizes a build traces its entries at, which their example inputs are made with."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import TraceError


@dataclass(frozen=True)
class Shapes:
    """Build-wide static sizes that example inputs are made with."""

    slots: int  # cache slots: the largest batch bucket, plus one scratch slot
    max_seq: int
    device: str = "cpu"
    # The cache positions a context-bucketed entry's graph reads (EntrySpec.context):
    # example_inputs gives it views of the first `context` positions of max_seq caches.
    context: int | None = None
    # The model's cache allocations at (slots, max_seq), layer-major: its cache_specs(),
    # where a model states its cache shapes once; example_inputs takes them from here.
    caches: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, model: nn.Module, slots: int, max_seq: int, device: str = "cpu") -> "Shapes":
        specs = model.cache_specs(slots, max_seq) if hasattr(model, "cache_specs") else {}
        return cls(slots, max_seq, device, caches=specs)

    @property
    def positions(self) -> int:
        """How many cache positions the example caches expose."""
        return self.context or self.max_seq

    def cache(self, kind: str, position_dim: int, *, layers: bool = False) -> torch.Tensor:
        """Zeros of one layer's `kind` cache (its cache_specs() allocation without the
        layer dim; with `layers`, the whole allocation, every layer's), narrowed to the
        first positions the graph reads: `position_dim` holds max_seq positions or a fixed
        fraction of them (compressed entries)."""
        if kind not in self.caches:
            raise TraceError(f"example_inputs asks for a {kind!r} cache; the model's cache_specs() has {', '.join(sorted(self.caches)) or 'none'}")
        shape, dtype = self.caches[kind]
        whole = torch.zeros(shape if layers else shape[1:], dtype=dtype)
        return whole.narrow(position_dim, 0, whole.shape[position_dim] * self.positions // self.max_seq)
