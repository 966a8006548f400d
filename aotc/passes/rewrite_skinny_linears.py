"""Rewrite linear layers with few rows so that they stream the weight once.

A decode step multiplies 1 to 4 rows by every weight matrix, so it is bound
by how fast the weights are read. On the CPU, MKL's sgemm reads a skinny
`x @ W.T` at about half the memory bandwidth (one row) and a quarter of it
(2 to 4 rows, where it packs W first). `python bench/skinny.py`, 16 fp32
weights of 2816x1024 compiled by Inductor, weight bytes read per second:

    rows  linear       this pass
    1     20 GB/s      42 GB/s   (mul + sum: one fused reduction kernel)
    2     10 GB/s      38 GB/s   (W @ x.T: MKL streams W, packs the small side)
    4     11 GB/s      39 GB/s
    8     13 GB/s      21 GB/s   (two W @ x.T of 4 rows: W is read twice)

Cases handled, for `aten.linear(x, W, b)` with x of static shape [M, K]:

1. M == 1:      sum(W * x, -1)[None] (+ b)
2. 2 <= M <= 4: mm(W, x.T).T (+ b)
3. 4 < M <= 8:  cat([mm(W, x[:4].T).T, mm(W, x[4:].T).T]) (+ b)

Before:
    linear = aten.linear.default(x, w, b)        # x: [2, 1024], w: [2816, 1024]
After:
    t = aten.t.default(x)
    mm = aten.mm.default(w, t)
    t_1 = aten.t.default(mm)
    add = aten.add.Tensor(t_1, b)

Only for backends that run on the CPU through Inductor: on accelerators a
matmul engine wants the matmul.
"""

from __future__ import annotations

import torch
from torch import fx

from .base import GraphPass, fake_val, insert_call

aten = torch.ops.aten
MAX_ROWS = 8
CHUNK = 4  # MKL streams W at full speed for up to 4 right-hand columns


class RewriteSkinnyLinears(GraphPass):
    name = "rewrite_skinny_linears"

    def run(self, gm: fx.GraphModule) -> int:
        changes = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not aten.linear.default:
                continue
            x, w = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            xv, wv = fake_val(x), fake_val(w)
            if xv.dim() != 2 or wv.dim() != 2 or not isinstance(xv.shape[0], int) or xv.shape[0] > MAX_ROWS:
                continue
            rows = xv.shape[0]
            with gm.graph.inserting_before(node):
                if rows == 1:
                    out = insert_call(gm.graph, aten.mul.Tensor, w, x)
                    out = insert_call(gm.graph, aten.sum.dim_IntList, out, [-1])
                    out = insert_call(gm.graph, aten.unsqueeze.default, out, 0)
                else:
                    parts = []
                    for start in range(0, rows, CHUNK):
                        part = x if rows <= CHUNK else insert_call(gm.graph, aten.slice.Tensor, x, 0, start, start + CHUNK)
                        part = insert_call(gm.graph, aten.mm.default, w, insert_call(gm.graph, aten.t.default, part))
                        parts.append(insert_call(gm.graph, aten.t.default, part))
                    out = parts[0] if len(parts) == 1 else insert_call(gm.graph, aten.cat.default, parts)
                if bias is not None:
                    out = insert_call(gm.graph, aten.add.Tensor, out, bias)
            out.meta["stack_trace"] = node.meta.get("stack_trace")
            node.replace_all_uses_with(out)
            gm.graph.erase_node(node)
            changes += 1
        return changes
