"""Load-time weight layouts: graph inputs derived from checkpoint tensors.

A module may want its weights in another layout in compiled graphs than the
checkpoint stores them in: a MoE layer reads its experts stacked into one
[E, out, in] tensor, so that a decode step gathers only the chosen experts'
matrices. It declares so with `derived_weights()`:

    class MoE(nn.Module):
        def derived_weights(self):
            return {"w1": Derived("stack", tuple(f"experts.{e}.w1.weight" for e in range(n)))}

        def forward(self, x):
            stacked = aotc.derived(self)  # the graph inputs while traced; None in eager
            ...

The tracer makes each derived weight one graph input in place of its sources,
and the manifest records it as a named transform of checkpoint tensor paths.
The runtime applies the transform once, at bind, and re-points the sources at
views of the result, so memory is not doubled and eager code keeps reading the
checkpoint's names. Transforms are a fixed set of named functions: a bundle
names one, it never carries code.

A weight that the checkpoint stores in low precision (aotc.quant: fp8 with
block scales, packed fp4) enters the graphs as stored: two inputs, its values
and its scales, which the graph dequantizes next to their use. The loader
registers each such weight's `Stored` tensors here (`keep_stored`); eager code
reads the dequantized parameter.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .errors import TraceError
from .format import Fp8Reading, StoredFormat, StoredSpec, TransformName, WeightSpec
from .quant import dequantize


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
    """A parameter as the checkpoint stores it (aotc.quant)."""

    format: StoredFormat
    values: torch.Tensor  # float8_e4m3fn, or packed fp4 as uint8
    scale: torch.Tensor  # float32, or E8M0 exponent bytes as uint8
    fp8_reading: str = "e4m3fn"  # "e4m3" once rescaled for trn2 (aotc.fp8)

    def part(self, part: str) -> torch.Tensor:
        return self.values if part == "values" else self.scale


# owner module -> {leaf name: Stored}. Weak: the stored tensors live as long as the model.
_STORED: "weakref.WeakKeyDictionary[nn.Module, dict[str, Stored]]" = weakref.WeakKeyDictionary()


def keep_stored(model: nn.Module, path: str, stored: Stored) -> None:
    """Record the stored form of the tensor at `path` in `model`."""
    owner, _, leaf = path.rpartition(".")
    _STORED.setdefault(model.get_submodule(owner), {})[leaf] = stored


def stored_at(module: nn.Module, path: str) -> Stored | None:
    """The stored form of the tensor at `path` in `module`, if it has one."""
    owner, _, leaf = path.rpartition(".")
    try:
        return _STORED.get(module.get_submodule(owner), {}).get(leaf)
    except AttributeError:  # no such submodule: nothing stored there
        return None


def stored_of(module: nn.Module) -> dict[str, Stored]:
    """The stored forms of the module's tensors, by path inside it."""
    out = {}
    for path, sub in module.named_modules():
        prefix = f"{path}." if path else ""
        out.update({prefix + leaf: s for leaf, s in _STORED.get(sub, {}).items()})
    return out


def weights_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters, then its buffers, by path."""
    return dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))


def graph_weights(module: nn.Module, fp8_reading: Fp8Reading = "e4m3fn") -> list[WeightSpec]:
    """The weight inputs of an entry's graph, in order, as the manifest records them: the
    parameters and buffers that no derived weight consumes, then the derived weights.
    `fp8_reading`: how the target reads fp8 bytes (Backend.fp8_reading)."""

    def spec(path: str, t: torch.Tensor, transform=None, sources=(), fmt=None, part=None, logical=None) -> WeightSpec:
        reading = fp8_reading if fmt == "fp8" else "e4m3fn"
        stored_spec = StoredSpec(fmt, part, dtype_name(logical), reading) if fmt else None
        return WeightSpec(path, list(t.shape), dtype_name(t.dtype), list(t.stride()), transform, list(sources), stored_spec)

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


# -- while tracing: the derived graph inputs of each module ----------------------------

# id(module) -> its derived graph inputs, while an entry is traced. A plain dict, not a
# ContextVar: torch.compile traces through a dict lookup but breaks the graph at
# ContextVar.get. Tracing is single-threaded (build workers are processes).
_ACTIVE: dict[int, dict[str, torch.Tensor]] = {}


def derived(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """The module's derived weights while its entry is traced (graph inputs), else None:
    eager code reads the checkpoint's tensors."""
    return _ACTIVE.get(id(module))


@contextlib.contextmanager
def providing(module: nn.Module, weights: list[WeightSpec], values: dict[str, torch.Tensor]):
    """Make `derived()` answer with `values` (by weight name, as `dequantized` gives them)
    inside `module`, and yield the sources' views, to be swapped in for the sources."""
    active: dict[int, dict[str, torch.Tensor]] = {}
    views: dict[str, torch.Tensor] = {}
    for path, sub in module.named_modules():
        prefix = f"{path}." if path else ""
        for name in _declared(sub):
            w = next(w for w in weights if w.path == prefix + name and (w.stored is None or w.stored.part != "scale"))
            active.setdefault(id(sub), {})[name] = values[w.path]
            views.update(zip(w.sources, TRANSFORMS[w.transform].views(values[w.path])))
    before = dict(_ACTIVE)
    _ACTIVE.update(active)
    try:
        yield views
    finally:
        _ACTIVE.clear()
        _ACTIVE.update(before)
