"""The reference backend: the post-pass ExportedProgram, run as an FX graph.

It runs the same aten ops as eager, everywhere, and is what the other
backends are checked against.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
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

from .. import heap
from ..format import ArtifactRecord, write_atomic
from .base import HOST, Backend, CompileResult, Program, Specs, Step, Weights, joined_ranks
from .export_archive import WEIGHTS_MEMBER, read_archive
from .registry import register_backend

if TYPE_CHECKING:
    from torch.export import ExportedProgram

PROGRAM = "program.pt2"  # the ExportedProgram, saved by torch.export.save


class GraphProgram(Program):
    """One archive's graph module, deserialized from the checked bytes when first run or read:
    torch.export.load is most of an export bundle's load (0.6 s for a DeepSeek V4 block's
    program), and a run that never reaches a bucket never pays for its program."""

    label = PROGRAM

    def __init__(self, archive: "_Archive"):
        self._archive = archive

    @property
    def gm(self) -> torch.fx.GraphModule:
        return self._archive.graph_module()

    def bind(self, weights: Weights, *, rank: int = 0, world_size: int = 1) -> Step:
        joined_ranks(ExportBackend.name, rank, world_size)
        tensors = weights.tensors()  # the model's own tensors: the host runs the graph
        gm = None

        def run(args, call=0):
            nonlocal gm
            if gm is None:  # rebuilt on the first call; later calls take no lock
                gm = self.gm
            return list(gm(*tensors, *args))

        return Step(HOST, run, tensors)


def save_program(program: "ExportedProgram", f, weights: list[str]) -> None:
    """torch.export.save without the example inputs: they are fake tensors (the build
    never reads weights), which do not serialize, and running needs none. `weights`:
    which tensor each weight input is (Specs.weight_paths), kept in the archive, since
    its inputs are named flat_0, flat_1..."""
    example, program.example_inputs = program.example_inputs, None
    try:
        with _without_canonical_form_self_test(), heap.paused():  # its schema records are many, and acyclic
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
    """torch.export.load of an archive's bytes, its JSON decoded by a decoder that knows each schema type."""
    _decode_schema_once()
    with heap.paused():  # the graph's many objects all live on
        return torch.export.load(io.BytesIO(data))


@functools.cache
def _decode_schema_once() -> None:
    """torch.export.load rebuilds the program's JSON into schema objects with
    serialize._dict_to_dataclass, which resolves each value's type (its hints, fields and
    origin) again for every value it rebuilds: 2.4 s of the 12 s that a DeepSeek V4 bundle's
    18 programs took to load (pytorch#196452, open). The schema's types never change, so
    the decoder below resolves each once; it returns what torch's does
    (tests/test_export_archive.py compares the two on a program). Only where torch's
    serializer has the function this decoder was written against; else as it is."""
    from torch._export.serde import schema, serialize
    from torch.export.pt2_archive import _package

    own = getattr(serialize, "_dict_to_dataclass", None)
    if getattr(own, "__module__", None) == serialize.__name__ and hasattr(serialize, "_resolve_schema_cls") and hasattr(serialize, "_Union"):
        decode = schema_decoder(serialize, vars(schema))
        decode.__wrapped__ = own  # torch's, for the test that compares the two
        for module in (serialize, _package):  # the archive reader imported it by name
            if getattr(module, "_dict_to_dataclass", None) is own:
                module._dict_to_dataclass = decode


def schema_decoder(serialize: types.ModuleType, namespace: dict) -> typing.Callable[[typing.Any, typing.Any], typing.Any]:
    """serialize._dict_to_dataclass(cls, data), with what it learns of each type kept."""
    kinds: dict = {}

    def kind_of(cls) -> tuple:
        c = serialize._resolve_schema_cls(cls)
        if isinstance(c, str):
            raise AssertionError(f"Unresolved class type: '{c}'.")
        origin = typing.get_origin(c)
        if origin is typing.Annotated:
            return ("alias", c.__origin__)
        if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(c):
            return ("optional", typing.get_args(c))
        if isinstance(c, type) and issubclass(c, serialize._Union):
            return ("union", c, typing.get_type_hints(c, globalns=namespace))
        if dataclasses.is_dataclass(c):
            hints = typing.get_type_hints(c, globalns=namespace)
            return ("dataclass", c, tuple((f.name, hints[f.name]) for f in dataclasses.fields(c)))
        return ("plain", c)

    def decode(cls, data):
        kind = kinds.get(cls)
        if kind is None:
            kind = kinds[cls] = kind_of(cls)
        tag = kind[0]
        if tag == "dataclass":  # keys the type does not have are skipped, as torch does (forward compatibility)
            return kind[1](**{name: decode(hint, data[name]) for name, hint in kind[2] if name in data})
        if tag == "union":
            if not isinstance(data, dict) or len(data) != 1:
                raise AssertionError(f"expected a dict with 1 key, got {data!r:.80}")
            ((name, value),) = data.items()
            return kind[1].create(**{name: decode(kind[2][name], value)})
        if tag == "alias":
            return decode(kind[1], data)
        if tag == "optional":
            if data is None:
                return None
            if len(kind[1]) != 2:
                raise AssertionError(f"expected 2 type args, got {len(kind[1])}")
            return decode(kind[1][0], data)
        if isinstance(data, list):
            return [decode(typing.get_args(kind[1])[0], d) for d in data] if data else data
        if isinstance(data, dict):
            value = typing.get_args(kind[1])[1]
            return {k: decode(value, v) for k, v in data.items()}
        return float(data) if kind[1] is float else data

    return decode


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
        return GraphProgram(_read(art_dir / PROGRAM))

    def signature(self, art_dir: Path) -> list[tuple[list[int], str]]:
        return _read(art_dir / PROGRAM).inputs

    def weight_paths(self, art_dir: Path) -> list[str]:
        return _read(art_dir / PROGRAM).weights


class _Archive:
    """One export archive as this process read it: what its JSON says (checked), the bytes
    that were checked, and its graph module once loaded from those bytes."""

    def __init__(self, inputs: list[tuple[list[int], str]], weights: list[str], data: bytes):
        self.inputs, self.weights, self._data, self._gm = inputs, weights, data, None
        self.lock = threading.Lock()

    def graph_module(self) -> torch.fx.GraphModule:
        with self.lock:
            if self._gm is None:
                # Every input is a user input, so the graph module takes the flat list
                # as is; this skips ExportedProgram.module()'s pytree and state handling.
                self._gm, self._data = load_program(self._data).graph_module, None
            return self._gm


# The archives this process has checked and loaded, by the sha256 of their bytes, the most
# recently used last. A bundle loads each archive three times (its signature, its weights,
# the program: one JSON parse), and a process that opens a bundle again (a server's
# Session, a test) deserializes none of it again. Keyed by the bytes read each time, so
# what runs is always what these bytes hold. A graph module without its weights is small.
_ARCHIVES: "collections.OrderedDict[str, _Archive]" = collections.OrderedDict()
_ARCHIVES_KEPT = 256
_ARCHIVES_LOCK = threading.Lock()


def _read(path: Path) -> _Archive:
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    with _ARCHIVES_LOCK:
        archive = _ARCHIVES.get(digest)
        if archive is not None:
            _ARCHIVES.move_to_end(digest)
            return archive
    # Read as data first: torch's loader, next, unpickles and resolves names.
    archive = _Archive(*read_archive(path, data), data)
    with _ARCHIVES_LOCK:
        archive = _ARCHIVES.setdefault(digest, archive)
        while len(_ARCHIVES) > _ARCHIVES_KEPT:
            _ARCHIVES.popitem(last=False)
    return archive
