"""What every aotc model provides, and loading one from a model folder.

A model is an ordinary `nn.Module` tree. Its submodules' entry methods
(`aotc.entry`) are what gets compiled; the `CausalLM` methods below are the
eager orchestration around them (embedding lookup, the layer loop), which runs
unchanged whether the entries are eager or bound to a bundle.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Container

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from .. import parallel, quant
from ..errors import ConfigError, WeightsError
from ..format import KvCacheRecord, ParallelRecord, ShardSpec
from ..kvcache import Fp8Rows, RowLayout
from ..layout import Stored, keep_stored, stored_at
from .checkpoint import Checkpoint, Merged, StoredInfo, as_stored, stored_dtype, stored_form
from .config import ConfigReader, read_config
from .registry import Architecture, resolve

# Padding rows of a bucket write their cache entries into the last slot of the
# cache pool, which no sequence owns (-1 indexes it directly).
SCRATCH_SLOT = -1

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def read_dtype(cfg: ConfigReader) -> torch.dtype:
    # transformers 5 writes "dtype", older versions "torch_dtype". A config with both
    # that disagree ran one silently (a bench's "bf16" row loaded fp32): refused.
    dtype, torch_dtype = cfg.config.get("dtype"), cfg.config.get("torch_dtype")
    if dtype and torch_dtype and dtype != torch_dtype:
        raise ConfigError(
            f"{cfg.source}: fields 'dtype' ({dtype!r}) and 'torch_dtype' ({torch_dtype!r}) disagree; they name the same "
            "thing (transformers 5 writes 'dtype', older versions 'torch_dtype'): keep one"
        )
    name = dtype or torch_dtype or "float32"
    if name not in _DTYPES:
        raise ConfigError(f"{cfg.source}: field 'dtype' is {name!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


class CausalLM(nn.Module):
    """Base class of aotc models. Subclasses set `config_class` and implement the
    methods that raise NotImplementedError."""

    config_class: type
    # What its caches can store (--kv-cache-dtype): "auto" is the model's dtype; a model
    # that adds "fp8" reads config.kv_cache and packs its caches (aotc.kvcache).
    kv_cache_dtypes: tuple[str, ...] = ("auto",)

    # -- checkpoint layout ---------------------------------------------------
    def checkpoint_name(self, param: str) -> str | list[str]:
        """The checkpoint tensor name of a parameter path (default: the same), or
        candidate names in order (checkpoints of one model come in several layouts)."""
        return param

    def checkpoint_layout(self, names: Collection[str]) -> dict[str, str | Merged]:
        """For a checkpoint of the tensors `names`: the parameters it keeps under none of
        checkpoint_name's candidates, {param: its tensor's name, or the Merged tensors it is
        made of} (transformers' conversion mapping, on the generic path)."""
        return {}

    def tied_parameters(self) -> dict[str, str]:
        """Parameters that share another's tensor: {param: source param}."""
        return {}

    @classmethod
    def shard_specs(cls, config, degree: int) -> dict[str, ShardSpec] | None:
        """The model's tensor-parallel plan at `degree` ranks: {parameter path, `*` for a
        layer index: how each rank takes its part} (aotc.parallel); a parameter it does
        not name is whole on every rank. None: the model has no plan. A model with one
        builds each rank's sizes from config.parallel and sums or gathers across ranks
        in its entry methods (aotc.parallel.all_reduce, all_gather)."""
        return None

    @classmethod
    def expert_specs(cls, config, degree: int) -> dict[str, ShardSpec] | None:
        """The model's expert-parallel plan at `degree` ranks: {parameter path, `*` for an
        index: parallel.experts(...)} for each routed expert's tensors and their stacks;
        everything else whole on every rank. None: the model has no plan. A model with
        one builds rank `config.rank`'s experts (whose checkpoint names it gives) and sums
        their partial outputs across ranks in its entry methods."""
        return None

    def shard_of(self, param: str) -> ShardSpec | None:
        """How this rank takes parameter `param` from the checkpoint; None: whole."""
        layout = self.config.parallel
        if layout.world_size == 1:
            return None
        if "_shard_specs" not in self.__dict__:
            plan = type(self).shard_specs if layout.tensor_parallel > 1 else type(self).expert_specs
            self.__dict__["_shard_specs"] = plan(self.config, layout.world_size)
        return parallel.spec_of(self._shard_specs, param)

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (not in checkpoints) after weights were loaded."""

    def check_values(self, describe: Callable[[str], str]) -> None:
        """Check loaded values that the model's code indexes with (a routing table), and raise
        WeightsError for a bad one; describe(param) names its file and checkpoint tensor."""

    @classmethod
    def code_identity(cls, config: dict) -> dict:
        """What, beyond aotc's and the model package's own source, makes the model's graphs
        (the generic path: transformers' version and modeling source), for cache keys."""
        return {}

    def round_max_seq(self, n: int) -> int:
        """The cache length to allocate for n positions (some models need a multiple of a block)."""
        return n

    # -- caches --------------------------------------------------------------
    def cache_specs(self, slots: int, max_seq: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Root cache allocations, layer-major: {kind: (shape, dtype)}."""
        raise NotImplementedError

    def cache_rows(self) -> dict[str, Fp8Rows]:
        """The packed cache kinds (uint8 rows of fp8 values and their scales; aotc.kvcache):
        {kind: rows}. A packed row read back is the row of the model's float32 twin
        (reference_model), whose caches are plain."""
        return {}

    def cache_layouts(self) -> dict[str, RowLayout]:
        """The packed cache kinds' byte layouts: {kind: layout}."""
        return {kind: rows.layout for kind, rows in self.cache_rows().items()}

    def cache_bytes(self, slots: int, max_seq: int) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.cache_specs(slots, max_seq).values())

    def allocate_caches(self, slots: int, max_seq: int, device: torch.device | str = "cpu", split: bool = False) -> dict:
        """Zeroed caches, a separate allocation per kind, so no two graph inputs share a
        storage. split: packed kinds as one allocation per region (`Regions`), as compiled
        graphs take them; eager code reads the packed buffer."""
        layouts = self.cache_layouts() if split else {}
        return {
            kind: layouts[kind].allocate(shape, device) if kind in layouts else torch.zeros(shape, dtype=dtype, device=device)
            for kind, (shape, dtype) in self.cache_specs(slots, max_seq).items()
        }

    # -- generation ----------------------------------------------------------
    def batch_slots(self, n: int, device: torch.device | str) -> torch.Tensor:
        """[n]: the cache slots 0..n-1 of a decode batch, made once per size and device
        (every step passes them; compiled graphs never write an activation)."""
        made = self.__dict__.setdefault("_batch_slots", {})
        key = (n, str(device))
        if key not in made:
            made[key] = torch.arange(n, device=device)
        return made[key]

    def prefill(self, ids: torch.Tensor, slot: int, caches: dict[str, torch.Tensor], start: int = 0) -> torch.Tensor:
        """ids: [n] tokens at positions start..start+n-1 of the sequence in `slot`
        -> logits of the last token, [vocab] float32."""
        raise NotImplementedError

    def prefill_batch(self, prompts: list[torch.Tensor], slots: list[int], caches: dict[str, torch.Tensor], start: int = 0) -> torch.Tensor:
        """prompts[i]: [n_i] tokens of the sequence in slots[i], from position `start` for the
        first and from position 0 for every other -> logits of each prompt's last token,
        [len(prompts), vocab] float32. Here one prompt after another; a model whose prefill
        takes several sequences' rows in one chunk (models.packing) runs them together."""
        return torch.stack([self.prefill(ids, slot, caches, start if i == 0 else 0) for i, (ids, slot) in enumerate(zip(prompts, slots))])

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, caches: dict[str, torch.Tensor]) -> torch.Tensor:
        """ids, positions: [B], row i is the sequence in slot i -> logits [B, vocab] float32."""
        raise NotImplementedError

    def prompt_logits(self, ids: torch.Tensor, max_seq: int | None = None) -> torch.Tensor:
        """ids: [n] -> logits at every position, [n, vocab] float32, eager (for checks)."""
        raise NotImplementedError

    # -- aotc init tiny --------------------------------------------------------
    @classmethod
    def tiny_config(cls, *, layers: int, vocab_size: int, variant: str) -> dict:
        """A small config.json dict with Hugging Face field names."""
        raise NotImplementedError

    def init_random(self, generator: torch.Generator, *, head_std: float | None = None) -> None:
        """Random weights. head_std=None draws the LM head wide enough that the top two
        logits are far apart compared to float rounding (no near-ties). A number is the
        head's std: 0.02, transformers' default initializer_range, leaves near-ties."""
        raise NotImplementedError


def fake_tensor_mode() -> FakeTensorMode:
    """The fake mode that builds and traces run under. Its ShapeEnv lets `nonzero`
    and `.item()` run on fake tensors: they become unbacked symbolic sizes,
    which export captures and the static-shape pass then removes."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


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
    block, expected = q.get("weight_block_size"), quant.BLOCKS[fmt]
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

    Low-precision weights (aotc.quant) are dequantized to the model's dtype:
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
                    torch.empty(quant.stored_shape(form.format, expected[param].shape), dtype=stored_dtype(values.dtype)),
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


def _sources(model: CausalLM, checkpoint: Checkpoint) -> dict[str, str | Merged]:
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
    block = quant.BLOCKS[form.format]
    scaled = parallel.scaled(spec, block[spec.dim]) if form.format == "fp8" and spec.kind == "split" else spec
    if form.format == "fp4" and spec.kind == "split" or scaled is None:
        degree = model.config.parallel.tensor_parallel
        specs_at = functools.partial(type(model).shard_specs, model.config)
        pattern = next(k for k, v in model._shard_specs.items() if v is spec)

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
    return parallel.scaled(spec, quant.BLOCKS[stored.format][spec.dim])


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
    return {param: _rank_part(model, param, source) for param, source in _sources(model, checkpoint).items()}


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
                state[param] = quant.dequantize(form.format, values, scale, p.dtype)
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
            state[name] = quant.dequantize(stored.format, stored.values, stored.scale, torch.float32)
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
