"""What every FX pass is: a callable with a stable identity, on a GraphModule (a
GraphPass) or, when it replaces the graph's inputs, on the ExportedProgram (a
ProgramPass); and the helpers that passes build graphs with."""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..errors import TraceError

aten = torch.ops.aten


@dataclass
class PassResult:
    graph_module: fx.GraphModule
    modified: bool
    changes: int = 0  # a real count of rewritten sites; `modified` is changes > 0


@dataclass
class ProgramResult:
    program: torch.export.ExportedProgram  # re-signed: its inputs are its graph's placeholders
    changes: int
    # {position of a replaced input: one tag per input now in its place, in order}; the
    # pass says what a tag is (SplitDtypeRegions: a region's (byte start, byte end)).
    replaced: dict[int, list]


def loop_bodies(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The bodies of the graph's while_loops: graphs of their own, which passes run in too."""
    loops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.while_loop]
    return [getattr(gm, n.args[1].target) for n in loops]


class Pass:
    name: str = ""

    def uuid(self) -> str:
        """A hash of the pass's source file (one pass per file): it goes into the manifest."""
        return hashlib.sha256(inspect.getsource(inspect.getmodule(type(self))).encode()).hexdigest()[:16]

    def finish(self, gm: fx.GraphModule) -> None:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()


class GraphPass(Pass):
    """A pass that keeps the graph's inputs. Subclasses implement `run(gm) -> int` (the
    number of changes); `__call__` adds dead-code elimination, lint and recompile."""

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        changes = self.run(gm)
        if changes:
            self.finish(gm)
        return PassResult(gm, changes > 0, changes)

    def run(self, gm: fx.GraphModule) -> int:
        raise NotImplementedError


class ProgramPass(Pass):
    """A pass that replaces some of the program's inputs with inputs of its own.
    Subclasses implement `run(gm) -> {input position: [tag, ...]}`, the inputs they
    replaced, each with a tag per placeholder put in its place; `__call__` then
    re-signs the program from its graph's placeholders, here and nowhere else, so
    nothing about the change travels beside the program."""

    def __call__(self, program: torch.export.ExportedProgram) -> ProgramResult:
        replaced = self.run(program.graph_module)
        if not replaced:
            return ProgramResult(program, 0, {})
        self.finish(program.graph_module)
        return ProgramResult(_resigned(program), sum(map(len, replaced.values())), replaced)

    def run(self, gm: fx.GraphModule) -> dict[int, list]:
        raise NotImplementedError


def _resigned(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The program with its signature made from its graph's placeholders again: a new
    placeholder is a user input (aotc's weights are too)."""
    from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
    from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, TensorArgument

    gm = program.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    known = {s.arg.name: s for s in program.graph_signature.input_specs}
    specs = [known.get(n.name) or InputSpec(InputKind.USER_INPUT, TensorArgument(n.name), None) for n in placeholders]
    args = [s.arg for s in specs if s.kind == InputKind.USER_INPUT]
    signature = ExportGraphSignature(specs, list(program.graph_signature.output_specs))
    top = program.module_call_graph[0]
    in_spec = pytree.tree_flatten((tuple(range(len(args))), {}))[1]
    call = ModuleCallSignature(args, top.signature.outputs, in_spec, top.signature.out_spec)
    calls = [ModuleCallEntry(top.fqn, call)] + list(program.module_call_graph[1:])
    return torch.export.ExportedProgram(
        gm,
        gm.graph,
        signature,
        program.state_dict,
        program.range_constraints,
        calls,
        (tuple(n.meta["val"] for n, s in zip(placeholders, specs) if s.kind == InputKind.USER_INPUT), {}),
        program.constants,
        verifiers=program.verifiers,
    )


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


def insert_call(graph: fx.Graph, target, *args, val=None, trace_of: fx.Node | None = None, **kwargs) -> fx.Node:
    """Insert a call at the graph's current insert point with its fake value: `val`
    where given, else the op run on its arguments' fake values. `trace_of`: the node
    whose stack trace it gets, so that an error about it names the user's line."""
    node = graph.call_function(target, args, kwargs)
    if val is None:
        vals, kwvals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        tensors = [t for t in pytree.tree_leaves((vals, kwvals)) if isinstance(t, torch.Tensor)]
        # Factory calls (arange, full) have no tensor argument: take the graph's fake mode from its inputs.
        fake = tensors[0] if tensors else next(v for n in graph.nodes if n.op == "placeholder" and isinstance(v := n.meta.get("val"), torch.Tensor))
        # In-place targets get their metadata from the out-of-place op, so the
        # fake input is not marked as mutated while the graph is being built.
        functional = {torch.ops.aten.index_put_.default: torch.ops.aten.index_put.default}.get(target, target)
        with fake.fake_mode:
            val = functional(*vals, **kwvals)
    node.meta["val"] = val
    if trace_of is not None and trace_of.meta.get("stack_trace"):
        node.meta["stack_trace"] = trace_of.meta["stack_trace"]
    return node


def rewrite_each(gm: fx.GraphModule, target, rewrite) -> int:
    """The one node loop of the rewriting passes: replace each call of `target` with
    what rewrite(node) inserts before it (None: leave it); the number replaced."""
    changes = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not target:
            continue
        with gm.graph.inserting_before(node):
            out = rewrite(node)
        if out is None:
            continue
        out.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        changes += 1
    return changes


def per_row(graph: fx.Graph, x: fx.Node, dim: int, row_out) -> fx.Node:
    """Stack row_out(x's row m) for each row m along `dim`, reading the rows from memory:
    an identity as_strided of x first, so that Inductor stores it (rewrite_skinny_linears
    says why)."""
    xv = fake_val(x)
    if not xv.is_contiguous():  # a view (a transpose): copied, so that the strides below are the copy's own
        x = insert_call(graph, aten.clone.default, x, memory_format=torch.contiguous_format)
        xv = fake_val(x)
    x = insert_call(graph, aten.as_strided.default, x, list(xv.shape), list(xv.stride()), xv.storage_offset())
    rows = [row_out(insert_call(graph, aten.select.int, x, dim, m)) for m in range(xv.shape[dim])]
    return insert_call(graph, aten.stack.default, rows, dim)
