"""Low-precision checkpoint weights: their stored formats, dequantize, quantize.

Three formats, as DeepSeek publishes them (fp8, fp4) and as llama.cpp's Q8_0 grids
its weights (int8):

- "fp8": float8_e4m3fn values [out, in] with one scale per 128 x 128 block,
  [ceil(out/128), ceil(in/128)]: float32, or E8M0 (a power of two, its
  exponent byte).
- "fp4": e2m1 values packed two to a byte, [out, in/2] (the first of each
  pair in the low nibble), with one E8M0 scale per 32 input values, [out, in/32].
- "int8": int8 values [out, in] with one float32 scale per 32 input values,
  [out, ceil(in/32)]: llama.cpp's Q8_0 weight grid (symmetric, scale = amax / 127),
  with a float32 scale where Q8_0 keeps an fp16 one. Weight-only: activations
  stay in the model's dtype, where Q8_0 also rounds them to int8.

Scales are the factor the values are multiplied by (DeepSeek's `.scale`, the
Hugging Face `weight_scale_inv`). E8M0 scales travel as their exponent bytes
(uint8) and packed fp4 as uint8: every backend has uint8, few have the others.

`dequantize` is the one definition of the values: eager dequantizes with it at
load (the reference), and the compiled graphs run the same ops on the stored
tensors next to their use, so both see bit-identical weights.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import ConfigError
from .fp8 import E4M3FN_MAX, quantize_fp8

FP8_BLOCK = (128, 128)
FP4_BLOCK = (1, 32)
INT8_BLOCK = (1, 32)
BLOCKS: dict[str, tuple[int, int]] = {"fp8": FP8_BLOCK, "fp4": FP4_BLOCK, "int8": INT8_BLOCK}
INT8_MAX = 127
# config.json's quantization_config of an int8 checkpoint: no transformers quantizer
# reads this layout, so the method is aotc's own.
INT8_CONFIG = {"quant_method": "aotc", "fmt": "int8", "weight_block_size": list(INT8_BLOCK)}
FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # by the magnitude nibble 0..7


def stored_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored values' shape for a weight of `shape`."""
    return (*shape[:-1], shape[-1] // 2) if fmt == "fp4" else tuple(shape)


def scale_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    br, bc = BLOCKS[fmt]
    return (*shape[:-2], -(-shape[-2] // br), -(-shape[-1] // bc))


def scale_factors(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32. E8M0 exponent bytes become 2**(e - 127) by building the float's
    bits: exact, where exp2 in a compiled kernel need not be."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.int32) << 23).view(torch.float32)
    return scale.to(torch.float32)


def _expand(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A block scale [..., R, C] repeated over its blocks and cut to [..., rows, cols]."""
    *lead, r, c = scale.shape
    br, bc = block
    full = scale[..., :, None, :, None].expand(*lead, r, br, c, bc).reshape(*lead, r * br, c * bc)
    return full[..., :rows, :cols]


def decode_e2m1(nibbles: torch.Tensor) -> torch.Tensor:
    """e2m1 nibbles (int32, 0..15) -> float32, in integer arithmetic: no table to carry
    as a graph constant, no denormal float on the way (XLA's CPU flushes those).
    Magnitude: exponent 0: m/2; else (1 + m/2) * 2**(e-1) = ((2 + m) << e) / 4."""
    e, m = (nibbles >> 1) & 3, nibbles & 1
    mag = ((m + 2 * (e > 0).to(torch.int32)) << e.clamp(min=1)).to(torch.float32) * 0.25
    return torch.where(nibbles >= 8, -mag, mag)


def unpack_fp4(values: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., n/2] -> nibbles [..., n] (int32), the low nibble first."""
    b = values.to(torch.int32)
    return torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)


def dequantize(fmt: str, values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored values and scales -> the weight in `dtype` (leading dims: stacked weights)."""
    if fmt == "fp8":
        v = values.to(torch.float32)
    elif fmt == "fp4":
        v = decode_e2m1(unpack_fp4(values))
    elif fmt == "int8":
        return _dequantize_int8(values, scale, dtype)
    else:
        raise ValueError(f"unknown stored format {fmt!r}; known: {', '.join(BLOCKS)}")
    rows, cols = v.shape[-2:]
    return (v * _expand(scale_factors(scale), rows, cols, BLOCKS[fmt])).to(dtype)


def _dequantize_int8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Each scale times its group of 32 ([..., rows, groups, 32] by [..., rows, groups, 1]),
    # the values zero-padded to whole groups: a scale expanded and cut to a last partial
    # group (_expand) is miscompiled by Inductor (torch 2.13: reads past the scales).
    # Graphs take the values as int8 (checkpoint.stored_dtype); uint8 is the same bytes.
    v = (values.view(torch.int8) if values.dtype == torch.uint8 else values).to(torch.float32)
    *lead, rows, cols = v.shape
    groups = scale.shape[-1]
    if groups * INT8_BLOCK[1] != cols:
        v = torch.nn.functional.pad(v, (0, groups * INT8_BLOCK[1] - cols))
    w = (v.view(*lead, rows, groups, INT8_BLOCK[1]) * scale_factors(scale)[..., None]).flatten(-2)
    return (w if w.shape[-1] == cols else w[..., :cols]).to(dtype)


# -- quantizing (aotc init --quantize; tests) -------------------------------------


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """[rows, cols] -> [R, br, C, bc], zero-padded to whole blocks."""
    rows, cols = x.shape
    br, bc = block
    r, c = -(-rows // br), -(-cols // bc)
    padded = torch.nn.functional.pad(x.float(), (0, c * bc - cols, 0, r * br - rows))
    return padded.view(r, br, c, bc), (r, c)


def block_scales(x: torch.Tensor, block: tuple[int, int], max_value: float, e8m0: bool) -> torch.Tensor:
    """One scale per block: amax / max_value (float32), or the next power of two up as an
    E8M0 exponent byte (uint8), so that no value quantizes beyond max_value."""
    blocks, _ = _blocks(x, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=2.0**-100)
    if not e8m0:
        return amax / max_value
    return (torch.ceil(torch.log2(amax / max_value)) + 127).clamp(1, 254).to(torch.uint8)


def quantize_fp8_blocks(w: torch.Tensor, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] -> (float8_e4m3fn values, a scale per 128 x 128 block)."""
    scale = block_scales(w, FP8_BLOCK, E4M3FN_MAX, e8m0)
    q = quantize_fp8(w.float() / _expand(scale_factors(scale), *w.shape, FP8_BLOCK), E4M3FN_MAX)
    return q, scale


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] (in even) -> (packed e2m1 bytes [out, in/2], E8M0 scales [out, in/32])."""
    if w.shape[-1] % 2:
        raise ValueError(f"fp4 packs two values a byte: the input size {w.shape[-1]} must be even")
    scale = block_scales(w, FP4_BLOCK, FP4_MAX, e8m0=True)
    x = (w.float() / _expand(scale_factors(scale), *w.shape, FP4_BLOCK)).clamp(-FP4_MAX, FP4_MAX)
    grid = torch.tensor(E2M1_VALUES)
    # the nearest grid magnitude (a tie goes to the smaller one)
    mag = (x.abs()[..., None] - grid).abs().argmin(dim=-1).to(torch.uint8)
    nib = mag | ((x < 0) & (mag > 0)).to(torch.uint8) << 3
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return packed.contiguous(), scale


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] -> (int8 values, float32 scales [out, ceil(in/32)]): each value
    round(w / scale), scale = the block's amax / 127 (ties to even; a last block of fewer
    than 32 inputs scales those it has)."""
    scale = block_scales(w, INT8_BLOCK, INT8_MAX, e8m0=False)
    q = torch.round(w.float() / _expand(scale, *w.shape, INT8_BLOCK)).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def quantize(fmt: str, w: torch.Tensor, e8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "fp8":
        return quantize_fp8_blocks(w, e8m0)
    if fmt == "int8":
        return quantize_int8(w)
    return quantize_fp4(w)


def layer_formats(model: nn.Module, quantize: str, option: str) -> dict[str, str]:
    """Parameter -> stored format for `quantize` ("fp8" | "fp4-experts" | "int8"): the
    weights of the decoder layers' linear layers, fp8 (int8); with fp4-experts the routed
    experts' (modules under .experts.) fp4. `option` names the flag in the error of a
    model with no experts."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear) and ".layers." in f".{path}":
            out[f"{path}.weight"] = "fp4" if quantize == "fp4-experts" and ".experts." in f"{path}." else "int8" if quantize == "int8" else "fp8"
    if quantize == "fp4-experts" and "fp4" not in out.values():
        raise ConfigError(f"{option} fp4-experts: {type(model).__name__} has no routed experts (linear modules under .experts.); use {option} fp8")
    return out
