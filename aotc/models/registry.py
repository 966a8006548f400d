"""The architecture registry: config.json -> the aotc model class that runs it.

A model package registers its class with `register_architecture`, the same
way aotc's own models do:

    @aotc.register_architecture(model_types=("llama",), architectures=("LlamaForCausalLM",))
    class LlamaForCausalLM(aotc.CausalLM): ...
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class Architecture:
    name: str
    model_class: type
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]


_BY_NAME: dict[str, Architecture] = {}


def register_architecture(*, model_types: tuple[str, ...], architectures: tuple[str, ...] = (), name: str | None = None):
    """Class decorator registering a `CausalLM` subclass for these config.json values."""

    def register(cls):
        from .config import ModelConfig

        config_class = getattr(cls, "config_class", None)
        if not (isinstance(config_class, type) and issubclass(config_class, ModelConfig)):
            raise ConfigError(
                f"@register_architecture on {cls.__qualname__}: its config_class must be a subclass of "
                f"aotc.ModelConfig, got {config_class!r}; declare `class MyConfig(aotc.ModelConfig)`"
            )
        arch = Architecture(name or model_types[0], cls, tuple(model_types), tuple(architectures))
        _BY_NAME[arch.name] = arch
        return cls

    return register


def architectures() -> dict[str, Architecture]:
    _import_builtin_models()
    return dict(_BY_NAME)


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
        return _BY_NAME[hf.NAME]
    known = sorted({t for a in archs for t in a.model_types})
    raise ConfigError(
        f"{source}: unsupported architecture (model_type={model_type!r}, "
        f"architectures={config.get('architectures')!r}); aotc knows model_type {', '.join(known)}, and, with transformers "
        f"installed (aotc[hf]), every decoder-only model transformers has. "
        "Register your own with aotc.register_architecture and pass --plugin (see docs/models.md)."
    )


def _import_builtin_models() -> None:
    # Imported lazily so that `aotc.models.registry` has no import cycle with the models.
    from . import deepseek_v4, hf, llama  # noqa: F401

    if hf.NAME not in _BY_NAME:  # by name only: resolve() picks it for what no model_type claims
        _BY_NAME[hf.NAME] = Architecture(hf.NAME, hf.TransformersCausalLM, (), ())
