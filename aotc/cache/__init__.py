"""The compile cache: a local content-addressed store (local.py), an optional
S3 remote (remote.py), the keys (keys.py) and build recipes (recipes.py)."""

from .local import ENV, RECORD, CacheError, Entry, LocalCache, default_root, format_size, parse_size

__all__ = ["ENV", "RECORD", "CacheError", "Entry", "LocalCache", "default_root", "format_size", "parse_size"]
