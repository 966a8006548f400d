"""Give each dtype region of a graph input an input of its own.

A cache may pack several dtypes into one byte row per token: DeepSeek V4
keeps a token's fp8 NoPE values, their fp32 scales and its bf16 RoPE values
side by side, and aotc's fp8 KV caches do the same (aotc.kvcache). The model
reads and writes such a buffer through views of its column ranges,
`cache[..., a:b].view(torch.float32)`. Compiled as one input, that fails or
copies:

* given the regions as separate inputs that share one storage, aot_autograd
  compares their offsets in their own element units, sees an overlap that is
  not there and fails: "input mutations on views with different dtypes";
* functionalized, a write through a region view becomes a `slice_scatter` of
  the whole buffer and a copy back: the layer's cache copied on every call.

This pass replaces the input by one input per region, each a separate
allocation (DESIGN.md, Caches), so that every write is one direct
`index_put_` on an input. The runtime allocates the regions apart
(`aotc.kvcache.Regions`); eager code keeps the packed buffer.

Before:
    slice_1 = aten.slice.Tensor(cache, 3, 0, 64)
    view = aten.view.dtype(slice_1, torch.float8_e4m3fn)
    index_put_ = aten.index_put_.default(view, [slots, pos], q)
After:
    cache_r0_64                          # placeholder: float8_e4m3fn [..., 64]
    index_put_ = aten.index_put_.default(cache_r0_64, [slots, pos], q)

An input is split when every use is a slice of its last dim (step 1),
viewed as at most one dtype, and at least one view changes the dtype. Regions
that overlap, or a region read both as a whole and in another dtype, are
reported with their source line. The pass result's `replaced` is the split:
{input position: [(byte start, byte end), ...]}, in byte order, one region per
input now in the packed input's place (ProgramPass re-signs the program).

An input whose one use is a chain of slices of its other dims (a whole cache
that the graph reads through its first positions: a context bucket on a
backend without views) is split below that chain, and each region input
gets the same slices:

    narrow = aten.slice.Tensor(cache, 2, 0, 256)
    slice_1 = aten.slice.Tensor(narrow, 3, 0, 64)
    view = aten.view.dtype(slice_1, torch.float8_e4m3fn)
becomes
    cache_r0_64                          # placeholder: float8_e4m3fn [..., 4096, 64]
    slice_2 = aten.slice.Tensor(cache_r0_64, 2, 0, 256)
"""

from __future__ import annotations

import torch
from torch import fx

from ..errors import TraceError
from .base import ProgramPass, fake_val, is_inplace_op, source_line

aten = torch.ops.aten


class SplitDtypeRegions(ProgramPass):
    name = "split_dtype_regions"

    def run(self, gm: fx.GraphModule) -> dict[int, list[tuple[int, int]]]:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        split: dict[int, list[tuple[int, int]]] = {}
        changed: set[fx.Node] = set()
        for index, node in enumerate(placeholders):
            chain = _leading_slices(node)
            regions = _regions(node, chain[-1] if chain else node)
            if regions is None:
                continue
            split[index] = sorted(regions)
            changed |= _replace(gm, node, regions, chain)
        if split:
            _refresh(gm, changed)
        return split


def _leading_slices(node: fx.Node) -> list[fx.Node]:
    """The chain of slices of other dims than the last that is the input's one use, if any."""
    chain, at = [], node
    last = fake_val(node).dim() - 1
    while len(at.users) == 1:
        use = next(iter(at.users))
        if use.target is not aten.slice.Tensor or use.args[0] is not at or use.args[1] % (last + 1) == last:
            break
        chain.append(use)
        at = use
    return chain


def _regions(node: fx.Node, top: fx.Node) -> dict[tuple[int, int], tuple[torch.dtype, list[fx.Node]]] | None:
    """{(byte start, byte end): (dtype, the nodes that are the region)} when every use of
    the input (of `top`, the end of its chain of leading slices) is a last-dim slice seen
    as one dtype and some dtype differs; else None."""
    val = fake_val(node)
    if val.dim() == 0 or not top.users:
        return None
    last, item = val.dim() - 1, val.dtype.itemsize
    regions: dict[tuple[int, int], tuple[torch.dtype, list[fx.Node]]] = {}
    for use in top.users:
        if use.target is not aten.slice.Tensor or use.args[0] is not top:
            return None
        dim, start, end, step = (list(use.args[1:]) + [0, None, None, 1][len(use.args) - 1 :])[:4]
        if dim % val.dim() != last or step != 1:
            return None
        # An open-ended slice's end is None or 2**63 - 1 (export writes either): both clamp to the width.
        start, end = start or 0, val.shape[last] if end is None else min(end, val.shape[last])
        views = [u for u in use.users if u.target is aten.view.dtype]
        dtypes = {v.args[1] for v in views}
        if len(views) != len(use.users) and views:  # the slice read as bytes and as another dtype
            raise TraceError(
                f"{source_line(use)}: columns {start}:{end} of input '{node.name}' are read both as {val.dtype} "
                f"and as {', '.join(map(str, dtypes))}; read each region of a packed buffer as one dtype"
            )
        if len(dtypes) > 1:
            raise TraceError(
                f"{source_line(use)}: columns {start}:{end} of input '{node.name}' are viewed as "
                f"{' and '.join(sorted(map(str, dtypes)))}; read each region of a packed buffer as one dtype"
            )
        dtype = dtypes.pop() if dtypes else val.dtype
        key = (start * item, end * item)
        known = regions.setdefault(key, (dtype, []))
        if known[0] != dtype:
            raise TraceError(f"{source_line(use)}: bytes {key[0]}:{key[1]} of input '{node.name}' are viewed as {known[0]} and as {dtype}")
        known[1].extend(views or [use])
    if all(dtype == val.dtype for dtype, _ in regions.values()):
        return None
    spans = sorted(regions)
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        if b0 < a1:
            raise TraceError(
                f"input '{node.name}': its regions at bytes {a0}:{a1} and {b0}:{b1} overlap; the regions of a packed buffer must be disjoint column ranges, each read as one dtype"
            )
    return regions


def _replace(gm: fx.GraphModule, node: fx.Node, regions, chain: list[fx.Node]) -> set[fx.Node]:
    """Put one placeholder per region where `node` was, each sliced as the chain sliced the
    input; return the nodes that now read them."""
    val = fake_val(node)
    readers: set[fx.Node] = set()
    anchor = node
    top = chain[-1] if chain else node
    below = top.next  # each region's slices go here, in the chain's order
    for (start, end), (dtype, uses) in sorted(regions.items()):
        if start % dtype.itemsize or end % dtype.itemsize:
            raise TraceError(f"input '{node.name}': bytes {start}:{end} are not a whole number of {dtype} values")
        with gm.graph.inserting_after(anchor):
            region = gm.graph.placeholder(f"{node.name}_r{start}_{end}")
        count = (end - start) // dtype.itemsize
        with val.fake_mode:
            region.meta["val"] = torch.empty_strided((*val.shape[:-1], count), _region_strides(val, count), dtype=dtype, device=val.device)
        region.meta["tensor_meta"] = None
        at = region
        for link in chain:  # the region read through the same leading slices
            with gm.graph.inserting_before(below):
                sliced = gm.graph.call_function(aten.slice.Tensor, (at, *link.args[1:]))
            with val.fake_mode:
                sliced.meta["val"] = aten.slice.Tensor(at.meta["val"], *link.args[1:])
            sliced.meta["stack_trace"] = link.meta.get("stack_trace")
            at = sliced
        for use in uses:
            readers |= set(use.users)
            use.replace_all_uses_with(at)
        anchor = region
    for use in list(top.users):  # the last-dim slices, now unused
        for view in list(use.users):
            if view is not use and not view.users:
                gm.graph.erase_node(view)
        if not use.users:
            gm.graph.erase_node(use)
    for link in reversed(chain):
        gm.graph.erase_node(link)
    gm.graph.erase_node(node)
    return readers


def _region_strides(packed: torch.Tensor, count: int) -> tuple[int, ...]:
    """The strides of a region input of `count` values per row: those of the same view of
    the region's own allocation. A packed input that is a view of the first positions of
    a larger cache (a context bucket's decode graph) has the strides of that allocation,
    rows of `width` bytes; its region then is the same view of an allocation of rows of
    `count` values (kvcache.Regions), whose strides are the packed ones x count / width."""
    width = packed.shape[-1]
    lead = packed.stride()[:-1]
    if packed.stride()[-1] != 1 or any(s % width for s in lead):
        raise TraceError(f"a packed cache input of strides {list(packed.stride())} is not rows of {width} bytes; pass a view of a row-major cache")
    return (*(s // width * count for s in lead), 1)


def _refresh(gm: fx.GraphModule, changed: set[fx.Node]) -> None:
    """Recompute the fake values downstream of the new inputs: they are contiguous, where
    the views they replace were not, and later passes read strides from these values.
    Propagation stops where a value comes out as before, so data-dependent ops further
    down are not re-run (that would mint new unbacked symbols)."""
    mode = next(fake_val(n).fake_mode for n in gm.graph.nodes if n.op == "placeholder")
    dirty: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or (node not in changed and not any(a in dirty for a in node.all_input_nodes)):
            continue
        old = node.meta.get("val")
        if is_inplace_op(node.target) and isinstance(node.args[0], fx.Node):
            new = node.args[0].meta["val"]  # an in-place op returns its input
        else:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            with mode:
                new = node.target(*args, **kwargs)
        node.meta["val"] = new
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and _same_layout(old, new)):
            dirty.add(node)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
