"""Warnings that torch and JAX raise inside aotc's own calls, about their own
internals: nothing a user can act on, so the CLI and build workers drop them."""

from __future__ import annotations

import warnings

# (message regex, category)
THIRD_PARTY = [
    # torch 2.13's export pytree code, on (un)pickling a TreeSpec; remove when torch stops
    (r".*isinstance\(treespec, LeafSpec\)", FutureWarning),
    # torch.jit inside Inductor's imports (torch 2.13)
    (r".*torch\.jit\.script_method", DeprecationWarning),
]


def silence_third_party_warnings() -> None:
    for message, category in THIRD_PARTY:
        warnings.filterwarnings("ignore", message=message, category=category)
