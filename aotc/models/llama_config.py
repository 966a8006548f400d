"""The Llama family's config.json (llama, qwen2, mistral), read and checked, and its rotary frequencies."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .base import read_dtype
from .config import ConfigReader, ModelConfig

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class LlamaConfig(ModelConfig):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    layer_windows: tuple[int | None, ...]  # per layer: sliding window length, or None
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: ConfigReader) -> "LlamaConfig":
        model_type = cfg.get("model_type", str, "llama")
        hidden = cfg.positive("hidden_size")
        heads = cfg.positive("num_attention_heads")
        kv_heads = cfg.positive("num_key_value_heads", heads)
        layers = cfg.positive("num_hidden_layers")
        if heads % kv_heads:
            raise ConfigError(f"{cfg.source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        head_dim = cfg.positive("head_dim", None) or hidden // heads
        act = cfg.get("hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"{cfg.source}: field 'hidden_act' is {act!r}; the Llama family here supports 'silu' (SwiGLU)")
        if cfg.get("partial_rotary_factor", float, 1.0) != 1.0:
            raise ConfigError(f"{cfg.source}: field 'partial_rotary_factor' must be 1.0 for the Llama family")
        theta, scaling = _read_rope(cfg)
        is_qwen2 = model_type == "qwen2"
        attention_bias = cfg.get("attention_bias", bool, False)
        eos = cfg.config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg.positive("vocab_size"),
            hidden_size=hidden,
            intermediate_size=cfg.positive("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.positive_number("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.positive("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", bool, False),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=cfg.get("mlp_bias", bool, False),
            layer_windows=_read_windows(cfg, model_type, layers),
            dtype=read_dtype(cfg),
            eos_token_ids=eos_ids,
        )


def _read_rope(cfg: ConfigReader) -> tuple[float, dict | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older configs
    # write `rope_theta` and `rope_scaling`. Real checkpoints use both.
    params = cfg.get("rope_parameters", dict, None)
    theta = cfg.positive_number("rope_theta", 10000.0)
    if params is None:
        params = cfg.get("rope_scaling", dict, None) or {}
    else:
        theta = cfg.positive_number("rope_theta", theta, where=params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{cfg.source}: rope_type {rope_type!r} is not supported; expected one of {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    for key in required[rope_type]:
        if not isinstance(params.get(key), (int, float)):
            raise ConfigError(f"{cfg.source}: rope scaling {rope_type!r} needs a number in field {key!r}, got {params.get(key)!r}")
        cfg.positive_number(key, where=params)
    if rope_type == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ConfigError(
            f"{cfg.source}: rope scaling 'llama3' needs high_freq_factor above low_freq_factor (it divides by their difference), "
            f"got {params['high_freq_factor']} and {params['low_freq_factor']}"
        )
    return theta, {"rope_type": rope_type, **{k: params[k] for k in required[rope_type]}}


def _read_windows(cfg: ConfigReader, model_type: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.positive("sliding_window", None)
    if model_type == "mistral":
        return (window,) * layers
    if model_type != "qwen2":
        return (None,) * layers
    layer_types = cfg.get("layer_types", list, None)
    if layer_types is None:  # configs older than `layer_types`
        use = cfg.get("use_sliding_window", bool, False)
        first = cfg.get("max_window_layers", int, layers)
        layer_types = ["sliding_attention" if use and i >= first else "full_attention" for i in range(layers)]
    if len(layer_types) != layers:
        raise ConfigError(f"{cfg.source}: field 'layer_types' has {len(layer_types)} entries, expected num_hidden_layers={layers}")
    for t in layer_types:
        if t not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"{cfg.source}: field 'layer_types' holds {t!r}; expected 'full_attention' or 'sliding_attention'")
    if "sliding_attention" in layer_types and not window:
        raise ConfigError(f"{cfg.source}: 'layer_types' has sliding layers but 'sliding_window' is not set")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def local_kv_heads(config: LlamaConfig) -> int:
    """A rank's KV heads: its part of them, or one where the ranks outnumber them."""
    return max(1, config.num_key_value_heads // config.parallel.tensor_parallel)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] float32, with the config's scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, blend between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)
