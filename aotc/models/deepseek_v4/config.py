"""DeepSeek V4's config.json, read and checked, and its rotary frequencies."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import ConfigError
from ..base import read_dtype
from ..config import ConfigReader, ModelConfig

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn")


@dataclass
class DeepseekV4Config(ModelConfig):
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rate_csa: int
    compress_rate_hca: int
    rope: dict  # {"main": {...}, "compress": {...}}: rope_type, rope_theta and yarn fields
    rope_dim: int  # the trailing channels of each head that get RoPE
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: ConfigReader) -> "DeepseekV4Config":
        n = cfg.positive("num_hidden_layers")
        if cfg.get("num_key_value_heads", int, 1) != 1:
            raise ConfigError(f"{cfg.source}: DeepSeek V4 has one shared KV head; field 'num_key_value_heads' must be 1")
        act = cfg.get("hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"{cfg.source}: field 'hidden_act' is {act!r}; DeepSeek V4 uses 'silu'")
        head_dim = cfg.positive("head_dim")
        layer_types = cfg.get("layer_types", list, None) or ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))
        ]
        mlp_types = cfg.get("mlp_layer_types", list, None) or ["hash_moe"] * min(n, 3) + ["moe"] * max(0, n - 3)
        for name, types, allowed in (("layer_types", layer_types, LAYER_TYPES), ("mlp_layer_types", mlp_types, MLP_TYPES)):
            if len(types) != n:
                raise ConfigError(f"{cfg.source}: field {name!r} has {len(types)} entries, expected num_hidden_layers={n}")
            bad = [t for t in types if t not in allowed]
            if bad:
                raise ConfigError(f"{cfg.source}: field {name!r} holds {bad[0]!r}; expected one of {', '.join(allowed)}")
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(cfg.get("compress_rates", dict, None) or {})}
        for kind, rate in rates.items():  # a block length in positions: a whole number above 0
            if kind in LAYER_TYPES and (not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0):
                raise ConfigError(f"{cfg.source}: compress_rates[{kind!r}] is {rate!r}; expected a positive integer (positions per compressed entry)")
        scoring = cfg.get("scoring_func", str, "sqrtsoftplus")
        if scoring not in SCORING:
            raise ConfigError(f"{cfg.source}: field 'scoring_func' is {scoring!r}; expected one of {', '.join(SCORING)}")
        partial = cfg.get("partial_rotary_factor", float, None)
        if partial is None:
            partial = cfg.get("qk_rope_head_dim", int, 64) / head_dim
        rope = _read_rope(cfg, partial)
        eos = cfg.config.get("eos_token_id")
        return cls(
            vocab_size=cfg.positive("vocab_size"),
            hidden_size=cfg.positive("hidden_size"),
            moe_intermediate_size=cfg.positive("moe_intermediate_size"),
            num_hidden_layers=n,
            num_attention_heads=cfg.positive("num_attention_heads"),
            head_dim=head_dim,
            q_lora_rank=cfg.positive("q_lora_rank"),
            num_experts_per_tok=cfg.positive("num_experts_per_tok"),
            n_routed_experts=cfg.positive("n_routed_experts"),
            scoring_func=scoring,
            routed_scaling_factor=cfg.get("routed_scaling_factor", float, 1.0),
            max_position_embeddings=cfg.positive("max_position_embeddings", 4096),
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_types),
            compress_rate_csa=rates["compressed_sparse_attention"],
            compress_rate_hca=rates["heavily_compressed_attention"],
            rope=rope,
            rope_dim=int(head_dim * partial),
            hc_mult=cfg.positive("hc_mult", 4),
            hc_sinkhorn_iters=cfg.positive("hc_sinkhorn_iters", 20),
            hc_eps=cfg.get("hc_eps", float, 1e-6),
            swiglu_limit=cfg.get("swiglu_limit", float, 10.0),
            sliding_window=cfg.positive("sliding_window", 128),
            o_groups=cfg.positive("o_groups"),
            o_lora_rank=cfg.positive("o_lora_rank"),
            index_n_heads=cfg.positive("index_n_heads"),
            index_head_dim=cfg.positive("index_head_dim"),
            index_topk=cfg.positive("index_topk"),
            rms_norm_eps=cfg.positive_number("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", bool, False),
            dtype=read_dtype(cfg),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ()),
        )


def _read_rope(cfg: ConfigReader, partial: float) -> dict:
    # transformers writes {"main": {...}, "compress": {...}}; older configs have
    # rope_theta / compress_rope_theta and the yarn fields at the top level.
    params = cfg.get("rope_parameters", dict, None) or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:
        yarn = cfg.get("rope_scaling", dict, None) or {k: v for k, v in params.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": cfg.positive_number("rope_theta", 10000.0)}
        compress = {**yarn, "rope_theta": cfg.positive_number("compress_rope_theta", 160000.0)}
    out = {}
    for kind, p in (("main", main), ("compress", compress)):
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"{cfg.source}: rope_parameters.{kind}.rope_type is {rope_type!r}; expected one of {', '.join(ROPE_TYPES)}")
        if rope_type == "yarn":
            for key in ("factor", "original_max_position_embeddings"):
                if not isinstance(p.get(key), (int, float)):
                    raise ConfigError(f"{cfg.source}: yarn rope ({kind}) needs a number in field {key!r}, got {p.get(key)!r}")
                cfg.positive_number(key, where=p)
        out[kind] = {**p, "rope_type": rope_type, "rope_theta": cfg.positive_number("rope_theta", 10000.0, where=p), "partial_rotary_factor": partial}
    return out


def rope_inv_freq(config: DeepseekV4Config, kind: str) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim / 2] and the cos/sin scale for one rope kind (main or compress)."""
    p = config.rope[kind]
    dim, base = config.rope_dim, p["rope_theta"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if p["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    # YaRN: interpolate the low frequencies, keep the high ones, ramp between.
    factor, old = p["factor"], p["original_max_position_embeddings"]
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction(rotations):
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(correction(fast)), 0), min(math.ceil(correction(slow)), dim - 1)
    high = high + 0.001 if low == high else high
    extrapolate = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")

        def get(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = get(factor, mscale) / get(factor, mscale_all) if mscale and mscale_all else get(factor)
    return inv_freq, float(attention)
