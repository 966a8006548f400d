"""Rewrite linear layers with few rows so that they stream the weight once.

A decode step multiplies 1 to 8 rows by every weight matrix, so it is bound
by how fast the weights are read. On the CPU, MKL's sgemm reads a skinny
`x @ W.T` at about half the memory bandwidth (one row) and a quarter of it
(2 to 8 rows, where it packs W first). This pass writes each row's output as
its own mul + sum over the same weight:

    out[m] = sum(W * x[m], -1)            for each row m, stacked

Inductor fuses reductions with the same loop nest into one kernel, and loads
W once for all of them: per block of 16 weights, one load and one
accumulator register per row (a register tile of 1 x rows). So every row
costs FLOPs, not another pass over W. x goes through an identity as_strided
first: Inductor stores the input of an as_strided, so the rows read x back
from memory. Without it, a pointwise x (an RMSNorm's output) is recomputed
for every row at every weight element inside the reduction loop: the 100m
model's decode step took 46 ms at batch 8 with that, 31 ms without.

`python bench/skinny.py`, 16 fp32 weights of 2816x1024, weight bytes read
per second (one run on this 2-core VM, whose figures vary by up to 2x
between runs: a streaming sum read 26 to 49 GB/s today):

    rows  linear (MKL)   this pass   (the previous form: W @ x.T per 4 rows)
    1     15 GB/s        28 GB/s
    2      8 GB/s        27 GB/s     19 GB/s
    4      8 GB/s        24 GB/s     12 GB/s
    8      8 GB/s        15 GB/s      7 GB/s (W read twice)

At 8 rows the kernel's loop (one W load, 8 x loads, 8 multiplies and 8
adds per 16 weights) runs below memory speed, at 15 to 17 GB/s for K of
256, 1024 and 4096 alike (so not x's cache footprint); FMA contraction
(`cpp.enable_floating_point_contract_flag`) did not change it.

Cases handled: `aten.linear(x, W, b)` with x of static shape [M, K], M <= 8, or
[..., K] with at most 8 rows in all (transformers' layers give [B, T, K]: reshaped to
[B * T, K] and back).
(rewrite_skinny_matmuls does the same for decode attention's matmuls.)

Before:
    linear = aten.linear.default(x, w, b)        # x: [2, 1024], w: [2816, 1024]
After:
    as_strided = aten.as_strided.default(x, [2, 1024], [1024, 1], 0)
    select = aten.select.int(as_strided, 0, 0)
    mul = aten.mul.Tensor(w, select)
    sum_1 = aten.sum.dim_IntList(mul, [-1])
    select_1 = aten.select.int(as_strided, 0, 1)
    mul_1 = aten.mul.Tensor(w, select_1)
    sum_2 = aten.sum.dim_IntList(mul_1, [-1])
    stack = aten.stack.default([sum_1, sum_2], 0)
    add = aten.add.Tensor(stack, b)

Only for backends that run on the CPU through Inductor: on accelerators a
matmul engine wants the matmul.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from .base import GraphPass, fake_val, insert_call, per_row, rewrite_each

aten = torch.ops.aten
# Up to 8 rows: one accumulator register per row (16 where Inductor fuses two
# linears that share x, as gate and up) fits AVX-512's 32 registers. Wider
# inputs are prefill chunks, for which the GEMM is compute-bound anyway.
MAX_ROWS = 8


class RewriteSkinnyLinears(GraphPass):
    name = "rewrite_skinny_linears"

    def run(self, gm: fx.GraphModule) -> int:
        def rewrite(node):
            x, w = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            xv, wv = fake_val(x), fake_val(w)
            lead = list(xv.shape[:-1])  # the rows: [M], or [B, T] as transformers' layers give them
            if xv.dim() < 2 or wv.dim() != 2 or not all(isinstance(d, int) for d in xv.shape) or math.prod(lead) > MAX_ROWS:
                return None
            rows = x if xv.dim() == 2 else insert_call(gm.graph, aten.reshape.default, x, [math.prod(lead), xv.shape[-1]])
            out = per_row(gm.graph, rows, 0, lambda row: insert_call(gm.graph, aten.sum.dim_IntList, insert_call(gm.graph, aten.mul.Tensor, w, row), [-1]))
            if bias is not None:
                out = insert_call(gm.graph, aten.add.Tensor, out, bias)
            return out if xv.dim() == 2 else insert_call(gm.graph, aten.view.default, out, [*lead, wv.shape[0]])

        return rewrite_each(gm, aten.linear.default, rewrite)
