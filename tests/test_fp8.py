"""fp8 for trn2: the e4m3fn -> e4m3 (value/2) table, exhaustively."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from aotc.fp8 import HALVE_EXACT, HALVE_LUT, decode_e4m3, decode_e4m3fn, quantize_fp8, rescale_scales, rescale_weights

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is the independent reference for fp8 encodings (test extra)")

ALL = np.arange(256, dtype=np.uint8)


def test_decode_matches_ml_dtypes_for_all_256_bytes():
    ours = np.array([decode_e4m3fn(int(b)) for b in ALL], dtype=np.float32)
    np.testing.assert_array_equal(ours, ALL.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    ours = np.array([decode_e4m3(int(b)) for b in ALL], dtype=np.float32)
    np.testing.assert_array_equal(ours, ALL.view(ml_dtypes.float8_e4m3).astype(np.float32))


def test_halving_table_matches_ml_dtypes_for_all_256_bytes():
    halves = ALL.view(ml_dtypes.float8_e4m3fn).astype(np.float32) / 2
    np.testing.assert_array_equal(HALVE_LUT, halves.astype(ml_dtypes.float8_e4m3).view(np.uint8))


def test_exact_for_all_bytes_but_the_16_smallest_odd_codes():
    inexact = {int(b) for b in ALL[~HALVE_EXACT]}
    expected = {sign | (exp << 3) | man for sign in (0, 0x80) for exp in (0, 1) for man in (1, 3, 5, 7)}
    assert inexact == expected
    for b in ALL[HALVE_EXACT]:
        v, h = decode_e4m3fn(int(b)), decode_e4m3(int(HALVE_LUT[b]))
        assert (math.isnan(v) and math.isnan(h)) or h == v / 2
    for b in inexact:  # rounded to the nearest e4m3 value: off by at most half a subnormal step
        assert abs(decode_e4m3(int(HALVE_LUT[b])) - decode_e4m3fn(b) / 2) <= 2.0**-10


def test_rescaled_weights_times_doubled_scales_are_unchanged():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 384, generator=g) * 150).clamp(-448, 448).to(torch.float8_e4m3fn)  # up to e4m3fn's max
    assert w.float().abs().max() == 448  # so the bound below is met only by halving
    scale = torch.rand(2, 3, generator=g) + 0.5  # one per 128x128 block
    new_w, new_scale = rescale_weights(w), rescale_scales(scale, ue8m0=False)
    assert new_w.dtype == torch.float8_e4m3fn and new_w.shape == w.shape
    # Read as trn2 reads it (IEEE e4m3), times the doubled block scale.
    as_trn2 = torch.from_numpy(new_w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3).astype(np.float32))
    blocks = lambda s: s.repeat_interleave(128, 0).repeat_interleave(128, 1)  # noqa: E731
    exact = torch.from_numpy(HALVE_EXACT[w.view(torch.uint8).numpy()])
    torch.testing.assert_close((as_trn2 * blocks(new_scale))[exact], (w.float() * blocks(scale))[exact], rtol=0, atol=0)
    assert as_trn2.abs().max() <= 224


def test_ue8m0_scales_get_exponent_plus_one():
    exps = torch.tensor([0, 127, 130, 253], dtype=torch.uint8)
    assert rescale_scales(exps, ue8m0=True).tolist() == [1, 128, 131, 254]
    with pytest.raises(ValueError, match="254 cannot be doubled"):
        rescale_scales(torch.tensor([254], dtype=torch.uint8), ue8m0=True)


@pytest.mark.parametrize("max_value", [448.0, 224.0, 128.0, 1.0])
def test_quantize_clamps_to_a_configurable_maximum(max_value):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) * 7
    scale = x.abs().max() / max_value
    q = quantize_fp8(x / scale * 1.5, max_value)  # half again beyond the maximum: clamped, not NaN
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() == max_value and not q.float().isnan().any()
    q = quantize_fp8(x / scale, max_value)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for normals, absolute 2^-9 * scale below them.
    torch.testing.assert_close(q.float() * scale, x, rtol=2**-4, atol=float(scale) * 2**-9)
    if max_value <= 240:  # below 240, e4m3fn and trn2's e4m3 read the same bytes as the same values
        bytes_ = q.view(torch.uint8).numpy()
        np.testing.assert_array_equal(bytes_.view(ml_dtypes.float8_e4m3fn).astype(np.float32), bytes_.view(ml_dtypes.float8_e4m3).astype(np.float32))
    for bad in (500.0, 0.0, -1.0):
        with pytest.raises(ValueError, match="expected 0 < max_value <= 448"):
            quantize_fp8(x, bad)
