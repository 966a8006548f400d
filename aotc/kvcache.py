"""fp8 KV caches: rows that pack several dtypes, and their separate allocations.

A cache row of an fp8 cache holds, side by side in bytes, the fp8 values, one
fp32 scale per group of values and, where a model keeps some dims in higher
precision (DeepSeek V4's RoPE dims), those in bf16. Eager code keeps one
packed uint8 buffer per cache kind and reads and writes each region through a
view of its columns (`RowLayout.views`), as DeepSeek's kernels do. Compiled
graphs take each region as an input of its own (aotc.passes.
split_dtype_regions), and the runtime allocates the regions apart
(`Regions`), so no two graph inputs share a storage.

`--kv-cache-dtype fp8` asks for such caches (`KvCacheRecord` in the
manifest); `fp8-values` (llama family) packs the values so and keeps the keys
a plain bf16 cache, since fp8 keys lose a real model's answers (docs/low-precision.md).
Values are quantized to at most the target's fp8 maximum: 448 for
float8_e4m3fn, 224 on trn2, which reads the bytes as IEEE e4m3 (aotc.fp8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from .format import KvCacheRecord
from .fp8 import E4M3FN_MAX, quantize_fp8

# trn2 reads float8_e4m3fn bytes as IEEE e4m3 (largest finite 240): activations and
# caches quantize to 224 there, leaving rounding room (../shared/DESIGN.md).
E4M3_CACHE_MAX = 224.0
# How quantize_groups scales a group: by its largest magnitude / the fp8 maximum. The
# manifest records it (KvCacheRecord.scales): a bundle's graphs quantize as it says.
SCALES = "amax"


def kv_cache_record(dtype: str, fp8_reading: str) -> KvCacheRecord:
    """What a build asks for: the cache dtype, the fp8 maximum of the target, and the
    scales quantize_groups computes."""
    return KvCacheRecord(dtype, E4M3_CACHE_MAX if fp8_reading == "e4m3" else E4M3FN_MAX, SCALES)


@dataclass(frozen=True)
class Region:
    name: str
    dtype: torch.dtype
    count: int  # values per row


@dataclass(frozen=True)
class RowLayout:
    """Regions packed into one byte row, each aligned to its dtype's size."""

    regions: tuple[Region, ...]

    @cached_property
    def spans(self) -> dict[str, tuple[int, int]]:
        """Byte range of each region in the row."""
        out, at = {}, 0
        for r in self.regions:
            at = -(-at // r.dtype.itemsize) * r.dtype.itemsize
            out[r.name] = (at, at + r.count * r.dtype.itemsize)
            at += r.count * r.dtype.itemsize
        return out

    @property
    def width(self) -> int:
        """Bytes per row: rounded up so that every region's view of the buffer is aligned."""
        align = max(r.dtype.itemsize for r in self.regions)
        return -(-max(end for _, end in self.spans.values()) // align) * align

    def views(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each region of a packed uint8 buffer [..., width], as a view [..., count] of its dtype."""
        return {r.name: packed[..., slice(*self.spans[r.name])].view(r.dtype) for r in self.regions}

    def allocate(self, shape: tuple[int, ...], device: torch.device | str = "cpu") -> "Regions":
        """Separate zeroed allocations of the regions of a packed buffer of `shape` (last dim: width)."""
        return Regions({self.spans[r.name]: torch.zeros((*shape[:-1], r.count), dtype=r.dtype, device=device) for r in self.regions})

    def unpack(self, packed: torch.Tensor) -> "Regions":
        """Copies of a packed buffer's regions, as separate allocations."""
        return Regions.unpack(packed, {self.spans[r.name]: r.dtype for r in self.regions})


def layer_views(cache) -> list:
    """cache[i] for each layer i (a tensor's slices, or Regions), made once per cache and
    kept on it: a decode step hands every layer its slice, and indexing anew would make
    two tensors per layer and step.

    The list is a memo of the cache's own views, not state (without it every result is
    the same, only slower), and it is kept on the cache because it must live exactly as
    long as the cache: a WeakKeyDictionary by cache would keep each cache alive through
    its views, which hold their base."""
    views = getattr(cache, "_aotc_layers", None)
    if views is None:
        # A tensor, a device's allocations (runtime.resident.DeviceCaches), or Regions of either.
        layers = next(iter(cache.tensors.values())).shape[0] if isinstance(cache, Regions) else cache.shape[0]
        views = cache._aotc_layers = [cache[i] for i in range(layers)]
    return views


def copy_positions(cache, dim: int, src: int, dst: int, n: int) -> None:
    """Positions 0..n-1 of slot src into slot dst (dim 1 is the slot, `dim` the positions),
    in every region of a packed kind, by the device that holds the cache (torch's copy on
    a host or CUDA tensor; a resident device's own, per layer): nothing crosses to the host."""
    for part in cache.tensors.values() if isinstance(cache, Regions) else [cache]:
        if isinstance(part, torch.Tensor):
            part.select(1, dst).narrow(dim - 1, 0, n).copy_(part.select(1, src).narrow(dim - 1, 0, n))
            continue
        for layer in part.layers:  # runtime.resident.DeviceCaches: a DeviceBuffer per layer
            layer.value = layer.device.copy_positions(layer, dim - 1, src, dst, n)


class Regions:
    """A packed cache held as one allocation per region, by the region's byte range in
    the packed row (how a graph's inputs name them: format.RegionSpec). Indexing
    indexes every region alike, so `caches["k"][layer]` gives the layer's regions, as
    it gives the layer's slice of a packed buffer."""

    def __init__(self, tensors: dict[tuple[int, int], torch.Tensor]):
        self.tensors = tensors

    def __getitem__(self, index) -> "Regions":
        return Regions({span: t[index] for span, t in self.tensors.items()})

    @classmethod
    def unpack(cls, packed: torch.Tensor, spans: dict[tuple[int, int], torch.dtype]) -> "Regions":
        """Copies of a packed buffer's regions, as separate allocations."""
        return cls({(s, e): packed[..., s:e].view(dtype).clone() for (s, e), dtype in spans.items()})

    def pack_into(self, packed: torch.Tensor) -> None:
        """Write the regions back into a packed buffer."""
        for (s, e), t in self.tensors.items():
            packed[..., s:e].view(t.dtype).copy_(t)


@dataclass(frozen=True)
class Fp8Rows:
    """Rows of `quantized + plain` values: the first `quantized` stored as fp8 with one
    fp32 scale per `group` of them, the last `plain` in bf16 (none: plain=0)."""

    quantized: int
    group: int
    plain: int
    fp8_max: float

    @property
    def layout(self) -> RowLayout:
        regions = [Region("values", torch.float8_e4m3fn, self.quantized), Region("scale", torch.float32, math.ceil(self.quantized / self.group))]
        if self.plain:
            regions.append(Region("plain", torch.bfloat16, self.plain))
        return RowLayout(tuple(regions))

    def write(self, packed: torch.Tensor, index: tuple, x: torch.Tensor) -> None:
        """packed[index] = x, x [..., quantized + plain]: one indexed write per region."""
        views = self.layout.views(packed)
        values, scale = quantize_groups(x[..., : self.quantized], self.group, self.fp8_max)
        views["values"][index] = values
        views["scale"][index] = scale
        if self.plain:
            views["plain"][index] = x[..., self.quantized :].to(torch.bfloat16)

    def read(self, packed: torch.Tensor, index: tuple, dtype: torch.dtype) -> torch.Tensor:
        """packed[index] dequantized: [..., quantized + plain] in `dtype`."""
        views = self.layout.views(packed)
        x = dequantize_groups(views["values"][index], views["scale"][index], self.group, dtype)
        if self.plain:
            x = torch.cat([x, views["plain"][index].to(dtype)], dim=-1)
        return x


def row_spec(rows: Fp8Rows | None, lead: tuple[int, ...], dim: int, dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a cache of `lead` rows of `dim` values: in `dtype` (rows None),
    or packed rows of bytes."""
    return ((*lead, dim), dtype) if rows is None else ((*lead, rows.layout.width), torch.uint8)


def store(rows: Fp8Rows | None, cache: torch.Tensor, index: tuple, x: torch.Tensor) -> None:
    """cache[index] = x, for a full-precision cache (rows None) or a packed fp8 one."""
    if rows is not None:
        rows.write(cache, index, x)
    else:
        cache[index] = x if x.dtype == cache.dtype else x.to(cache.dtype)


def load(rows: Fp8Rows | None, cache: torch.Tensor, index: tuple, dtype: torch.dtype) -> torch.Tensor:
    """cache[index] in `dtype` (a packed fp8 cache dequantized)."""
    if rows is not None:
        return rows.read(cache, index, dtype)
    return cache[index] if cache.dtype == dtype else cache[index].to(dtype)  # bf16 keys beside fp8 values


def quantize_groups(x: torch.Tensor, group: int, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (float8_e4m3fn [..., n], float32 scales [..., ceil(n / group)]): each group
    of `group` values scaled by its largest magnitude / fp8_max, so that value is stored
    exactly (as fp8_max) and the rest within fp8's 3 mantissa bits of it.

    Exact scales, not powers of two: a key's largest value is often an outlier channel
    that dominates its dot products, and a power-of-two scale put it anywhere in the top
    binade, up to 6% off. On SmolLM2-135M-Instruct (800 tokens, teacher-forced) top-1
    agreement with float32 caches went from 90.3% to 94.0% (docs/low-precision.md, "fp8 KV caches").
    The division then need not be exact, so a backend that divides otherwise may round
    a value to the other fp8 neighbour; the fidelity rule (runtime.check) judges the
    result, as it must anyway: a 1e-6 difference from another GEMM row count moves a
    value across a rounding midpoint too."""
    n = x.shape[-1]
    groups = math.ceil(n / group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - n)).unflatten(-1, (groups, group))
    scale = padded.abs().amax(dim=-1).clamp(min=2.0**-100) / fp8_max
    values = quantize_fp8(padded / scale[..., None], fp8_max).flatten(-2)[..., :n]
    return values, scale


def dequantize_groups(values: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_groups, in `dtype`."""
    n = values.shape[-1]
    factors = scale[..., None].expand(*scale.shape, group).flatten(-2)[..., :n]
    return (values.float() * factors).to(dtype)
