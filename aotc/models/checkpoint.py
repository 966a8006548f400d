"""Reading Hugging Face safetensors checkpoints, single-file or sharded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .. import lowp_weights
from ..errors import WeightsError
from .config import model_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# safetensors dtype codes -> torch dtypes
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path


class Checkpoint:
    """The tensors of a model folder, known from the safetensors headers alone.

    Reading the headers costs a few kilobytes per file, so builds can check
    every shape and dtype without reading a single weight value.
    """

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._files():
            if not file.is_file():  # a FIFO or a device would block or never end; a dangling link
                raise WeightsError(f"{file}: not a regular file; the weights must be safetensors files")
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        if name in self.tensors:
                            raise WeightsError(f"{file}: tensor {name!r} is in {self.tensors[name].file.name} too; a checkpoint holds each tensor once")
                        sl = f.get_slice(name)
                        dtype = _DTYPES.get(sl.get_dtype())
                        if dtype is None:
                            raise WeightsError(f"{file}: tensor {name!r} has dtype {sl.get_dtype()}, which aotc does not read; known: {', '.join(sorted(_DTYPES))}")
                        self.tensors[name] = TensorInfo(name, tuple(sl.get_shape()), dtype, file)
            except (SafetensorError, OSError) as e:
                # Truncated, empty or not a safetensors file at all: its header does not parse.
                raise WeightsError(f"{file}: not a readable safetensors file ({e}); re-download or re-save the checkpoint") from None

    def _files(self) -> list[Path]:
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(model_file(self.dir, INDEX).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightsError(f"{index}: expected a JSON object with a 'weight_map' ({e})") from None
            if not isinstance(weight_map, dict):
                raise WeightsError(f"{index}: 'weight_map' is {type(weight_map).__name__}; expected an object of tensor name -> shard file name")
            bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or Path(v).name != v or v in ("", ".", "..")), None)
            if bad is not None:
                raise WeightsError(f"{index}: weight_map[{bad[0]!r}] is {bad[1]!r}; expected the name of a shard file in {self.dir}")
            files = sorted({model_file(self.dir, f) for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise WeightsError(f"{index} names shard {f.name}, which is missing from {self.dir}")
            return files
        single = model_file(self.dir, SINGLE)
        if single.exists():
            return [single]
        found = sorted(model_file(self.dir, f.name) for f in self.dir.glob("*.safetensors"))
        if found:
            return found
        raise WeightsError(f"{self.dir}: no {SINGLE}, {INDEX} or *.safetensors; the weights must be in safetensors format")

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise WeightsError(f"{self.dir}: checkpoint has no tensor {name!r} ({len(self.tensors)} tensors present)") from None

    def check(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        info = self.info(name)
        if tuple(info.shape) != tuple(shape):
            raise WeightsError(
                f"{info.file}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)} from config.json; the config and the weights do not belong together"
            )
        return info

    def load(self, names: list[str], pieces: dict | None = None) -> dict:
        """The named tensors, and pieces: {key: (name, piece(read))} for tensors of which only
        a part is wanted (a rank's, aotc.parallel.piece), each under its key: read(index)
        reads just the elements at that tuple of slices (safetensors' get_slice),
        read(None) the whole tensor."""
        wanted = [(name, name, None) for name in names] + [(key, name, fn) for key, (name, fn) in (pieces or {}).items()]
        by_file: dict[Path, list] = {}
        for item in wanted:
            by_file.setdefault(self.info(item[1]).file, []).append(item)
        out = {}
        for file, items in by_file.items():
            with safe_open(file, framework="pt") as f:
                for key, name, fn in items:
                    if fn is None:
                        out[key] = f.get_tensor(name)
                    else:
                        sl = f.get_slice(name)
                        out[key] = fn(lambda index, sl=sl: sl[:] if index is None else sl[index])
        return out


@dataclass(frozen=True)
class Merged:
    """A parameter that the checkpoint stores as several tensors, as transformers' MoE
    models' fused experts are (one tensor per expert, gate and up apart): each part's
    tensors stacked along `stack_dim`, then the parts concatenated along `cat_dim`."""

    parts: tuple[tuple[str, ...], ...]  # checkpoint tensor names, per part, in order
    stack_dim: int = 0
    cat_dim: int = 0
    # A rank's part already: the tensors of its experts only, of a parameter split along
    # the stack (expert parallelism), read whole.
    ranked: bool = False

    @property
    def names(self) -> list[str]:
        return [n for part in self.parts for n in part]

    def apply(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        stacked = [torch.stack([tensors[n] for n in part], dim=self.stack_dim) for part in self.parts]
        return stacked[0] if len(stacked) == 1 else torch.cat(stacked, dim=self.cat_dim)

    def info(self, checkpoint: "Checkpoint", param: str) -> tuple[tuple[int, ...], torch.dtype]:
        """The merged shape and dtype of `param`, from the headers: as many tensors in each
        part, and every tensor of a part alike."""
        infos = {n: checkpoint.info(n) for n in self.names}
        if len({len(part) for part in self.parts}) > 1:
            counts = " and ".join(f"{len(part)}{' tensors' if i == 0 else ''} like {part[0]!r}" for i, part in enumerate(self.parts))
            raise WeightsError(f"{infos[self.parts[0][0]].file}: {param} is merged from {counts}; the checkpoint lacks some of them")
        for part in self.parts:
            first = infos[part[0]]
            for n in part[1:]:
                if (infos[n].shape, infos[n].dtype) != (first.shape, first.dtype):
                    raise WeightsError(
                        f"{infos[n].file}: tensor {n!r} is {list(infos[n].shape)} {infos[n].dtype}, and {part[0]!r} is "
                        f"{list(first.shape)} {first.dtype}; the tensors merged into one parameter must be alike"
                    )
        metas = {n: torch.empty(i.shape, dtype=i.dtype, device="meta") for n, i in infos.items()}
        try:
            merged = self.apply(metas)
        except RuntimeError as e:  # parts that do not concatenate
            raise WeightsError(f"{infos[self.parts[0][0]].file}: {param} cannot be merged from {', '.join(repr(p[0]) for p in self.parts)}, ... ({e})") from None
        return tuple(merged.shape), merged.dtype


@dataclass(frozen=True)
class StoredInfo:
    """A weight the checkpoint stores in low precision (aotc.lowp_weights)."""

    format: str  # "fp8" | "fp4" | "int8"
    values: str  # checkpoint tensor names
    scale: str


def scale_names(name: str) -> list[str]:
    """Where a weight's block scales may be: the Hugging Face `<name>_scale_inv`, or
    DeepSeek's own `<module>.scale` beside `<module>.weight`."""
    names = [f"{name}_scale_inv"]
    if name.endswith(".weight"):
        names.append(name.removesuffix("weight") + "scale")
    return names


def stored_form(checkpoint: Checkpoint, name: str, shape: tuple[int, ...]) -> StoredInfo | None:
    """How the checkpoint stores the weight `name` of `shape` (the model's): None when
    as a plain tensor; else fp8 values with block scales, packed fp4 or int8 with scales
    per 32. The values' and the scales' shapes are checked against `shape`."""
    info = checkpoint.info(name)
    scale = next((s for s in scale_names(name) if s in checkpoint.tensors), None)
    packed_shape = lowp_weights.stored_shape("fp4", shape)
    if info.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        if info.dtype == torch.float8_e5m2:
            raise WeightsError(f"{info.file}: {name!r} is float8_e5m2; aotc reads fp8 weights as float8_e4m3fn (F8_E4M3) with block scales")
        fmt = "fp8"
    elif scale is not None and info.dtype == torch.int8 and info.shape == tuple(shape) and len(shape) >= 2:
        fmt = "int8"
    elif scale is not None and info.dtype == torch.float4_e2m1fn_x2 and info.shape == tuple(shape):
        fmt = "fp4"  # safetensors' F4 header gives the unpacked shape
    elif scale is not None and info.dtype in (torch.uint8, torch.int8) and info.shape == packed_shape and len(shape) >= 2:
        fmt = "fp4"
    else:
        return None
    if scale is None:
        raise WeightsError(f"{info.file}: {fmt} tensor {name!r} has no {' or '.join(map(repr, scale_names(name)))}; low-precision weights need their block scales")
    if fmt == "fp8":
        checkpoint.check(name, shape)
    expected = lowp_weights.scale_shape(fmt, shape)
    scale_info = checkpoint.info(scale)
    if scale_info.shape != expected:
        block = "x".join(map(str, lowp_weights.BLOCKS[fmt]))
        raise WeightsError(f"{scale_info.file}: {scale!r} has shape {list(scale_info.shape)}, expected {list(expected)} (one scale per {block} block of {list(shape)})")
    if scale_info.dtype not in (torch.float32, torch.bfloat16, torch.float8_e8m0fnu, torch.uint8):
        raise WeightsError(f"{scale_info.file}: {scale!r} is {scale_info.dtype}; block scales are F32, BF16 or E8M0 (F8_E8M0 or U8 exponents)")
    return StoredInfo(fmt, name, scale)


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a stored tensor has in graphs: packed fp4 and E8M0 exponents as uint8
    (the same bytes: every backend has uint8), int8 values as int8 (converted to float
    directly: Inductor reinterprets uint8 as int8 through a stack buffer per vector, a
    third of an int8 linear's time once its weights stream from memory), fp8 as
    float8_e4m3fn, other scales as float32."""
    if dtype == torch.int8:
        return dtype
    if dtype in (torch.uint8, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu):
        return torch.uint8
    return dtype if dtype == torch.float8_e4m3fn else torch.float32


def as_stored(t: torch.Tensor) -> torch.Tensor:
    """A loaded values or scale tensor in its graph dtype: the same bytes reinterpreted
    where the sizes agree, else converted (bf16 scales)."""
    dtype = stored_dtype(t.dtype)
    if t.dtype == dtype:
        return t
    return t.view(dtype) if t.dtype.itemsize == dtype.itemsize else t.to(dtype)
