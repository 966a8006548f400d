"""What every aotc model provides (loading one from a model folder: models/loader.py).

A model is an ordinary `nn.Module` tree. Its submodules' entry methods
(`aotc.entry`) are what gets compiled; the `CausalLM` methods below are the
eager orchestration around them (embedding lookup, the layer loop), which runs
unchanged whether the entries are eager or bound to a bundle.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Collection

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import parallel
from ..errors import ConfigError
from ..format import ShardSpec
from ..kvcache import Fp8Rows, RowLayout
from .checkpoint import Merged
from .config import ConfigReader

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

    @functools.cached_property
    def shard_plan(self) -> dict[str, ShardSpec] | None:
        """This model's plan at its degree, made once: shard_specs for --tensor-parallel,
        expert_specs for --expert-parallel; None on one rank."""
        layout = self.config.parallel
        if layout.world_size == 1:
            return None
        plan = type(self).shard_specs if layout.tensor_parallel > 1 else type(self).expert_specs
        return plan(self.config, layout.world_size)

    def shard_of(self, param: str) -> ShardSpec | None:
        """How this rank takes parameter `param` from the checkpoint; None: whole."""
        return None if self.shard_plan is None else parallel.spec_of(self.shard_plan, param)

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

    def cache_positions(self) -> dict[str, tuple[int, int]] | None:
        """Each cache kind's (positions dim, positions per row): dim 1 is the slot, and a
        slot's first n // per rows there hold exactly what its sequence's first n tokens
        made (per > 1: a compressed cache's entries, one per window of `per` positions,
        written when a window closes). The prefix cache copies those between slots
        (runtime.prefix). None: some kind is not indexed by position (a ring buffer, state
        carried from one position to the next), and no prefix is reused."""
        return None

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
        key = (n, device)  # not str(device): a step's host work is tens of microseconds
        found = self.batch_slot_tensors.get(key)
        if found is None:
            found = self.batch_slot_tensors[key] = torch.arange(n, device=device)
        return found

    @functools.cached_property
    def batch_slot_tensors(self) -> dict[tuple[int, torch.device | str], torch.Tensor]:
        """batch_slots' tensors, by size and device."""
        return {}

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

    def decode_tokens(self, ids: torch.Tensor, positions: torch.Tensor, caches: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """decode's logits, and their argmax [B] where the model computes it with them (a
        whole step's graph: the engine then reads B tokens, not B x vocab logits), else None."""
        return self.decode(ids, positions, caches), None

    def prompt_logits(self, ids: torch.Tensor, max_seq: int | None = None) -> torch.Tensor:
        """ids: [n] -> logits at every position, [n, vocab] float32, eager (for checks)."""
        raise NotImplementedError

    # -- whole steps -----------------------------------------------------------
    def whole_step_replaces(self) -> dict[str, set[tuple[type, str]]]:
        """The model's own entry methods that run a whole step (decode's every layer in one
        graph), each with the (class, method) entries it runs in place of. A build makes
        one side of each: the whole step where whole_step_refusal() and the backend allow
        it (Backend.loops), else the entries it replaces; bind takes either."""
        return {}

    def whole_step_refusal(self) -> str | None:
        """Why this configuration builds no whole step (None: it can)."""
        return None

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
