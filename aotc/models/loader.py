"""Loading a model folder: config.json to the aotc class that runs it (the architectures
registered, aotc's own and transformers' generic one), the module built, and its
checkpoint's weights checked and assigned as the graphs take them.

The contract a model implements is models/base.py; the table of architectures is
models/registry.py, which the model files fill as they are imported. This module reads
both and imports the model files, which import neither it nor each other.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Container

import torch
from torch.overrides import TorchFunctionMode

from .. import lowp_weights, parallel
from ..errors import ConfigError, WeightsError, did_you_mean
from ..format import KvCacheRecord, ParallelRecord, ShardSpec
from ..layout import Stored, keep_stored, stored_at
from .base import CausalLM, fake_tensor_mode
from .checkpoint import Checkpoint, Merged, StoredInfo, as_stored, stored_dtype, stored_form
from .config import ConfigReader, read_config
from .registry import Architecture, add, registered

# Padding rows of a bucket write their cache entries into the last slot of the
# cache pool, which no sequence owns (-1 indexes it directly).


def architectures() -> dict[str, Architecture]:
    _import_builtin_models()
    return registered()


def get_architecture(name: str) -> Architecture:
    archs = architectures()
    for arch in archs.values():
        if name == arch.name or name in arch.model_types:
            return arch
    raise ConfigError(f"unknown architecture {name!r}; {did_you_mean(name, archs)}")


MODELING = ("auto", "aotc", "transformers")


def modeling_of(architecture: str) -> str:
    """The --modeling that picks a bundle's recorded architecture again."""
    from . import hf

    return "transformers" if architecture == hf.NAME else "auto"


def resolve(config: dict, source: Path | str, modeling: str = "auto") -> Architecture:
    """Pick the architecture for a config.json dict, by `model_type` then `architectures`;
    where aotc has no code of its own for it (or `modeling` is "transformers"),
    transformers' own modeling code (aotc.models.hf). "aotc": aotc's own code only."""
    from . import hf

    if modeling not in MODELING:
        raise ConfigError(f"--modeling {modeling!r}: expected one of {', '.join(MODELING)}")
    if config.get("is_encoder_decoder") is True:
        raise ConfigError(f"{source}: model_type {config.get('model_type')!r} is an encoder-decoder (field 'is_encoder_decoder' is true); aotc compiles decoder-only causal LMs")
    if modeling == "transformers":
        if not hf.knows(config):
            raise ConfigError(
                f"{source}: --modeling transformers, but transformers {hf.installed() or '(not installed)'} has no causal LM for "
                f"model_type {config.get('model_type')!r}; install aotc[hf], or use --modeling auto"
            )
        return architectures()[hf.NAME]
    archs = [a for a in architectures().values() if a.name != hf.NAME]
    model_type = config.get("model_type")
    names = config.get("architectures") or ()
    by_type = next((a for a in archs if model_type in a.model_types), None)
    by_name = next((a for name in names for a in archs if name in a.architectures), None)
    if by_name and model_type is not None and by_type is not by_name:
        what = f"is {by_type.name}" if by_type else "is no architecture aotc knows"
        raise ConfigError(
            f"{source}: model_type {model_type!r} {what}, but architectures {list(names)} is {by_name.name}; the config contradicts itself. Fix whichever field is wrong"
        )
    if by_type or by_name:
        return by_type or by_name
    if modeling == "auto" and hf.knows(config):  # transformers' own modeling code, where aotc has none of its own
        return registered()[hf.NAME]
    known = sorted({t for a in archs for t in a.model_types})
    raise ConfigError(
        f"{source}: unsupported architecture (model_type={model_type!r}, "
        f"architectures={config.get('architectures')!r}); aotc knows model_type {', '.join(known)}, and, with transformers "
        f"installed (aotc[hf]), every decoder-only model transformers has. "
        "Register your own with aotc.register_architecture and pass --plugin (see docs/models.md)."
    )


def _import_builtin_models() -> None:
    # aotc's own models, imported where they are first needed (they register themselves).
    from . import deepseek_v4, hf, llama  # noqa: F401

    if hf.NAME not in registered():  # by name only: resolve() picks it for what no model_type claims
        add(Architecture(hf.NAME, hf.TransformersCausalLM, (), ()))


@dataclass
class LoadedModel:
    model: CausalLM
    arch: Architecture
    config: object
    config_dict: dict
    dir: Path


def parse_config(
    model_dir: Path, kv_cache: KvCacheRecord | None = None, modeling: str = "auto", layout: ParallelRecord | None = None,
) -> tuple[dict, Architecture, object]:  # fmt: skip
    config_dict = read_config(model_dir)
    source = Path(model_dir) / "config.json"
    _check_quantization(config_dict, source)
    arch = resolve(config_dict, source, modeling)
    config = arch.model_class.config_class.from_hf(ConfigReader(config_dict, source))
    if kv_cache is not None:
        if kv_cache.dtype not in arch.model_class.kv_cache_dtypes:
            raise ConfigError(
                f"--kv-cache-dtype {kv_cache.dtype}: {arch.name} keeps its caches as {' or '.join(arch.model_class.kv_cache_dtypes)}; build it with --kv-cache-dtype auto"
            )
        config = dataclasses.replace(config, kv_cache=kv_cache)
    if layout is not None and layout.world_size > 1:
        _check_degree(arch, config, layout)
        config = dataclasses.replace(config, parallel=layout)
    return config_dict, arch, config


def _check_degree(arch: Architecture, config, layout: ParallelRecord) -> None:
    """--tensor-parallel N or --expert-parallel N: the model has that plan, and every
    tensor it splits splits N ways."""
    if layout.tensor_parallel > 1:
        name, plan = "tensor-parallel", arch.model_class.shard_specs
        has = "the llama family has one, and a transformers model whose config class has base_model_tp_plan"
    else:
        name, plan = "expert-parallel", arch.model_class.expert_specs
        has = "DeepSeek V4 has one, and a transformers model whose config class has base_model_ep_plan"
    degree, specs_at = layout.world_size, functools.partial(plan, config)
    option = f"--{name} {degree}"
    if specs_at(degree) is None:
        what = f"{config.architecture} has" if getattr(config, "architecture", None) else f"{arch.name} models have"
        raise ConfigError(f"{option}: {what} no {name} plan in aotc ({has}); build it with --{name} 1")
    why = parallel.misfit(specs_at(degree), degree)
    if why:
        valid = parallel.valid_degrees(specs_at, max(degree, 64))
        raise ConfigError(f"{option}: {why}; valid degrees for this model: {', '.join(map(str, valid))}")


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")  # model.layers.3.*, transformer.h.3.*


def _check_layer_count(config, checkpoint: Checkpoint) -> None:
    """Before any module is built (a config's layer count may be 10**7): the checkpoint
    must hold tensors for every layer config.json names."""
    n = getattr(config, "num_hidden_layers", None)
    found = {int(m.group(1)) for name in checkpoint.tensors for m in [_LAYER_INDEX.search(name)] if m}
    if isinstance(n, int) and found and n > max(found) + 1:
        raise WeightsError(
            f"{checkpoint.dir}: config.json's num_hidden_layers is {n}, but the checkpoint has tensors for layers 0 to "
            f"{max(found)} only; the config and the weights do not belong together"
        )


def _check_quantization(config: dict, source: Path) -> None:
    """A quantization_config must say what aotc reads: fp8 scales per 128 x 128 block, int8
    (fmt "int8") per 1 x 32 (the scales' shapes are checked against that block, which the
    config must not contradict)."""
    q = config.get("quantization_config")
    if q is None:
        return
    if not isinstance(q, dict):
        raise ConfigError(f"{source}: field 'quantization_config' is {type(q).__name__}; expected an object")
    fmt = "int8" if q.get("fmt") == "int8" else "fp8"
    block, expected = q.get("weight_block_size"), lowp_weights.BLOCKS[fmt]
    if block is not None and block != list(expected):
        raise ConfigError(
            f"{source}: quantization_config.weight_block_size is {block!r}; aotc reads {fmt} weights with a scale per "
            f"{expected[0]}x{expected[1]} block. Re-quantize with that block, or dequantize the checkpoint"
        )


def load_model(
    model_dir: Path | str, *, weights: bool = True, stored: bool | Container[str] = False, kv_cache: KvCacheRecord | None = None,
    modeling: str = "auto", layout: ParallelRecord | None = None, rank: int = 0,
) -> LoadedModel:  # fmt: skip
    """Build the eager model of a model folder.

    weights=False traces-only: parameters are fake tensors and the checkpoint
    is checked against them from its headers, without reading any value; the
    low-precision weights' stored forms are fake tensors too (aotc.layout).

    Low-precision weights (aotc.lowp_weights) are dequantized to the model's dtype:
    eager runs them so, the reference. `stored` keeps their checkpoint form as
    well, for compiled graphs: True for all (beside the dequantized ones); a
    set of parameter paths for those only, which are then not dequantized, so
    memory holds the checkpoint's bytes (their parameters read as NaN, and only
    compiled code must read them).

    kv_cache: what the caches store (default: the model's dtype); a bundle's is in
    its manifest (`model.kv_cache`). modeling: whose code runs it (registry.resolve;
    a bundle's: registry.modeling_of(its architecture)).

    layout: the ranks it runs on (a bundle's `parallel`); the model is then rank
    `rank`'s part, with its sizes, and reads only its part of each tensor it splits.
    """
    model_dir = Path(model_dir)
    config_dict, arch, config = parse_config(model_dir, kv_cache, modeling, layout)
    config = dataclasses.replace(config, rank=rank)
    checkpoint = Checkpoint(model_dir)
    _check_layer_count(config, checkpoint)
    if not weights:
        fake_mode = fake_tensor_mode()
        with fake_mode:
            model = arch.model_class(config)
        forms = _check_checkpoint(model, checkpoint, _rank_sources(model, checkpoint))
        expected = checkpoint_tensors(model)
        with fake_mode:
            for param, form in forms.items():
                values = checkpoint.info(form.values)
                scale = checkpoint.info(form.scale)
                keep_stored(model, param, Stored(
                    form.format,
                    torch.empty(lowp_weights.stored_shape(form.format, expected[param].shape), dtype=stored_dtype(values.dtype)),
                    torch.empty(parallel.rank_shape(_scale_shard(model, param, form, checkpoint), scale.shape), dtype=stored_dtype(scale.dtype)),
                ))  # fmt: skip
        return LoadedModel(model.eval(), arch, config, config_dict, model_dir)
    with torch.device("meta"), _SkipInit():
        model = arch.model_class(config)
    _load_weights(model, checkpoint, stored, rank)
    return LoadedModel(model.eval(), arch, config, config_dict, model_dir)


class _SkipInit(TorchFunctionMode):
    """Skip torch.nn.init while building on the meta device: the checkpoint
    overwrites every value, and the meta init kernels import torch._dynamo
    (about 0.75 s of a cold start)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def checkpoint_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """What the checkpoint must provide: parameters and persistent buffers, but tied copies."""
    tied = model.tied_parameters()
    out = {name: p for name, p in model.named_parameters(remove_duplicate=False) if name not in tied}
    for module_name, module in model.named_modules():
        for name, b in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}" if module_name else name] = b
    return out


def checkpoint_names(model: CausalLM, param: str) -> list[str]:
    """The names a parameter may have in a checkpoint, the one aotc writes first."""
    names = model.checkpoint_name(param)
    return [names] if isinstance(names, str) else list(names)


def checkpoint_sources(model: CausalLM, checkpoint: Checkpoint) -> dict[str, str | Merged]:
    """Where the checkpoint keeps each parameter: the first of the model's candidate names
    it has, or what the model's checkpoint_layout says."""
    layout = model.checkpoint_layout(checkpoint.tensors.keys())
    out = {}
    for param in checkpoint_tensors(model):
        candidates = checkpoint_names(model, param)
        found = next((c for c in candidates if c in checkpoint.tensors), None)
        out[param] = found or layout.get(param, candidates[0])
    return out


def _scale_shard(model: CausalLM, param: str, form: StoredInfo, checkpoint: Checkpoint) -> ShardSpec | None:
    """The shard of a stored weight's scales: its values' shard in blocks. A split that
    cuts a block (or packed fp4 values) is refused, naming the degrees that keep them."""
    spec = model.shard_of(param)
    if spec is None:
        return None
    block = lowp_weights.BLOCKS[form.format]
    scaled = parallel.scaled(spec, block[spec.dim]) if form.format == "fp8" and spec.kind == "split" else spec
    if form.format == "fp4" and spec.kind == "split" or scaled is None:
        degree = model.config.parallel.tensor_parallel
        specs_at = functools.partial(type(model).shard_specs, model.config)
        pattern = next(k for k, v in model.shard_plan.items() if v is spec)

        def keeps_blocks(d: int) -> bool:
            s = specs_at(d)[pattern]
            return form.format == "fp8" and parallel.scaled(s, block[s.dim]) is not None

        valid = [d for d in parallel.valid_degrees(specs_at) if keeps_blocks(d)]
        raise WeightsError(
            f"{checkpoint.info(form.values).file}: --tensor-parallel {degree}: {param} ({form.values!r}) is stored as {form.format} "
            f"with a scale per {'x'.join(map(str, block))} block, and {degree} ranks would split "
            f"{'its packed values' if form.format == 'fp4' else 'a block'} along dim {spec.dim}; "
            f"valid degrees for this checkpoint: {', '.join(map(str, valid)) or 'none but 1'}"
        )
    return scaled


def weight_shard(model: CausalLM, param: str, stored) -> ShardSpec | None:
    """How this rank takes one graph weight (a StoredSpec's part: an fp8 weight's scales
    go with its values in blocks; load_model has checked that they split whole)."""
    spec = model.shard_of(param)
    if spec is None or stored is None or stored.part == "values" or spec.kind == "first":
        return spec
    return parallel.scaled(spec, lowp_weights.BLOCKS[stored.format][spec.dim])


def _check_checkpoint(model: CausalLM, checkpoint: Checkpoint, sources: dict) -> dict:
    """Check every tensor's shape from the headers (a rank's part: the whole tensor's);
    return the stored forms by parameter."""
    forms = {}
    for name, p in checkpoint_tensors(model).items():
        source = sources[name]
        spec = _shard_to_read(model, name, source)
        if spec is not None and isinstance(source, Merged):
            source.info(checkpoint, name)  # a checkpoint that lacks some of the tensors says so first
            raise WeightsError(
                f"{parallel.flag(model.config.parallel)}: {name} is merged from {len(source.names)} checkpoint tensors; aotc splits "
                "such a parameter along its stack of whole tensors only (its experts)"
            )
        full = parallel.full_shape(spec, tuple(p.shape))
        if isinstance(source, Merged):
            low = next((n for n in source.names if stored_form(checkpoint, n, checkpoint.info(n).shape) is not None), None)
            if low is not None:
                raise WeightsError(
                    f"{checkpoint.info(low).file}: {name} is merged from per-expert tensors, and {low!r} is stored in low precision; "
                    "aotc merges full-precision expert tensors only: dequantize the checkpoint, or save it with the experts fused"
                )
            shape, dtype = source.info(checkpoint, name)
            if shape != tuple(p.shape):
                raise WeightsError(
                    f"{checkpoint.info(source.parts[0][0]).file}: {name} is merged from {len(source.names)} tensors "
                    f"({', '.join(repr(part[0]) for part in source.parts)}, ...) into shape {list(shape)}, expected {list(p.shape)} "
                    "from config.json; the config and the weights do not belong together"
                )
            info = checkpoint.info(source.parts[0][0])
            ckpt_name = source.parts[0][0]
        else:
            ckpt_name = source
            form = stored_form(checkpoint, ckpt_name, full)
            if form is not None:
                _scale_shard(model, name, form, checkpoint)
                forms[name] = form
                continue
            info = checkpoint.check(ckpt_name, full)
            dtype = info.dtype
        if dtype.is_floating_point != p.dtype.is_floating_point:
            raise WeightsError(
                f"{info.file}: tensor {ckpt_name!r} is {str(dtype).removeprefix('torch.')}, but the model's "
                f"{name} is {str(p.dtype).removeprefix('torch.')}; re-save the checkpoint with {'floating-point' if p.dtype.is_floating_point else 'integer'} weights"
            )
    return forms


def _rank_part(model: CausalLM, param: str, source: str | Merged) -> str | Merged:
    """A merged parameter that the rank splits along its stack of whole tensors (an
    expert-parallel rank's experts, one checkpoint tensor each): the rank's tensors only."""
    spec = model.shard_of(param)
    if not isinstance(source, Merged) or spec is None or spec.kind != "split" or spec.dim != source.stack_dim or len(spec.blocks) != 1:
        return source
    if any(len(part) != spec.blocks[0] for part in source.parts):  # refused with the counts (_check_checkpoint)
        return source
    ((start, end),) = parallel.ranges(spec, model.config.rank, model.config.parallel.world_size)
    return dataclasses.replace(source, parts=tuple(part[start:end] for part in source.parts), ranked=True)


def _rank_sources(model: CausalLM, checkpoint: Checkpoint) -> dict[str, str | Merged]:
    return {param: _rank_part(model, param, source) for param, source in checkpoint_sources(model, checkpoint).items()}


def _shard_to_read(model: CausalLM, param: str, source: str | Merged) -> ShardSpec | None:
    """How much of `source` the rank still has to cut: none of a rank's merged part."""
    return None if isinstance(source, Merged) and source.ranked else model.shard_of(param)


def _load_weights(model: CausalLM, checkpoint: Checkpoint, stored: bool | Container[str], rank: int = 0) -> None:
    expected = checkpoint_tensors(model)
    sources = _rank_sources(model, checkpoint)
    forms = _check_checkpoint(model, checkpoint, sources)
    # A rank reads only its part of each tensor it splits (and of a stored one's scales).
    world, pieces = model.config.parallel.world_size, {}
    for param in expected:
        spec, form = _shard_to_read(model, param, sources[param]), forms.get(param)
        if spec is not None:
            read = functools.partial(parallel.piece, rank=rank, world_size=world)
            pieces[param, "values"] = (form.values if form else sources[param], functools.partial(read, spec=spec))
            if form:
                pieces[param, "scale"] = (form.scale, functools.partial(read, spec=_scale_shard(model, param, form, checkpoint)))
    whole = [p for p in expected if (p, "values") not in pieces]
    names = [n for p in whole for s in [sources[p]] for n in (s.names if isinstance(s, Merged) else [s])]
    names += [forms[p].scale for p in whole if p in forms]
    tensors = checkpoint.load(names, pieces)

    def tensor(param: str, name: str, part: str = "values") -> torch.Tensor:
        return tensors[param, part] if (param, part) in tensors else tensors[name]

    state = {}
    for param, p in expected.items():
        form = forms.get(param)
        if form is not None:
            values, scale = as_stored(tensor(param, form.values)), as_stored(tensor(param, form.scale, "scale"))
            keep = stored if isinstance(stored, bool) else param in stored
            if keep:
                keep_stored(model, param, Stored(form.format, values, scale))
            if keep and not isinstance(stored, bool):
                # Compiled code reads the stored form; eager must not read this. NaN says so
                # loudly if it does, at the cost of one element.
                state[param] = torch.full((), float("nan"), dtype=p.dtype).expand(p.shape)
            else:
                state[param] = lowp_weights.dequantize(form.format, values, scale, p.dtype)
            continue
        source = sources[param]
        # dtype kinds checked from the headers
        state[param] = (source.apply(tensors) if isinstance(source, Merged) else tensor(param, source)).to(p.dtype)

    def describe(param: str) -> str:
        source = sources[param]
        name = source.parts[0][0] if isinstance(source, Merged) else source
        return f"{checkpoint.info(name).file}: tensor {name!r}" + (f" (one of the {len(source.names)} merged into {param})" if isinstance(source, Merged) else "")

    _assign(model, state, describe)


def _assign(model: CausalLM, state: dict[str, torch.Tensor], describe: Callable[[str], str]) -> None:
    """Load `state` (the checkpoint's tensors, tied copies left out) into a model built on
    the meta device, and make it whole: tied weights, non-persistent buffers."""
    for param, source in model.tied_parameters().items():
        state[param] = state[source]
    model.load_state_dict(state, strict=True, assign=True)
    model.check_values(describe)
    # assign=True replaces Parameter objects; re-tie so tied weights stay one tensor.
    for param, source in model.tied_parameters().items():
        owner, _, leaf = param.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(source))
    # Non-persistent buffers were built on the meta device: make them real.
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype)
    model.init_buffers()


def full_precision(model: CausalLM) -> bool:
    """Whether the model computes in float32 with float32 caches: its own reference."""
    kv_cache = getattr(model.config, "kv_cache", None)
    return model.config.dtype == torch.float32 and (kv_cache is None or kv_cache.dtype == "auto")


def reference_model(model: CausalLM) -> CausalLM:
    """The model's weights in float32, with float32 caches: what a lower-precision model
    and its compiled graphs are both measured against (runtime.check). Weights with a
    stored form (fp8, fp4) are dequantized from it, so the reference holds exactly the
    values the checkpoint stores."""
    changes = {"dtype": torch.float32}
    if getattr(model.config, "kv_cache", None) is not None:
        changes["kv_cache"] = dataclasses.replace(model.config.kv_cache, dtype="auto")
    with torch.device("meta"), _SkipInit():
        twin = type(model)(dataclasses.replace(model.config, **changes))
    state = {}
    for name, t in checkpoint_tensors(model).items():
        stored = stored_at(model, name)
        if stored is not None:
            state[name] = lowp_weights.dequantize(stored.format, stored.values, stored.scale, torch.float32)
        else:
            state[name] = t.detach().float() if t.is_floating_point() else t.detach().clone()
    _assign(twin, state, lambda param: f"{param} of the model")
    return twin.eval().to(next(model.parameters()).device)


def available_memory() -> int:
    """Bytes this machine can still allocate without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_shortfall(model: CausalLM, slots: int, max_seq: int) -> str | None:
    """None when the caches for (slots, max_seq) fit in available memory, with a quarter
    to spare for activations and the rest; else what they need against what there is."""
    need, have = model.cache_bytes(slots, max_seq), available_memory()
    if need * 1.25 <= have:
        return None
    return f"its caches take {need / 1e9:.1f} GB ({slots} slots x {max_seq} positions), and this machine has {have / 1e9:.1f} GB available"
