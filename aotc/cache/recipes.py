"""Build recipes: warm rebuilds without tracing.

Once a build has finished, its manifest is kept in the cache under the build's
recipe key (aotc/cache/keys.py). A rebuild with the same recipe whose
artifacts are all still cached assembles the bundle from it without loading
torch's tracer: a second or two instead of a trace per graph.

    <cache root>/builds/<recipe key>.json   a Manifest
"""

from __future__ import annotations

from pathlib import Path

from ..format import Manifest, artifact_dir, encode, is_file_name, parse_manifest, write_atomic
from .local import CacheError, Entry, LocalCache


def recipe_file(cache: LocalCache, recipe: str) -> Path:
    return cache.root / "builds" / f"{recipe}.json"


def save_recipe(cache: LocalCache, recipe: str, manifest: Manifest) -> None:
    cache.claim()
    file = recipe_file(cache, recipe)
    file.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(file, encode(manifest))


def load_recipe(cache: LocalCache, recipe: str) -> tuple[Manifest, dict[str, Entry]] | None:
    """The recipe's manifest and every artifact's cache entry; None unless all are there."""
    file = recipe_file(cache, recipe)
    if not cache.made_by_aotc() or not file.is_file():
        return None
    # A corrupt recipe raises CacheError: the build reports it as a miss and goes the normal way.
    manifest = parse_manifest(file.read_bytes(), str(file), CacheError)
    entries = {}
    # The copies' folders are checked by the reader (format.copy_dir).
    folders = [(is_file_name(e.id) and art.dir == artifact_dir(e.id, art.bucket, art.context), art) for e, art in manifest.artifacts()]
    for ours, art in folders + [(True, c.artifact) for c in manifest.copies]:
        if not ours or not all(map(is_file_name, art.files)):
            # Not a folder aotc would write: a corrupt recipe is a miss, never followed.
            return None
        try:
            entry = cache.get(art.cache_key)
        except CacheError:
            return None  # a corrupt entry: the normal build reports it and compiles again
        if entry is None:
            return None  # pruned since: build the normal way
        entries[art.cache_key] = entry
    return manifest, entries


def served_by(cache: LocalCache) -> dict[str, set[tuple[str, str, str]]]:
    """What each cache key was compiled for, as the finished builds' recipes record it:
    key -> {(model: its Hub id or folder name, artifact label, backend)}. A corrupt recipe
    is left out; a key no finished build used (a --shard build, a killed one) has none."""
    served: dict[str, set[tuple[str, str, str]]] = {}
    if not cache.made_by_aotc():
        return served
    for file in sorted((cache.root / "builds").glob("*.json")):
        try:
            manifest = parse_manifest(file.read_bytes(), str(file), CacheError)
        except (CacheError, OSError):
            continue
        model = manifest.model.hub.repo_id if manifest.model.hub else Path(manifest.model.source).name
        for label, art in manifest.compiled():
            served.setdefault(art.cache_key, set()).add((model, label, manifest.backend.name))
    return served
