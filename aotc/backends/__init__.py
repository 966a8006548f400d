"""Backends: one file each, registered by name (base.py has the contract)."""

from .base import Backend, CompileResult, Program, Progress, Specs, get_backend
from .registry import backend_names, find_backend, get_backend_class, register_backend

__all__ = ["Backend", "CompileResult", "Program", "Progress", "Specs", "backend_names", "find_backend", "get_backend", "get_backend_class", "register_backend"]
