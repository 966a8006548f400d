"""The architecture registry: config.json -> the aotc model class that runs it.

A model package registers its class with `register_architecture`, the same
way aotc's own models do:

    @aotc.register_architecture(model_types=("llama",), architectures=("LlamaForCausalLM",))
    class LlamaForCausalLM(aotc.CausalLM): ...
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


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
        add(Architecture(name or model_types[0], cls, tuple(model_types), tuple(architectures)))
        return cls

    return register


def add(arch: Architecture) -> None:
    _BY_NAME[arch.name] = arch


def registered() -> dict[str, Architecture]:
    """The architectures registered so far (aotc.models.loader.architectures: all of them)."""
    return dict(_BY_NAME)
