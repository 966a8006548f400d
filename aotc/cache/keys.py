"""Cache keys: what determines the compiled code, and nothing else (DESIGN.md, Cache key).

An artifact's key hashes the graph after passes, its input and output
metadata, the backend with its version and normalized flags, and torch's
version: never paths, hostnames, timestamps or weight values. A recipe key
hashes what a whole build's graphs are made from, so a rebuild can be served
without tracing (aotc/cache/recipes.py).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from .. import __version__
from ..format import FORMAT_VERSION

if TYPE_CHECKING:
    from ..backends import Backend
    from ..builder.options import BuildOptions
    from ..trace import TracedGraph


def cache_key(graph: "TracedGraph", backend: "Backend", version: str | None = None, code: dict | None = None) -> str:
    """`version`: the backend version to key with (default: this machine's; a re-trace
    keys with the version the bundle was built with, to compare graphs). `code`: the
    model's CausalLM.code_identity, where its code is another package's (empty for aotc's
    own models)."""
    payload = {
        "format": FORMAT_VERSION,
        "graph": graph.graph_module.code,
        # A while_loop's condition and body are graphs of their own, which the code above only names.
        "subgraphs": {name: sub.code for name, sub in graph.graph_module.named_modules() if name and isinstance(sub, torch.fx.GraphModule)},
        # A weight input's path (inside the instance, never a file's) is in the artifact (it
        # records which tensor each weight input is), so graphs that differ only there differ.
        "inputs": [(i.kind, i.shape, i.dtype, i.stride, i.pad, i.path) for i in graph.inputs],
        "outputs": [(o.shape, o.dtype) for o in graph.outputs],
        "backend": backend.name,
        "backend_version": backend.version() if version is None else version,
        "flags": backend.flags(),
        "torch": torch.__version__,
    }
    variant = getattr(graph, "variant", None)
    if variant is not None and variant.layout.world_size > 1:  # the parallel layout; never the rank
        payload["parallel"] = [msgspec.to_builtins(variant.layout), msgspec.to_builtins(variant.shards)]
    if code:  # a model whose code is another package's (transformers): CausalLM.code_identity
        payload["code"] = code
    return _digest(payload)


def build_key(keys: list[tuple]) -> str:
    """One key for a whole build from its (entry, bucket, context, key) tuples."""
    return hashlib.sha256(json.dumps(keys).encode()).hexdigest()


def recipe_key(options: "BuildOptions", config: dict, model_class: type, backend: "Backend") -> str:
    """config.json, the checkpoint's tensors (names, shapes, dtypes: a re-quantized
    checkpoint with the same config.json makes other graphs), the build options, the
    backend, torch and Python, and the source of aotc and of the model's package."""
    from ..models.checkpoint import Checkpoint

    tensors = sorted((t.name, t.shape, str(t.dtype)) for t in Checkpoint(options.model_dir).tensors.values())
    payload = {
        "format": FORMAT_VERSION,
        "aotc": __version__,
        "config": config,
        "tensors": hashlib.sha256(json.dumps(tensors).encode()).hexdigest(),
        "batch": options.batch_buckets,
        "chunk": options.chunk_buckets,
        "first": options.first_chunk_buckets,
        "max_seq": options.max_seq,
        "context": options.context_buckets,
        "kv_cache": options.kv_cache(backend),
        "modeling": options.modeling,
        "tensor_parallel": options.tensor_parallel,
        "expert_parallel": options.expert_parallel,
        "attention": options.layout.attention,
        "code": model_class.code_identity(config) if hasattr(model_class, "code_identity") else {},
        "backend": [backend.name, backend.version(), backend.flags(), [p.name for p in backend.passes()]],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "sources": _source_digest(Path(__file__).parent.parent) + _source_digest(_package_dir(model_class)),
    }
    return _digest(payload)


def _digest(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _package_dir(cls: type) -> Path:
    top = cls.__module__.split(".")[0]
    return Path(importlib.import_module(top).__file__).parent


@functools.lru_cache(maxsize=None)
def _source_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(folder.rglob("*.py")):
        h.update(file.relative_to(folder).as_posix().encode() + b"\0" + file.read_bytes())
    return h.hexdigest()
