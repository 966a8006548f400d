"""fp8 for trn2: checkpoint float8_e4m3fn weights as IEEE e4m3, on the host.

trn2 reads float8_e4m3fn bytes as IEEE e4m3: the same bias (7), but the top
exponent is reserved for inf/NaN, so the largest finite value is 240 instead
of 448. aotc rewrites each weight byte b (value v) as the e4m3 byte of v/2
and doubles the block's scale (a ue8m0 scale exponent + 1), so scale * weight
is unchanged. The rewrite is a 256-entry lookup table applied with numpy: a
billion weights in seconds, where doing it with tensor ops on the device
means a compile per weight shape.

v/2 is exact in e4m3 for every byte but 16: those with exponent field 0 or 1
and an odd mantissa (|v| in {1,3,5,7} * 2**-9 and {9,11,13,15} * 2**-9), whose
halves fall between e4m3's subnormals; they round to nearest, ties to even
(an error of 2**-10 at most). NaN stays NaN.

Checkpoint weights quantize to at most 448 (`quantize_fp8`), so rescaled
they stay within 224, under e4m3's 240: below 240, e4m3fn and e4m3 encode
every value with the same byte, so what the host writes is what trn2 reads.
"""

from __future__ import annotations

import math

import numpy as np
import torch

E4M3FN_MAX = 448.0


def decode_e4m3fn(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.copysign(math.nan, sign)
    if exp == 0:
        return sign * man * 2.0**-9  # subnormal: man/8 * 2**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def encode_e4m3(value: float) -> int:
    """IEEE-style e4m3 (bias 7, exponent 15 = inf/NaN), round to nearest even."""
    sign = 0x80 if math.copysign(1.0, value) < 0 else 0
    if math.isnan(value):
        return sign | 0x7C  # the quiet NaN
    a = abs(value)
    if a == 0:
        return sign
    if a < 2.0**-6:  # subnormal range: steps of 2**-9
        man = _round_even(a / 2.0**-9)
        return sign | (0x08 if man == 8 else man)  # 8 steps round up to the smallest normal
    exp = math.floor(math.log2(a))
    man = _round_even((a / 2.0**exp - 1) * 8)
    if man == 8:
        exp, man = exp + 1, 0
    if exp + 7 >= 15:
        return sign | 0x78  # inf: beyond 240
    return sign | ((exp + 7) << 3) | man


def _round_even(x: float) -> int:
    floor = math.floor(x)
    rest = x - floor
    if rest > 0.5 or (rest == 0.5 and floor % 2 == 1):
        return floor + 1
    return floor


def _tables() -> tuple[np.ndarray, np.ndarray]:
    lut = np.zeros(256, dtype=np.uint8)
    exact = np.zeros(256, dtype=bool)
    for b in range(256):
        half = decode_e4m3fn(b) / 2
        lut[b] = encode_e4m3(half)
        back = decode_e4m3(int(lut[b]))
        exact[b] = (math.isnan(half) and math.isnan(back)) or back == half
    return lut, exact


def decode_e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF:
        return math.nan if man else sign * math.inf
    if exp == 0:
        return sign * man * 2.0**-9
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


HALVE_LUT, HALVE_EXACT = _tables()


def rescale_weights(weights: np.ndarray | torch.Tensor, chunk: int = 1 << 20) -> np.ndarray | torch.Tensor:
    """e4m3fn weight bytes -> e4m3 bytes holding value/2 (same shape; uint8 or float8 in, same out)."""
    is_torch = isinstance(weights, torch.Tensor)
    src = weights.view(torch.uint8).numpy() if is_torch else weights.view(np.uint8)
    out = np.empty_like(src)
    flat_in, flat_out = src.reshape(-1), out.reshape(-1)
    for start in range(0, flat_in.size, chunk):  # cache-sized chunks: 2x faster than one pass
        np.take(HALVE_LUT, flat_in[start : start + chunk], out=flat_out[start : start + chunk])
    if is_torch:
        return torch.from_numpy(out).view(weights.dtype)
    return out


def rescale_scales(scales: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """The block scales that go with rescaled weights: doubled (ue8m0: exponent byte + 1)."""
    if ue8m0:
        if scales.dtype == torch.uint8:
            if int(scales.max()) >= 254:
                raise ValueError("a ue8m0 scale exponent of 254 cannot be doubled (255 is NaN)")
            return scales + 1
        return scales * 2  # ue8m0 values stored as float: a power of two, doubled exactly
    return scales * 2


def quantize_fp8(x: torch.Tensor, max_value: float = E4M3FN_MAX) -> torch.Tensor:
    """Scaled values -> float8_e4m3fn, clamped to +-max_value first: a cast alone turns
    what lies beyond 448 into NaN. 448 is e4m3fn's maximum; a target that reads the
    bytes another way passes its own (trn2 reads IEEE e4m3: at most 240)."""
    if not 0 < max_value <= E4M3FN_MAX:
        raise ValueError(f"max_value {max_value}: expected 0 < max_value <= {E4M3FN_MAX} (float8_e4m3fn's maximum)")
    return x.float().clamp(-max_value, max_value).to(torch.float8_e4m3fn)
