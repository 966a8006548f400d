"""Reading Hugging Face safetensors checkpoints, single-file or sharded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import WeightsError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# safetensors dtype codes -> torch dtypes
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
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
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        dtype = _DTYPES.get(sl.get_dtype())
                        if dtype is None:
                            raise WeightsError(
                                f"{file}: tensor {name!r} has dtype {sl.get_dtype()}, which aotc does not read; "
                                f"known: {', '.join(sorted(_DTYPES))}"
                            )
                        self.tensors[name] = TensorInfo(name, tuple(sl.get_shape()), dtype, file)
            except (SafetensorError, OSError) as e:
                # Truncated, empty or not a safetensors file at all: its header does not parse.
                raise WeightsError(f"{file}: not a readable safetensors file ({e}); re-download or re-save the checkpoint") from None

    def _files(self) -> list[Path]:
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightsError(f"{index}: expected a JSON object with a 'weight_map' ({e})") from None
            files = sorted({self.dir / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise WeightsError(f"{index} names shard {f.name}, which is missing from {self.dir}")
            return files
        single = self.dir / SINGLE
        if single.is_file():
            return [single]
        found = sorted(self.dir.glob("*.safetensors"))
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
                f"{info.file}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)} "
                "from config.json; the config and the weights do not belong together"
            )
        return info

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.info(name).file, []).append(name)
        out = {}
        for file, file_names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in file_names:
                    out[name] = f.get_tensor(name)
        return out


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK = 128  # DeepSeek-style fp8 checkpoints scale each 128 x 128 block of a weight


def dequantize(checkpoint: Checkpoint, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 weights with per-block `<name>_scale_inv` -> `dtype`; other tensors pass through.

    Scales are float32, or ue8m0 exponents (a power of two, `scale_fmt: ue8m0`)
    stored as float8_e8m0fnu or uint8.
    """
    if tensor.dtype not in FP8:
        return tensor
    scale_name = f"{name}_scale_inv"
    if scale_name not in checkpoint.tensors:
        raise WeightsError(f"{checkpoint.info(name).file}: fp8 tensor {name!r} has no {scale_name!r}; fp8 weights need their block scales")
    scale = checkpoint.load([scale_name])[scale_name]
    if scale.dtype == torch.uint8:  # a bare ue8m0 exponent
        scale = torch.exp2(scale.float() - 127)
    scale = scale.float()
    rows, cols = tensor.shape[-2], tensor.shape[-1]
    blocks = (-(-rows // BLOCK), -(-cols // BLOCK))
    if tuple(scale.shape[-2:]) != blocks:
        raise WeightsError(
            f"{checkpoint.info(scale_name).file}: {scale_name!r} has shape {list(scale.shape)}, expected {list(blocks)} "
            f"(one scale per {BLOCK}x{BLOCK} block of {list(tensor.shape)})"
        )
    full = scale.repeat_interleave(BLOCK, -2)[..., :rows, :].repeat_interleave(BLOCK, -1)[..., :cols]
    return (tensor.float() * full).to(dtype)
