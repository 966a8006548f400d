"""The thin runtime: load a bundle, bind it to a model, generate, check against eager."""

from .bundle import Bundle
from .check import CheckReport, check_generation, compare, tolerance_for
from .dispatch import Dispatcher
from .generate import Generation, Sequence, generate

__all__ = ["Bundle", "CheckReport", "Dispatcher", "Generation", "Sequence", "check_generation", "compare", "generate", "tolerance_for"]
