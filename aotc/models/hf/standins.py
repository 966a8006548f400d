"""What the generic path puts in transformers' place inside a layer: the stand-in cache, the "aotc" attention and experts functions, the compiled experts, and the layer index and kernel wrappers that would split one graph per layer."""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from ... import parallel
from ...entry import freezer
from ...errors import ConfigError
from ...kvcache import load, store
from ..packing import packed_bias, packed_rows
from .config import ATTENTION, EXPERTS


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


def _register_config_freezer() -> None:
    from transformers.configuration_utils import PretrainedConfig

    freezer(PretrainedConfig, _freeze_config)


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
    if slots is not None:  # [T, S] -> a row per (query head of a KV head, token); as a float bias, as llama's (packing.packed_bias says why)
        scores = scores + packed_bias(positions[0], slots, s - t, sliding_window or None).repeat(rep, 1)
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
