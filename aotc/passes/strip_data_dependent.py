"""Make a graph with data-dependent sizes static: `nonzero` and `.item()` out.

Traced under a ShapeEnv, `nonzero`, a boolean-mask index and `.item()` give
unbacked symbolic sizes (u0, u1, ...). A static-shape backend (XLA, Neuron)
cannot compile them; this pass rewrites them into fixed-size tensor code and
re-propagates the fake values, so that no unbacked symbol is left.

Cases handled:

1. `nonzero(x)`, `nonzero(x, as_tuple=True)` and `x[mask]` ->
   `nonzero_static(size=bound, fill_value=-1)`, where the bound is the
   model's `torch._check(n <= bound)` read from the shape env (the number of
   elements when there is none). The fill rows are padded rows: their indices
   are clamped to 0, and a validity mask (`arange(bound) < count`) follows
   them through an allow-list of row-wise ops (pointwise, casts, views that
   keep the row dim, `linear`, `index` by padded rows, reductions over other
   dims).
2. Where padded rows would change a result, they are masked: the source of
   `index_add_` and of an accumulating `index_put_` is zeroed, a sum / mean /
   amax over the padded dim ignores them, and a cache write (`index_put_` on
   a graph input) sends them to the scratch slot (`SCRATCH_SLOT`, the cache's
   last slot), never to a real one.
3. `.item()` -> the 0-d tensor itself; the integer arithmetic on it becomes
   tensor arithmetic, and a `select` / `slice` at that offset becomes one
   gather (`index_select` at `clamp(start + arange(L))`): exact when the
   length L is constant, padded and masked as in 1-2 when it is only bounded.
4. Runtime asserts on unbacked sizes (the model's `torch._check`) are dropped:
   the static graph meets them by construction.

Anything else that depends on the data (a size from `.item()`, padded rows
mixed by an op not known to be row-wise, a padded output) is a TraceError
naming the source line and what to write instead.

Before:
    nonzero_numpy = aten.nonzero_numpy.default(eq)          # eq: [4, 2] bool
    rows = getitem(nonzero_numpy, 0)                        # [u0]
    index = aten.index.Tensor(x, [rows])                    # [u0, 128]
    ...
    index_add_ = aten.index_add_.default(out, 0, rows, y)   # y: [u0, 128]
After:
    nonzero_static = aten.nonzero_static.default(eq, size=4, fill_value=-1)
    valid = aten.ne.Scalar(aten.select.int(nonzero_static, 1, 0), -1)   # [4]
    nz = aten.clamp_min.default(nonzero_static, 0)
    rows = aten.select.int(nz, 1, 0)                        # [4]
    index = aten.index.Tensor(x, [rows])                    # [4, 128]
    ...
    masked = aten.where.self(aten.view.default(valid, [4, 1]), y, zeros)
    index_add_ = aten.index_add_.default(out, 0, rows, masked)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._sympy.functions import Max as TorchMax
from torch.utils._sympy.functions import Min as TorchMin

from ..errors import TraceError
from ..models.base import SCRATCH_SLOT
from .base import GraphPass, alias_root, insert_call, source_line
from .unbacked_ops import (
    _ASSERTS,
    _INDEX_PUT,
    _ITEM,
    _ROW_WISE,
    _SCATTER_ADD,
    _SPLITS,
    _SYM_ARITH,
    _SYM_COMPARE,
    _broadcast_shape,
    _expr,
    _min_of,
    _reduced_dims,
    _static_numel,
    _vals,
    has_unbacked,
    propagate,
    unbacked_in,
)

aten = torch.ops.aten

_SUM, _MEAN, _AMAX = aten.sum.dim_IntList, aten.mean.dim, aten.amax.default


@dataclass
class _Padded:
    """A dim of static size `bound` whose first `count` rows are real; `valid`: [bound] bool."""

    bound: int
    valid: fx.Node


class StripDataDependent(GraphPass):
    name = "strip_data_dependent"

    def run(self, gm: fx.GraphModule) -> int:
        if not has_unbacked(gm):
            return 0
        return _Stripper(gm).run()


class _Stripper:
    def __init__(self, gm: fx.GraphModule):
        self.gm, self.graph = gm, gm.graph
        fake = next(n.meta["val"] for n in self.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor))
        self.mode = fake.fake_mode
        shape_envs = [v.fake_mode.shape_env for n in self.graph.nodes for v in _vals(n) if isinstance(v, torch._subclasses.FakeTensor)]
        self.shape_env = next((s for s in shape_envs if s is not None and s.var_to_range), None)
        self.padded: dict[sympy.Expr, _Padded] = {}
        self.scalars: dict[fx.Node, fx.Node] = {}  # SymInt node -> 0-d int64 tensor node
        self.changes = 0
        self.at: fx.Node | None = None  # the node being rewritten (for stack traces)

    # -- building --------------------------------------------------------------
    def call(self, target, *args, val=None, **kwargs) -> fx.Node:
        """Insert a call with the stack trace of the node being rewritten. `val` is its
        fake value in terms of the ORIGINAL symbols (the final propagation recomputes
        it); without one, it is computed."""
        return insert_call(self.graph, target, *args, val=val, trace_of=self.at, **kwargs)

    def fail(self, node: fx.Node, what: str, fix: str):
        raise TraceError(f"{source_line(node)}: {what}; a static-shape backend cannot compile it. {fix}")

    # -- the walk ----------------------------------------------------------------
    def run(self) -> int:
        for node in list(self.graph.nodes):
            if node.op not in ("call_function", "output"):
                continue
            self.at = node
            with self.graph.inserting_before(node):
                if node.op == "output":
                    self.check_output(node)
                elif node.target in _ASSERTS:
                    continue
                elif node.target in (aten.nonzero.default, aten.nonzero_numpy.default) or self.is_mask_index(node):
                    self.strip_nonzero(node)
                elif node.target in _ITEM:
                    self.strip_item(node)
                elif node.target in _SYM_ARITH or node.target in (operator.floordiv, operator.neg):
                    self.strip_sym_arith(node)
                elif node.target in _SYM_COMPARE or node.target is aten.sym_size.int:
                    continue  # only asserts may use them: checked at the end
                elif node.target is operator.getitem:
                    continue
                elif node.target in (aten.select.int, aten.slice.Tensor) and any(a in self.scalars for a in node.args):
                    self.strip_offset(node)
                else:
                    self.check_rows(node)
        self.finish()
        return self.changes

    # -- case 1: nonzero -> nonzero_static ---------------------------------------
    def is_mask_index(self, node: fx.Node) -> bool:
        if node.target is not aten.index.Tensor:
            return False
        return any(isinstance(i, fx.Node) and i.meta["val"].dtype == torch.bool for i in node.args[1])

    def strip_nonzero(self, node: fx.Node) -> None:
        if node.target is aten.index.Tensor:
            masks = [(k, i) for k, i in enumerate(node.args[1]) if isinstance(i, fx.Node) and i.meta["val"].dtype == torch.bool]
            if len(masks) > 1:
                self.fail(node, "indexing by two boolean masks", "Combine them into one mask first (m1 & m2)")
            k, mask = masks[0]
            rows = node.meta["val"].shape[k]
        elif node.target is aten.nonzero.default:
            mask, rows = node.args[0], node.meta["val"].shape[0]
        else:
            mask, rows = node.args[0], node.meta["val"][0].shape[0]
        mval = mask.meta["val"]
        bound = self.bound(_expr(rows), mval.numel())
        found = self.call(aten.nonzero_static.default, mask, size=bound, fill_value=-1)  # [bound, ndim]
        valid = self.call(aten.ne.Scalar, self.call(aten.select.int, found, 1, 0), -1)
        self.padded[_expr(rows)] = _Padded(bound, valid)
        with self.mode:  # its value in the original symbols: [rows, ndim]
            like = torch.empty((rows, mval.dim()), dtype=torch.long, device=mval.device)
        clamped = self.call(aten.clamp_min.default, found, 0, val=like)  # fill rows index row 0
        if node.target is aten.nonzero.default:
            node.replace_all_uses_with(clamped)
        else:
            cols = [self.call(aten.select.int, clamped, 1, j) for j in range(mval.dim())]
            if node.target is aten.nonzero_numpy.default:
                for user in list(node.users):
                    if user.target is not operator.getitem:
                        self.fail(user, "nonzero(as_tuple=True) used other than by unpacking", "Unpack it: rows, cols = m.nonzero(as_tuple=True)")
                    user.replace_all_uses_with(cols[user.args[1]])
            else:  # x[mask] -> x[i0, i1, ...] with the mask's nonzero indices
                indices = list(node.args[1])
                indices[k : k + 1] = cols
                node.replace_all_uses_with(self.call(aten.index.Tensor, node.args[0], indices, val=node.meta["val"]))
        self.changes += 1

    def bound(self, expr: sympy.Expr | None, fallback: int) -> int:
        """The largest value of an unbacked size: from the model's torch._check, else `fallback`."""
        if expr is None or self.shape_env is None:
            return fallback
        from torch.utils._sympy.value_ranges import bound_sympy

        ranges = self.shape_env.var_to_range
        # A slice's size comes as Max(0, end - Min(size, start)): bounding it as a
        # whole loses the relation between end and start (16 for a length <= 3).
        # Bound end - start instead: it bounds the size whenever start <= size,
        # and a slice starting past the end is empty anyway.
        while isinstance(expr, (sympy.Max, TorchMax)) and len(expr.args) == 2 and 0 in expr.args:
            expr = next(a for a in expr.args if a != 0)
        expr = expr.replace(lambda e: isinstance(e, (sympy.Min, TorchMin)), _min_of)
        uppers = [ranges[expr].upper if expr in ranges else bound_sympy(expr, ranges).upper]
        # The checks that relate symbols (end <= start + 3) are runtime asserts:
        # a check a <= b with expr == a - b + c bounds expr by c.
        for asserts in self.shape_env.deferred_runtime_asserts.values():
            for check in asserts:
                rel = check.expr
                if isinstance(rel, (sympy.Le, sympy.Lt)):
                    c = sympy.expand(expr - (rel.lhs - rel.rhs))
                    if c.is_number:
                        uppers.append(c - 1 if isinstance(rel, sympy.Lt) else c)
        finite = [int(u) for u in uppers if getattr(u, "is_finite", False) and u.is_number]
        return max(1, min([fallback] + finite))

    # -- case 3: .item() -> tensor ops and a gather ------------------------------------
    def strip_item(self, node: fx.Node) -> None:
        t = node.args[0]
        tval = t.meta["val"]
        if tval.dtype.is_floating_point or tval.dtype == torch.bool:
            self.fail(node, f".item() of a {tval.dtype} tensor", "Keep it a tensor (use it in tensor ops, or torch.where for a branch)")
        v = self.call(aten.view.default, t, [])
        if tval.dtype != torch.int64:
            v = self.call(aten._to_copy.default, v, dtype=torch.int64)
        self.scalars[node] = v
        self.changes += 1

    def as_tensor(self, x) -> fx.Node:
        if isinstance(x, fx.Node):
            return self.scalars[x]
        return self.call(aten.scalar_tensor.default, int(x), dtype=torch.int64)

    def strip_sym_arith(self, node: fx.Node) -> None:
        if not any(a in self.scalars for a in node.args):
            return
        if node.target is operator.neg:
            self.scalars[node] = self.call(aten.neg.default, self.as_tensor(node.args[0]))
        elif node.target is operator.floordiv:
            a, b = (self.as_tensor(x) for x in node.args)
            self.scalars[node] = self.call(aten.div.Tensor_mode, a, b, rounding_mode="floor")
        else:
            a, b = (self.as_tensor(x) for x in node.args)
            self.scalars[node] = self.call(_SYM_ARITH[node.target], a, b)

    def strip_offset(self, node: fx.Node) -> None:
        """select / slice at an offset computed from .item(): one index_select."""
        x, dim = node.args[0], node.args[1]
        xval = x.meta["val"]
        size = xval.shape[dim]
        if not isinstance(size, int):
            self.fail(node, "a select/slice of a data-dependent size", "Slice a tensor of static shape")
        if node.target is aten.select.int:
            at = self.call(aten.remainder.Scalar, self.as_tensor(node.args[2]), size)  # Python's negative indices
            picked = self.call(aten.index_select.default, x, dim, self.call(aten.view.default, at, [1]))
            new = self.call(aten.squeeze.dim, picked, dim, val=node.meta["val"])
        else:
            start, end = node.args[2], node.args[3]
            step = node.args[4] if len(node.args) > 4 else 1
            if step != 1:
                self.fail(node, "a strided slice at a data-dependent offset", "Use step 1, or gather with an index tensor")
            start = 0 if start is None else start
            end = size if end is None else end
            length = node.meta["val"].shape[dim]
            start_t = self.as_tensor(start)
            if isinstance(length, int):  # exact: a fixed number of rows
                count, bound = None, length
            else:
                # Python's slice: both ends clamped to the size, never negative.
                first = self.call(aten.clamp.default, start_t, None, size)
                last = self.call(aten.clamp.default, self.as_tensor(end), None, size)
                count = self.call(aten.sub.Tensor, last, first)
                bound = self.bound(_expr(length), size)
            offsets = self.call(aten.arange.default, bound, dtype=torch.int64, device=xval.device)
            at = self.call(aten.clamp.default, self.call(aten.add.Tensor, start_t, offsets), 0, size - 1)
            new = self.call(aten.index_select.default, x, dim, at, val=node.meta["val"])
            if count is not None:
                valid = self.call(aten.lt.Tensor, offsets, count)
                self.padded[_expr(length)] = _Padded(bound, valid)
        node.replace_all_uses_with(new)
        self.changes += 1

    # -- case 2: padded rows through their consumers ---------------------------------------------
    def padded_dims(self, node: fx.Node, val=None) -> list[tuple[int, _Padded]]:
        val = node.meta.get("val") if val is None else val
        if not isinstance(val, torch.Tensor):
            return []
        out = []
        for d, s in enumerate(val.shape):
            e = _expr(s)
            if e is None or not free_unbacked_symbols(s):
                continue
            if e not in self.padded:
                self.fail(
                    node,
                    f"{node.target} gives a tensor of data-dependent size {s} (dim {d})",
                    "Keep rows of nonzero / a mask in their own dim (no reshape that merges them), or compute with a fixed-size mask (torch.where)",
                )
            out.append((d, self.padded[e]))
        return out

    def check_rows(self, node: fx.Node) -> None:
        inputs = [a for a in node.all_input_nodes]
        if any(a in self.scalars for a in inputs):
            if torch.Tag.pointwise in getattr(node.target, "tags", ()):
                node.args = fx.node.map_arg(node.args, lambda a: self.scalars.get(a, a))
                self.changes += 1
                return
            self.fail(
                node,
                f"{node.target} takes a value computed by .item() (a size or an index)",
                "Use the tensor itself: index with index tensors, build fixed-size tensors and mask them",
            )
        ins = {a: self.padded_dims(a) for a in inputs}
        if not any(ins.values()):
            self.padded_dims(node)
            return
        target = node.target
        if target in _SCATTER_ADD:
            return self.mask_scatter_add(node)
        if target in _INDEX_PUT:
            return self.mask_index_put(node)
        if target is aten._assert_tensor_metadata.default:
            return
        if target in (_SUM, _MEAN, _AMAX, aten.sum.default):
            src = node.args[0]
            reduced = _reduced_dims(node, src.meta["val"].dim())
            hit = [(d, p) for d, p in ins[src] if d in reduced]
            if hit:
                return self.mask_reduction(node, hit)
        if target in (aten.linear.default, aten.mm.default, aten.matmul.default):
            a, b = node.args[0], node.args[1]
            if ins.get(b) or any(d == a.meta["val"].dim() - 1 for d, _ in ins[a]):
                self.fail(node, f"{target} contracts over the padded rows of nonzero", "Reduce over rows with sum / index_add_ instead")
            return
        if target in (aten.cat.default, aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten.amin.default):
            dim = node.args[1] if len(node.args) > 1 else 0
            for a, dims in ins.items():
                if any(d == dim % a.meta["val"].dim() for d, _ in dims):
                    self.fail(node, f"{target} across the rows of nonzero", "Keep rows independent; reduce them with sum / index_add_")
            return
        if target in _SPLITS:  # (a tuple, read by getitem) row-wise unless it splits the rows (which export mostly refuses itself)
            src = node.args[0]
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            if any(d == dim % src.meta["val"].dim() for d, _ in ins[src]):
                self.fail(node, f"{target} across the rows of nonzero", "Split along another dim; keep the rows together")
            return
        if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints):
            src = node.args[0]
            sval, oval = src.meta["val"], node.meta["val"]
            for d, p in ins[src]:
                before = _static_numel(sval.shape[:d])
                out = [k for k, s in enumerate(oval.shape) if _expr(s) is not None and self.padded.get(_expr(s)) is p]
                if not out or before != _static_numel(oval.shape[: out[0]]):
                    self.fail(node, "a reshape that moves the rows of nonzero", "Keep the row dim in place when reshaping")
            self.padded_dims(node)
            return
        if target in _ROW_WISE or torch.Tag.pointwise in getattr(target, "tags", ()):
            self.padded_dims(node)
            return
        self.fail(
            node,
            f"{target} on the rows of nonzero / a boolean mask (padded to a fixed count), which is not known to be row-wise",
            "Use row-wise ops on them and combine rows with index_add_ / sum, or write it with a fixed-size mask (torch.where)",
        )

    def valid_at(self, p: _Padded, dim: int, ndim: int) -> fx.Node:
        return self.call(aten.view.default, p.valid, [p.bound if d == dim else 1 for d in range(ndim)])

    def zero_padded(self, src: fx.Node, dims, fill=0.0) -> fx.Node:
        val = src.meta["val"]
        out = src
        for d, p in dims:
            keep = self.valid_at(p, d, val.dim())
            out = self.call(aten.where.ScalarOther, keep, out, fill, val=val)
        return out

    def mask_scatter_add(self, node: fx.Node) -> None:
        # index_add_(target, dim, index, source): padded rows add 0 (their index is clamped to 0)
        src = node.args[3]
        dims = self.padded_dims(src)
        if dims:
            node.update_arg(3, self.zero_padded(src, dims))
            self.changes += 1
        self.padded_dims(node)

    def mask_index_put(self, node: fx.Node) -> None:
        target, indices, values = node.args[0], list(node.args[1]), node.args[2]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if any(isinstance(i, fx.Node) and i.meta["val"].dtype == torch.bool for i in indices):
            self.fail(node, "a boolean-mask write of a data-dependent number of values", "Write x = torch.where(mask, new, x) instead")
        if isinstance(values, fx.Node) and self.padded_dims(values) and accumulate:
            node.update_arg(2, self.zero_padded(values, self.padded_dims(values)))
            self.changes += 1
            return
        root, _ = alias_root(target)
        if root.op != "placeholder":
            self.fail(
                node,
                "an indexed write at the rows of nonzero into a tensor that is not a cache input",
                "Accumulate instead (index_add_ / index_put_(..., accumulate=True) of masked values), or write into a cache",
            )
        # A cache write: padded rows go to the scratch slot (dim 0 of a cache is its slot).
        ivals = [i.meta["val"] for i in indices if isinstance(i, fx.Node)]
        bshape = _broadcast_shape([v.shape for v in ivals])
        padded = None
        for i in indices:
            if isinstance(i, fx.Node):
                for d, p in self.padded_dims(i):
                    padded = (d + len(bshape) - i.meta["val"].dim(), p)
        if padded is None:  # only the values are padded: broadcast against static indices
            self.fail(node, "a cache write of padded rows at static indices", "Index the write by the rows' own index tensors")
        d, p = padded
        keep = self.valid_at(p, d, len(bshape))
        first = indices[0]
        if not isinstance(first, fx.Node):
            self.fail(node, "a cache write without a slot index", "Index the cache's slot dim with a tensor")
        with self.mode:
            routed_val = torch.empty(bshape, dtype=torch.long, device=first.meta["val"].device)
        indices[0] = self.call(aten.where.ScalarOther, keep, first, SCRATCH_SLOT, val=routed_val)
        node.update_arg(1, indices)
        self.changes += 1

    def mask_reduction(self, node: fx.Node, hit) -> None:
        src = node.args[0]
        if node.target is _AMAX:
            node.update_arg(0, self.zero_padded(src, hit, float("-inf")))
        elif node.target is _MEAN:
            masked = self.zero_padded(src, hit)
            total = self.call(aten.sum.dim_IntList, masked, *node.args[1:], **node.kwargs, val=node.meta["val"])
            count = None
            for _, p in hit:
                c = self.call(aten.sum.default, p.valid)
                count = c if count is None else self.call(aten.mul.Tensor, count, c)
            new = self.call(aten.div.Tensor, total, count, val=node.meta["val"])
            node.replace_all_uses_with(new)
        else:
            node.update_arg(0, self.zero_padded(src, hit))
        self.changes += 1

    def check_output(self, node: fx.Node) -> None:
        for out in node.all_input_nodes:
            if self.padded_dims(out):
                self.fail(out, "an output whose size depends on the data", "Return a fixed-size tensor (pad it and return a mask, or reduce)")

    # -- the end: drop asserts, re-propagate, check ---------------------------------------------
    def finish(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "call_function" and node.target in _ASSERTS and any(unbacked_in(a) for a in node.all_input_nodes):
                self.graph.erase_node(node)
                self.changes += 1
        self.graph.eliminate_dead_code()
        for node in self.graph.nodes:  # what is left of an unbacked size must not feed anything
            if node.op == "call_function" and (node.target in _ITEM or node.target is aten.sym_size.int or node.target in _SYM_COMPARE) and unbacked_in(node):
                user = next(iter(node.users), node)
                self.fail(
                    user,
                    f"{user.target} uses a data-dependent number ({node.meta['val']})",
                    "Compute it as a tensor (x.sum(), a mask) instead of a Python number",
                )
        self.gm.recompile()
        propagate(self.gm)
        for node in self.graph.nodes:
            node.meta.pop("unbacked_bindings", None)
            if unbacked_in(node):
                self.fail(node, f"{node.target} still has a data-dependent size", "Write it with fixed-size tensors and masks")
