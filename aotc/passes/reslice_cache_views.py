"""Rewrite every write through a view of a graph input as one direct indexed
write on that input.

Written through a view, a cache update survives functionalization as a
scatter of the whole cache followed by a copy of the whole cache back into
the input: the compiled code copies the layer's cache on every call (8.5x
slower than eager at max_seq 1024, ../shared/DESIGN.md). Written as one
`index_put_` on the input itself, backends lower it to an in-place scatter of
just the new rows.

Cases handled (the target is any chain of view ops on a placeholder,
including a layer's slice of a bigger root, and in-place results, which
alias their input):

1. `copy_(view, src)`                 -> index_put_(root, idx, src)
2. `fill_(view, value)`, `zero_(view)` -> index_put_(root, idx, full([], value))
3. `index_put_(view, indices, v)`     -> index_put_(root, idx ∘ indices, v)
4. `index_copy_(view, dim, index, v)` -> as 3, with `index` at `dim`
5. a direct write whose target is an in-place result of the root is pointed
   at the root placeholder itself.
6. `index_put_(prefix, indices, v)`, where the view is the root's first
   positions along some dims (same strides, no offset: a context bucket's
   cache, narrowed in the graph) and indices has a tensor for each such dim
   -> index_put_(root, indices, v): the same write, with no index tensors
   built (each narrowed dim's index taken modulo the view's length, as a
   negative one counts from the view's end).

Index tensors are built in the graph from `arange` over the view's dims and
the view's strides relative to the root (read from the fake tensors), so
dynamic index tensors (positions, slots) compose with static slices.

Before:
    select = aten.select.int(k_cache, 0, 1)
    slice_1 = aten.slice.Tensor(select, 1, 4, 6)
    copy_ = aten.copy_.default(slice_1, k)
After:
    i0 = ...; i1 = ...; i2 = ...          # broadcast index tensors
    index_put_ = aten.index_put_.default(k_cache, [i0, i1, i2], k)

Any other in-place op on a view of an input is reported with its source line.
"""

from __future__ import annotations

import torch
from torch import fx

from ..errors import TraceError
from .base import GraphPass, alias_root, fake_val, insert_call, is_inplace_op, source_line

aten = torch.ops.aten

_WRITES = {
    aten.copy_.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.index_put_.default,
    aten.index_copy_.default,
}


class ResliceCacheViews(GraphPass):
    name = "reslice_cache_views"

    def run(self, gm: fx.GraphModule) -> int:
        changes = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or not is_inplace_op(node.target):
                continue
            root, views = alias_root(node.args[0])
            if root.op != "placeholder":
                continue
            if not views:
                if node.args[0] is not root and node.target is aten.index_put_.default:
                    node.update_arg(0, root)  # case 5
                    changes += 1
                continue
            if node.target not in _WRITES:
                raise TraceError(
                    f"{source_line(node)}: in-place {node.target} writes through a view of input '{root.name}'; write with index_put_ (x[idx] = v) or copy_ on the view instead"
                )
            with gm.graph.inserting_before(node):
                new = _Rewriter(gm.graph, node, root).rewrite()
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            new.meta["stack_trace"] = node.meta.get("stack_trace")
            changes += 1
        return changes


class _Rewriter:
    def __init__(self, graph: fx.Graph, node: fx.Node, root: fx.Node):
        self.graph, self.node, self.root = graph, node, root
        self.view = fake_val(node.args[0])
        self.base = fake_val(root)
        self.device = self.base.device
        if not self.base.is_contiguous():
            raise TraceError(f"{source_line(node)}: input '{root.name}' is written through a view but is not contiguous")
        if any(not isinstance(s, int) for s in (*self.view.shape, *self.view.stride(), self.view.storage_offset())):
            raise TraceError(
                f"{source_line(node)}: a view of '{root.name}' has a data-dependent shape or offset; "
                "write with index tensors (cache[:, :, positions] = k) instead of slicing by a tensor value"
            )

    # -- graph building helpers ------------------------------------------------
    def call(self, target, *args, **kwargs) -> fx.Node:
        return insert_call(self.graph, target, *args, **kwargs)

    def arange(self, n: int, dim: int, ndim: int) -> fx.Node:
        """arange(n) shaped to broadcast along `dim` of an `ndim`-dim result."""
        r = self.call(aten.arange.default, n, dtype=torch.int64, device=self.device)
        return self.call(aten.view.default, r, [n if d == dim else 1 for d in range(ndim)])

    # -- the rewrite -----------------------------------------------------------
    def rewrite(self) -> fx.Node:
        node, target = self.node, self.node.target
        shape = list(self.view.shape)
        accumulate = False
        if target is aten.index_put_.default:
            values = node.args[2]
            accumulate = bool(node.args[3]) if len(node.args) > 3 else bool(node.kwargs.get("accumulate", False))
            prefix = self.prefix_indices(list(node.args[1]))
            if prefix is not None:  # case 6
                return self.call(aten.index_put_.default, self.root, prefix, self.as_root_dtype(values), accumulate)
            idx, result_shape = self.view_indices(list(node.args[1]))
        elif target is aten.index_copy_.default:
            dim, index, values = node.args[1], node.args[2], node.args[3]
            dim = dim % len(shape)
            idx, result_shape = self.view_indices([None] * dim + [index])
        else:
            idx = [self.arange(n, d, len(shape)) for d, n in enumerate(shape)]
            result_shape = shape
            if target is aten.copy_.default:
                values = node.args[1]
            else:
                fill = 0 if target is aten.zero_.default else node.args[1]
                values = fill if isinstance(fill, fx.Node) else self.call(aten.full.default, [], fill, dtype=self.base.dtype, device=self.device)
        root_idx = self.root_indices(idx, len(result_shape))
        return self.call(aten.index_put_.default, self.root, root_idx, self.as_root_dtype(values), accumulate)

    def as_root_dtype(self, values):
        if isinstance(values, fx.Node) and fake_val(values).dtype != self.base.dtype:
            return self.call(aten._to_copy.default, values, dtype=self.base.dtype)
        return values

    def prefix_indices(self, indices: list) -> list | None:
        """Case 6's indices on the root, or None where the view is not such a prefix."""
        view, base = self.view, self.base
        if view.dim() != base.dim() or view.stride() != base.stride() or view.storage_offset() != base.storage_offset():
            return None
        indices = indices + [None] * (view.dim() - len(indices))
        narrowed = [d for d in range(view.dim()) if view.shape[d] != base.shape[d]]
        if any(indices[d] is None or fake_val(indices[d]).dtype == torch.bool for d in narrowed):
            return None
        out = list(indices)
        for d in narrowed:
            out[d] = self.call(aten.remainder.Scalar, indices[d], view.shape[d])
        return out

    def view_indices(self, indices: list) -> tuple[list[fx.Node], list[int]]:
        """Per view dim, an index tensor broadcasting to the shape of view[indices]."""
        shape = list(self.view.shape)
        indices = indices + [None] * (len(shape) - len(indices))
        adv = [d for d, i in enumerate(indices) if i is not None]
        if not adv:
            return [self.arange(n, d, len(shape)) for d, n in enumerate(shape)], shape
        for d in adv:
            if fake_val(indices[d]).dtype == torch.bool:
                raise TraceError(f"{source_line(self.node)}: a boolean mask write into a cache is data-dependent; use index tensors")
        bshape = list(torch.broadcast_shapes(*(fake_val(indices[d]).shape for d in adv)))
        consecutive = adv == list(range(adv[0], adv[-1] + 1))
        rest = [d for d in range(len(shape)) if d not in adv]
        if consecutive:  # advanced dims stay in place
            before = [d for d in rest if d < adv[0]]
            after = [d for d in rest if d > adv[-1]]
            order = before + ["adv"] + after
        else:  # advanced dims go first
            order = ["adv"] + rest
        result_shape, pos = [], {}
        for d in order:
            if d == "adv":
                pos["adv"] = len(result_shape)
                result_shape += bshape
            else:
                pos[d] = len(result_shape)
                result_shape.append(shape[d])
        ndim = len(result_shape)
        out = []
        for d in range(len(shape)):
            if indices[d] is None:
                out.append(self.arange(shape[d], pos[d], ndim))
                continue
            i = indices[d]
            ishape = list(fake_val(i).shape)
            ishape = [1] * (len(bshape) - len(ishape)) + ishape
            p = pos["adv"]
            i = self.call(aten.view.default, i, [1] * p + ishape + [1] * (ndim - p - len(bshape)))
            # Negative indices count from the end of this view dim.
            out.append(self.call(aten.remainder.Scalar, i, shape[d]))
        return out, result_shape

    def root_indices(self, idx: list[fx.Node], ndim: int) -> list[fx.Node]:
        """Map per-view-dim indices to per-root-dim indices through the strides."""
        view, base = self.view, self.base
        rshape, rstride = list(base.shape), list(base.stride())
        offset = view.storage_offset() - base.storage_offset()
        const = []
        for n, s in zip(rshape, rstride):
            const.append((offset // s) % n)
        mapping = {}  # view dim -> (root dim, multiplier)
        for d, (n, s) in enumerate(zip(view.shape, view.stride())):
            if n == 1:
                continue
            r = next((r for r in range(len(rshape)) if rstride[r] <= s and s % rstride[r] == 0 and rshape[r] > 1), None)
            if r is None:
                mapping = None
                break
            mapping[d] = (r, s // rstride[r])
        if mapping is not None:
            extent = list(const)
            for d, (r, m) in mapping.items():
                extent[r] += (view.shape[d] - 1) * m
            if all(e < n for e, n in zip(extent, rshape)):
                return self.separable(idx, mapping, const, ndim)
        return self.general(idx, offset, ndim)

    def separable(self, idx, mapping, const, ndim) -> list[fx.Node]:
        # Each view dim walks one root dim: root_idx[r] = const[r] + sum(idx[d] * m).
        out = []
        for r, c in enumerate(const):
            terms = [(idx[d], m) for d, (rr, m) in mapping.items() if rr == r]
            acc = None
            for t, m in terms:
                t = t if m == 1 else self.call(aten.mul.Tensor, t, m)
                acc = t if acc is None else self.call(aten.add.Tensor, acc, t)
            if acc is None:
                acc = self.call(aten.full.default, [1] * ndim, c, dtype=torch.int64, device=self.device)
            elif c:
                acc = self.call(aten.add.Tensor, acc, c)
            out.append(acc)
        return out

    def general(self, idx, offset, ndim) -> list[fx.Node]:
        # Views that merge root dims: go through the flat element offset.
        flat = None
        for t, s in zip(idx, self.view.stride()):
            t = self.call(aten.mul.Tensor, t, s)
            flat = t if flat is None else self.call(aten.add.Tensor, flat, t)
        if offset:
            flat = self.call(aten.add.Tensor, flat, offset)
        out = []
        for n, s in zip(self.base.shape, self.base.stride()):
            q = self.call(aten.floor_divide.default, flat, s) if s != 1 else flat
            out.append(self.call(aten.remainder.Scalar, q, n))
        return out
