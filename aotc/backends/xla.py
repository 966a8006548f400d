"""XLA: each post-pass graph lowered to an HLO module, caches donated.

The artifact holds the HLO module as a serialized HloModuleProto (`hlo.pb`,
what neuronx-cc takes) and as text (`hlo.txt`), plus the same computation as
a serialized `jax.export` module (`model.jax`) that the runtime runs on XLA
(JAX's CPU client here). Cache inputs are donated: the HLO carries an
`input_output_alias` from each cache input to its updated value.

Lowering goes through torchax (PyTorch ops -> JAX) onto JAX, installed with
`pip install 'aotc[xla]'`; the base install does not pull JAX.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import BackendError
from ..format import HLO_PROTO, HLO_TEXT, JAX_MODULE, ArtifactRecord, XlaExtra
from .base import Backend, CompileResult, Runner, register_backend

if TYPE_CHECKING:
    from ..trace import TracedGraph

INSTALL = "pip install 'aotc[xla]' (jax and torchax)"


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
    _fix_nonzero_static()
    _fix_view_dtype()
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
    so view.dtype (a bitcast: how aotc.quant turns E8M0 scale bytes into floats,
    exactly) fails on the dtype as a shape. The overload gets its own entry, a
    bitcast. Remove when torchax lowers view.dtype."""
    import dataclasses

    import jax
    from torchax.ops import mappings, ops_registry

    def view_dtype(x, dtype):
        return jax.lax.bitcast_convert_type(x, mappings.t2j_dtype(dtype))

    entry = ops_registry.all_aten_ops[torch.ops.aten.view]
    ops_registry.all_aten_ops[torch.ops.aten.view.dtype] = dataclasses.replace(entry, func=view_dtype)


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


def decomposed(graph: "TracedGraph") -> tuple[torch.fx.GraphModule, list[int]]:
    """The traced graph as torchax lowers it: functional (each in-place cache write
    becomes an output), decomposed, without export's metadata asserts; and the input
    positions of the written caches, in the order of the outputs that hold them."""
    torchax = import_torchax()
    program = graph.program.run_decompositions().run_decompositions(torchax.decompositions.DECOMPOSITIONS)
    gm = program.graph_module
    # Export's runtime metadata asserts have no XLA lowering and no effect on values.
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            gm.graph.erase_node(node)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n.name: i for i, n in enumerate(placeholders)}
    mutated = [index[s.target] for s in program.graph_signature.output_specs if s.kind.name == "USER_INPUT_MUTATION"]
    caches = [i for i, info in enumerate(graph.inputs) if info.kind == "cache"]
    if sorted(mutated) != sorted(set(mutated)) or not set(mutated) <= set(caches):
        raise BackendError(f"{graph.variant.entry_id}: the graph mutates inputs {mutated} that are not its caches {caches}")
    return gm, mutated


def jitted(gm: torch.fx.GraphModule, donate: tuple[int, ...] = ()):
    """gm as a jitted JAX function of its placeholders, and their shape specs."""
    torchax = import_torchax()
    import jax

    class Named(torchax.export.JaxInterpreter):
        # Each FX node's ops carry its name in the HLO metadata (op_name=".../<node>/..."),
        # so that a finding in the HLO (aotc verify, the neuron lint, aotc bisect) names the node.
        def run_node(self, n):
            with jax.named_scope(n.name):
                return super().run_node(n)

    def computation(*args):
        return tuple(Named(gm).run(*args, enable_io_processing=False))

    specs = [jax.ShapeDtypeStruct(tuple(n.meta["val"].shape), _jax_dtype(n.meta["val"].dtype)) for n in gm.graph.nodes if n.op == "placeholder"]
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


def lower(graph: "TracedGraph") -> Lowered:
    """The traced graph as one XLA computation: f(*inputs) -> (*updated caches, *outputs)."""
    import jax

    from ..passes.base import source_line  # build-time only: loading a bundle imports no pass

    gm, mutated = decomposed(graph)
    fn, specs = jitted(gm, tuple(mutated))
    with _x64_casts_quiet():
        hlo = fn.lower(*specs).compiler_ir("hlo")
        exported = jax.export.export(fn)(*specs)
    sources = {n.name: source_line(n) for n in gm.graph.nodes if n.op == "call_function"}
    return Lowered(hlo.as_serialized_hlo_module_proto(), hlo.as_hlo_text(), bytes(exported.serialize()), mutated, sources)


def _jax_dtype(dtype: torch.dtype):
    import jax.numpy as jnp

    return jnp.dtype(str(dtype).removeprefix("torch."))


@register_backend
class XlaBackend(Backend):
    name = "xla"

    def version(self) -> str:
        import jax

        torchax = import_torchax()
        return f"torch-{torch.__version__}-jax-{jax.__version__}-torchax-{getattr(torchax, '__version__', '?')}"

    def can_compile(self) -> str | None:
        missing = [m for m in ("jax", "torchax") if importlib.util.find_spec(m) is None]
        return f"{' and '.join(missing)} not installed: {INSTALL}" if missing else None

    def can_load(self) -> str | None:
        # model.jax is a jax.export module: running it needs JAX only, not torchax.
        return None if importlib.util.find_spec("jax") else f"jax not installed: {INSTALL}"

    def pass_target(self) -> str | None:
        return "xla"

    def incompatible(self, manifest) -> str | None:
        # Running needs the JAX that serialized model.jax, not the torchax that lowered it.
        import jax

        if f"-jax-{jax.__version__}-" not in manifest.backend.version:
            return f"built with {manifest.backend.version}, this machine has jax {jax.__version__}"
        return None

    def compile(self, graph: "TracedGraph", out_dir: Path) -> CompileResult:
        lowered = lower(graph)
        (out_dir / HLO_PROTO).write_bytes(lowered.hlo_proto)
        (out_dir / HLO_TEXT).write_text(lowered.hlo_text)
        (out_dir / JAX_MODULE).write_bytes(lowered.jax_module)
        return CompileResult([HLO_PROTO, HLO_TEXT, JAX_MODULE], XlaExtra(lowered.mutated))

    def load(self, art_dir: Path, record: ArtifactRecord) -> Runner:
        import jax

        exported = jax.export.deserialize(bytearray((art_dir / JAX_MODULE).read_bytes()))
        mutated = record.extra.mutated
        call = jax.jit(exported.call)

        def run(args: list[torch.Tensor]) -> list[torch.Tensor]:
            # torch <-> jax through DLPack: no copies on the way in, but for a cache view of a
            # context bucket's first positions (strided; JAX takes row-major buffers only).
            outs = call(*[jax.dlpack.from_dlpack(a.detach().contiguous()) for a in args])
            for position, new in zip(mutated, outs):
                # The updated cache comes back as a new buffer: write it into the caller's cache.
                args[position].copy_(torch.from_dlpack(new))
            return [torch.from_dlpack(o) for o in outs[len(mutated) :]]

        return run

    def signature(self, art_dir: Path) -> list[tuple[list[int], str]]:
        import jax

        exported = jax.export.deserialize(bytearray((art_dir / JAX_MODULE).read_bytes()))
        # Without JAX's x64 mode, int64 inputs are int32 in the module (see lower()).
        return [(list(a.shape), str(a.dtype).replace("int32", "int64")) for a in exported.in_avals]
