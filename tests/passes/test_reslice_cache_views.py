"""ResliceCacheViews: structure (ops, graph signature) and numbers against eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aotc.errors import TraceError
from aotc.passes.base import alias_root, is_inplace_op, written_args
from aotc.passes.reslice_cache_views import ResliceCacheViews

aten = torch.ops.aten


def count_view_writes(gm) -> int:
    """In-place writes whose target is a view chain on a placeholder (0 after the pass)."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_inplace_op(node.target):
            root, views = alias_root(node.args[0])
            n += root.op == "placeholder" and bool(views)
    return n


def export(module, *args):
    return torch.export.export(module, tuple(a.clone() for a in args), strict=False)


def writes(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if written_args(n)]


def check(module, args, cache_arg: int, expected_writes: int, root=None):
    """Export, run the pass, check structure, and check numbers on `root` (or the cache arg)."""
    ep = export(module, *args)
    gm = ep.graph_module
    assert count_view_writes(gm) == expected_writes
    result = ResliceCacheViews()(gm)
    assert result.modified and result.changes == expected_writes
    # Structure: every write is one index_put_ directly on a placeholder, nothing
    # is written through a view, and the outputs are the user's outputs only.
    assert count_view_writes(gm) == 0
    for node in writes(gm):
        assert node.target is aten.index_put_.default
        assert node.args[0].op == "placeholder"
    assert not any(n.target in (aten.copy_.default, aten.slice_scatter.default, aten.select_scatter.default) for n in gm.graph.nodes)
    assert [s.kind.name for s in ep.graph_signature.output_specs] == ["USER_OUTPUT"] * len(ep.graph_signature.output_specs)
    # Functionalized (as compilers see it), the write stays a scatter of just the
    # written elements: no slice/select scatter that rebuilds the whole cache.
    functional = ep.run_decompositions().graph_module
    scatters = {aten.slice_scatter.default, aten.select_scatter.default, aten.as_strided_scatter.default}
    assert not any(n.target in scatters for n in functional.graph.nodes)
    assert any(n.target is aten.index_put.default for n in functional.graph.nodes)
    # Numbers: the rewritten graph mutates the cache exactly as eager does.
    eager_args = [a.clone() for a in args]
    expected = module(*eager_args)
    run_args = [a.clone() for a in args]
    if root is not None:  # the cache argument is a slice of a bigger root allocation
        eager_root, run_root = root.clone(), root.clone()
        eager_args[cache_arg] = eager_root[1]
        expected = module(*eager_args)
        run_args[cache_arg] = run_root[1]
    out = gm(*run_args)
    torch.testing.assert_close(out[0], expected)
    if root is not None:
        torch.testing.assert_close(run_root, eager_root)
        assert run_root[0].eq(root[0]).all() and run_root[2].eq(root[2]).all()  # other layers untouched
    else:
        torch.testing.assert_close(run_args[cache_arg], eager_args[cache_arg])
    return gm


class SliceWrite(nn.Module):
    def forward(self, k, cache):  # cache: [B, H, S, D]; k: [B, H, 2, D]
        cache[:, :, 4:6] = k
        return cache[:, :, :8].sum(2)


class SelectChainWrite(nn.Module):
    def forward(self, x, cache):  # cache: [L, S, D]
        layer = cache.select(0, 1)
        layer[3:5].copy_(x)
        layer.transpose(0, 1)[:, 7].fill_(2.5)
        cache[2].zero_()
        return layer.sum(0, keepdim=True)


class IndexThroughView(nn.Module):
    def forward(self, k, pos, slots, cache):  # cache: [slots, H, S, D]; k: [N, H, D]
        cache.narrow(0, 0, 3)[slots, :, pos] = k
        cache[:, 1].index_copy_(1, pos[:1], k[:1, 1:2].permute(1, 0, 2).expand(cache.shape[0], 1, -1).contiguous())
        return cache.sum(2)


class DtypeCast(nn.Module):
    def forward(self, x, cache):  # writing float32 into a bfloat16 cache through a view
        cache[:, 2:4].copy_(x)
        return cache.float().sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slice_write(dtype):
    k = torch.randn(2, 3, 2, 8, dtype=dtype)
    cache = torch.zeros(2, 3, 16, 8, dtype=dtype)
    check(SliceWrite(), [k, cache], 1, expected_writes=1)


def test_select_chain_write():
    check(SelectChainWrite(), [torch.randn(2, 8), torch.randn(3, 10, 8)], 1, expected_writes=3)


def test_index_put_and_index_copy_through_views_with_negative_index():
    k = torch.randn(3, 2, 8)
    pos = torch.tensor([5, 0, 9])
    slots = torch.tensor([0, 2, -1])  # -1: the last slot of the view, as padding rows use
    cache = torch.randn(4, 2, 12, 8)
    check(IndexThroughView(), [k, pos, slots, cache], 3, expected_writes=2)


def test_cache_that_is_a_slice_of_a_bigger_root():
    """The graph input is root[1] (a layer's contiguous slice); writes land in the root."""
    root = torch.randn(3, 2, 3, 16, 8)
    k = torch.randn(2, 3, 2, 8)
    check(SliceWrite(), [k, root[1].clone()], 1, expected_writes=1, root=root)


def test_dtype_cast_on_write():
    x = torch.randn(4, 2, 8)
    cache = torch.zeros(4, 6, 8, dtype=torch.bfloat16)
    gm = check(DtypeCast(), [x, cache], 1, expected_writes=1)
    assert any(n.target is aten._to_copy.default for n in gm.graph.nodes)


def test_merged_dims_view_goes_through_flat_offsets():
    class Flat(nn.Module):
        def forward(self, x, cache):  # cache: [4, 6]; view as [24] and write 5 elements
            cache.view(-1)[3:8] = x
            return cache.sum(0)

    check(Flat(), [torch.randn(5), torch.zeros(4, 6)], 1, expected_writes=1)


def test_direct_writes_are_left_alone():
    class Direct(nn.Module):
        def forward(self, k, pos, cache):
            cache[:, :, pos] = k
            return cache.sum(2)

    ep = export(Direct(), torch.randn(2, 3, 8), torch.tensor([1]), torch.zeros(2, 3, 4, 8))
    result = ResliceCacheViews()(ep.graph_module)
    assert not result.modified and result.changes == 0


def test_unsupported_inplace_through_view_names_the_line():
    class Scale(nn.Module):
        def forward(self, x, cache):
            cache[:, 1:3].mul_(x)
            return cache.sum(0)

    ep = export(Scale(), torch.randn(2, 8), torch.ones(3, 4, 8))
    with pytest.raises(TraceError, match=r"test_reslice_cache_views.py.*mul_"):
        ResliceCacheViews()(ep.graph_module)


def test_alias_root_follows_views_and_inplace_results():
    ep = export(SelectChainWrite(), torch.randn(2, 8), torch.randn(3, 10, 8))
    gm = ep.graph_module
    cache = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    for node in writes(gm):
        root, views = alias_root(node.args[0])
        assert root is cache and views


def run_against_eager(module, args, cache_arg):
    """Export, run the pass, and return (graph, pass result) after checking the cache and
    the output against eager."""
    ep = export(module, *args)
    gm = ep.graph_module
    result = ResliceCacheViews()(gm)
    assert count_view_writes(gm) == 0
    eager_args, run_args = [a.clone() for a in args], [a.clone() for a in args]
    expected = module(*eager_args)
    torch.testing.assert_close(gm(*run_args)[0], expected)
    torch.testing.assert_close(run_args[cache_arg], eager_args[cache_arg])
    return gm, result


def test_inplace_on_an_intermediate_is_left_and_later_cache_writes_still_rewritten():
    class ScratchThenCache(nn.Module):
        def forward(self, x, cache):  # cache: [4, 6, 8]
            t = x * 2
            t[0].add_(1.0)  # in place on a tensor the graph made: not an input, not touched
            cache[:, 1:3] = t
            return cache.sum(1)

    gm, result = run_against_eager(ScratchThenCache(), [torch.randn(4, 2, 8), torch.randn(4, 6, 8)], 1)
    assert result.changes == 1 and any(n.target is aten.add_.Tensor for n in gm.graph.nodes)


def test_accumulating_index_put_through_a_view_adds_repeated_indices():
    class Accumulate(nn.Module):
        def forward(self, k, slots, cache):  # cache: [4, 2, 8]; slot 1 appears twice
            cache.narrow(0, 0, 3).index_put_((slots,), k, accumulate=True)
            return cache.sum(1)

    run_against_eager(Accumulate(), [torch.randn(3, 2, 8), torch.tensor([1, 0, 1]), torch.randn(4, 2, 8)], 2)


def test_consecutive_advanced_indices_keep_their_place():
    class Consecutive(nn.Module):
        def forward(self, k, slots, pos, cache):  # cache: [H, slots, S, D]; index dims 1 and 2 together
            cache[:, :3][:, slots, pos] = k  # k: [H, N, D]
            return cache.sum(2)

    k, cache = torch.randn(2, 3, 8), torch.randn(2, 4, 12, 8)
    run_against_eager(Consecutive(), [k, torch.tensor([0, 2, 1]), torch.tensor([5, 0, 9]), cache], 3)


def test_advanced_indices_of_different_ranks_broadcast():
    class Broadcast(nn.Module):
        def forward(self, k, rows, cols, cache):  # rows: [2, 3], cols: [3] -> [2, 3] positions
            cache.narrow(0, 0, 3)[rows, :, cols] = k  # k: [2, 3, H]
            return cache.sum(2)

    rows, cols = torch.tensor([[0, 1, 2], [2, 1, 0]]), torch.tensor([4, 7, 1])
    run_against_eager(Broadcast(), [torch.randn(2, 3, 2), rows, cols, torch.randn(4, 2, 12)], 3)


def test_a_write_up_to_the_last_position_maps_dim_by_dim():
    """Each view dim walks one root dim, up to its end: no flat offsets (floor_divide)."""

    class LastPositions(nn.Module):
        def forward(self, k, cache):  # cache: [B, H, S, D]; the last two of S positions
            cache[:, :, 14:16] = k
            return cache.sum(2)

    gm, _ = run_against_eager(LastPositions(), [torch.randn(2, 3, 2, 8), torch.randn(2, 3, 16, 8)], 1)
    assert not any(n.target is aten.floor_divide.default for n in gm.graph.nodes)


class ContextWrite(nn.Module):
    """A decode layer's write on a backend without views: the whole layer cache comes in,
    the graph reads and writes its first 8 positions (a context bucket)."""

    def forward(self, k, pos, slots, cache):  # cache: [slots, H, S, D]; k: [N, H, D]
        first = cache[:, :, :8]
        first[slots, :, pos] = k
        return first[: k.shape[0]].sum(2)


def test_a_write_through_the_first_positions_is_the_same_write_on_the_cache():
    """Case 6: a prefix view written with an index tensor in each narrowed dim becomes the
    same index_put_ on the input, with no index tensors built (no arange in the graph)."""
    k = torch.randn(3, 2, 8)
    pos = torch.tensor([5, 0, 7])
    slots = torch.tensor([0, 2, -1])  # padding rows: the scratch slot
    gm = check(ContextWrite(), [k, pos, slots, torch.randn(4, 2, 16, 8)], 3, expected_writes=1)
    (write,) = writes(gm)
    assert write.args[1][0].name == "slots" and write.args[1][1] is None  # the user's own indices, dim 1 whole
    assert write.args[1][2].target is aten.remainder.Scalar and write.args[1][2].args == (write.args[1][2].args[0], 8)
    assert not any(n.target is aten.arange.default for n in gm.graph.nodes)
