"""Models and backends that live in the user's own package: `--plugin PACKAGE.MODULE`.

Importing the module must register at least one architecture
(`aotc.register_architecture`) or backend (`aotc.backends.register_backend`);
bundles record their plugins, and running one needs them named again.
"""

from __future__ import annotations

import importlib
import traceback

from .backends.registry import registered_backends
from .errors import AotcError
from .models.loader import architectures


def load_plugins(names: list[str] | tuple[str, ...]) -> list[str]:
    """Import each plugin module; returns the architecture and backend names each added."""
    added = []
    for name in names:
        before = set(architectures()) | set(registered_backends())
        try:
            importlib.import_module(name)
        except Exception as e:  # any failure in the user's module is theirs to see, with its line
            where = traceback.extract_tb(e.__traceback__)[-1]
            raise AotcError(
                f"--plugin {name}: importing it failed with {type(e).__name__}: {e} ({where.filename}:{where.lineno}); is its package installed or on PYTHONPATH?"
            ) from None
        new = sorted((set(architectures()) | set(registered_backends())) - before)
        ours = [a.model_class for a in architectures().values()] + list(registered_backends().values())
        if not new and not any(cls.__module__.startswith(name) for cls in ours):
            raise AotcError(
                f"--plugin {name}: imported, but it registered no architecture or backend; decorate the model class "
                "with @aotc.register_architecture(model_types=(...)), or the backend class with "
                "@aotc.backends.register_backend, in that module"
            )
        added += new
    return added
