"""What strip_data_dependent knows of ops and unbacked sizes: the ops it treats row by row, the asserts and symbolic arithmetic it removes, and the static size of a value after it."""

from __future__ import annotations

import operator

import sympy
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

aten = torch.ops.aten

_ASSERTS = {
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten.sym_constrain_range.default,
}


_ITEM = {aten.item.default, aten._local_scalar_dense.default}


_SYM_ARITH = {
    operator.add: aten.add.Tensor,
    operator.sub: aten.sub.Tensor,
    operator.mul: aten.mul.Tensor,
    operator.mod: aten.remainder.Tensor,
    torch.sym_max: aten.maximum.default,
    torch.sym_min: aten.minimum.default,
}


_SYM_COMPARE = {operator.ge, operator.gt, operator.le, operator.lt, operator.eq, operator.ne}


# Ops whose rows stay independent (beyond pointwise ops, found by their tag).
_ROW_WISE = {
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten._to_copy.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten.type_as.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.expand.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.select.int,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.linear.default,
    aten.matmul.default,
    aten.mm.default,
    aten.index.Tensor,
    aten.index_select.default,
    aten.stack.default,
    aten.cat.default,
    aten.softmax.int,
    aten._softmax.default,
    aten.log_softmax.int,
    aten.sum.dim_IntList,
    aten.mean.dim,
    aten.amax.default,
    aten.amin.default,
    aten.gelu.default,
    aten.silu.default,
    aten.relu.default,
    aten.sigmoid.default,
    aten.clamp.default,
}


_SPLITS = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor}


_SCATTER_ADD = {aten.index_add_.default, aten.index_add.default}


_INDEX_PUT = {aten.index_put_.default, aten.index_put.default}


def has_unbacked(gm: fx.GraphModule) -> bool:
    return any(unbacked_in(n) for n in gm.graph.nodes)


def unbacked_in(node: fx.Node) -> set:
    """The unbacked symbols in a node's fake value (sizes, strides, or a SymInt)."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    out = set()
    for v in vals:
        if isinstance(v, (torch.Tensor, torch.SymInt, torch.SymBool, torch.SymFloat)):
            out |= free_unbacked_symbols(v)
    return out


def _expr(size) -> sympy.Expr | None:
    return size.node.expr if isinstance(size, torch.SymInt) else None


def propagate(gm: fx.GraphModule) -> None:
    """Recompute every node's fake value from the (static) placeholders."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    args = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            v = node.meta["val"]
            with mode:
                args.append(torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device))
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)


def _min_of(e: sympy.Expr) -> sympy.Expr:
    """Min(size, x) -> x (see `bound`)."""
    rest = [a for a in e.args if not a.is_number]
    return rest[0] if len(rest) == 1 else e


def _vals(node: fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (list, tuple)) else [val]


def _reduced_dims(node: fx.Node, ndim: int) -> set[int]:
    if node.target is aten.sum.default:
        return set(range(ndim))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        return set(range(ndim))
    dims = [dims] if isinstance(dims, int) else dims
    return {d % ndim for d in dims}


def _static_numel(shape) -> int | None:
    n = 1
    for s in shape:
        if not isinstance(s, int):
            return None
        n *= s
    return n


def _broadcast_shape(shapes) -> list:
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for s in shapes:
        for k, n in enumerate(s):
            d = ndim - len(s) + k
            if not (isinstance(n, int) and n == 1):
                out[d] = n
    return out
