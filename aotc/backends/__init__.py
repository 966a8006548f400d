"""Backends: export (reference) | inductor | xla | neuron."""

from .base import Backend, CompileResult, Runner, backend_names, get_backend, register_backend

__all__ = ["Backend", "CompileResult", "Runner", "backend_names", "get_backend", "register_backend"]
