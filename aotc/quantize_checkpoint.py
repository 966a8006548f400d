"""`aotc quantize`: a low-precision checkpoint from a bf16 or fp32 model folder.

It writes the formats aotc already reads (aotc.lowp_weights), in the Hugging Face layout
(`<name>_scale_inv` beside each quantized weight, `quantization_config` in
config.json), as llama.cpp's `llama-quantize` writes a GGUF:

- "fp8": the decoder layers' linear weights as float8_e4m3fn with a float32 scale
  per 128 x 128 block.
- "fp4-experts": as fp8, and the routed experts' (modules under `.experts.`) as
  packed e2m1 with an E8M0 scale per 32 inputs (DeepSeek V4's published form).
- "int8": the decoder layers' linear weights as int8 with a float32 scale per 32
  inputs (llama.cpp's Q8_0 weight grid), and the LM head too by default.

With fp8 the LM head stays at the source precision by default (`head="keep"`, as
`aotc init tiny --quantize` writes it); `head="fp8"` quantizes it too, as int8 does
by default and llama.cpp's Q8_0 does: decode reads the head's bytes every token, so an fp8 head reads a quarter of
fp32's. Where the head is tied to the embedding, it is then written as a tensor of
its own (config `tie_word_embeddings: false`) and the embedding keeps the source
precision: a lookup reads one row a token, so an fp8 embedding would save disk, not
time.

The source is read one shard at a time; the new folder is written beside the
destination under a temporary name and renamed when whole.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from . import lowp_weights
from .cache.local import writer_locks
from .errors import ConfigError, WeightsError
from .format import temp_folder, umask, writers_turn
from .models.checkpoint import INDEX, Checkpoint, Merged, model_file
from .models.config import read_config
from .models.loader import checkpoint_names, checkpoint_sources, load_model

FORMATS = ("fp8", "fp4-experts", "int8")
HEADS = ("keep", "fp8", "int8")
# The head's format where --head is not given: int8 quantizes it, as Q8_0 does.
DEFAULT_HEAD = {"fp8": "keep", "fp4-experts": "keep", "int8": "int8"}
HEAD_NAMES = ("lm_head.weight", "head.weight")  # the head's checkpoint names (Hugging Face's, DeepSeek's)
LOW_PRECISION = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu)


@dataclass
class Quantized:
    """What `quantize_model` wrote."""

    out: Path
    format: str
    tensors: dict[str, str] = field(default_factory=dict)  # checkpoint tensor -> "fp8" | "fp4"
    kept: dict[str, str] = field(default_factory=dict)  # tensor -> its dtype, for those copied as they are
    bytes_in: int = 0  # of the tensors quantized, at the source precision
    bytes_out: int = 0  # of their values and scales
    head: str = ""  # what became of the LM head, in words


def quantize_model(source: Path | str, out: Path | str, fmt: str, head: str | None = None) -> Quantized:
    """Write `out`, a copy of the model folder `source` with its weights in `fmt`; the head
    as `head` says (keep, or the layers' format; default: DEFAULT_HEAD)."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    head = DEFAULT_HEAD[fmt] if head is None else head
    if head not in HEADS:
        raise ConfigError(f"--head {head}: expected one of {', '.join(HEADS)}")
    layers = "int8" if fmt == "int8" else "fp8"
    if head not in ("keep", layers):
        raise ConfigError(f"--head {head} with --format {fmt}: the head is kept or takes the layers' format; pass --head keep or --head {layers}")
    source, out = Path(source), Path(out)
    _check_paths(source, out)
    config = read_config(source)  # a bad config.json is refused naming it, as build refuses it
    if config.get("quantization_config") is not None:
        raise ConfigError(
            f"{source / 'config.json'}: quantization_config is set; the checkpoint is already quantized. "
            "aotc quantize reads a bf16 or fp32 folder: quantize the full-precision source instead"
        )
    checkpoint = Checkpoint(source)
    low = next((t for t in checkpoint.tensors.values() if t.dtype in LOW_PRECISION), None)
    if low is not None:
        raise WeightsError(
            f"{low.file}: tensor {low.name!r} is {str(low.dtype).removeprefix('torch.')}; the checkpoint is already "
            "quantized. aotc quantize reads a bf16 or fp32 folder: quantize the full-precision source instead"
        )
    model = load_model(source, weights=False).model  # checks every header against config.json
    plan = _plan(model, checkpoint, fmt, head)
    result = Quantized(out, fmt, head=plan.head_words)
    with writers_turn(out, writer_locks(None)):  # what a killed quantize left beside `out` is removed first
        _write(checkpoint, plan, source, out, config, fmt, result)
    return result


def _write(checkpoint: Checkpoint, plan: "_Plan", source: Path, out: Path, config: dict, fmt: str, result: Quantized) -> None:
    """The quantized folder, written under a temporary name beside `out`, then renamed."""
    tmp = temp_folder(f".{out.name}.tmp-", out.parent)
    try:
        weight_map = _write_shards(checkpoint, plan, tmp, result)
        _copy_files(source, tmp)
        # transformers' FineGrainedFP8 reads every linear not in modules_to_not_convert as quantized
        if fmt == "int8":
            config["quantization_config"] = {**lowp_weights.INT8_CONFIG, "modules_to_not_convert": sorted(plan.not_converted)}
        else:
            config["quantization_config"] = {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(lowp_weights.FP8_BLOCK),
                "modules_to_not_convert": sorted(plan.not_converted),
            }  # fmt: skip
        if fmt == "fp4-experts":
            config["expert_dtype"] = "fp4"
        if plan.untie is not None:
            config["tie_word_embeddings"] = False
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if (source / INDEX).is_file():
            total = sum(os.path.getsize(tmp / f) for f in set(weight_map.values()))
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        try:
            if out.exists():
                out.rmdir()  # empty (_check_paths): replaced by the finished folder
            os.replace(tmp, out)
        except OSError as e:  # not the disk: `out` changed while the weights were written
            raise ConfigError(
                f"-o {out}: the finished folder could not take its place ({e.strerror}): something was written there "
                "while aotc quantize ran. Nothing was left half-written; choose another path, or empty it, and run again"
            ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_paths(source: Path, out: Path) -> None:
    if not (source / "config.json").is_file():
        raise ConfigError(f"{source}: no config.json; aotc quantize reads a Hugging Face model folder")
    src, dst = source.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise ConfigError(f"-o {out}: inside the source folder {source}; aotc quantize writes a new folder beside it, never into the source. Choose a path outside {source}")
    if dst in src.parents:
        raise ConfigError(f"-o {out}: holds the source folder {source}; choose a new or empty folder outside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"-o {out}: exists and is not an empty folder; aotc quantize writes a new one. Choose another path, or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)


@dataclass
class _Plan:
    formats: dict[str, str]  # checkpoint tensor -> stored format
    untie: tuple[str, str] | None  # (the head's new tensor, the embedding tensor it is made from)
    not_converted: set[str]  # linear modules left at the source precision (transformers' names)
    head_words: str


def _plan(model, checkpoint: Checkpoint, fmt: str, head: str) -> _Plan:
    """Which checkpoint tensors become which format."""
    sources = checkpoint_sources(model, checkpoint)
    tied = model.tied_parameters()
    head_param = next((p for p, _ in model.named_parameters(remove_duplicate=False) if set(checkpoint_names(model, p)) & set(HEAD_NAMES)), None)
    by_param = lowp_weights.layer_formats(model, fmt, "--format")
    merged = [param for param in by_param if isinstance(sources[param], Merged)]
    if merged:  # the loader reads low-precision experts fused only
        raise WeightsError(
            f"{checkpoint.info(sources[merged[0]].parts[0][0]).file}: {merged[0]} (and {len(merged) - 1} more) are merged from "
            "per-expert tensors, which aotc reads at full precision only; save the checkpoint with the experts fused first"
        )
    formats = {sources[param]: f for param, f in by_param.items()}
    # the other linears, transformers' names: its FineGrainedFP8 reads every linear not listed as quantized
    not_converted = {
        _module_name(checkpoint_names(model, f"{path}.weight")[0]) for path, m in model.named_modules()
        if isinstance(m, nn.Linear) and f"{path}.weight" not in by_param and f"{path}.weight" != head_param
    }  # fmt: skip
    if not formats:
        raise ConfigError(f"{checkpoint.dir}: {type(model).__name__} has no linear layers in its decoder layers for aotc quantize to quantize")
    untie = None
    if head_param is None:
        words = "no LM head found: none quantized"
    elif head == "keep":
        words = f"kept at {_dtype(checkpoint, sources[tied.get(head_param, head_param)])}"
        not_converted.add(_module_name(checkpoint_names(model, head_param)[0]))
    elif head_param in tied:
        untie = (checkpoint_names(model, head_param)[0], sources[tied[head_param]])
        formats[untie[0]] = head
        words = f"{head}, untied from the embedding {untie[1]!r}, which stays {_dtype(checkpoint, untie[1])}"
    else:
        formats[sources[head_param]] = head
        words = head
    return _Plan(formats, untie, not_converted, words)


def _module_name(tensor: str) -> str:
    return tensor.removesuffix(".weight")


def _dtype(checkpoint: Checkpoint, name: str) -> str:
    return str(checkpoint.info(name).dtype).removeprefix("torch.")


def _write_shards(checkpoint: Checkpoint, plan: _Plan, tmp: Path, result: Quantized) -> dict[str, str]:
    """Each source shard as a shard of the same name: its quantized tensors as values and
    scales, the rest as they are. Returns the new weight map."""
    by_file: dict[Path, list[str]] = {}
    for name, info in checkpoint.tensors.items():
        by_file.setdefault(info.file, []).append(name)
    weight_map = {}
    for file, names in by_file.items():
        tensors = {}
        with safe_open(file, framework="pt") as f:
            for name in names:
                t = f.get_tensor(name)
                made = [(name, t)]
                if plan.untie is not None and name == plan.untie[1]:
                    made.append((plan.untie[0], t))
                for made_name, tensor in made:
                    fmt = plan.formats.get(made_name)
                    if fmt is None:
                        tensors[made_name] = tensor
                        result.kept[made_name] = str(tensor.dtype).removeprefix("torch.")
                        continue
                    if not torch.isfinite(tensor).all():  # one NaN or inf would make its whole block's scale NaN or inf
                        at = (~torch.isfinite(tensor)).nonzero()[0].tolist()
                        raise WeightsError(
                            f"{file}: tensor {name!r} holds {tensor[tuple(at)].item()} at {at}; a block scale made from it would "
                            "lose every value of its block. Fix or re-export the checkpoint"
                        )
                    values, scale = lowp_weights.quantize(fmt, tensor, e8m0=fmt == "fp4")
                    if scale.dtype == torch.uint8:
                        scale = scale.view(torch.float8_e8m0fnu)  # safetensors' F8_E8M0, as published
                    tensors[made_name], tensors[f"{made_name}_scale_inv"] = values, scale
                    result.tensors[made_name] = fmt
                    result.bytes_in += tensor.numel() * tensor.element_size()
                    result.bytes_out += values.numel() * values.element_size() + scale.numel() * scale.element_size()
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / file.name), metadata={"format": "pt"})
        except SafetensorError as e:  # safetensors' own error on a failed write (a full disk): as the OSError it is
            raise OSError(errno.ENOSPC if "StorageFull" in str(e) or "No space left" in str(e) else None, str(e), str(tmp / file.name)) from e
        os.chmod(tmp / file.name, 0o666 & ~umask())  # safetensors writes 0600; a model folder is read by others where the umask lets them
        weight_map.update(dict.fromkeys(tensors, file.name))
    return weight_map


def _copy_files(source: Path, tmp: Path) -> None:
    """The folder's other files (tokenizer, chat template, generation config): their
    contents, links followed, so that the new folder stands alone."""
    for path in sorted(source.iterdir()):
        if path.name in ("config.json", INDEX) or path.suffix == ".safetensors" or path.name.startswith("."):
            continue
        if path.is_file():
            shutil.copyfile(model_file(source, path.name), tmp / path.name)
