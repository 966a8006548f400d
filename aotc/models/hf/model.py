"""TransformersCausalLM: a transformers *ForCausalLM built around aotc's caches, its layers and head made entries."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ... import parallel
from ...errors import ConfigError
from ...kvcache import row_spec
from ..base import CausalLM
from ..config import ConfigReader
from ..packing import pack
from . import parallel as hf_parallel
from .config import TransformersConfig, _hf_config
from .contract import LMHead, _convert_layer, _fp8_rows, _learn
from .conversion import _conversion_layout
from .recorder import _Step
from .standins import _experts_class, _is_experts, _register_attention, _register_config_freezer, _register_experts


@dataclass(frozen=True)
class _Outside:
    """A module held by a module without being its submodule (nn.Module registers any
    module set as an attribute; a dataclass it stores as it is)."""

    module: nn.Module


class TransformersCausalLM(CausalLM):
    """A transformers causal LM, its decoder layers and LM head compiled as entries."""

    config_class = TransformersConfig
    kv_cache_dtypes = ("auto", "fp8", "fp8-values")
    outside: _Outside  # the transformers model, whose children are this model's

    @property
    def hf(self) -> nn.Module:
        return self.outside.module

    def __init__(self, config: TransformersConfig):
        super().__init__()
        _register_attention()
        _register_experts()
        _register_config_freezer()
        self.config = config
        model_class = _model_class(config.model_type, config.architecture)
        degree = config.parallel.tensor_parallel
        fields = config.hf
        if degree > 1:  # the rank's sizes, from the whole model's (aotc.models.hf_parallel)
            whole = _hf_config(config.model_type, config.hf, "config.json")
            fields = hf_parallel.local_fields(config.hf, whole, degree)
        hf_config = _hf_config(config.model_type, fields, "config.json")
        try:
            with _default_dtype(config.dtype):
                hf = model_class(hf_config)
        except Exception as e:  # transformers' own code, given aotc's attention: say which and why
            raise ConfigError(
                f"config.json: transformers' {config.architecture} cannot be built with aotc's attention function "
                f"({type(e).__name__}: {e}); aotc's generic path runs models whose attention goes through transformers' AttentionInterface"
            ) from None
        hf.eval()
        # The transformers model is not a submodule: its children are ours, so that parameter
        # paths are the checkpoint's names (model.layers.0..., lm_head.weight).
        self.outside = _Outside(hf)
        for name, child in hf.named_children():
            self.add_module(name, child)
        self.layer_modules = _decoder_layers(hf, config)
        for module in hf.modules():  # experts that run through the ExpertsInterface: compiled, gathered
            if _is_experts(module):
                module.__class__ = _experts_class(type(module))
        if config.parallel.expert_parallel > 1:
            self._split_experts()
        self.contract = _learn(hf, self.layer_modules, config)
        rows = _fp8_rows(config, self.contract)
        for i, layer in enumerate(self.layer_modules):
            _convert_layer(layer, i, self.contract, rows)
        head = hf.get_output_embeddings()
        if type(head) is nn.Linear:
            head.__class__ = LMHead
        self.tied_head: tuple[str, str] | None = None  # a rank's head: (its path, the embedding's it reads its rows of)
        if degree > 1:
            self._split(model_class, whole, head)

    def _split(self, model_class: type, whole, head: nn.Module) -> None:
        """A rank's modules sum and gather across the ranks where transformers' plan splits them (aotc.models.hf_parallel)."""
        config = self.config
        if not isinstance(head, LMHead):
            raise ConfigError(f"--tensor-parallel: {config.architecture}'s LM head is a {type(head).__name__}, not a linear layer; aotc splits a linear head by vocabulary")
        group = parallel.group_name(config.parallel)
        specs = type(self).shard_specs(config, config.parallel.world_size)
        # The rank's rows of the vocabulary (the config's vocab_size is the embedding's too)
        rows = head.out_features // config.parallel.world_size
        head.weight = nn.Parameter(head.weight.new_empty(rows, head.in_features), requires_grad=False)
        if head.bias is not None:
            head.bias = nn.Parameter(head.bias.new_empty(rows), requires_grad=False)
        head.out_features = rows
        head.register_buffer("rank_index", head.weight.new_empty(1, dtype=torch.long), persistent=False)
        hf_parallel.place(self, specs, hf_parallel.full_shapes(model_class, config.hf, config.model_type), group, config.parallel.world_size, config.architecture)
        head.group = group
        if getattr(whole, "tie_word_embeddings", False):
            paths = {m: n for n, m in self.named_modules()}
            self.tied_head = (f"{paths[head]}.weight", f"{paths[self.hf.get_input_embeddings()]}.weight")

    def _split_experts(self) -> None:
        """Each experts module holds the rank's experts, summed across the ranks (aotc.models.hf_parallel); attention is whole on every rank."""
        layout = self.config.parallel
        if parallel.data_parallel(layout):
            raise ConfigError(f"--data-parallel-attention: aotc's generic path runs attention whole on every rank; build {self.config.architecture} without it")
        specs = type(self).expert_specs(self.config, layout.world_size)
        group = parallel.group_name(layout)
        for path, module in self.named_modules():
            if _is_experts(module):
                hf_parallel.split_experts(module, path, specs, layout.world_size, group)

    @classmethod
    def expert_specs(cls, config: TransformersConfig, degree: int):
        whole = _hf_config(config.model_type, config.hf, "config.json")
        return hf_parallel.expert_specs(_model_class(config.model_type, config.architecture), config.hf, whole, config.architecture, degree)

    @classmethod
    def shard_specs(cls, config: TransformersConfig, degree: int):
        whole = _hf_config(config.model_type, config.hf, "config.json")
        return hf_parallel.shard_specs(_model_class(config.model_type, config.architecture), config.hf, whole, config.architecture, degree)

    def checkpoint_name(self, param: str) -> str:
        if self.tied_head is not None and param == self.tied_head[0]:
            return self.tied_head[1]  # a rank's part of the tied embedding
        return param

    @classmethod
    def code_identity(cls, config: dict) -> dict:
        parsed = TransformersConfig.from_hf(ConfigReader(config, "config.json"))
        return code_identity(parsed.model_type, parsed.architecture)

    def init_random(self, generator, *, head_std=None):
        # transformers' own init (aotc verify's random weights), drawn from the generator's seed.
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(generator.initial_seed())
            for t in [*self.parameters(), *self.buffers()]:
                t._is_hf_initialized = False  # private (hf_compat.PRIVATE)
            self.hf.init_weights()
            if head_std is not None:
                self.hf.get_output_embeddings().weight.normal_(0, head_std)

    # -- checkpoint --------------------------------------------------------------
    def tied_parameters(self) -> dict[str, str]:
        # transformers' own record of its ties (expanded to parameter names), which holds
        # while loading replaces the tied Parameter objects.
        names = dict(self.named_parameters(remove_duplicate=False))
        return {k: v for k, v in (self.hf.all_tied_weights_keys or {}).items() if k in names and v in names}  # private (hf_compat.PRIVATE)

    def checkpoint_layout(self, names):
        """Parameters the checkpoint keeps as transformers' conversion mapping describes
        them for this model: under an older name (mixtral's block_sparse_moe), or as
        per-expert tensors that it stacks into its fused experts (and concatenates, gate
        and up). Checkpoints transformers saves are of that layout."""
        return _conversion_layout(self.hf, names)

    def init_buffers(self) -> None:
        # Non-persistent buffers (rotary's inverse frequencies, Gemma's embedding scale) are
        # made by transformers' own init from the config, as from_pretrained makes them:
        # every loaded tensor is marked initialized, so that init leaves it alone.
        # Private names (hf_compat.PRIVATE): _is_hf_initialized, _init_weights.
        for t in [*self.parameters(), *self.buffers()]:
            t._is_hf_initialized = True
        with torch.no_grad():
            for module in self.hf.modules():
                if module._non_persistent_buffers_set - {"expert_map", "rank_index"}:  # transformers' own
                    for name in module._non_persistent_buffers_set:
                        buf = module._buffers.get(name)
                        if buf is not None:
                            buf._is_hf_initialized = False
                    self.hf._init_weights(module)
                if _is_experts(module) and module.group is not None:
                    hf_parallel.init_expert_map(module, self.config.rank)
                if isinstance(module, LMHead) and module.group is not None:
                    module.rank_index = torch.tensor([self.config.rank])

    # -- caches ------------------------------------------------------------------
    def cache_specs(self, slots, max_seq):
        c, rows = self.contract, _fp8_rows(self.config, self.contract)
        lead = (self.config.num_hidden_layers, slots, c.kv_heads, max_seq)
        key_dtype = torch.bfloat16 if self.config.kv_cache.dtype == "fp8-values" else self.config.dtype
        return {"k": row_spec(rows[0], lead, c.k_dim, key_dtype), "v": row_spec(rows[1], lead, c.v_dim, self.config.dtype)}

    def cache_rows(self):
        return {kind: r for kind, r in zip("kv", _fp8_rows(self.config, self.contract)) if r is not None}

    def cache_positions(self):
        return {"k": (3, 1), "v": (3, 1)}  # [layers, slots, kv_heads, positions, row]

    # -- generation ----------------------------------------------------------------
    @torch.no_grad()
    def _forward(self, method: str, ids, positions, slots, caches, keep: int | torch.Tensor):
        # ids, positions: [B, T]; slots: [B * T]
        step = _Step(method, positions.reshape(-1), slots, caches)
        out = self.hf(input_ids=ids, position_ids=positions, **{self.contract.cache_param: step}, use_cache=True, logits_to_keep=keep)
        return out.logits.float()

    def prefill(self, ids, slot, caches, start=0):
        n = ids.shape[0]
        positions = torch.arange(start, start + n, device=ids.device)
        slots = torch.full((n,), slot, dtype=torch.long, device=ids.device)
        return self._forward("prefill", ids[None], positions[None], slots, caches, 1)[0, -1]

    def prefill_batch(self, prompts, slots, caches, start=0):
        p = pack(prompts, slots, start)
        return self._forward("prefill", p.ids[None], p.positions[None], p.slots, caches, p.last)[0]

    def decode(self, ids, positions, caches):
        slots = self.batch_slots(ids.shape[0], ids.device)
        return self._forward("decode", ids[:, None], positions[:, None], slots, caches, 0)[:, -1]

    def prompt_logits(self, ids, max_seq=None):
        n = ids.shape[0]
        caches = self.allocate_caches(1, max_seq or n)
        return self._forward("prefill", ids[None], torch.arange(n)[None], torch.zeros(n, dtype=torch.long), caches, 0)[0]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    # As transformers' from_pretrained builds a model of a dtype: parameters made in it,
    # buffers that ask for float32 (rotary's) kept so.
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@functools.cache
def code_identity(model_type: str, architecture: str) -> dict:
    """transformers' version and the sha256 of the modeling module that defines the class:
    what, with aotc's own source, makes the graphs (cache keys)."""
    from transformers import __version__

    module = inspect.getmodule(_model_class(model_type, architecture))
    return {"transformers": __version__, "modeling": hashlib.sha256(inspect.getsource(module).encode()).hexdigest()}


def _model_class(model_type: str, name: str) -> type:
    # The model's own modeling module, imported by its path: `transformers.<Name>` would
    # have transformers index every model it has first (about 1.4 s of a cold start).
    import importlib

    from transformers import __version__
    from transformers.models.auto.configuration_auto import model_type_to_module_name  # private (hf_compat.PRIVATE)

    module = model_type_to_module_name(model_type)
    try:
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name, None)
    except ImportError:
        cls = None
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ConfigError(f"config.json: architectures names {name!r}, which transformers {__version__} does not have for model_type {model_type!r}")
    return cls


def _decoder_layers(hf: nn.Module, config: TransformersConfig) -> list[nn.Module]:
    """The decoder layers, in order: the modules of the classes transformers keeps whole
    when it splits a model across devices (_no_split_modules)."""
    names = set(getattr(hf, "_no_split_modules", None) or ())  # private (hf_compat.PRIVATE)
    layers: list[nn.Module] = []
    inner: set[int] = set()  # modules of those classes inside another (Mamba's mixer in its block)
    for m in hf.modules():
        if type(m).__name__ in names and id(m) not in inner:
            layers.append(m)
            inner.update(id(sub) for sub in m.modules())
    if len(layers) != config.num_hidden_layers:
        raise ConfigError(
            f"config.json: {config.architecture} has {len(layers)} modules of its layer classes ({', '.join(sorted(names)) or 'none'}), "
            f"and num_hidden_layers is {config.num_hidden_layers}; aotc's generic path needs one decoder layer per hidden layer"
        )
    return layers
