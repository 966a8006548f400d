"""Rewrite decode attention's batched matmuls so that they read the cache once per KV head.

This is rewrite_skinny_linears' form (each output row its own mul + sum, over
rows read back from memory) applied to attention's two matmuls, q @ k^T and
p @ v, where the few rows are the query heads that share one KV head.

Each row m of the output becomes sum(a[..., m, :, None] * b, -2), so that
the cache is read once for all of a KV head's queries. `python bench/skinny.py`, 8 layers of 4 KV heads x 4096
positions x 64 (67 MB of k, v), attention ms against MKL's batched matmuls:

    query rows   MKL     this pass
    1            2.52    2.84   (left to MKL)
    2            3.45    3.17
    4            5.54    4.01
    8            6.64    6.94   (left to MKL)

Cases handled: `aten.matmul(a, b)` of rank >= 3 where a has 2 to 4 rows.

Before:
    matmul = aten.matmul.default(q, k_t)         # q: [1, 4, 2, 64], k_t: [1, 4, 64, 256]
After:
    as_strided = aten.as_strided.default(q, [1, 4, 2, 64], [512, 128, 64, 1], 0)
    select = aten.select.int(as_strided, -2, 0)
    unsqueeze = aten.unsqueeze.default(select, -1)
    mul = aten.mul.Tensor(unsqueeze, k_t)
    sum_1 = aten.sum.dim_IntList(mul, [-2])
    ... (row 1 likewise)
    stack = aten.stack.default([sum_1, sum_2], -2)

Only for backends that run on the CPU through Inductor: on accelerators a
matmul engine wants the matmul.
"""

from __future__ import annotations

import torch
from torch import fx

from .base import GraphPass, fake_val, insert_call, per_row, rewrite_each

aten = torch.ops.aten
# Attention's rows (query heads per KV head): where the rewrite beat MKL's batched
# matmul in bench/skinny.py (1 row and 8 rows did not).
MATMUL_ROWS = range(2, 5)


class RewriteSkinnyMatmuls(GraphPass):
    name = "rewrite_skinny_matmuls"

    def run(self, gm: fx.GraphModule) -> int:
        def rewrite(node):
            a, b = node.args[0], node.args[1]
            av, bv = fake_val(a), fake_val(b)
            if av.dim() < 3 or bv.dim() != av.dim() or av.shape[-2] not in MATMUL_ROWS:
                return None
            # Row m: a[..., m, :] as a column against b, summed over K: [..., N]
            return per_row(gm.graph, a, -2, lambda row: insert_call(
                gm.graph, aten.sum.dim_IntList, insert_call(gm.graph, aten.mul.Tensor, insert_call(gm.graph, aten.unsqueeze.default, row, -1), b), [-2]
            ))  # fmt: skip

        return rewrite_each(gm, aten.matmul.default, rewrite)
