"""The generic path's config: which transformers models it takes (installed, knows), their config.json read and checked, and what it refuses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ConfigError
from ..base import read_dtype
from ..config import ConfigReader, ModelConfig
from . import compat as hf_compat

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


# layer_types that are no attention with a KV cache of its own, and what they are
# (transformers 5.24 names every hybrid's recurrent layers "linear_attention").
_LAYER_KINDS = {
    "linear_attention": "a linear-attention or state-space layer (Gated DeltaNet, Mamba, ...), which keeps recurrent state",
    "conv": "a short convolution, which keeps its last inputs", "chunked_attention": "chunked attention",
}  # fmt: skip


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
