"""Drop the runtime asserts inside a while_loop's body.

A whole step's loop (models.llama, LlamaModel.compiled_forward) indexes its stacked
weights with its counter's `.item()`, an unbacked symbol of the body's own, bounded by
`torch._check`s that export records as `_assert_scalar` nodes in the body. torch 2.13's
export serializer cannot read those back: deserializing the assert looks the symbol up
before the body has defined it (`KeyError: u0` in `_should_skip_static_eval`), so the
program could not reach a compile worker or an export artifact. The loop's condition
already bounds the counter, so the asserts check nothing the graph can break. The
symbol's range stays in the program's range constraints.
"""

from __future__ import annotations

import torch
from torch import fx

from .base import GraphPass, loop_bodies


class DropLoopAsserts(GraphPass):
    name = "drop_loop_asserts"

    def run(self, gm: fx.GraphModule) -> int:
        changes = 0
        for body in loop_bodies(gm):
            asserts = [n for n in body.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._assert_scalar.default]
            for n in asserts:
                body.graph.erase_node(n)
            if asserts:
                body.graph.eliminate_dead_code()
                body.recompile()
                changes += len(asserts)
        return changes
