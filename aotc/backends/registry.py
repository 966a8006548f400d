"""The backends by name: what a backend's file registers (register_backend) and what a
bundle's manifest names (backend.name) is looked up here. A leaf: the bundle format reads
it to find the backend that wrote a bundle, and the backends' contract (base.py) does
not come with it."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
from typing import TYPE_CHECKING

from ..errors import BackendError, did_you_mean

if TYPE_CHECKING:
    from .base import Backend

_BACKENDS: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    _BACKENDS[cls.name] = cls
    return cls


def registered_backends() -> dict[str, type[Backend]]:
    """The backends imported so far, by name."""
    return dict(_BACKENDS)


def find_backend(name: str) -> type[Backend] | None:
    """The backend registered as `name`: aotc's own is imported from its file on first use."""
    if name not in _BACKENDS and re.fullmatch(r"[a-z][a-z0-9_]*", name) and importlib.util.find_spec(f"{__package__}.{name}") is not None:
        importlib.import_module(f"{__package__}.{name}")
    return _BACKENDS.get(name)


def backend_names() -> list[str]:
    """Every backend: aotc's own files, and those plugins registered."""
    for module in pkgutil.iter_modules(importlib.import_module(__package__).__path__):
        find_backend(module.name)
    return sorted(_BACKENDS)


def get_backend_class(name: str) -> type[Backend]:
    found = find_backend(name)
    if found is None:
        raise BackendError(f"unknown backend {name!r}; {did_you_mean(name, backend_names())}")
    return found
