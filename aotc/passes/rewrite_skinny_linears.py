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

Each weight is read in stripes of its output rows, side by side: at 1 to 4
rows, W [N, K] as 4 stripes [N/4, K], each row's output the concatenation of
its sums over the stripes (2 stripes at 5 to 8 rows). Inductor makes them
one loop with an accumulator per row and stripe, reading 4 streams of W at
once. With one stream and one accumulator, a weight's loop waited on each
add and on each cache line as it came from memory: SmolLM2's int8 head read
its weights at 14 GB/s once they streamed from memory, and at 27 GB/s in
stripes (bench/step_split.py; the whole int8 step 12.8 ms to 9.2 ms, fp32's
25.5 to 23.1). Linears that share their input and weight shape (gate and up)
share one loop in Inductor, so they share its 16 accumulators (stripes()).
`python bench/skinny.py`, its table of 16 weights each on an input of its
own, stripes over one stripe: 1.48x fp32 and 1.35x int8 at 1 row, 1.18x and
1.02x at 8.

Cases handled: `aten.linear(x, W, b)` with x of static shape [M, K], M <= 8, or
[..., K] with at most 8 rows in all (transformers' layers give [B, T, K]: reshaped to
[B * T, K] and back).
(rewrite_skinny_matmuls does the same for decode attention's matmuls.)

Before:
    linear = aten.linear.default(x, w, b)        # x: [2, 1024], w: [2816, 1024]
After (4 stripes, the second row's the same as the first's):
    view = aten.view.default(w, [4, 704, 1024])
    w0 = aten.select.int(view, 0, 0)   ... w3 = aten.select.int(view, 0, 3)
    as_strided = aten.as_strided.default(x, [2, 1024], [1024, 1], 0)
    select = aten.select.int(as_strided, 0, 0)
    sum_1 = aten.sum.dim_IntList(aten.mul.Tensor(w0, select), [-1])
    ... sum_4 = aten.sum.dim_IntList(aten.mul.Tensor(w3, select), [-1])
    cat = aten.cat.default([sum_1, sum_2, sum_3, sum_4])
    select_1 = aten.select.int(as_strided, 0, 1)
    ... cat_1 = aten.cat.default([sum_5, sum_6, sum_7, sum_8])
    stack = aten.stack.default([cat, cat_1], 0)
    add = aten.add.Tensor(stack, b)

Only for backends that run on the CPU through Inductor: on accelerators a
matmul engine wants the matmul.
"""

from __future__ import annotations

import collections
import math

import torch
from torch import fx

from .base import GraphPass, fake_val, insert_call, per_row, rewrite_each

aten = torch.ops.aten
# Up to 8 rows: one accumulator register per row (16 where Inductor fuses two
# linears that share x, as gate and up) fits AVX-512's 32 registers. Wider
# inputs are prefill chunks, for which the GEMM is compute-bound anyway.
MAX_ROWS = 8


# Each row's sum over a stripe of a weight is one accumulator register, in a loop
# that Inductor shares between the linears of one input and weight shape (gate and
# up): 16 of them (rows x stripes x such linears) leave AVX-512's other 16
# registers for the loads. Four streams ran as fast as eight.
MAX_ACCUMULATORS = 16
MAX_STRIPES = 4


def stripes(rows: int, n: int) -> int:
    """How many stripes of its output rows a weight [n, K] is read in, side by side:
    1, 2 or 4, as many as fit MAX_ACCUMULATORS with `rows` accumulators a stripe
    (rows times the linears that share the loop) and divide n."""
    count = 1
    while count * 2 <= MAX_STRIPES and count * 2 * rows <= MAX_ACCUMULATORS and n % (count * 2) == 0:
        count *= 2
    return count


class RewriteSkinnyLinears(GraphPass):
    name = "rewrite_skinny_linears"

    def run(self, gm: fx.GraphModule) -> int:
        # Linears of one input and weight shape: Inductor fuses their reductions into one loop.
        sharing = collections.Counter(_loop_key(n) for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.linear.default)

        def rewrite(node):
            x, w = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            xv, wv = fake_val(x), fake_val(w)
            lead = list(xv.shape[:-1])  # the rows: [M], or [B, T] as transformers' layers give them
            if xv.dim() < 2 or wv.dim() != 2 or not all(isinstance(d, int) for d in xv.shape) or math.prod(lead) > MAX_ROWS:
                return None
            rows = x if xv.dim() == 2 else insert_call(gm.graph, aten.reshape.default, x, [math.prod(lead), xv.shape[-1]])
            n, k = wv.shape
            count = stripes(math.prod(lead) * sharing[_loop_key(node)], n)
            parts = [w]
            if count > 1:
                striped = insert_call(gm.graph, aten.view.default, w, [count, n // count, k])
                parts = [insert_call(gm.graph, aten.select.int, striped, 0, i) for i in range(count)]

            def row_out(row):
                sums = [insert_call(gm.graph, aten.sum.dim_IntList, insert_call(gm.graph, aten.mul.Tensor, part, row), [-1]) for part in parts]
                return sums[0] if count == 1 else insert_call(gm.graph, aten.cat.default, sums)

            out = per_row(gm.graph, rows, 0, row_out)
            if bias is not None:
                out = insert_call(gm.graph, aten.add.Tensor, out, bias)
            return out if xv.dim() == 2 else insert_call(gm.graph, aten.view.default, out, [*lead, wv.shape[0]])

        return rewrite_each(gm, aten.linear.default, rewrite)


def _loop_key(linear: fx.Node):
    return linear.args[0], tuple(fake_val(linear.args[1]).shape)
