"""Decode fp8 weights to float32 in integer arithmetic, where the CPU has no fp8 instructions.

A stored fp8 weight (aotc.lowp_weights) is converted to float32 in the graph next to
its use. Inductor's C++ converts each byte with a branchy scalar routine, which
makes an fp8 matrix-vector product slower than the float32 one though it reads
a quarter of the bytes. The same conversion in integer arithmetic vectorizes:
an e4m3fn byte `s eeee mmm` is (8 + m) * 2**(e - 10) where e > 0 and m * 2**-9
where e = 0 (subnormal), so with t = (8 + m) << e, or m << 1 where e = 0, the
value is float(t) * 2**-10 (both exact: t < 2**19), negated where s is set.

An earlier form moved the byte's bits into a float32 (shift and mask, then a
bitcast and one multiply by 2**120). Inductor lowers the int32 -> float32
bitcast through a stack buffer, an element at a time: on an AVX-512 Xeon a
1536 x 576 product at 1 row took 1478 us that way, 89 us in this form, 196 us
with the plain conversion, 59 us in fp32 (torch.compile, weights in cache).

Before:
    to = aten.to.dtype(w, torch.float32)                 # w: float8_e4m3fn
After:
    i = aten.to.dtype(aten.view.dtype(w, torch.int8), torch.int32)   # sign-extended
    e, m = (i & 0x7F) >> 3, i & 7
    t = where(e > 0, (m + 8) << e, m << 1)
    f = aten.to.dtype(t, torch.float32) * 2**-10
    to = where(i < 0, -f, f)

The one byte it decodes otherwise is NaN (0x7F, 0xFF): 480 here. Quantizers
clamp, so checkpoints hold no NaN weights.

Only for CPU Inductor: XLA and Neuron convert fp8 natively.
"""

from __future__ import annotations

import torch
from torch import fx

from .base import GraphPass, fake_val, insert_call, rewrite_each

aten = torch.ops.aten


class DecodeFp8Bits(GraphPass):
    name = "decode_fp8_bits"

    def run(self, gm: fx.GraphModule) -> int:
        g = gm.graph

        def decode(node):
            src = node.args[0]
            if node.args[1] != torch.float32 or not isinstance(src, fx.Node) or fake_val(src).dtype != torch.float8_e4m3fn:
                return None
            i = insert_call(g, aten.to.dtype, insert_call(g, aten.view.dtype, src, torch.int8), torch.int32)
            e = insert_call(g, aten.bitwise_right_shift.Tensor_Scalar, insert_call(g, aten.bitwise_and.Scalar, i, 0x7F), 3)
            m = insert_call(g, aten.bitwise_and.Scalar, i, 7)
            normal = insert_call(g, aten.bitwise_left_shift.Tensor, insert_call(g, aten.add.Scalar, m, 8), e)
            subnormal = insert_call(g, aten.bitwise_left_shift.Tensor_Scalar, m, 1)
            t = insert_call(g, aten.where.self, insert_call(g, aten.gt.Scalar, e, 0), normal, subnormal)
            f = insert_call(g, aten.mul.Tensor, insert_call(g, aten.to.dtype, t, torch.float32), 2.0**-10)
            return insert_call(g, aten.where.self, insert_call(g, aten.lt.Scalar, i, 0), insert_call(g, aten.neg.default, f), f)

        return rewrite_each(gm, aten.to.dtype, decode)
