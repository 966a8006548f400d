"""The `aotc` command line: one module per command (aotc/cli/<command>.py), each a thin
layer over the library, on the app and helpers of aotc/cli/common.py."""

from __future__ import annotations

# Each module registers its command on import, and `aotc --help` lists them in this order.
# isort: off
from . import init, quantize, build, cache, run, serve, verify, bisect, inspect  # noqa: F401

# isort: on
from .common import app, name_value_types

name_value_types(app, init.init_app, cache.cache_app)


def main() -> None:  # pragma: no cover
    app()
