"""RewriteSkinnyLinears: structure (ops) and numbers against eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aotc.passes.rewrite_skinny_linears import RewriteSkinnyLinears

aten = torch.ops.aten


class Two(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.a = nn.Linear(32, 48, bias=bias)
        self.b = nn.Linear(48, 16, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("rows", [1, 2, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_skinny_linears_are_rewritten(rows, dtype, bias):
    module = Two(bias).to(dtype)
    x = torch.randn(rows, 32, dtype=dtype)
    gm = torch.export.export(module, (x,), strict=False).module()
    expected = module(x)
    result = RewriteSkinnyLinears()(gm)
    assert result.modified and result.changes == 2
    assert aten.linear.default not in ops(gm)
    if rows == 1:
        assert ops(gm).count(aten.sum.dim_IntList) == 2 and aten.mm.default not in ops(gm)
    else:
        assert ops(gm).count(aten.mm.default) == 2 * (1 + (rows > 4))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(gm(x), expected, **tol)


def test_wide_inputs_are_left_alone():
    module = Two(True)
    gm = torch.export.export(module, (torch.randn(9, 32),), strict=False).module()
    result = RewriteSkinnyLinears()(gm)
    assert not result.modified and ops(gm).count(aten.linear.default) == 2
