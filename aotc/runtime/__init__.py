"""The thin runtime: load a bundle, bind it to a model, generate."""

from .bundle import Bundle, read_manifest
from .dispatch import Dispatcher
from .generate import Generation, Sequence, generate

__all__ = ["Bundle", "Dispatcher", "Generation", "Sequence", "generate", "read_manifest"]
