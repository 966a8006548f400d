"""torch's functional collectives as per-rank HLO: the form Neuron compiles.

A tensor-parallel graph calls `torch.ops._c10d_functional` (all_reduce,
all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, wait_tensor) on a
process group named in the graph. torchax's own lowerings (torchax/ops/jc10d.py) bind
JAX's named-axis collectives, which lower only inside shard_map and then in JAX's
global-view form (channel_id, use_global_device_ids, xla.sdy custom calls), gather
untiled, and have no reduce-scatter or all-to-all. What neuronx-cc takes, as torch-xla's
BuildAllReduce, NxD and nkipy write it, is one module per rank whose collectives name
their `replica_groups` and nothing else: the groups are the only statement of the world.

So each collective here is a JAX primitive of its own whose MLIR lowering emits the
cross-replica op (`all-reduce`, `all-gather` tiled on dim 0 as torch's,
`reduce-scatter`, `all-to-all` of equal splits) with the group's ranks as its replica
groups, resolved from the process group the build traces under (aotc.parallel.tracing).
Run on one replica, such a module is wrong without a word (an all-reduce returns its
input), so it runs only where every rank is a replica.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..errors import BackendError

# Part of the xla backend's version, and so of every cache key its artifacts have.
VERSION = "collectives-1"
REDUCTIONS = ("sum", "avg", "max", "min")


def replica_groups(group_name: str) -> tuple[tuple[int, ...], ...]:
    """The replica groups of the process group `group_name`: every rank of the world,
    partitioned. One group of the whole world is all aotc builds today."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_initialized():
        raise BackendError(f"a collective on process group {group_name!r} outside a parallel build (aotc.parallel.tracing)")
    ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(group_name)))
    if sorted(ranks) != list(range(dist.get_world_size())):
        raise BackendError(f"a collective on process group {group_name!r} of ranks {list(ranks)}, not every rank of {dist.get_world_size()}: subgroups are not built on xla yet")
    return (ranks,)


@functools.cache
def _primitives() -> dict:
    """The four collectives as JAX primitives, each lowered to its cross-replica HLO op."""
    import jax
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo
    from jax.extend.core import Primitive

    def groups_attr(groups):
        return ir.DenseIntElementsAttr.get(np.asarray(groups, dtype=np.int64))

    def with_reduction(op, ctx, aval, how):
        # The scalar computation the reduction applies (its `to_apply`).
        scalar = mlir.aval_to_ir_type(ctx.module_context, jax.core.ShapedArray((), aval.dtype))
        block = op.regions[0].blocks.append(scalar, scalar)
        with ir.InsertionPoint(block):
            a, b = block.arguments
            hlo.return_([{"sum": hlo.add, "max": hlo.maximum, "min": hlo.minimum}[how](a, b)])
        return op

    def tensor_type(ctx, aval):
        return mlir.aval_to_ir_type(ctx.module_context, aval)

    made = {}

    all_reduce = Primitive("aotc_all_reduce")
    all_reduce.def_abstract_eval(lambda x, *, how, groups: jax.core.ShapedArray(x.shape, x.dtype))

    def all_reduce_lowering(ctx, x, *, how, groups):
        (aval,) = ctx.avals_in
        op = hlo.AllReduceOp([x.type], [x], replica_groups=groups_attr(groups))
        return with_reduction(op, ctx, aval, how).results

    mlir.register_lowering(all_reduce, all_reduce_lowering)
    made["all_reduce"] = all_reduce

    all_gather = Primitive("aotc_all_gather")
    all_gather.def_abstract_eval(lambda x, *, groups: jax.core.ShapedArray((x.shape[0] * len(groups[0]), *x.shape[1:]), x.dtype))

    def all_gather_lowering(ctx, x, *, groups):
        (out,) = ctx.avals_out
        return hlo.AllGatherOp([tensor_type(ctx, out)], [x], all_gather_dim=0, replica_groups=groups_attr(groups)).results

    mlir.register_lowering(all_gather, all_gather_lowering)
    made["all_gather"] = all_gather

    reduce_scatter = Primitive("aotc_reduce_scatter")
    reduce_scatter.def_abstract_eval(lambda x, *, how, groups: jax.core.ShapedArray((x.shape[0] // len(groups[0]), *x.shape[1:]), x.dtype))

    def reduce_scatter_lowering(ctx, x, *, how, groups):
        (aval,), (out,) = ctx.avals_in, ctx.avals_out
        op = hlo.ReduceScatterOp(tensor_type(ctx, out), x, scatter_dimension=0, replica_groups=groups_attr(groups))
        return with_reduction(op, ctx, aval, how).results

    mlir.register_lowering(reduce_scatter, reduce_scatter_lowering)
    made["reduce_scatter"] = reduce_scatter

    all_to_all = Primitive("aotc_all_to_all")
    all_to_all.def_abstract_eval(lambda x, *, groups: jax.core.ShapedArray(x.shape, x.dtype))

    def all_to_all_lowering(ctx, x, *, groups):
        n = len(groups[0])
        op = hlo.AllToAllOp([x], split_dimension=0, concat_dimension=0, split_count=n, replica_groups=groups_attr(groups), results=[x.type])
        return op.results

    mlir.register_lowering(all_to_all, all_to_all_lowering)
    made["all_to_all"] = all_to_all
    return made


def _reduction(reduce_op: str) -> str:
    how = reduce_op.lower()
    if how not in REDUCTIONS:
        raise BackendError(f"a collective reduces with {reduce_op!r}; the xla backend lowers {', '.join(REDUCTIONS)}")
    return how


def _all_reduce(x, reduce_op: str, group_name: str):
    how, groups = _reduction(reduce_op), replica_groups(group_name)
    out = _primitives()["all_reduce"].bind(x, how="sum" if how == "avg" else how, groups=groups)
    return out / len(groups[0]) if how == "avg" else out


def _all_gather(x, group_size: int, group_name: str):
    groups = replica_groups(group_name)
    _check_size(group_size, groups, group_name)
    return _primitives()["all_gather"].bind(x, groups=groups)


def _reduce_scatter(x, reduce_op: str, group_size: int, group_name: str):
    how, groups = _reduction(reduce_op), replica_groups(group_name)
    _check_size(group_size, groups, group_name)
    if x.shape[0] % group_size:
        raise BackendError(f"reduce_scatter_tensor of dim 0 = {x.shape[0]} over {group_size} ranks: dim 0 must divide evenly")
    out = _primitives()["reduce_scatter"].bind(x, how="sum" if how == "avg" else how, groups=groups)
    return out / group_size if how == "avg" else out


def _all_to_all(x, output_split_sizes, input_split_sizes, group_name: str):
    groups = replica_groups(group_name)
    n = len(groups[0])
    even = [x.shape[0] // n] * n
    for name, splits in (("output_split_sizes", output_split_sizes), ("input_split_sizes", input_split_sizes)):
        if splits is not None and list(splits) != even:
            raise BackendError(f"all_to_all_single with {name}={list(splits)}: the xla backend lowers equal splits only ({even})")
    if x.shape[0] % n:
        raise BackendError(f"all_to_all_single of dim 0 = {x.shape[0]} over {n} ranks: dim 0 must divide evenly")
    return _primitives()["all_to_all"].bind(x, groups=groups)


def _check_size(group_size: int, groups, group_name: str) -> None:
    if group_size != len(groups[0]):
        raise BackendError(f"a collective says group {group_name!r} has {group_size} ranks; the process group has {len(groups[0])}")


def install() -> None:
    """Puts the lowerings in torchax's table, in place of jc10d's where it was imported
    (set directly: registering again logs a warning each time torchax is imported)."""
    from torchax.ops import ops_registry

    c10d = torch.ops._c10d_functional
    table = {
        c10d.all_reduce: _all_reduce, c10d.all_gather_into_tensor: _all_gather, c10d.reduce_scatter_tensor: _reduce_scatter,
        c10d.all_to_all_single: _all_to_all, c10d.wait_tensor: lambda x: x,  # a traced graph's values are ready when used
    }  # fmt: skip
    for packet, func in table.items():
        for op in (packet, packet.default):
            ops_registry.all_aten_ops[op] = ops_registry.Operator(op, func, is_jax_function=True, is_user_defined=False, needs_env=False, is_view_op=False)
