"""Models that live in the user's own package: `--plugin PACKAGE.MODULE`.

Importing the module must register at least one architecture with
`aotc.register_architecture`; bundles record their plugins, so `aotc run`
imports them again by itself.
"""

from __future__ import annotations

import importlib
import traceback

from .errors import AotcError
from .models.registry import architectures


def load_plugins(names: list[str] | tuple[str, ...]) -> list[str]:
    """Import each plugin module; returns the architecture names each added."""
    added = []
    for name in names:
        before = set(architectures())
        try:
            importlib.import_module(name)
        except Exception as e:  # any failure in the user's module is theirs to see, with its line
            where = traceback.extract_tb(e.__traceback__)[-1]
            raise AotcError(
                f"--plugin {name}: importing it failed with {type(e).__name__}: {e} "
                f"({where.filename}:{where.lineno}); is its package installed or on PYTHONPATH?"
            ) from None
        new = sorted(set(architectures()) - before)
        if not new and not any(a.model_class.__module__.startswith(name) for a in architectures().values()):
            raise AotcError(
                f"--plugin {name}: imported, but it registered no architecture; decorate the model class "
                "with @aotc.register_architecture(model_types=(...)) in that module"
            )
        added += new
    return added
