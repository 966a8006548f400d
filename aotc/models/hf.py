"""Any dense decoder-only model in transformers, from transformers' own modeling code.

transformers supplies the weight names, the embeddings, rotary, norms and the
layers; aotc supplies the caches, buckets, passes, backends and runtime. The
model's own `*ForCausalLM.forward` runs eagerly around its decoder layers and
LM head, which are entries, so one compiled graph serves every layer of a
class (a variant of it, where layers differ: sliding or full, NoPE, a scale):

- **Layers.** Each decoder layer (the model's `_no_split_modules`) becomes an
  instance of a generated subclass of its own class, whose `decode` and
  `prefill` entries call the class's own `forward` with a stand-in cache
  (`_LayerCache`): its `update` is one indexed write per cache into the
  layer's cache input (aotc.kvcache, so fp8 caches, context buckets and the
  passes work as for aotc's own models), and returns the rows the layer's
  queries see. The subclass's `forward` is what the model's loop calls: it
  takes the hidden state and rotary (cos, sin) the model computed and hands
  them, with positions, slots and the layer's caches, to the entry.
- **Attention.** The "aotc" function of transformers' AttentionInterface
  (`_attention`) masks by the positions the entry passes through the layer's
  kwargs (`aotc_positions`), and the window, softcap and sinks the attention
  module passes it; transformers builds no mask for it.
- **`layer_idx`** reads as a `_LayerIndex`, which the stand-in cache ignores
  and anything else refuses, so that no layer's graph bakes in its index; a
  module's `config` groups layers by the hash of its JSON.
- **The contract** (what each layer's call passes, the shapes its attention
  writes to the cache) is learnt from one forward of the model on meta or
  fake tensors, when the model is built (`_learn`); nothing is written per
  architecture.
- **The head.** The LM head, an `nn.Linear`, becomes an entry too (`project`);
  the final norm, a softcap or a logits scale stay in the model's forward.
- **Experts.** MoE experts that use transformers' ExpertsInterface run the
  "aotc" experts function eagerly (each chosen expert on its tokens) and, in
  graphs, a compiled form (`_experts_class`): each token's chosen experts
  gathered from the fused weights at decode, every expert on its tokens at
  prefill. Checkpoints that keep one tensor per expert are merged into the
  fused parameters as transformers' conversion mapping says
  (`checkpoint_layout`).
- **Refusals.** What the path cannot take (recurrent or convolution state,
  chunked attention, KV shared across layers, masks other than causal and
  sliding, encoder-decoders, a cache asked for more than `update`) is refused
  from the config or the contract learning run, before anything is traced.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel
from ..entry import entry, freezer
from ..errors import ConfigError, WeightsError
from ..kvcache import Fp8Rows, layer_views, load, row_spec, store
from . import hf_compat, hf_parallel
from .base import SCRATCH_SLOT, CausalLM, read_dtype
from .checkpoint import Merged
from .config import ConfigReader, ModelConfig
from .packing import pack, packed_rows, packed_visible

NAME = "transformers"
ATTENTION = "aotc"
EXPERTS = "aotc"  # the ExpertsInterface function
# config.json fields that say nothing about the graphs: left out of the config the bundle
# compares (eos ids are ModelConfig's runtime-only field).
_NOT_COMPARED = ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype")
# Arguments of a layer's forward that aotc fills itself.
_OURS = ("hidden_states", "attention_mask", "position_ids", "cache", "past_key_values", "position_embeddings", "use_cache", "cache_position")


def installed() -> str | None:
    """transformers' version, where it is installed."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def knows(config: dict) -> bool:
    """Whether transformers has a causal LM for this config.json (and is installed)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


@dataclass
class TransformersConfig(ModelConfig):
    model_type: str
    architecture: str  # the transformers class, e.g. Qwen3ForCausalLM
    vocab_size: int
    hf: dict  # config.json, but fields that change no graph
    num_hidden_layers: int
    max_position_embeddings: int
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: ConfigReader) -> "TransformersConfig":
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        hf_compat.check()  # every way into the generic path reads its config here first

        model_type = cfg.get("model_type", str)
        default = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if default is None:
            raise ConfigError(f"{cfg.source}: model_type {model_type!r} has no causal LM in transformers; aotc's generic path runs *ForCausalLM models")
        names = cfg.get("architectures", list, [default])
        architecture = next((n for n in names if isinstance(n, str) and n.endswith(("ForCausalLM", "LMHeadModel"))), None)
        if architecture is None:
            raise ConfigError(f"{cfg.source}: field 'architectures' is {names!r}; aotc's generic path runs a causal LM ({default} for {model_type})")
        _check_fields(cfg)
        hf = {k: v for k, v in cfg.config.items() if k not in _NOT_COMPARED}
        hf_config = _hf_config(model_type, hf, str(cfg.source))
        if getattr(type(hf_config), "is_encoder_decoder", False) is True:  # the family's default, not this config's
            raise ConfigError(
                f"{cfg.source}: model_type {model_type!r} is an encoder-decoder family; its {architecture} is the decoder, with "
                "cross-attention to an encoder. aotc compiles decoder-only causal LMs"
            )
        _check_layer_kinds(hf_config, cfg.source)
        eos = cfg.config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            model_type=model_type,
            architecture=architecture,
            vocab_size=int(hf_config.vocab_size),
            hf=hf,
            num_hidden_layers=int(hf_config.num_hidden_layers),
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", None) or 4096),
            dtype=read_dtype(cfg),
            eos_token_ids=eos_ids,
        )


# Fields most decoder configs share, checked as aotc's own families check them, where the
# config has them: transformers accepts a negative rope base, a NaN epsilon or a window of 0
# and builds a model that computes nonsense.
_COUNTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim", "vocab_size", "max_position_embeddings")
_SCALES = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")


def _check_fields(cfg: ConfigReader) -> None:
    for key in _COUNTS:
        cfg.positive(key, None)
    for key in _SCALES:
        cfg.positive_number(key, None)
    if cfg.config.get("sliding_window") is not None:
        cfg.positive("sliding_window")
    act = cfg.config.get("hidden_act")
    if act is not None:
        from transformers.activations import ACT2FN

        if not isinstance(act, str) or act not in ACT2FN:
            raise ConfigError(f"{cfg.source}: field 'hidden_act' is {act!r}; expected one of transformers' activations ({', '.join(sorted(ACT2FN))})")
    kinds = cfg.config.get("layer_types")
    if kinds is not None:
        layers = cfg.positive("num_hidden_layers")
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds) or len(kinds) != layers:
            raise ConfigError(f"{cfg.source}: field 'layer_types' is {kinds!r}; expected a list of one layer kind (a string) per layer, num_hidden_layers {layers}")


def _check_layer_kinds(hf_config, source) -> None:
    """Refuse, from the config alone, layers that are no attention with a KV cache of their own."""
    for i, kind in enumerate(getattr(hf_config, "layer_types", None) or ()):
        if kind not in ("full_attention", "sliding_attention"):
            what = _LAYER_KINDS.get(kind, "no attention layer aotc knows")
            raise ConfigError(f"{source}: layer_types[{i}] is {kind!r}, {what}; aotc's generic path runs full and sliding attention layers, each with a KV cache of its own")
    shared = getattr(hf_config, "num_kv_shared_layers", None)
    if shared:
        raise ConfigError(
            f"{source}: field 'num_kv_shared_layers' is {shared}: the last {shared} layers read the keys and values of earlier "
            "layers (KV state shared across layers); aotc's generic path runs layers with a KV cache each"
        )
    if getattr(hf_config, "attention_chunk_size", None):
        raise ConfigError(f"{source}: field 'attention_chunk_size' is set: chunked attention; aotc's generic path runs full and sliding attention")


def _hf_config(model_type: str, fields: dict, source: str):
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.configuration_auto import AutoConfig

    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if k != "model_type"})
    except (TypeError, ValueError, KeyError, StrictDataclassError) as e:  # the last: a config class's own validation
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"{source}: transformers refuses this config ({type(e).__name__}: {first}); fix the field it names") from None
    config._attn_implementation = ATTENTION
    config._experts_implementation = EXPERTS  # read by experts classes that use transformers' ExpertsInterface
    return config


# -- what stands in for transformers' cache and attention -----------------------


class _LayerIndex:
    """A layer's `layer_idx` inside an entry: the stand-in cache ignores it, and any other
    use refuses, since a graph that used it would be one layer's graph only."""

    def __init__(self, where: str):
        self.where = where

    def _refuse(self, *_):
        raise ConfigError(
            f"{self.where}.layer_idx is used in the layer's forward other than to update the cache; aotc's generic path "
            "shares one graph across layers and cannot bake in a layer's index"
        )

    __index__ = __int__ = __bool__ = __add__ = __radd__ = __sub__ = __mul__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __hash__ = object.__hash__

    def __eq__(self, other):
        return self._refuse()


freezer(_LayerIndex, lambda value: "layer_idx")


class _KernelFuncs(dict):
    """A layer's `_kernel_funcs` (transformers 5.25 and the `kernels` package it needs:
    `use_kernelized_func` gives each module its own wrapper of a function such as
    apply_rotary_pos_emb, which `kernels.kernelize` could swap for a Hub kernel). aotc
    never kernelizes, so a wrapper runs the function the modeling code names: layers whose
    wrappers name the same functions share a graph. Remove when transformers drops
    per-instance kernel wrappers."""


def _freeze_kernel_funcs(funcs: _KernelFuncs) -> tuple:
    # A wrapper's class is made per function, in the modeling module, named by its kernel layer.
    return tuple(sorted((name, type(f).__module__, getattr(type(f), "kernel_layer_name", type(f).__qualname__)) for name, f in funcs.items()))


freezer(_KernelFuncs, _freeze_kernel_funcs)


def _freeze_config(config) -> str:
    # One value per config: layers that share it share their graphs, whatever it holds.
    return "config:" + hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16]


class _LayerCache:
    """What one layer's attention sees as transformers' cache, inside an entry: `update`
    writes the step's keys and values into the layer's cache inputs (one indexed write
    each) and returns the cache rows of the sequences its queries belong to."""

    def __init__(self, rows: tuple, k_cache, v_cache, positions, slots, decode: bool):
        self.rows, self.k_cache, self.v_cache = rows, k_cache, v_cache
        self.positions, self.slots, self.decode = positions, slots, decode

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        # key_states: [batch, kv heads, tokens, head dim]; a row per (sequence, token)
        b, heads, t, _ = key_states.shape
        k = key_states.transpose(1, 2).reshape(b * t, heads, key_states.shape[-1])
        v = value_states.transpose(1, 2).reshape(b * t, heads, value_states.shape[-1])
        index = (self.slots, slice(None), self.positions)
        store(self.rows[0], self.k_cache, index, k)
        store(self.rows[1], self.v_cache, index, v)
        if self.decode:  # each row's own slot
            seen = (slice(None, b),)
            return load(self.rows[0], self.k_cache, seen, key_states.dtype), load(self.rows[1], self.v_cache, seen, value_states.dtype)
        # A packed prefill chunk (models.packing): [1, kv heads, S + T, head dim].
        return (
            packed_rows(self.rows[0], self.k_cache, self.slots, self.positions, key_states.dtype)[None],
            packed_rows(self.rows[1], self.v_cache, self.slots, self.positions, value_states.dtype)[None],
        )


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention interface, as aotc runs it: query [B, heads, T, d], key and
    value [B, kv heads, S, d] (the cache rows); masked by position, so that the cache's
    positions past a sequence's own are never seen. A prefill chunk (B 1, `aotc_slots`
    given) packs sequences (models.packing): its keys are the first sequence's S - T
    cached positions and the chunk's T rows. Returns [B, T, heads, d]."""
    positions = kwargs.get("aotc_positions")  # [B, T]
    slots = kwargs.get("aotc_slots")  # [T], prefill only
    if positions is None:
        raise ConfigError(
            f"{type(module).__qualname__} called attention without the kwargs its layer was given; aotc's generic path passes positions through them, as transformers' layers do"
        )
    if attention_mask is not None:
        raise ConfigError(f"{type(module).__qualname__} was given an attention mask; aotc's generic path masks by position")
    b, heads, t, d = query.shape
    kv_heads, s = key.shape[1], key.shape[2]
    rep = heads // kv_heads
    scale = d**-0.5 if scaling is None else scaling
    # A KV head's query heads and tokens as the rows of one matmul against its keys, as
    # aotc's llama attends (and rewrite_skinny_matmuls makes decode's few rows read the
    # cache once per KV head): [B, kv, rep * T, d] @ [B, kv, d, S].
    q = query.reshape(b, kv_heads, rep * t, d)
    scores = (q @ key.transpose(-1, -2)).float() * scale  # [B, kv, rep * T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if slots is not None:  # [T, S] -> a row per (query head of a KV head, token)
        seen = packed_visible(positions[0], slots, s - t, sliding_window or None).repeat(rep, 1)
    else:
        k_pos = torch.arange(s, device=query.device)
        q_pos = positions[:, None, None, :].expand(b, 1, rep, t).reshape(b, 1, rep * t, 1)
        seen = k_pos <= q_pos
        if sliding_window:
            seen = seen & (k_pos > q_pos - sliding_window)
    scores = scores.masked_fill(~seen, float("-inf"))
    if s_aux is not None:  # attention sinks: a per-head logit that takes probability but gives no value
        sinks = s_aux.float().view(1, kv_heads, rep, 1).expand(b, -1, -1, t).reshape(b, kv_heads, rep * t, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = probs.to(value.dtype) @ value  # [B, kv, rep * T, d]
    return out.reshape(b, heads, t, value.shape[-1]).transpose(1, 2), None


def _register_attention() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


def _experts(module, hidden_states, top_k_index, top_k_weights):
    """transformers' ExpertsInterface, as aotc runs it eagerly: hidden_states [N, H],
    each token's k chosen experts and their weights [N, k]; returns [N, H]. Each expert
    that a token chose runs once, on the tokens routed to it, as transformers' own eager
    loop does. A token that picks one expert in two slots gets it weighted by both, as
    transformers counts it."""
    if module._is_expert_parallel:
        raise ConfigError(f"{type(module).__qualname__} is expert-parallel in transformers' own way; aotc splits experts itself (--expert-parallel)")
    chosen, weights = _local_choices(module, top_k_index, top_k_weights)
    hit = [e for e in chosen.unique().tolist() if e < module.num_experts]  # eager only: the compiled form loops over every expert
    dtype = None if getattr(module, "group", None) is None else torch.float32
    return _summed(module, _each_expert(module, hidden_states, chosen, weights, hit, dtype), hidden_states.dtype)


def _local_choices(module, chosen, weights):
    """The router's choices as this rank's experts (num_experts, its count: another rank's)
    and their weights, 0 for another rank's (--expert-parallel); on one rank, unchanged."""
    if getattr(module, "group", None) is None:  # one rank (or transformers' own experts class)
        return chosen, weights
    local = module.expert_map[chosen]
    return local, weights * (local < module.num_experts)


def _summed(module, out, dtype):
    """The experts' output: on several ranks, every rank's part summed (one fp32 all-reduce)."""
    group = getattr(module, "group", None)
    return out.to(dtype) if group is None else parallel.all_reduce(out.float(), group).to(dtype)


def _expert_linear(module, x, weight, bias):
    # x [..., in] by one expert's weight [out, in] ([in, out] where transposed): a matmul;
    # by each token's chosen experts' [..., out, in]: a multiply and sum, which Inductor
    # fuses with the indexing into one reduction (no copy of the chosen matrices).
    if weight.dim() == 2:
        out = x @ weight if module.is_transposed else F.linear(x, weight)
    else:
        out = (x.unsqueeze(-1) * weight).sum(-2) if module.is_transposed else (x.unsqueeze(-2) * weight).sum(-1)
    return out if bias is None else out + bias


def _expert_mlp(module, x, index):
    """The experts' MLP on x [..., H], expert `index` (an int, or a tensor of x's leading
    shape) of each: up (with the gate), activation, down, the optional post norm."""
    up, up_bias = (module.gate_up_proj, "gate_up_proj_bias") if module.has_gate else (module.up_proj, "up_proj_bias")
    bias = (lambda name: getattr(module, name)[index]) if module.has_bias else (lambda name: None)
    h = _expert_linear(module, x, up[index], bias(up_bias))
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    h = _expert_linear(module, h, module.down_proj[index], bias("down_proj_bias"))
    return module.post_expert_norm(h) if module.has_post_expert_norm else h


def _gathered_experts(module, x, chosen, weights):
    h = _expert_mlp(module, x[:, None, :], chosen)  # [N, k, H]
    return (h * weights[..., None].to(h.dtype)).sum(1)


def _each_expert(module, x, chosen, weights, experts, dtype=None):
    out = torch.zeros_like(x, dtype=dtype)
    for e in experts:
        picked = chosen == e  # [N, k]
        (rows,) = picked.any(dim=-1).nonzero(as_tuple=True)  # the tokens routed to expert e
        torch._check(rows.shape[0] <= x.shape[0])  # one row per token, whatever the picks: the static bound
        w = (weights * picked).sum(dim=-1)  # [N]: the sum of its slots' weights, as two slots count twice
        out.index_add_(0, rows, (_expert_mlp(module, x[rows], e) * w[rows, None].to(x.dtype)).to(out.dtype))
    return out


def _is_experts(module: nn.Module) -> bool:
    # What transformers' use_experts_implementation sets on the experts modules it decorates.
    return all(hasattr(module, a) for a in ("num_experts", "has_gate", "has_bias", "is_transposed", "has_post_expert_norm", "_is_expert_parallel"))


@functools.cache
def _experts_class(base: type) -> type:
    def compiled_forward(self, hidden_states, top_k_index, top_k_weights, derived):
        """Each token's chosen experts gathered from the fused weights (a multiply and sum Inductor fuses, reading only the chosen matrices), where a step makes fewer choices than there are experts; else each expert on its tokens (nonzero, which strip_data_dependent makes static).

        Across ranks (--expert-parallel): the rank's experts, the others' choices weighted 0
        (gathered, they read expert num_experts - 1), and one fp32 all-reduce of the parts."""
        chosen, weights = _local_choices(self, top_k_index, top_k_weights)
        if top_k_index.numel() < self.num_experts:
            out = _gathered_experts(self, hidden_states, chosen if self.group is None else chosen.clamp(max=self.num_experts - 1), weights)
        else:
            out = _each_expert(self, hidden_states, chosen, weights, range(self.num_experts), None if self.group is None else torch.float32)
        return _summed(self, out, hidden_states.dtype)

    compiled_forward.__qualname__ = f"{base.__name__}.compiled_forward"
    # group: the ranks' group where the module holds one rank's experts (hf_parallel.split_experts)
    return type(base.__name__, (base,), {"compiled_forward": compiled_forward, "group": None, "__module__": __name__})


def _register_experts() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS, _experts)


def _conversion_layout(hf: nn.Module, names) -> dict:
    """{param: checkpoint name or Merged} for the checkpoint tensors `names` that
    transformers' conversion mapping renames or merges (transformers' own renaming of a
    key, then at most one converter, as its loader applies them)."""
    # Private names (hf_compat.PRIVATE): the loader's conversion mapping and its transforms.
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming, apply_renamings, dot_natural_key

    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    layout: dict = {}
    merges: dict[str, tuple] = {}  # target -> (converter, {source pattern: names})
    for name in sorted(names, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        renamed = apply_renamings(name, renamings)
        for converter in converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                merges.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(name)
                break
        else:
            if renamed != name:
                layout[renamed] = name
    for target, (converter, by_pattern) in merges.items():
        ops = converter.operations
        kinds = [type(op) for op in ops]
        if kinds not in ([MergeModulelist], [MergeModulelist, Concatenate]):
            raise WeightsError(
                f"config.json: transformers makes {target} of the checkpoint's {', '.join(converter.source_patterns)} with "
                f"{', '.join(k.__name__ for k in kinds)}; aotc's generic path merges per-expert tensors (MergeModulelist, "
                "then Concatenate) only: save the checkpoint with transformers' own layout"
            )
        parts = tuple(tuple(by_pattern[p]) for p in converter.source_patterns if p in by_pattern)
        layout[target] = Merged(parts, stack_dim=ops[0].dim, cat_dim=ops[1].dim if len(ops) > 1 else 0)
    return layout


# -- a step: what the model's loop hands each layer -----------------------------


class _Step:
    """The cache object the model's forward passes to its layers in aotc's runs: which
    entry to call, and each layer's cache slices (the contract learning run passes a
    `_Recorder` instead)."""

    def __init__(self, method: str, positions, slots, caches: dict):
        self.method, self.positions, self.slots = method, positions, slots
        self.layers = {kind: layer_views(c) for kind, c in caches.items()}

    def caches_of(self, layer: int) -> tuple:
        return self.layers["k"][layer], self.layers["v"][layer]


@dataclass
class _Call:
    """What the contract learning run saw of one layer."""

    layer: str  # its class
    tensors: dict  # the layer's tensor arguments (and rotary's pair) by name: their shapes
    writes: list  # (key shape, value shape, dtype) of each cache update
    windows: list  # the sliding window given to attention


class _Recorder:
    """transformers' cache, in the run that learns the layers' contract: records each
    update, and returns the step's own keys and values (no past). Anything else asked of
    it is recorded and missing: the contract learning run refuses a model that needs it."""

    def __init__(self):
        self.calls: list[_Call] = []
        self.asked: list[tuple[str, str]] = []  # (where, attribute)

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.calls[-1].writes.append((tuple(key_states.shape), tuple(value_states.shape), key_states.dtype))
        return key_states, value_states

    def __getattr__(self, name):
        if not name.startswith("__"):
            where = f"layer {len(self.calls) - 1} ({self.calls[-1].layer})" if self.calls else "its forward (before any layer)"
            self.asked.append((where, name))  # a getattr with a default asks too: only a failure refuses
        raise AttributeError(name)


# layer_types that are no attention with a KV cache of its own, and what they are
# (transformers 5.24 names every hybrid's recurrent layers "linear_attention").
_LAYER_KINDS = {
    "linear_attention": "a linear-attention or state-space layer (Gated DeltaNet, Mamba, ...), which keeps recurrent state",
    "conv": "a short convolution, which keeps its last inputs", "chunked_attention": "chunked attention",
}  # fmt: skip
# The attention masks transformers builds that aotc's attention reproduces by position.
_MASKS = ("create_causal_mask", "create_sliding_window_causal_mask")
_LEARNING = threading.Lock()  # _learn's patch of transformers' globals (see there)


@dataclass(frozen=True)
class Contract:
    """What every layer takes and writes, learnt from one forward (`_learn`)."""

    hidden: int
    dtype: torch.dtype  # of the hidden state
    rope: int  # the width of the rotary (cos, sin) the layers take; 0: none
    kv_heads: int
    k_dim: int
    v_dim: int
    cache_param: str  # the name of the layer's cache argument


# -- the model ---------------------------------------------------------------------


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


def _fp8_rows(config: TransformersConfig, contract: Contract) -> tuple[Fp8Rows | None, Fp8Rows | None]:
    """The packed rows of fp8 caches (k, v): a head's values with one scale, as the llama
    family packs them."""
    kv = config.kv_cache
    if kv.dtype == "auto":
        return None, None
    v = Fp8Rows(contract.v_dim, contract.v_dim, 0, kv.fp8_max)
    return (Fp8Rows(contract.k_dim, contract.k_dim, 0, kv.fp8_max) if kv.dtype == "fp8" else None), v


# -- learning the contract ---------------------------------------------------------


def _learn(hf: nn.Module, layers: list[nn.Module], config: TransformersConfig) -> Contract:
    """Run the model once on two tokens where it was built (on meta or fake tensors, as
    builds and loads make it, no value is computed), recording what each layer is given
    and writes."""
    recorder = _Recorder()
    signature = inspect.signature(type(layers[0]).forward)
    params = signature.parameters
    var_kw = next((k for k, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    cache_param = "cache" if "cache" in params else "past_key_values"
    if cache_param not in params:
        raise ConfigError(f"{type(layers[0]).__name__}.forward takes no cache; aotc's generic path runs layers that keep a KV cache")

    def before(module, args, kwargs):
        bound = signature.bind(module, *args, **kwargs).arguments
        extra = bound.pop(var_kw, {})  # what the layer's **kwargs took
        given = {**bound, **extra}
        tensors = {}
        for name, value in given.items():
            if isinstance(value, torch.Tensor):
                tensors[name] = tuple(value.shape)
            elif isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
                tensors[name] = tuple(tuple(v.shape) for v in value)
        recorder.calls.append(_Call(type(module).__name__, tensors, [], []))

    hooks = [layer.register_forward_pre_hook(before, with_kwargs=True) for layer in layers]

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
        recorder.calls[-1].windows.append(sliding_window)
        return query.transpose(1, 2), None

    from transformers.integrations.moe import ExpertsInterface
    from transformers.modeling_utils import AttentionInterface

    # transformers takes the attention and experts functions from its global registries, by
    # the name in the config, and the mask builders from the modeling module's globals: no
    # hook per model or per call. So the recorder's stand-ins replace aotc's own in them for
    # this one meta forward and are put back after it, under _LEARNING, so that two
    # learnings in one process never interleave (a transformers model run meanwhile by
    # code other than aotc's, in another thread, would still see them). Remove the lock when
    # transformers takes these functions per model or per call.
    with _LEARNING:
        AttentionInterface.register(ATTENTION, attention)
        # No value is computed: the experts' output has its input's shape (and `nonzero` has
        # no meta kernel).
        ExpertsInterface.register(EXPERTS, lambda module, hidden_states, *_: torch.zeros_like(hidden_states))
        # The masks the model builds: transformers builds none for aotc's attention, which
        # masks by position, so any other than causal and sliding would be lost.
        modeling = inspect.getmodule(type(hf))
        creators = {n: f for n, f in vars(modeling).items() if n.startswith("create_") and getattr(f, "__module__", None) == "transformers.masking_utils"}
        masks: list[tuple[str, list[str]]] = []

        def recording(name, create):
            def record(*args, **kwargs):
                masks.append((name, [k for k in ("or_mask_function", "and_mask_function") if kwargs.get(k) is not None]))
                return create(*args, **kwargs)

            return record

        for name, create in creators.items():
            setattr(modeling, name, recording(name, create))
        try:
            ids = torch.zeros(1, 2, dtype=torch.long)
            with torch.no_grad():
                hf(input_ids=ids, position_ids=torch.arange(2)[None], **{cache_param: recorder}, use_cache=True, aotc_positions=torch.arange(2)[None])
        except AttributeError as e:
            if not recorder.asked or e.args != (recorder.asked[-1][1],):  # not what the recorder lacked
                raise
            where, name = recorder.asked[-1]
            raise ConfigError(
                f"{config.architecture}: {where} asks transformers' cache for {name!r}; aotc's stand-in cache has update() only "
                "(one indexed write per layer and step, at the positions the step gives, not from the cache's length)"
            ) from None
        finally:
            for h in hooks:
                h.remove()
            vars(modeling).update(creators)
            _register_attention()
            _register_experts()
    for name, extra in masks:
        if name not in _MASKS or extra:
            raise ConfigError(
                f"{config.architecture}: its forward builds its attention mask with {name}{' and an ' + ' and '.join(extra) if extra else ''}; "
                "aotc's generic path masks by position (causal, and the sliding window the attention module passes), not by that mask"
            )
    return _contract_of(recorder.calls, layers, config, hf.config, cache_param)


def _contract_of(calls: list[_Call], layers, config: TransformersConfig, hf_config, cache_param: str) -> Contract:
    if len(calls) != len(layers):
        raise ConfigError(f"{config.architecture}: its forward called {len(calls)} decoder layers, it has {len(layers)}; aotc's generic path runs each layer once per step")
    for i, call in enumerate(calls):
        if len(call.writes) != 1:
            what = "writes no KV cache of its own (it shares another layer's, or keeps another kind of state)" if not call.writes else f"writes the cache {len(call.writes)} times"
            raise ConfigError(f"{config.architecture}: layer {i} ({type(layers[i]).__name__}) {what}; aotc's generic path runs layers with one KV cache each")
        if len(call.windows) != 1:
            raise ConfigError(
                f"{config.architecture}: layer {i} ({type(layers[i]).__name__}) computes attention {'with code of its own' if not call.windows else f'{len(call.windows)} times'}, "
                "not once through transformers' AttentionInterface; aotc's generic path masks attention by position there, and cannot "
                "take a model whose attention reads a mask of its own"
            )
        others = sorted(set(call.tensors) - {"hidden_states", "position_embeddings", "position_ids", "attention_mask", "aotc_positions"})
        if others:
            raise ConfigError(f"{config.architecture}: its layers are given the tensors {', '.join(others)}, which aotc's generic path does not pass yet")
    shapes = {c.writes[0][:2] for c in calls}
    if len(shapes) != 1:
        raise ConfigError(f"{config.architecture}: its layers write caches of several shapes ({sorted(shapes)}); aotc's generic path needs one")
    ((k_shape, v_shape),) = shapes
    rope = {c.tensors["position_embeddings"][0][-1] if "position_embeddings" in c.tensors else 0 for c in calls}
    if len(rope) != 1:
        raise ConfigError(f"{config.architecture}: some of its layers are given rotary embeddings and some not; aotc's generic path needs all or none")
    # The config object's, not config.json's: the config class derives layer_types where an
    # older config.json has none (qwen2's use_sliding_window and max_window_layers).
    hf_window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    for i, call in enumerate(calls):
        expected = hf_window if (types is None or types[i] == "sliding_attention") and hf_window else None
        if expected is not None and call.windows != [expected]:
            raise ConfigError(
                f"{config.architecture}: layer {i} is a sliding-window layer (sliding_window {expected}) but its attention is given "
                f"window {call.windows[0]!r}; aotc's generic path masks by the window the attention module passes"
            )
    return Contract(calls[0].tensors["hidden_states"][-1], config.dtype, rope.pop(), k_shape[1], k_shape[3], v_shape[3], cache_param)


# -- the generated classes -----------------------------------------------------------


def _convert_layer(layer: nn.Module, index: int, contract: Contract, rows: tuple) -> None:
    """Make a decoder layer an instance of its class's aotc subclass, its layer_idx
    attributes stand-ins (`_LayerIndex`), and note its index for the model's loop."""
    layer.__class__ = _layer_class(type(layer), contract)
    for path, m in layer.named_modules():
        if isinstance(m.__dict__.get("layer_idx"), int):
            m.layer_idx = _LayerIndex(f"{type(m).__name__}")
        if type(m.__dict__.get("_kernel_funcs")) is dict:  # the instance's own, not a class default
            m._kernel_funcs = _KernelFuncs(m._kernel_funcs)
    layer.aotc_index = index
    layer.k_rows, layer.v_rows = rows


@functools.cache
def _layer_class(base: type, contract: Contract) -> type:
    params = ["x", *(("cos", "sin") if contract.rope else ()), "positions", "slots", "k_cache", "v_cache"]
    signature = inspect.signature(base.forward)  # once: forward binds with it per layer and step
    takes_positions = "position_ids" in signature.parameters

    def call(self, decode: bool, args):
        named = dict(zip(params, args))
        x, positions, slots = named["x"], named["positions"], named["slots"]
        n = x.shape[0]
        shape = (n, 1) if decode else (1, n)
        kw = {contract.cache_param: _LayerCache((self.k_rows, self.v_rows), named["k_cache"], named["v_cache"], positions, slots, decode)}
        if contract.rope:
            kw["position_embeddings"] = (named["cos"].view(*shape, -1), named["sin"].view(*shape, -1))
        if takes_positions:
            kw["position_ids"] = positions.view(shape)
        if not decode:
            kw["aotc_slots"] = slots
        out = base.forward(self, x.view(*shape, -1), attention_mask=None, use_cache=True, aotc_positions=positions.view(shape), **kw)
        if isinstance(out, tuple):
            out = out[0]
        return out.reshape(n, -1)

    def decode(self, *args):
        return call(self, True, args)

    def prefill(self, *args):
        return call(self, False, args)

    signed = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params]
    )
    decode.__signature__ = prefill.__signature__ = signed
    decode.__qualname__ = f"{base.__name__}.decode"
    prefill.__qualname__ = f"{base.__name__}.prefill"
    pad = {"slots": SCRATCH_SLOT}
    caches = ("k_cache", "v_cache")
    decode = entry(bucket="batch", caches=caches, pad=pad, context="positions")(decode)
    prefill = entry(bucket="chunk", caches=caches, pad=pad, split=True, context="positions")(prefill)

    def forward(self, *args, **kwargs):
        # transformers' loops pass the hidden state first and the rest by name: read them so
        # (binding the signature for each layer and step costs more than the graph's call
        # overhead); anything else binds.
        bound = {"hidden_states": args[0], **kwargs} if len(args) == 1 and "hidden_states" not in kwargs else signature.bind(self, *args, **kwargs).arguments
        step = bound.get(contract.cache_param)
        if not isinstance(step, _Step):  # not aotc's loop: transformers' own layer
            return base.forward(self, *args, **kwargs)
        x = bound["hidden_states"]
        b, t, h = x.shape
        given = [x.reshape(b * t, h)]
        if contract.rope:
            cos, sin = bound["position_embeddings"]
            given += [cos.reshape(b * t, -1), sin.reshape(b * t, -1)]
        out = getattr(self, step.method)(*given, step.positions, step.slots, *step.caches_of(self.aotc_index))
        return out.view(b, t, h)

    def example_inputs(self, method, rows, shapes):
        dtype = contract.dtype
        positions = torch.zeros(rows, dtype=torch.long)
        # Two tensors: one object passed twice would be one graph input.
        rope = tuple(torch.zeros(rows, contract.rope, dtype=dtype) for _ in range(2)) if contract.rope else ()
        return (torch.zeros(rows, contract.hidden, dtype=dtype), *rope, positions, positions.clone(), shapes.cache("k", 2), shapes.cache("v", 2))

    return type(base.__name__, (base,), {
        "decode": decode, "prefill": prefill, "forward": forward, "example_inputs": example_inputs, "__module__": __name__,
        "__annotations__": {"aotc_index": int},  # the layer's index in the model's loop: forward reads it, outside any graph
    })  # fmt: skip


class LMHead(nn.Linear):
    """A transformers model's LM head, compiled as an entry (`project`). Across ranks
    (`group`), each holds its rows of the vocabulary and the logits are gathered: by an
    all-reduce of each rank's logits placed at its block (`rank_index`, a buffer: one
    graph for every rank). AOTInductor runs an all-gather through its proxy executor,
    which hands gloo Python tensors; gloo's worker then lets go of them under the GIL
    that the next graph holds while it waits for its own all-reduce, and the ranks hung
    (torch 2.13, parallel.settled)."""

    group: str | None = None

    @entry(bucket="batch")
    def project(self, x):
        logits = F.linear(x, self.weight, self.bias)  # [B, V / ranks]
        if self.group is None:
            return logits
        every = parallel.all_gather_rows(logits, self.group, self.rank_index)  # [ranks * B, V / ranks]
        return every.view(-1, *logits.shape).transpose(0, 1).reshape(logits.shape[0], -1)

    def forward(self, x):
        shape = x.shape
        return self.project(x.reshape(-1, shape[-1])).view(*shape[:-1], -1)

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, self.in_features, dtype=self.weight.dtype),)


def _register_config_freezer() -> None:
    from transformers.configuration_utils import PretrainedConfig

    freezer(PretrainedConfig, _freeze_config)
