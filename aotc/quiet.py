"""Warnings that torch and JAX raise inside aotc's own calls, about their own
internals: nothing a user can act on, so the CLI and build workers drop them.

Each is matched by its exact text, so a new warning, even of the same category
from the same library, still shows. `aotc --verbose` shows these too.
"""

from __future__ import annotations

import os
import re
import warnings

# (exact message, category)
THIRD_PARTY = [
    # torch 2.13's export pytree code, on (un)pickling a TreeSpec; remove when torch stops
    (
        "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()` instead.",
        FutureWarning,
    ),
    # torch.jit inside Inductor's imports (torch 2.13)
    ("`torch.jit.script_method` is deprecated. Please switch to `torch.compile` or `torch.export`.", DeprecationWarning),
]

VERBOSE_ENV = "AOTC_VERBOSE"  # set by `aotc --verbose`; build workers inherit it


def silence_third_party_warnings() -> None:
    if os.environ.get(VERBOSE_ENV) == "1":
        return
    for message, category in THIRD_PARTY:
        warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z", category=category)
