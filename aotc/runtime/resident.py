"""Values that stay on a backend's device between graphs (a resident Device: JAX, Neuron).

A bound model's eager code runs on the host: the embedding lookup, the layer
loop, the RoPE rows. What the graphs give back between layers must not come to
the host and go out again, and a cache must never cross at all. So:

  * caches are allocated on the device (`DeviceCaches`: one DeviceBuffer per
    layer and kind, or per region of a packed kind), and each call writes them
    there;
  * a graph's outputs come back as `Resident` tensors: torch tensors by shape
    and dtype whose values are the device's arrays. The next dispatcher hands
    those arrays to its graph as they are; anything else torch does with one
    (`x[-1:]`, `argmax`) reads it to the host first, once, as a copy.

Host devices (export, inductor) use neither: their values are torch tensors.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from ..backends.base import Device, DeviceBuffer


class Resident(torch.Tensor):
    """A tensor whose values are a device's arrays. `parts`: (array, rows, bucket) for each
    consecutive piece: the first `rows` rows of a `bucket`-row array (one piece, or the
    calls of a prompt run in chunks). Its version at creation tells whether torch has
    written it since (then the host copy is the truth)."""

    @staticmethod
    def __new__(cls, device: Device, parts: list[tuple[object, int, int]], shape: tuple[int, ...], dtype: torch.dtype):
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")
        r.on, r.parts, r.made, r._host = device, parts, r._version, None
        return r

    def host(self) -> torch.Tensor:
        """The values on the host: read from the device once (a copy)."""
        if self._host is None:
            pieces = [self.on.get(array, self.dtype)[:rows] for array, rows, _ in self.parts]
            self._host = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return self._host

    def unchanged(self) -> bool:
        return self._version == self.made

    @classmethod
    def joined(cls, pieces: list["Resident"]) -> "Resident":
        """Consecutive row pieces as one tensor, each still on the device."""
        first = pieces[0]
        return cls(first.on, [p for piece in pieces for p in piece.parts], (sum(p.shape[0] for p in pieces), *first.shape[1:]), first.dtype)

    def piece(self, i: int) -> "Resident":
        array, rows, bucket = self.parts[i]
        return Resident(self.on, [self.parts[i]], (rows, *self.shape[1:]), self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Rows of one piece of a chunked prompt (prefill's last token: x[-1:]) read that piece only.
        if func is torch.ops.aten.slice.Tensor and isinstance(args[0], Resident) and args[0]._host is None and len(args[0].parts) > 1:
            found = _within_one_piece(*args)
            if found is not None:
                return found
        args, kwargs = pytree.tree_map_only(Resident, Resident.host, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self, **_):
        return f"Resident({list(self.shape)}, {self.dtype}, {len(self.parts)} piece{'s' if len(self.parts) > 1 else ''})"


def _within_one_piece(r: Resident, dim: int = 0, start=None, end=None, step: int = 1):
    if dim != 0 or step != 1:
        return None
    n = r.shape[0]
    start = 0 if start is None else (start + n if start < 0 else min(start, n))
    end = n if end is None else (end + n if end < 0 else min(end, n))
    at = 0
    for i, (_, rows, _) in enumerate(r.parts):
        if at <= start and end <= at + rows:
            return r.piece(i).host()[start - at : end - at]
        at += rows
    return None


class DeviceCaches:
    """One cache kind's root allocation on a resident device: a DeviceBuffer per layer
    (the device has no views: each layer's slice is an allocation of its own). Indexed
    like the host's layer-major tensor: `caches[i]` is layer i's."""

    def __init__(self, device: Device, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype = torch.Size(shape), dtype
        self.layers = [DeviceBuffer(device, device.allocate(tuple(shape[1:]), dtype), shape[1:], dtype) for _ in range(shape[0])]

    def __getitem__(self, i: int) -> DeviceBuffer:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_host(self) -> torch.Tensor:
        """A host copy of every layer, stacked as the host's root allocation is."""
        return torch.stack([layer.to_host() for layer in self.layers])


def buffers(caches: dict) -> list[DeviceBuffer]:
    """Every device allocation of a bound model's caches (a packed kind's regions included)."""
    from ..kvcache import Regions

    out = []
    for cache in caches.values():
        for part in cache.tensors.values() if isinstance(cache, Regions) else [cache]:
            out += part.layers if isinstance(part, DeviceCaches) else []
    return out
