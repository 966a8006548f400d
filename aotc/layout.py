"""Load-time weight layouts: graph inputs derived from checkpoint tensors.

A module may want its weights in another layout in compiled graphs than the
checkpoint stores them in: a MoE layer reads its experts stacked into one
[E, out, in] tensor, so that a decode step gathers only the chosen experts'
matrices. It declares so with `derived_weights()`, and reads them in its
compiled form, `compiled_forward`, which the tracer calls in place of
`forward` (eager code never runs it, and has no stacked tensor to read):

    class MoE(nn.Module):
        def derived_weights(self):
            return {"w1": Derived("stack", tuple(f"experts.{e}.w1.weight" for e in range(n)))}

        def forward(self, x):
            '''A loop over the experts.'''
            ...

        def compiled_forward(self, x, derived):
            '''The chosen experts gathered from the stacked weights.'''
            stacked = derived["w1"]  # the graph input
            ...

A compiled form is a second algorithm, so `aotc run --check` and `aotc verify`
list each one (its class, and the first lines of both docstrings): they then
compare two programs, and say so.

The tracer makes each derived weight one graph input in place of its sources,
and the manifest records it as a named transform of checkpoint tensor paths.
The runtime applies the transform once, at bind, and re-points the sources at
views of the result, so memory is not doubled and eager code keeps reading the
checkpoint's names. Transforms are a fixed set of named functions: a bundle
names one, it never carries code.

A weight that the checkpoint stores in low precision (aotc.lowp_weights: fp8 with
block scales, packed fp4) enters the graphs as stored: two inputs, its values
and its scales, which the graph dequantizes next to their use. The loader
keeps each such weight's `Stored` tensors as buffers of the module that owns
the weight (`keep_stored`), so that `model.to()` moves them; eager code reads
the dequantized parameter.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .errors import TraceError
from .format import Fp8Reading, StoredFormat, StoredSpec, TransformName, WeightSpec
from .lowp_weights import dequantize


@dataclass(frozen=True)
class Transform:
    apply: Callable[[list[torch.Tensor]], torch.Tensor]  # checkpoint tensors -> the graph input
    # The sources as views of the result: bind re-points them there (no second copy), and
    # the tracer passes them so that code reading a source reads the graph input.
    views: Callable[[torch.Tensor], Sequence[torch.Tensor]]


TRANSFORMS: dict[str, Transform] = {"stack": Transform(torch.stack, torch.unbind)}


@dataclass(frozen=True)
class Derived:
    transform: TransformName
    sources: tuple[str, ...]  # tensor paths inside the declaring module, in order


@dataclass(frozen=True)
class Stored:
    """A parameter as the checkpoint stores it (aotc.lowp_weights)."""

    format: StoredFormat
    values: torch.Tensor  # float8_e4m3fn, or packed fp4 as uint8
    scale: torch.Tensor  # float32, or E8M0 exponent bytes as uint8
    fp8_reading: str = "e4m3fn"  # "e4m3" once rescaled for trn2 (aotc.fp8)

    def part(self, part: str) -> torch.Tensor:
        return self.values if part == "values" else self.scale


# A stored weight's two parts are non-persistent buffers of the module that owns the
# weight, named after it, so that model.to() moves them with it (and state_dict leaves
# them out: the checkpoint names them itself); their format is a plain attribute of it.
PARTS = ("values", "scale")
# owner.__dict__[_FORMS]: {leaf: (format, fp8_reading)}. The owner is any module (an
# nn.Linear, transformers' own), whose class aotc does not define, so the form cannot be a
# declared field of it; it is written and read here only, and goes where the module goes
# (deepcopy, the twin reference_model makes), as its buffers do.
_FORMS = "aotc_stored_forms"


def part_buffer(leaf: str, part: str) -> str:
    """The buffer that holds a part of the stored weight `leaf` of its module."""
    return f"{leaf}__stored_{part}"


def _is_part_buffer(name: str) -> bool:
    return name.rpartition(".")[2].endswith(tuple(f"__stored_{p}" for p in PARTS))


def keep_stored(model: nn.Module, path: str, stored: Stored) -> None:
    """Make `stored` the stored form of the tensor at `path` in `model`: buffers of the
    module that owns it."""
    owner_path, _, leaf = path.rpartition(".")
    owner = model.get_submodule(owner_path)
    for part in PARTS:
        owner.register_buffer(part_buffer(leaf, part), stored.part(part), persistent=False)
    vars(owner).setdefault(_FORMS, {})[leaf] = (stored.format, stored.fp8_reading)


def _stored_in(owner: nn.Module) -> dict[str, Stored]:
    forms = vars(owner).get(_FORMS, {})
    return {leaf: Stored(fmt, *(getattr(owner, part_buffer(leaf, p)) for p in PARTS), reading) for leaf, (fmt, reading) in forms.items()}


def stored_at(module: nn.Module, path: str) -> Stored | None:
    """The stored form of the tensor at `path` in `module`, if it has one."""
    owner, _, leaf = path.rpartition(".")
    try:
        return _stored_in(module.get_submodule(owner)).get(leaf)
    except AttributeError:  # no such submodule: nothing stored there
        return None


def stored_of(module: nn.Module) -> dict[str, Stored]:
    """The stored forms of the module's tensors, by path inside it."""
    out = {}
    for path, sub in module.named_modules():
        prefix = f"{path}." if path else ""
        out.update({prefix + leaf: s for leaf, s in _stored_in(sub).items()})
    return out


def weights_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters, then its buffers, by path: the tensors its code reads (a
    stored weight's parts are graph inputs through stored_of, not read by its code)."""
    buffers = {n: b for n, b in module.named_buffers(remove_duplicate=False) if not _is_part_buffer(n)}
    return dict(module.named_parameters(remove_duplicate=False)) | buffers


def graph_weights(module: nn.Module, fp8_reading: Fp8Reading = "e4m3fn") -> list[WeightSpec]:
    """The weight inputs of an entry's graph, in order, as the manifest records them: the
    parameters and buffers that no derived weight consumes, then the derived weights.
    `fp8_reading`: how the target reads fp8 bytes (Backend.fp8_reading)."""

    def spec(path: str, t: torch.Tensor, transform=None, sources=(), fmt=None, part=None, logical=None) -> WeightSpec:
        reading = fp8_reading if fmt == "fp8" else "e4m3fn"
        stored_spec = StoredSpec(fmt, part, dtype_name(logical), reading) if fmt else None
        return WeightSpec(path, list(t.shape), dtype_name(t.dtype), list(t.stride()), transform, list(sources), stored_spec, None)

    tensors = weights_of(module)
    stored = stored_of(module)
    derived = []
    consumed: set[str] = set()
    for path, sub in module.named_modules():
        prefix = f"{path}." if path else ""
        for name, d in _declared(sub).items():
            sources = tuple(prefix + s for s in d.sources)
            missing = [s for s in sources if s not in tensors]
            if missing:
                raise TraceError(f"{type(sub).__qualname__}.derived_weights(): {name!r} reads {missing[0]!r}, which is not a parameter or buffer")
            if consumed & set(sources):
                raise TraceError(f"{type(sub).__qualname__}.derived_weights(): {name!r} reads a tensor that another derived weight reads")
            consumed |= set(sources)
            where = f"{type(sub).__qualname__}.derived_weights()[{name!r}]"
            formats = {stored[s].format if s in stored else None for s in sources}
            if len(formats) > 1:
                raise TraceError(f"{where}: its sources are stored in different formats ({', '.join(sorted(map(str, formats)))}); a derived weight needs them alike")
            fmt = formats.pop()
            if fmt is None:
                meta = derive_meta(d.transform, [tensors[s] for s in sources], where)
                derived.append(spec(prefix + name, meta, d.transform, sources))
                continue
            for part in ("values", "scale"):
                meta = derive_meta(d.transform, [stored[s].part(part) for s in sources], where)
                derived.append(spec(prefix + name, meta, d.transform, sources, fmt, part, tensors[sources[0]].dtype))
    plain = []
    for n, t in tensors.items():
        if n in consumed:
            continue
        if n not in stored:
            plain.append(spec(n, t))
            continue
        for part in ("values", "scale"):
            plain.append(spec(n, stored[n].part(part), fmt=stored[n].format, part=part, logical=t.dtype))
    return plain + derived


def dequantized(weights: list[WeightSpec], values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """By weight path, the tensor the module's code reads: a stored weight dequantized
    from its two parts (in a graph: next to its use), any other as it is."""
    out = {}
    for w in weights:
        if w.stored is None:
            out[w.path] = values[w.key]
        elif w.stored.part == "values":
            out[w.path] = dequantize(w.stored.format, values[w.key], values[f"{w.path}:scale"], getattr(torch, w.stored.dtype))
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def derive_meta(transform: str, sources: list[torch.Tensor], where: str) -> torch.Tensor:
    """The transform's result on meta tensors: its shape, dtype and strides without the data."""
    metas = [torch.empty_strided(s.shape, s.stride(), dtype=s.dtype, device="meta") for s in sources]
    try:
        return TRANSFORMS[transform].apply(metas)
    except Exception as e:  # e.g. stacking tensors of different shapes
        raise TraceError(f"{where}: transform {transform!r} fails on its sources: {e}") from e


def _declared(module: nn.Module) -> dict[str, Derived]:
    fn = getattr(module, "derived_weights", None)
    return fn() if callable(fn) else {}


# -- compiled forms: what the tracer runs in place of forward ---------------------------


@dataclass(frozen=True)
class CompiledForm:
    """A module class whose compiled graphs run another algorithm than its eager code."""

    cls: str
    modules: int  # instances in the model
    eager: str  # forward's docstring, its first line
    compiled: str  # compiled_forward's


def compiled_forms(*roots: nn.Module) -> list[CompiledForm]:
    """Each module class with a compiled form in the roots (a model, or the instances of
    some entries), once, in order, with how many of its modules there are."""
    seen = {id(sub): sub for root in roots for sub in root.modules() if _compiled_form(sub) is not None}
    counts: dict[type, int] = {}
    for sub in seen.values():
        counts[type(sub)] = counts.get(type(sub), 0) + 1
    return [CompiledForm(cls.__qualname__, n, _summary(cls.forward), _summary(cls.compiled_forward)) for cls, n in counts.items()]


def _compiled_form(module: nn.Module):
    return getattr(type(module), "compiled_forward", None)


def _summary(fn) -> str:
    doc = inspect.getdoc(fn)
    return f"{fn.__qualname__}: {doc.splitlines()[0]}" if doc else fn.__qualname__


@contextlib.contextmanager
def compiled(module: nn.Module, weights: list[WeightSpec], values: dict[str, torch.Tensor]):
    """While an entry of `module` is traced: each submodule with a compiled form runs
    `compiled_forward(*args, derived=...)` in place of forward, given its derived weights
    (graph inputs, by name: `values` by weight path, as `dequantized` gives them); yield
    the sources' views, to be swapped in for the sources."""
    views: dict[str, torch.Tensor] = {}
    swapped = []
    try:
        for path, sub in module.named_modules():
            prefix = f"{path}." if path else ""
            declared, form = _declared(sub), _compiled_form(sub)
            if declared and form is None:
                raise TraceError(
                    f"{type(sub).__qualname__}.derived_weights() declares {', '.join(map(repr, declared))}, but the class has no "
                    "compiled_forward(..., derived) to read them: eager code reads the sources, the compiled form the derived weights"
                )
            if form is None:
                continue
            given = {}
            for name in declared:
                w = next(w for w in weights if w.path == prefix + name and (w.stored is None or w.stored.part != "scale"))
                given[name] = values[w.path]
                views.update(zip(w.sources, TRANSFORMS[w.transform].views(values[w.path])))
            if "forward" in vars(sub):
                raise TraceError(f"{prefix or 'the model'}: an instance attribute 'forward' hides {type(sub).__qualname__}.forward; the tracer cannot run its compiled form")
            # An instance attribute is found before the class's forward: nn.Module.__call__ runs it.
            sub.forward = functools.partial(form, sub, derived=given)
            swapped.append(sub)
        yield views
    finally:
        for sub in swapped:
            del sub.forward
