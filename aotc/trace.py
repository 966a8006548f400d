"""Tracing: one static graph per (entry class, method, variant, bucket).

For each entry method, the instances of its class are grouped into variants
(instances that agree on parameter names, shapes and dtypes and on every
plain attribute the method reads). Each variant is exported once per bucket
with torch.export (non-strict, static shapes), with the instance's parameters
and buffers passed as graph inputs, so the one graph serves every instance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from . import heap
from .entry import FREEZERS, EntrySpec, entries_of, whole_steps
from .errors import TraceError
from .format import ParallelRecord, PassRecord, RegionSpec, ShardSpec, TensorSpec, WeightSpec
from .layout import compiled, dequantized, dtype_name, graph_weights, stored_of, weights_of
from .models.base import fake_tensor_mode
from .parallel import SINGLE
from .passes import needs_static, pipeline_for, run_pipeline
from .passes.base import alias_root, loop_bodies, source_line, written_args
from .passes.unbacked_ops import unbacked_in
from .shapes import Shapes

if TYPE_CHECKING:
    from .backends import Backend

PLAIN = (int, float, bool, str, type(None))
# nn.Module's own bookkeeping (_parameters, _modules, training, hooks...): not model attributes.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)


@dataclass
class Variant:
    """Instances of one class that share a compiled graph for one method."""

    entry_id: str
    cls: type
    spec: EntrySpec
    instances: list[tuple[str, nn.Module]]
    attributes: dict  # the differing attributes' values, when a class has several variants
    context: int | None = None  # the context bucket (EntrySpec.context); None: all of max_seq
    layout: ParallelRecord = field(default_factory=lambda: SINGLE)  # the ranks its graph runs on (aotc.parallel)
    shards: dict[str, ShardSpec] = field(default_factory=dict)  # WeightSpec.key -> how each rank takes it

    @property
    def module(self) -> nn.Module:
        return self.instances[0][1]


@dataclass
class TracedGraph:
    variant: Variant
    bucket: int
    program: torch.export.ExportedProgram
    inputs: list[TensorSpec]  # every graph input: weights (kind "weight"), then the method's arguments
    outputs: list[TensorSpec]
    passes: list[PassRecord] = field(default_factory=list)
    export_s: float = 0.0

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self.program.graph_module


# -- finding entries and variants ----------------------------------------------


def whole_step_refusal(model: nn.Module, loops: bool) -> str | None:
    """Why a build makes no whole step of the model (None: it does). loops: the backend
    runs a whole step's loop (Backend.loops)."""
    if not loops:
        return "the backend builds no loops"
    if stored_of(model):
        return "weights stored in low precision: their layers' graphs dequantize them"
    return model.whole_step_refusal()


def unbuilt(model: nn.Module, loops: bool) -> frozenset[tuple[type, str]]:
    """The (class, method) entries a build leaves out: of each whole step
    (CausalLM.whole_step_replaces) and the entries it replaces, the side it does not make."""
    replaces = whole_steps(model)
    whole = bool(replaces) and whole_step_refusal(model, loops) is None
    return frozenset(m for method, replaced in replaces.items() for m in (replaced if whole else {(type(model), method)}))


def find_variants(model: nn.Module, shapes: Shapes, loops: bool = False) -> list[Variant]:
    """All entry methods of the model's modules, split into variants: each whole step in
    place of the entries it replaces where `loops` (the backend runs them) and the model
    allow it, else those entries (unbuilt). The side left out is left out before any entry
    runs: a whole step that the configuration refuses may not run at all (on fp8 caches'
    packed rows)."""
    skip = unbuilt(model, loops)
    groups: dict[tuple[type, str], list[tuple[str, nn.Module]]] = {}
    for path, module in model.named_modules():
        for method in entries_of(type(module)):
            if (type(module), method) not in skip:
                groups.setdefault((type(module), method), []).append((path, module))
    variants = []
    for (cls, method), instances in groups.items():
        spec = entries_of(cls)[method]
        if not hasattr(cls, "example_inputs"):
            raise TraceError(f"{cls.__qualname__} has entry {method!r} but no example_inputs(method, rows, shapes) method")
        keyed: dict[tuple, list[tuple[str, nn.Module]]] = {}
        reads_of = {}
        for path, module in instances:
            reads = _attribute_reads(module, method, shapes, path)
            reads_of[path] = reads
            key = (_weight_signature(module), tuple(sorted(reads.items())))
            keyed.setdefault(key, []).append((path, module))
        base = f"{cls.__name__}.{method}"
        if len(keyed) == 1:
            variants.append(Variant(base, cls, spec, instances, {}))
            continue
        all_reads = [reads_of[group[0][0]] for group in keyed.values()]
        differing = sorted({k for r in all_reads for k in r if len({repr(x.get(k)) for x in all_reads}) > 1})
        signatures = [set(key[0]) for key in keyed]
        shared = set.intersection(*signatures)
        for i, group in enumerate(keyed.values()):
            reads = reads_of[group[0][0]]
            attrs = {k: reads.get(k) for k in differing}
            if not differing:  # the weights differ: in shape, dtype, layout or stored form (an fp8 layer among plain ones)
                own = sorted(signatures[i] - shared, key=str)
                attrs = {"weights": [f"{key}:{list(shape)}:{dtype}" for key, shape, dtype, _ in own][:4]}
            variants.append(Variant(f"{base}.v{i}", cls, spec, group, attrs))
    return variants


def _weight_signature(module: nn.Module) -> tuple:
    return tuple((w.key, tuple(w.shape), w.dtype, w.transform) for w in graph_weights(module))


@contextlib.contextmanager
def _recording(module: nn.Module, log: dict, prefix: str):
    """Record plain attributes read from the instance's __dict__ (and its submodules')."""
    originals = []
    paths = {id(m): name for name, m in module.named_modules()}

    def make(cls):
        def __getattribute__(self, name):
            value = object.__getattribute__(self, name)
            if name not in _MODULE_INTERNALS and name in object.__getattribute__(self, "__dict__"):
                where = paths.get(id(self), "")
                key = f"{where}.{name}" if where else name
                if isinstance(value, torch.Tensor):
                    raise TraceError(
                        f"{prefix}.{key} is a tensor attribute that is neither a parameter nor a buffer; "
                        "it would be baked into the graph as a constant. Register it with register_buffer()"
                    )
                if not callable(value) and not isinstance(value, nn.Module):
                    log[key] = _freeze(value, f"{prefix}.{key}")
            return value

        return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})

    subclasses: dict[type, type] = {}
    try:
        for m in module.modules():
            cls = type(m)
            sub = subclasses.setdefault(cls, make(cls))
            originals.append((m, cls))
            m.__class__ = sub
        yield
    finally:
        for m, cls in originals:
            m.__class__ = cls


def _freeze(value, where: str):
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, PLAIN) for v in value):
        return tuple(value)
    if isinstance(value, torch.dtype):
        return str(value)
    freeze = next((f for cls, f in FREEZERS.items() if isinstance(value, cls)), None)
    if freeze is not None:
        return freeze(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and value.__dataclass_params__.frozen:
        # A frozen record of plain values (e.g. aotc.kvcache.Fp8Rows): equal records, equal graphs.
        return (type(value).__qualname__, *(_freeze(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)))
    raise TraceError(
        f"{where} = {value!r} ({type(value).__name__}) is read by an entry method; layers can only be "
        "grouped by plain values (int, float, bool, str, None, tuples of them, or frozen dataclasses of "
        "them). Make it a buffer if it is per-layer data, or a plain value"
    )


def _fake_mode_of(module: nn.Module) -> tuple[FakeTensorMode, bool]:
    """The fake mode of the module's weights (a build's), or a new one; either has a
    ShapeEnv, so that data-dependent ops run and are captured as unbacked symbols."""
    for t in weights_of(module).values():
        if isinstance(t, FakeTensor):
            if t.fake_mode.shape_env is None:
                raise TraceError(
                    f"{type(module).__qualname__} has fake weights made under a FakeTensorMode without a ShapeEnv; "
                    "make them under aotc.models.base.fake_tensor_mode() (load_model(weights=False) does)"
                )
            return t.fake_mode, True
    return fake_tensor_mode(), False


def _fake_weights(module: nn.Module, mode: FakeTensorMode, already: bool) -> tuple[list[WeightSpec], dict[str, torch.Tensor]]:
    """The graph's weight inputs and a fake tensor for each."""
    weights = graph_weights(module)
    tensors = weights_of(module)
    stored = stored_of(module)
    device = next((t.device for t in tensors.values()), torch.device("cpu"))
    values = {}
    for w in weights:
        if w.transform is None:
            t = tensors[w.path] if w.stored is None else stored[w.path].part(w.stored.part)
            values[w.key] = t if already else mode.from_tensor(t)
        else:
            with mode:
                values[w.key] = torch.empty_strided(w.shape, w.stride, dtype=getattr(torch, w.dtype), device=device)
    return weights, values


def _call(module: nn.Module, method: str, weights: list[WeightSpec], values: dict[str, torch.Tensor], args):
    """Run the method with its weights swapped for `values` (by WeightSpec.key), and each
    module's compiled form where it has one. Sources of derived weights read as views of
    the derived input, so the graph has that one input for them; stored weights are
    dequantized from their parts in the graph."""
    tensors = dequantized(weights, values)
    with compiled(module, weights, tensors) as views:
        swapped = {f"inner.{w.path}": tensors[w.path] for w in weights if w.transform is None}
        swapped |= {f"inner.{k}": v for k, v in views.items()}
        # Every tensor the code reads is swapped for a graph input. A stored weight's parts
        # are left out: read by nothing (the graph reads its inputs), and a view of a stacked
        # part made here would stay in the graph, unused.
        left = {f"inner.{k}" for k in weights_of(module)} ^ swapped.keys()
        if left:
            raise RuntimeError(f"{type(module).__qualname__}.{method}: these tensors would not be graph inputs: {sorted(left)}")
        return torch.func.functional_call(_Method(module, method), swapped, args, tie_weights=False, strict=False)


class _Method(nn.Module):
    """Calls one method of a module, so functional_call can swap its weights."""

    def __init__(self, inner: nn.Module, method: str):
        super().__init__()
        self.inner = inner
        self.method = method

    def forward(self, *args):
        return getattr(type(self.inner), self.method)(self.inner, *args)


def _attribute_reads(module: nn.Module, method: str, shapes: Shapes, path: str) -> dict:
    mode, already = _fake_mode_of(module)
    log: dict = {}
    weights, values = _fake_weights(module, mode, already)
    with mode:
        args = module.example_inputs(method, 1, shapes)
    _check_tensor_args(module, method, args)
    try:
        with _recording(module, log, path or type(module).__name__), mode:
            _call(module, method, weights, values, args)
    except TraceError:
        raise
    except Exception as e:  # the user's code failed on fake inputs; say where
        raise TraceError(_explain_failure(f"{type(module).__name__}.{method}", "cannot run on example inputs", e)) from e
    return log


def _check_tensor_args(module: nn.Module, method: str, args) -> None:
    params = entries_of(type(module))[method].params
    for name, a in zip(params, args):
        if not isinstance(a, torch.Tensor):
            raise TraceError(
                f"{type(module).__qualname__}.{method}: argument {name!r} is {a!r} ({type(a).__name__}); "
                "entry arguments must be tensors (make a per-call value a tensor, a fixed one an attribute)"
            )


# -- export --------------------------------------------------------------------


def trace(variant: Variant, bucket: int, shapes: Shapes, backend: "Backend | None" = None) -> TracedGraph:
    """Export one variant at one bucket, run the pass pipeline (with the static-shape
    passes and the backend's own where it has them), check the result."""
    import time

    module, spec = variant.module, variant.spec
    mode, already = _fake_mode_of(module)
    graph_ws, weights = _fake_weights(module, mode, already)
    shapes = dataclasses.replace(shapes, context=variant.context)
    with mode:
        args = tuple(module.example_inputs(spec.method, bucket, shapes))
        if shapes.device != "cpu":  # the build machine needs no GPU: these are fake tensors
            weights = {k: v.to(shapes.device) for k, v in weights.items()}
            # empty_strided, not .to(): a cache view of the first `context` positions keeps its strides.
            args = tuple(torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=shapes.device) for a in args)
    if len(args) != len(spec.params):
        raise TraceError(f"{variant.cls.__qualname__}.example_inputs({spec.method!r}) returned {len(args)} tensors; the method takes {len(spec.params)}: {', '.join(spec.params)}")
    names = list(weights)
    narrow: dict[int, list[tuple[int, int]]] = {}
    if backend is not None and not backend.views:
        args, narrow = _whole_caches(args, spec, f"{variant.entry_id} (bucket {bucket})")
    wrapper = _flat_wrapper(module, spec.method, graph_ws, narrow)
    _record_frames_of(module)
    t0 = time.perf_counter()
    with heap.paused():  # the graph's many objects all live on
        try:
            program = torch.export.export(wrapper, (*weights.values(), *args), strict=False)
        except Exception as e:  # export's errors are many types; all mean the same to the user
            raise TraceError(_explain_failure(f"{variant.entry_id} (bucket {bucket})", "cannot be exported", e)) from e
        export_s = time.perf_counter() - t0
        result = run_pipeline(program, pipeline_for(backend))
    program, reports, gm = result.program, result.reports, result.program.graph_module
    if needs_static(backend):
        _check_static(gm, f"{variant.entry_id} (bucket {bucket})", backend.name)
    _drop_stale_ranges(program)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # A split input (SplitDtypeRegions) is one placeholder per region, in its place: its tag is the region.
    given = [((names + list(spec.params))[i], region) for i, region in result.inputs]
    if len(placeholders) != len(given):
        raise TraceError(f"{variant.entry_id}: export produced {len(placeholders)} inputs, expected {len(given)}")
    inputs = []
    for node, (name, region) in zip(placeholders, given):
        val = node.meta["val"]
        if region is not None:
            if name not in spec.caches:
                raise TraceError(
                    f"{variant.entry_id}: argument {name!r} is read as regions of several dtypes, which only a cache "
                    "may be (name it in @entry(caches=...)), or read it as one dtype"
                )
            inputs.append(TensorSpec(f"{name}@{region[0]}", "cache", list(val.shape), dtype_name(val.dtype), list(val.stride()), None, 0, RegionSpec(name, *region)))
            continue
        if name in weights:
            kind, path, pad = "weight", name, 0
        elif name in spec.caches:
            kind, path, pad = "cache", None, 0
        else:
            kind, path, pad = "activation", None, spec.pad.get(name, 0)
            if not val.shape or val.shape[0] != bucket:
                raise TraceError(
                    f"{variant.cls.__qualname__}.example_inputs({spec.method!r}, {bucket}) gave {name!r} shape "
                    f"{list(val.shape)}; an activation's dim 0 must be the bucket ({bucket})"
                )
        inputs.append(TensorSpec(name if kind != "weight" else f"w.{name}", kind, list(val.shape), dtype_name(val.dtype), list(val.stride()), path, pad, None))
    outputs = _outputs(gm, variant, bucket)
    _check_mutations(gm, inputs, variant)
    return TracedGraph(variant, bucket, program, inputs, outputs, reports, export_s)


def _record_frames_of(module: nn.Module) -> None:
    """Make export record the frames of the model's own methods in node stack traces,
    so that errors name the user's line (e.g. in `decode`), not its caller's.
    Workaround: torch 2.13's export keeps only frames named `forward` and frames
    registered as anchors; remove when it records every user frame."""
    from torch.fx.proxy import _register_stack_trace_anchor

    for cls in {type(m) for m in module.modules()}:
        for klass in cls.__mro__:
            if klass.__module__.startswith("torch."):
                continue
            for fn in vars(klass).values():
                if inspect.isfunction(fn):
                    _register_stack_trace_anchor(fn)


def _check_static(gm: torch.fx.GraphModule, what: str, backend: str) -> None:
    """No unbacked symbol (a size or number that depends on tensor values) is left."""
    for node in gm.graph.nodes:
        symbols = unbacked_in(node)
        if symbols:
            raise TraceError(
                f"{source_line(node)}: {what} still has a data-dependent size ({', '.join(sorted(map(str, symbols)))}, "
                f"from {node.target}) after the passes, and the {backend} backend compiles static shapes only. "
                "Compute it with fixed-size tensors: torch.where or a mask instead of a boolean index, "
                "nonzero_static instead of nonzero, index tensors instead of .item() or tolist()"
            )


def _drop_stale_ranges(program: torch.export.ExportedProgram) -> None:
    """Forget the ranges of unbacked symbols that the passes removed from the graph
    (a saved program would carry them, and its loader warns about each). A while_loop's
    body is a graph of its own, with symbols of its own (the whole step's layer index,
    bounded by the body's asserts): the loader needs their ranges to read those asserts
    back, and Inductor needs the asserts to know the index is in range (without them it
    computed each weight's offset outside its kernels, ending a kernel at each)."""
    graphs = [program.graph_module, *loop_bodies(program.graph_module)]
    left = set().union(*(unbacked_in(n) for g in graphs for n in g.graph.nodes))
    ranges = program.range_constraints  # the program's own dict: it has no setter
    for symbol in [s for s in ranges if free_unbacked_symbols(s) and s not in left]:
        del ranges[symbol]


def _whole_caches(args: tuple, spec: EntrySpec, what: str) -> tuple[tuple, dict[int, list[tuple[int, int]]]]:
    """For a backend whose programs take no strided views: each cache argument that is a view
    of its allocation's first positions (a context bucket's) replaced by that allocation,
    and for each, the (dim, length) narrowings that make the view again inside the graph."""
    args, narrow = list(args), {}
    for i, name in enumerate(spec.params):
        a = args[i]
        if name not in spec.caches or a._base is None:
            continue
        base = a._base
        dims = [(d, a.shape[d]) for d in range(a.dim()) if a.dim() == base.dim() and a.shape[d] != base.shape[d]]
        if a.dim() != base.dim() or a.storage_offset() != 0 or a.stride() != base.stride() or not base.is_contiguous():
            raise TraceError(
                f"{what}: cache {name!r} is a view (shape {list(a.shape)}, strides {list(a.stride())}) that is not the first "
                "positions of its allocation; this backend takes whole caches, so example_inputs must give the allocation or a "
                "prefix slice of it (cache[:, :, :positions])"
            )
        args[i], narrow[i] = base, dims
    return tuple(args), narrow


def _flat_wrapper(module: nn.Module, method: str, weights: list[WeightSpec], narrow: dict[int, list[tuple[int, int]]]) -> nn.Module:
    n = len(weights)

    class Flat(nn.Module):
        # module is deliberately not a registered submodule: its weights
        # must enter the graph as the inputs below, not as lifted parameters.
        def forward(self, *flat):
            args = list(flat[n:])
            for i, dims in narrow.items():  # a whole cache, read and written through its first positions
                for d, length in dims:
                    args[i] = args[i][(slice(None),) * d + (slice(0, length),)]  # aten.slice, which the passes see through
            return _call(module, method, weights, {w.key: v for w, v in zip(weights, flat[:n])}, tuple(args))

    return Flat()


def _outputs(gm, variant: Variant, bucket: int) -> list[TensorSpec]:
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = []
    for i, node in enumerate(out_node.args[0]):
        if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            raise TraceError(f"{variant.entry_id}: output {i} is not a tensor; entry methods return tensors only")
        root, _ = alias_root(node)
        if root.op == "placeholder":
            raise TraceError(
                f"{variant.entry_id}: output {i} is (a view of) input {root.name}; caches are written in place and never returned, and inputs are never returned as outputs"
            )
        val = node.meta["val"]
        if not val.shape or val.shape[0] != bucket:
            raise TraceError(f"{variant.entry_id}: output {i} has shape {list(val.shape)}; its dim 0 must be the bucket ({bucket})")
        outs.append(TensorSpec(f"out{i}", "activation", list(val.shape), dtype_name(val.dtype), list(val.stride()), None, 0, None))
    return outs


def _check_mutations(gm, inputs: list[TensorSpec], variant: Variant) -> None:
    kinds = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, info in zip(placeholders, inputs):
        kinds[node] = info
    for node in gm.graph.nodes:
        for target in written_args(node):
            root, views = alias_root(target)
            info = kinds.get(root)
            if info is None:
                continue
            if info.kind != "cache":
                raise TraceError(
                    f"{source_line(node)}: {variant.entry_id} writes into {info.kind} {info.path or info.name!r}; only arguments named in @entry(caches=...) may be written"
                )
            direct = node.target in (torch.ops.aten.index_put_.default, torch.ops.aten.index_copy_.default)
            if views or not direct:
                raise TraceError(
                    f"{source_line(node)}: cache {info.name!r} is written by {node.target} "
                    f"{'through a view' if views else ''}; write it with one indexed assignment (cache[idx] = value)"
                )


def _explain_failure(what: str, verb: str, e: Exception) -> str:
    text = str(e)
    # The user's frames: not torch's, and not aotc's own machinery (its models are user code here).
    aotc_dir = Path(__file__).parent
    machinery = (str(Path(torch.__file__).parent), str(aotc_dir))
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(machinery) or f.filename.startswith(str(aotc_dir / "models"))]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({(frames[-1].line or '').strip()})" if frames else ""
    hint = ""
    lowered = (text + type(e).__name__).lower()
    if any(k in lowered for k in ("data-dependent", "datadependent", "dynamicoutputshape", "unbacked", "local_scalar_dense", "nonzero")):
        hint = (
            " The code depends on tensor values (.item(), nonzero, tolist, a boolean mask, or a branch on a "
            "tensor): compute it with tensor ops instead (torch.where, index tensors, a fixed-size mask)."
        )
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"{what} {verb}{where}: {first}.{hint}"
