"""RewriteSkinnyLinears: structure (ops), numbers against eager, and the kernel Inductor makes of it."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from aotc.backends.inductor import InductorBackend
from aotc.passes.rewrite_skinny_linears import RewriteSkinnyLinears, stripes

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
    # One mul + sum per row, linear and stripe of the weight's output rows, each
    # reading the weight itself: a [N, K] weight in 4 stripes at up to 4 rows, 2 at 8.
    sums = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert stripes(rows, 48) == stripes(rows, 16) == (4 if rows <= 4 else 2)
    assert len(sums) == 2 * rows * stripes(rows, 48)
    for name in ("a.weight", "b.weight"):
        parts = [n.args[0].args[0] for n in sums if n.args[0].args[0].args[0].args[0].target == name]
        assert len(parts) == rows * stripes(rows, 48)
        assert {(p.target, p.args[1], p.args[2]) for p in parts} == {(aten.select.int, 0, i) for i in range(stripes(rows, 48))}
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
    inner loop loads a block of each stripe of W once and keeps one accumulator per
    row and stripe, so 8 rows stream W once (MKL's W @ x.T packed W first, and 8 rows
    took two calls). The normalized x is stored once and read back, not recomputed
    per row and weight."""
    rows, k, n = 8, 64, 96
    module = NormThenLinear(k, n)
    x = torch.randn(rows, k)
    gm = torch.export.export(module, (x,), strict=False).module()
    RewriteSkinnyLinears()(gm)
    # torch._inductor.compile, not torch.compile: dynamo breaks once torchax is imported in a worker.
    with torch.no_grad():
        compiled, (code,) = run_and_get_code(lambda: torch._inductor.compile(gm, [x]))
        torch.testing.assert_close(compiled(x), module(x))
    assert "extern_kernels.mm" not in code and "extern_kernels.addmm" not in code  # nothing left to MKL
    # The reduction loop over K that accumulates every row.
    count = stripes(rows, n)
    last = code.index(f"tmp_acc{rows * count - 1}_vec = tmp_acc{rows * count - 1}_vec +")
    loop = code[code.rindex("for(", 0, last) : code.index("vec_reduce_all", last)]
    assert len(set(re.findall(r"tmp_acc(\d+)_vec = tmp_acc", loop))) == rows * count == 16, loop
    # W's two stripes (48 rows apart), each once.
    assert len(re.findall(rf"loadu\(in_ptr\d+ \+ static_cast<int64_t>\(x1 \+ {k}L\*x0\)", loop)) == 1, loop
    assert len(re.findall(rf"loadu\(in_ptr\d+ \+ static_cast<int64_t>\({n // count * k}L \+ x1 \+ {k}L\*x0\)", loop)) == 1, loop
    assert loop.count("loadu(") == rows + count, loop  # and each row of the stored x once
    assert "rsqrt" not in loop, loop


@pytest.mark.skipif(InductorBackend().can_compile() is not None, reason="no C++ compiler for Inductor")
def test_one_row_reads_four_stripes_of_the_weight_side_by_side():
    """At one row, one accumulator per kernel loop left the weight's stream waiting on
    each add (SmolLM2's int8 head read at 14 GB/s): four stripes of its output rows,
    each with its own accumulator, read in the same loop (29 GB/s, bench/step_split.py)."""
    k, n = 64, 96
    module = NormThenLinear(k, n)
    x = torch.randn(1, k)
    gm = torch.export.export(module, (x,), strict=False).module()
    RewriteSkinnyLinears()(gm)
    with torch.no_grad():
        compiled, (code,) = run_and_get_code(lambda: torch._inductor.compile(gm, [x]))
        torch.testing.assert_close(compiled(x), module(x))
    last = code.index("tmp_acc3_vec = tmp_acc3_vec +")
    loop = code[code.rindex("for(", 0, last) : code.index("vec_reduce_all", last)]
    assert len(set(re.findall(r"tmp_acc(\d+)_vec = tmp_acc", loop))) == 4, loop
    offsets = re.findall(rf"loadu\(in_ptr\d+ \+ static_cast<int64_t>\((?:(\d+)L \+ )?x1 \+ {k}L\*x0\)", loop)
    assert sorted(int(o or 0) for o in offsets) == [i * n // 4 * k for i in range(4)], loop


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


@pytest.mark.parametrize(("rows", "n", "count"), [(1, 96, 4), (4, 96, 4), (5, 96, 2), (8, 96, 2), (1, 6, 2), (1, 7, 1), (2, 14, 2)])
def test_a_weight_is_striped_only_where_its_rows_divide(rows, n, count):
    assert stripes(rows, n) == count
    module = nn.Linear(32, n)
    x = torch.randn(rows, 32)
    gm = torch.export.export(module, (x,), strict=False).module()
    RewriteSkinnyLinears()(gm)
    assert sum(n.target is aten.sum.dim_IntList for n in gm.graph.nodes) == rows * count
    torch.testing.assert_close(gm(x), module(x))


class Shared(nn.Module):
    """`count` linears of one input and weight shape (gate and up): one loop in Inductor."""

    def __init__(self, count):
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(32, 48) for _ in range(count))
        self.other = nn.Linear(32, 16)

    def forward(self, x):
        return [p(x) for p in self.proj] + [self.other(x)]


@pytest.mark.parametrize(("count", "rows", "per_linear"), [(2, 1, 4), (2, 4, 2), (2, 8, 1), (16, 1, 1), (4, 2, 2)])
def test_linears_that_share_a_loop_share_its_accumulators(count, rows, per_linear):
    """At most 16 accumulators in the loop Inductor makes of the linears that read one
    input with one weight shape (16 such linears at 1 row spilled registers in
    bench/skinny.py: 0.92x with 4 stripes each); a linear of another shape keeps its own."""
    module = Shared(count)
    x = torch.randn(rows, 32)
    gm = torch.export.export(module, (x,), strict=False).module()
    RewriteSkinnyLinears()(gm)
    sums = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    assert len(sums) == rows * (count * per_linear + stripes(rows, 16))
    torch.testing.assert_close(gm(x), module(x))
