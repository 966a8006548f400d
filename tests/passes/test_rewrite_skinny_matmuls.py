"""RewriteSkinnyMatmuls: structure (ops), numbers against eager and compiled by Inductor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aotc.backends.inductor import InductorBackend
from aotc.passes.rewrite_skinny_matmuls import RewriteSkinnyMatmuls

aten = torch.ops.aten


def ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


class Attention(nn.Module):
    """Decode attention of one sequence: `rep` query heads per KV head against the cache."""

    def forward(self, q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)  # [B, kv, rep, S]
        return p @ v


@pytest.mark.parametrize("rep", [2, 3, 4])
def test_skinny_attention_matmuls_are_rewritten(rep):
    """q @ k^T and p @ v: each query row a mul + sum over the cache, stacked."""
    q, k, v = torch.randn(1, 2, rep, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    gm = torch.export.export(Attention(), (q, k, v), strict=False).module()
    expected = Attention()(q, k, v)
    result = RewriteSkinnyMatmuls()(gm)
    assert result.changes == 2 and aten.matmul.default not in ops(gm) and aten.bmm.default not in ops(gm)
    sums = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert len(sums) == 2 * rep and all(n.args[1] == [-2] for n in sums)
    torch.testing.assert_close(gm(q, k, v), expected)


@pytest.mark.parametrize("rep", [1, 8, 9])
def test_other_matmuls_are_left_alone(rep):
    """One query row per KV head, and 8 (where MKL's batched matmul was as fast), and
    prefill's queries (a chunk of rows per head) stay a matmul."""
    q, k, v = torch.randn(1, 2, rep, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    gm = torch.export.export(Attention(), (q, k, v), strict=False).module()
    assert RewriteSkinnyMatmuls()(gm).changes == 0 and ops(gm).count(aten.matmul.default) == 2


class Matmul(nn.Module):
    def forward(self, a, b):
        return a @ b


@pytest.mark.parametrize("shape_a, shape_b, changes", [((2, 3, 16), (2, 16, 40), 1), ((1, 2, 3, 16), (1, 2, 16, 40), 1), ((3, 16), (16, 40), 0)], ids=["rank3", "rank4", "rank2"])
def test_matmuls_of_rank_three_and_more_are_rewritten_and_plain_ones_left(shape_a, shape_b, changes):
    """A batched matmul of 3 rows per batch is rewritten at rank 3 as at rank 4; a plain
    [M, K] @ [K, N] is a linear layer's business (RewriteSkinnyLinears), left alone."""
    a, b = torch.randn(*shape_a), torch.randn(*shape_b)
    gm = torch.export.export(Matmul(), (a, b), strict=False).module()
    assert RewriteSkinnyMatmuls()(gm).changes == changes
    torch.testing.assert_close(gm(a, b), a @ b)


class SinkAttention(nn.Module):
    """DeepSeek V4's attention: a softmax with a sink column, sliced off; and its
    hyper-connection mix, a transposed intermediate times the streams."""

    def forward(self, q, k, sink, c, s):
        scores = q @ k.transpose(-1, -2)  # [N, H, S]
        probs = torch.softmax(torch.cat([scores, sink.expand(q.shape[0], -1, 1)], -1), -1)[..., :-1]
        return probs @ k, c.softmax(-1).transpose(-1, -2) @ s


@pytest.mark.skipif(InductorBackend().can_compile() is not None, reason="no C++ compiler for AOTInductor")
def test_views_that_are_not_contiguous_compile_to_the_same_numbers():
    """The rows of a view that is not contiguous (a slice, a transpose) are read from a
    contiguous copy: an identity as_strided of the view itself compiled to the wrong
    elements in DeepSeek V4's decode."""
    args = (torch.randn(1, 4, 16), torch.randn(1, 24, 16), torch.randn(1, 4, 1), torch.randn(1, 2, 2), torch.randn(1, 2, 32))
    gm = torch.export.export(SinkAttention(), args, strict=False).module()
    assert RewriteSkinnyMatmuls()(gm).changes == 3
    with torch.no_grad():
        torch.testing.assert_close(torch._inductor.compile(gm, list(args))(*args), SinkAttention()(*args))
