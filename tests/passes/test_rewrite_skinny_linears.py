"""RewriteSkinnyLinears: structure (ops), numbers against eager, and the kernel Inductor makes of it."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from aotc.backends.inductor import InductorBackend
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
    assert aten.linear.default not in ops(gm) and aten.mm.default not in ops(gm)
    # One mul + sum per row and linear, each reading the weight itself.
    sums = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert len(sums) == 2 * rows
    assert {n.args[0].args[0].target for n in sums} == {"a.weight", "b.weight"}
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(gm(x), expected, **tol)


def test_wide_inputs_are_left_alone():
    module = Two(True)
    gm = torch.export.export(module, (torch.randn(9, 32),), strict=False).module()
    result = RewriteSkinnyLinears()(gm)
    assert not result.modified and ops(gm).count(aten.linear.default) == 2


class NormThenLinear(nn.Module):
    """An RMSNorm feeding a linear layer, as a decoder layer's projections are fed."""

    def __init__(self, k, n):
        super().__init__()
        self.g = nn.Parameter(torch.rand(k) + 0.5)
        self.proj = nn.Linear(k, n)

    def forward(self, x):
        return self.proj(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.g)


@pytest.mark.skipif(InductorBackend().can_compile() is not None, reason="no C++ compiler for Inductor")
def test_inductor_reads_the_weight_once_for_every_row():
    """What the pass is for: Inductor fuses the rows' reductions into one kernel whose
    inner loop loads a block of W once and keeps one accumulator per row, so 8 rows
    stream W once (MKL's W @ x.T packed W first, and 8 rows took two calls). The
    normalized x is stored once and read back, not recomputed per row and weight."""
    rows, k = 8, 64
    module = NormThenLinear(k, 96)
    x = torch.randn(rows, k)
    gm = torch.export.export(module, (x,), strict=False).module()
    RewriteSkinnyLinears()(gm)
    # torch._inductor.compile, not torch.compile: dynamo breaks once torchax is imported in a worker.
    with torch.no_grad():
        compiled, (code,) = run_and_get_code(lambda: torch._inductor.compile(gm, [x]))
        torch.testing.assert_close(compiled(x), module(x))
    assert "extern_kernels.mm" not in code and "extern_kernels.addmm" not in code  # nothing left to MKL
    # The reduction loop over K that accumulates every row.
    last = code.index(f"tmp_acc{rows - 1}_vec = tmp_acc{rows - 1}_vec +")
    loop = code[code.rindex("for(", 0, last) : code.index("vec_reduce_all", last)]
    assert len(set(re.findall(r"tmp_acc(\d+)_vec = tmp_acc", loop))) == rows, loop
    assert len(re.findall(rf"loadu\(in_ptr\d+ \+ static_cast<int64_t>\(x1 \+ {k}L\*x0\)", loop)) == 1, loop  # W, once
    assert loop.count("loadu(") == rows + 1, loop  # and each row of the stored x once
    assert "rsqrt" not in loop, loop


class Attention(nn.Module):
    """Decode attention of one sequence: `rep` query heads per KV head against the cache."""

    def forward(self, q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)  # [B, kv, rep, S]
        return p @ v


@pytest.mark.parametrize("rep", [2, 3, 4])
def test_skinny_attention_matmuls_are_rewritten(rep):
    """q @ k^T and p @ v: each query row a mul + sum over the cache, stacked."""
    from aotc.passes.rewrite_skinny_linears import RewriteSkinnyMatmuls

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
    from aotc.passes.rewrite_skinny_linears import RewriteSkinnyMatmuls

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
    from aotc.passes.rewrite_skinny_linears import RewriteSkinnyMatmuls

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
    from aotc.passes.rewrite_skinny_linears import RewriteSkinnyMatmuls

    args = (torch.randn(1, 4, 16), torch.randn(1, 24, 16), torch.randn(1, 4, 1), torch.randn(1, 2, 2), torch.randn(1, 2, 32))
    gm = torch.export.export(SinkAttention(), args, strict=False).module()
    assert RewriteSkinnyMatmuls()(gm).changes == 3
    with torch.no_grad():
        torch.testing.assert_close(torch._inductor.compile(gm, list(args))(*args), SinkAttention()(*args))


class LinearOfALaterRow(nn.Module):
    """A linear on rows that start inside their storage: h[1:] (a contiguous view, offset K)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 16)

    def forward(self, x):
        h = x * 2
        return self.proj(h[1:])


def test_rows_of_a_view_inside_its_storage_are_read_from_its_own_offset():
    module, x = LinearOfALaterRow(), torch.randn(3, 32)
    gm = torch.export.export(module, (x,), strict=False).module()
    assert RewriteSkinnyLinears()(gm).changes == 1
    strided = [n for n in gm.graph.nodes if n.target is aten.as_strided.default]
    assert len(strided) == 1 and strided[0].args[3] == 32  # the view's storage offset, one row in
    torch.testing.assert_close(gm(x), module(x))
