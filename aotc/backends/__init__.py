"""Backends: one file each, registered by name (base.py has the contract)."""

from .base import Backend, CompileResult, Progress, Runner, backend_names, get_backend, register_backend

__all__ = ["Backend", "CompileResult", "Progress", "Runner", "backend_names", "get_backend", "register_backend"]
