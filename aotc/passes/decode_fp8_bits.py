"""Decode fp8 weights to float32 by moving bits, where the CPU has no fp8 instructions.

A stored fp8 weight (aotc.quant) is converted to float32 in the graph next to
its use. Inductor's C++ converts each byte with a branchy scalar routine, which
makes an fp8 matrix-vector product slower than the float32 one though it reads
a quarter of the bytes. Moving the bits is the same conversion in two vector
integer ops: an e4m3fn byte `s eeee mmm` placed at bits 31 and 26..20 of a
float32 is that value times 2**-120 (the exponent biases differ by 120;
subnormals included), so one multiply by 2**120, exact, finishes it.
Sign-extended to int32 and shifted left by 20, the byte's sign fills bits
27..31: a mask keeps bit 31 and the seven bits below.

`python bench/skinny.py`, 16 weights of 2816 x 1024 at 1 row, on this CPU
(AVX-512, no AVX512-FP16): fp32 5.8 ms, fp8 converted 6.3 ms, fp8 with its
bits moved 2.9 ms.

Before:
    to = aten.to.dtype(w, torch.float32)                 # w: float8_e4m3fn
After:
    i8 = aten.view.dtype(w, torch.int8)
    i = aten.to.dtype(i8, torch.int32)                   # sign-extended
    bits = (i << 20) & 0x87F00000                        # as int32: -2014314496
    to = aten.view.dtype(bits, torch.float32) * 2**120

The one byte it decodes otherwise is NaN (0x7F, 0xFF): 480 here. Quantizers
clamp, so checkpoints hold no NaN weights.

Only for CPU Inductor: XLA and Neuron convert fp8 natively (and XLA's CPU
flushes the float32 subnormals that the small e4m3 values pass through).
"""

from __future__ import annotations

import torch
from torch import fx

from .base import GraphPass, fake_val, insert_call, rewrite_each

aten = torch.ops.aten
MASK = 0x87F00000 - 2**32  # bit 31 and bits 26..20, as an int32


class DecodeFp8Bits(GraphPass):
    name = "decode_fp8_bits"

    def run(self, gm: fx.GraphModule) -> int:
        g = gm.graph

        def decode(node):
            src = node.args[0]
            if node.args[1] != torch.float32 or not isinstance(src, fx.Node) or fake_val(src).dtype != torch.float8_e4m3fn:
                return None
            i = insert_call(g, aten.to.dtype, insert_call(g, aten.view.dtype, src, torch.int8), torch.int32)
            bits = insert_call(g, aten.bitwise_and.Scalar, insert_call(g, aten.bitwise_left_shift.Tensor_Scalar, i, 20), MASK)
            return insert_call(g, aten.mul.Tensor, insert_call(g, aten.view.dtype, bits, torch.float32), 2.0**120)

        return rewrite_each(gm, aten.to.dtype, decode)
