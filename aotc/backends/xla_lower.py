"""PyTorch programs to JAX and HLO through torchax, as the xla backend compiles them and
neuronx-cc takes them: torchax imported on this torch, the graph decomposed and jitted,
the HLO module and the jax.export module of a program, and the weights a module reads.
Installed with `pip install 'aotc[xla]'`; the base install does not pull JAX."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import BackendError, BundleError
from .base import Specs

if TYPE_CHECKING:
    from torch.export import ExportedProgram

INSTALL = "pip install 'aotc[xla]' (jax and torchax)"
# The artifact: the HLO module as neuronx-cc takes it (HloModuleProto), as text, and
# the same computation as a jax.export module, which the runtime runs.
HLO_PROTO, HLO_TEXT, JAX_MODULE = "hlo.pb", "hlo.txt", "model.jax"

# -- torchax on torch 2.13 -------------------------------------------------------
#
# torch 2.13 dropped the named-tensor (Dimname) overloads of aten ops, such as
# aten.prod.dim_Dimname; torchax 0.0.13 (the latest release) still names them
# in module-level tables (autocast policies, decomposition lists), so
# `import torchax` fails. While torchax is imported, each overload it names
# that this torch lacks resolves to a stand-in that matches no real op; the
# stand-ins are removed right after. tests/test_xla.py pins down that every
# shimmed name is a named-tensor overload. Remove when torchax stops naming them.


class _DroppedOverload:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<aten::{self.name}: not in torch {torch.__version__}>"


def dropped_overloads() -> list[tuple[str, str]]:
    """(op, overload) pairs that torchax's sources name and this torch lacks."""
    spec = importlib.util.find_spec("torchax")
    if spec is None or spec.origin is None:
        return []
    names = set()
    for file in Path(spec.origin).parent.rglob("*.py"):
        names.update(re.findall(r"torch\.ops\.aten\.(\w+)\.(\w+)", file.read_text()))
    missing = []
    for op, overload in sorted(names):
        packet = getattr(torch.ops.aten, op, None)
        if packet is not None and not hasattr(packet, overload):
            missing.append((op, overload))
    return missing


@contextlib.contextmanager
def _dropped_overloads_shim():
    added = []
    try:
        for op, overload in dropped_overloads():
            packet = getattr(torch.ops.aten, op)
            setattr(packet, overload, _DroppedOverload(f"{op}.{overload}"))
            added.append((packet, overload))
        yield
    finally:
        for packet, overload in added:
            delattr(packet, overload)


def import_torchax():
    """torchax, imported with the shim above; a clear error when it is not installed."""
    if importlib.util.find_spec("torchax") is None or importlib.util.find_spec("jax") is None:
        raise BackendError(f"the xla backend needs JAX and torchax: {INSTALL}")
    with _dropped_overloads_shim():
        import torchax
        import torchax.decompositions
        import torchax.export
        import torchax.ops.jaten  # noqa: F401  (registers the aten -> JAX lowerings)
    from . import xla_collectives

    xla_collectives.install()
    _fix_nonzero_static()
    _fix_view_dtype()
    _fix_accelerator()
    return torchax


def _fix_nonzero_static() -> None:
    """torchax 0.0.13 lowers nonzero_static with an unsized jnp.argwhere, which has a
    data-dependent shape and fails under jax.jit; the static-shape pass emits exactly
    this op. Its entry is replaced in place (registering again would log a warning).
    Remove when torchax passes `size` to argwhere."""
    import dataclasses

    import jax.numpy as jnp
    from torchax.ops import ops_registry

    def nonzero_static(x, size, fill_value=-1):
        return jnp.argwhere(x, size=size, fill_value=fill_value)

    for op in (torch.ops.aten.nonzero_static, torch.ops.aten.nonzero_static.default):
        entry = ops_registry.all_aten_ops.get(op)
        if entry is not None and entry.func is not nonzero_static:
            ops_registry.all_aten_ops[op] = dataclasses.replace(entry, func=nonzero_static)


def _fix_view_dtype() -> None:
    """torchax 0.0.13 registers one lowering for every aten.view overload, a reshape,
    so view.dtype (a bitcast: how aotc.lowp_weights turns E8M0 scale bytes into floats,
    exactly) fails on the dtype as a shape. The overload gets its own entry, a
    bitcast. Remove when torchax lowers view.dtype."""
    import dataclasses

    import jax
    import numpy as np
    from torchax.ops import mappings, ops_registry

    def view_dtype(x, dtype):
        # torch keeps the rank and scales the last dim by the ratio of the item sizes;
        # XLA's bitcast adds (to a narrower type) or takes (from one) a trailing dim of it.
        to = mappings.t2j_dtype(dtype)
        wide, narrow = np.dtype(x.dtype).itemsize, np.dtype(to).itemsize
        if wide == narrow:
            return jax.lax.bitcast_convert_type(x, to)
        if wide > narrow:
            out = jax.lax.bitcast_convert_type(x, to)  # [..., n, wide / narrow]
            return out.reshape(*x.shape[:-1], x.shape[-1] * (wide // narrow))
        ratio = narrow // wide
        return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // ratio, ratio), to)

    entry = ops_registry.all_aten_ops[torch.ops.aten.view]
    ops_registry.all_aten_ops[torch.ops.aten.view.dtype] = dataclasses.replace(entry, func=view_dtype)


def _fix_accelerator() -> None:
    """torchax 0.0.13 names torch's privateuse1 device "jax" with a device module whose
    is_available() is True, but registers no device hooks: torch.accelerator then reports
    an accelerator whose current_device_index() raises, and every torch.compile in the
    process fails (dynamo reads the current stream). aotc lowers programs through JAX and
    never makes tensors on that device, so where torch.accelerator is broken this way the
    module says it is unavailable. Remove when torchax registers its device's hooks."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != "jax":
        return
    try:
        torch.accelerator.current_device_index()
    except RuntimeError:
        torch.get_device_module("jax").is_available = lambda: False


# -- lowering ---------------------------------------------------------------------


_ASSERTS = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default)


@dataclass
class Lowered:
    hlo_proto: bytes
    hlo_text: str
    jax_module: bytes
    # Input positions of the written caches, in the order of the leading outputs
    # that hold their updates; each is donated (aliased to that output).
    mutated: list[int]
    sources: dict[str, str]  # FX node name (the HLO's op_name scope) -> the user's source line


def decomposed(program: "ExportedProgram", specs: Specs) -> tuple[torch.fx.GraphModule, list[int]]:
    """The program as torchax lowers it: functional (each in-place cache write
    becomes an output), decomposed, without export's metadata asserts; and the input
    positions of the written caches, in the order of the outputs that hold them."""
    torchax = import_torchax()
    # One retrace, not two: core ATen's table with torchax's rules for the ops core ATen
    # keeps (where both have a rule, core ATen's, as when torchax's ran second). Two
    # run_decompositions took 2.4x as long, for the same ops plus a copy per written cache.
    table = {**torchax.decompositions.DECOMPOSITIONS, **torch.export.default_decompositions()}
    program = program.run_decompositions(table)
    gm = program.graph_module
    # Export's runtime metadata asserts have no XLA lowering and no effect on values.
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            gm.graph.erase_node(node)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n.name: i for i, n in enumerate(placeholders)}
    mutated = [index[s.target] for s in program.graph_signature.output_specs if s.kind.name == "USER_INPUT_MUTATION"]
    caches = specs.caches
    if sorted(mutated) != sorted(set(mutated)) or not set(mutated) <= set(caches):
        raise BackendError(f"the graph mutates inputs {mutated} that are not its caches {caches}")
    return gm, mutated


def jitted(gm: torch.fx.GraphModule, donate: tuple[int, ...] = (), weights: list[str] = ()):
    """gm as a jitted JAX function of its placeholders, and their shape specs. The first
    len(weights) inputs each come as a dict of one key, the tensor's path (Specs.weight_paths):
    the module's input tree then records which tensor each weight input is (and the HLO's
    parameter names show it), with the flat order of the inputs unchanged."""
    torchax = import_torchax()
    import jax

    class Named(torchax.export.JaxInterpreter):
        # Each FX node's ops carry its name in the HLO metadata (op_name=".../<node>/..."),
        # so that a finding in the HLO (aotc verify, the neuron lint, aotc bisect) names the node.
        def run_node(self, n):
            with jax.named_scope(n.name):
                return super().run_node(n)

    def computation(*args):
        flat = [a[w] for a, w in zip(args, weights)] + list(args[len(weights) :])
        return tuple(Named(gm).run(*flat, enable_io_processing=False))

    specs = [jax.ShapeDtypeStruct(tuple(n.meta["val"].shape), jax_dtype(n.meta["val"].dtype)) for n in gm.graph.nodes if n.op == "placeholder"]
    specs[: len(weights)] = [{w: spec} for w, spec in zip(weights, specs)]
    # keep_unused: hlo.pb takes every graph input, in order, as the runtime passes them
    # (jit would drop an input the computation does not read, such as token ids in a
    # layer that does not hash them, and shift every later parameter).
    return jax.jit(computation, donate_argnums=donate, keep_unused=True), specs


@contextlib.contextmanager
def _x64_casts_quiet():
    with warnings.catch_warnings():
        # JAX runs without x64: int64 indices and positions are computed as int32,
        # exact for every index a cache can hold (< 2^31). JAX warns at each cast.
        warnings.filterwarnings("ignore", message=r".*requested in astype is not available", category=UserWarning)
        yield


def hlo_of(gm: torch.fx.GraphModule) -> bytes:
    """gm's HloModuleProto, lowered as `lower` does (aotc bisect's subgraphs)."""
    fn, specs = jitted(gm)
    with _x64_casts_quiet():
        return fn.lower(*specs).compiler_ir("hlo").as_serialized_hlo_module_proto()


def lower(program: "ExportedProgram", specs: Specs) -> Lowered:
    """The program as one XLA computation: f(*inputs) -> (*updated caches, *outputs)."""
    import jax

    from ..passes.base import source_line  # build-time only: loading a bundle imports no pass

    gm, mutated = decomposed(program, specs)
    fn, shapes = jitted(gm, tuple(mutated), specs.weight_paths)
    with _x64_casts_quiet():
        hlo = fn.lower(*shapes).compiler_ir("hlo")
        exported = jax.export.export(fn)(*shapes)
    sources = {n.name: source_line(n) for n in gm.graph.nodes if n.op == "call_function"}
    return Lowered(hlo.as_serialized_hlo_module_proto(), hlo.as_hlo_text(), bytes(exported.serialize()), mutated, sources)


def module_weights(exported, path: Path) -> list[str]:
    """Which tensor each weight input is, from the module's input tree (jitted): the
    leading inputs that are dicts of one key, the tensor's path."""
    import jax

    tree = jax.tree_util.tree_unflatten(exported.in_tree, range(exported.in_tree.num_leaves))
    args = tree[0] if isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[0], tuple) else ()
    weights = [a for a in args if isinstance(a, dict)]
    if any(len(w) != 1 or not isinstance(next(iter(w)), str) for w in weights) or any(not isinstance(a, dict) for a in args[: len(weights)]):
        raise BundleError(f"{path}: its input tree is not one aotc writes (weights as leading dicts of one path each); rebuild the bundle (aotc build)")
    return [next(iter(w)) for w in weights]


def jax_dtype(dtype: torch.dtype):
    import jax.numpy as jnp

    return jnp.dtype(str(dtype).removeprefix("torch."))
