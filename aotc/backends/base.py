"""The backend contract: name, version, availability, compile and load.

A backend imports its vendor SDK only inside its methods, so the CLI and the
other backends work on a machine without that SDK.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import torch

from ..errors import BackendError, did_you_mean
from ..trace import TracedGraph

# A loaded artifact: takes the flat graph inputs (weights, then the method's
# arguments) and returns the flat outputs.
Runner = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@dataclass
class CompileResult:
    files: list[str]  # relative to the artifact folder
    extra: dict = field(default_factory=dict)  # backend-specific manifest fields


class Backend(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def version(self) -> str:
        """Everything about the compiler that changes its output; goes into cache keys."""

    def unavailable(self) -> str | None:
        """None when usable here, else what is missing and how to get it."""
        return None

    def flags(self) -> dict:
        """Normalized compiler flags; go into cache keys and the manifest."""
        return {}

    def pass_target(self) -> str | None:
        """Which backend-specific passes run on its graphs (aotc.passes.BACKEND_PASSES)."""
        return None

    def incompatible(self, built: dict) -> str | None:
        """Why artifacts built as `built` (the manifest's backend record) cannot run here, or None."""
        if built.get("version") != self.version():
            return f"built with {self.name} {built.get('version')}, this machine has {self.version()}"
        return None

    @abc.abstractmethod
    def compile(self, graph: TracedGraph, out_dir: Path) -> CompileResult:
        """Compile one traced graph into files under out_dir."""

    @abc.abstractmethod
    def load(self, art_dir: Path, files: list[str], entry: dict) -> Runner:
        """Load one compiled artifact; `entry` is its manifest record."""


_BACKENDS: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    _BACKENDS[cls.name] = cls
    return cls


def backend_names() -> list[str]:
    _import_builtin()
    return sorted(_BACKENDS)


def get_backend_class(name: str) -> type[Backend]:
    _import_builtin()
    if name not in _BACKENDS:
        raise BackendError(f"unknown backend {name!r}; {did_you_mean(name, _BACKENDS)}")
    return _BACKENDS[name]


def get_backend(name: str, **options) -> Backend:
    backend = get_backend_class(name)(**options)
    why = backend.unavailable()
    if why:
        raise BackendError(f"backend {name!r} is not available here: {why}")
    return backend


def _import_builtin() -> None:
    from . import export, inductor, neuron, xla  # noqa: F401
