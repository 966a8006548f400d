"""What every FX pass is: a callable on a GraphModule with a stable identity."""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx

from ..errors import TraceError


@dataclass
class PassResult:
    graph_module: fx.GraphModule
    modified: bool
    changes: int = 0  # a real count of rewritten sites; `modified` is changes > 0


class GraphPass:
    """Base class. Subclasses implement `run(gm) -> int` (the number of changes);
    `__call__` adds dead-code elimination, lint and recompile."""

    name: str = ""

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        changes = self.run(gm)
        if changes:
            gm.graph.eliminate_dead_code()
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, changes > 0, changes)

    def run(self, gm: fx.GraphModule) -> int:
        raise NotImplementedError

    def uuid(self) -> str:
        """A hash of the pass's source file: it goes into cache keys and the manifest."""
        return hashlib.sha256(inspect.getsource(inspect.getmodule(type(self))).encode()).hexdigest()[:16]


def is_view_op(target) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    ret = schema.returns[0].alias_info
    arg = schema.arguments[0].alias_info
    return ret is not None and not ret.is_write and arg is not None and not arg.is_write


def is_inplace_op(target) -> bool:
    """True for ops that write into their first argument (and return it)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    arg = schema.arguments[0].alias_info
    returns_self = bool(schema.returns) and schema.returns[0].alias_info is not None
    return arg is not None and arg.is_write and returns_self


def written_args(node: fx.Node) -> list[fx.Node]:
    """The node arguments that `node` writes into (from the op schema's alias info)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if isinstance(value, fx.Node):
                out.append(value)
    return out


def alias_root(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """Follow views and in-place results back to the tensor they alias.

    Returns (root, views): `views` are the view nodes between the root and
    `node`, outermost last; in-place results (which return their input) are
    skipped, as they alias the same tensor.
    """
    views = []
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        if is_view_op(node.target):
            views.append(node)
        elif not (is_inplace_op(node.target) and written_args(node)[:1] == [node.args[0]]):
            break
        node = node.args[0]
    return node, views[::-1]


def source_line(node: fx.Node) -> str:
    """The user's source line a node came from, for error messages."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    # The innermost frame of the user's code, not torch's own (nn.Linear's F.linear line).
    torch_dir = str(Path(torch.__file__).parent)
    users = [ln for ln in lines if not ln.startswith(f'File "{torch_dir}')]
    return (users or lines or ["(source line unknown)"])[-1]


def fake_val(node: fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise TraceError(f"node {node.name} has no tensor metadata; was the graph made by torch.export?")
    return val


def insert_call(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    """Insert a call (at the graph's current insert point) with its fake-tensor metadata."""
    node = graph.call_function(target, args, kwargs)
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    vals = [[x.meta["val"] if isinstance(x, fx.Node) else x for x in v] if isinstance(v, list) else v for v in vals]
    tensors = [t for v in vals for t in (v if isinstance(v, list) else [v]) if isinstance(t, torch.Tensor)]
    # Factory calls (arange, full) have no tensor argument: take the graph's fake mode from its inputs.
    fake = tensors[0] if tensors else next(n.meta["val"] for n in graph.nodes if n.op == "placeholder")
    # In-place targets get their metadata from the out-of-place op, so the
    # fake input is not marked as mutated while the graph is being built.
    functional = {torch.ops.aten.index_put_.default: torch.ops.aten.index_put.default}.get(target, target)
    with fake.fake_mode:
        node.meta["val"] = functional(*vals, **kwargs)
    return node
