"""The reference backend: the post-pass ExportedProgram, run as an FX graph.

It runs the same aten ops as eager, everywhere, and is what the other
backends are checked against.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import io
import json
import threading
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..format import ArtifactRecord, write_atomic
from .base import HOST, Backend, CompileResult, Program, Specs, Step, Weights, joined_ranks, register_backend
from .export_archive import WEIGHTS_MEMBER, read_archive

if TYPE_CHECKING:
    from torch.export import ExportedProgram

PROGRAM = "program.pt2"  # the ExportedProgram, saved by torch.export.save


class GraphProgram(Program):
    label = PROGRAM

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm

    def bind(self, weights: Weights, *, rank: int = 0, world_size: int = 1) -> Step:
        joined_ranks(ExportBackend.name, rank, world_size)
        gm, tensors = self.gm, weights.tensors()  # the model's own tensors: the host runs the graph
        return Step(HOST, lambda args, call=0: list(gm(*tensors, *args)), tensors)


def save_program(program: "ExportedProgram", f, weights: list[str]) -> None:
    """torch.export.save without the example inputs: they are fake tensors (the build
    never reads weights), which do not serialize, and running needs none. `weights`:
    which tensor each weight input is (Specs.weight_paths), kept in the archive, since
    its inputs are named flat_0, flat_1..."""
    example, program.example_inputs = program.example_inputs, None
    try:
        with _without_canonical_form_self_test():
            torch.export.save(program, f, extra_files={WEIGHTS_MEMBER: json.dumps(weights)})
    finally:
        program.example_inputs = example


_SAVING = threading.Lock()


@contextlib.contextmanager
def _without_canonical_form_self_test():
    """torch.export.save canonicalizes the serialized program only to test that its
    canonical form is well defined, and drops the result (serialize.py: "Test canonical
    form is well defined"): a deep copy of the whole serialized graph, a third of saving a
    DeepSeek V4 layer's program. The archive's bytes are the same without it
    (test_export_archive.py). For this torch's serializer, whose `canonicalize` is a module
    name; else as it is. Remove when torch.export.save stops calling it."""
    from torch._export.serde import serialize

    own = getattr(serialize, "canonicalize", None)
    if own is None:
        yield
        return
    with _SAVING:  # the patch is process-wide: one save at a time restores what it replaced
        serialize.canonicalize = lambda ep, constants=None: ep
        try:
            yield
        finally:
            serialize.canonicalize = own


def load_program(data: bytes) -> "ExportedProgram":
    """torch.export.load of an archive's bytes, with the schema's type hints resolved once."""
    _resolve_schema_hints_once()
    return torch.export.load(io.BytesIO(data))


@functools.cache
def _resolve_schema_hints_once() -> None:
    """torch.export.load asks typing.get_type_hints for a schema class's hints once per
    serialized object it rebuilds (serialize._dict_to_dataclass): 60% of loading a
    DeepSeek V4 layer's program, 13.6 s for a 9-artifact bundle (pytorch#196452, open).
    The schema's classes never change, so their hints are looked up once each (about 5 s).
    Only where torch's serializer reads `typing` as this torch's does; else as it is."""
    from torch._export.serde import schema, serialize

    if getattr(serialize, "typing", None) is typing:
        serialize.typing = _typing_with_schema_hints(vars(schema))


def _typing_with_schema_hints(namespace: dict) -> types.ModuleType:
    """A copy of the typing module whose get_type_hints remembers its answers for lookups
    in the schema's namespace (the only ones torch's serializer makes)."""
    copy = types.ModuleType("typing")
    copy.__dict__.update(vars(typing))
    hints: dict = {}

    def get_type_hints(obj, globalns=None, localns=None, include_extras=False):
        if globalns is not namespace or localns is not None or include_extras:
            return typing.get_type_hints(obj, globalns, localns, include_extras)
        if obj not in hints:
            hints[obj] = typing.get_type_hints(obj, globalns)
        return hints[obj]

    copy.get_type_hints = get_type_hints
    return copy


@register_backend
class ExportBackend(Backend):
    name = "export"
    collectives_in_graph = True  # the FX graph calls them as eager torch does
    files = (PROGRAM,)
    reads_files_loaded = False  # the program is read into memory

    def version(self) -> str:
        return f"torch-{torch.__version__}"

    def compile(self, program: "ExportedProgram", specs: Specs, out_dir: Path) -> CompileResult:
        # Serialized in memory, written by Python: torch's file writer aborts the process on a
        # full disk, where a Python write raises an OSError that the build reports.
        buf = io.BytesIO()
        save_program(program, buf, specs.weight_paths)
        write_atomic(out_dir / PROGRAM, buf.getvalue())
        return CompileResult([PROGRAM])

    def load(self, art_dir: Path, record: ArtifactRecord) -> Program:
        archive, data = _read(art_dir / PROGRAM)
        with archive.lock:
            if archive.gm is None:
                # Every input is a user input, so the graph module takes the flat list
                # as is; this skips ExportedProgram.module()'s pytree and state handling.
                archive.gm = load_program(data).graph_module
        return GraphProgram(archive.gm)

    def signature(self, art_dir: Path) -> list[tuple[list[int], str]]:
        return _read(art_dir / PROGRAM)[0].inputs

    def weight_paths(self, art_dir: Path) -> list[str]:
        return _read(art_dir / PROGRAM)[0].weights


class _Archive:
    """One export archive as this process read it: what its JSON says (checked), and its
    graph module once loaded."""

    def __init__(self, inputs: list[tuple[list[int], str]], weights: list[str]):
        self.inputs, self.weights, self.gm = inputs, weights, None
        self.lock = threading.Lock()


# The archives this process has checked and loaded, by the sha256 of their bytes, the most
# recently used last. A bundle loads each archive three times (its signature, its weights,
# the program: one JSON parse), and a process that opens a bundle again (a server's
# Session, a test) deserializes none of it again: torch.export.load is most of a bundle's
# load (0.5 s for a DeepSeek V4 block's program). Keyed by the bytes read each time, so
# what runs is always what these bytes hold. A graph module without its weights is small.
_ARCHIVES: "collections.OrderedDict[str, _Archive]" = collections.OrderedDict()
_ARCHIVES_KEPT = 256
_ARCHIVES_LOCK = threading.Lock()


def _read(path: Path) -> tuple[_Archive, bytes]:
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    with _ARCHIVES_LOCK:
        archive = _ARCHIVES.get(digest)
        if archive is not None:
            _ARCHIVES.move_to_end(digest)
            return archive, data
    # Read as data first: torch's loader, next, unpickles and resolves names.
    archive = _Archive(*read_archive(path, data))
    with _ARCHIVES_LOCK:
        archive = _ARCHIVES.setdefault(digest, archive)
        while len(_ARCHIVES) > _ARCHIVES_KEPT:
            _ARCHIVES.popitem(last=False)
    return archive, data
