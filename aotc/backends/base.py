"""The backend contract: name, version, what it needs, compile, load, finish.

A backend imports its vendor SDK only inside its methods, so the CLI and the
other backends work on a machine without that SDK. What compiling needs
(`can_compile`) is not what loading needs (`can_load`): a deploy host runs
inductor packages without a C++ compiler, and NEFFs without JAX. This module
imports neither the tracer nor the passes, so loading a bundle does not either.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar

import torch

from ..errors import BackendError, did_you_mean
from ..format import ArtifactRecord, BackendExtra, ExportExtra

if TYPE_CHECKING:
    from ..format import Manifest
    from ..trace import TracedGraph

# A loaded artifact: takes the flat graph inputs (weights, then the method's
# arguments) and returns the flat outputs.
Runner = Callable[[list[torch.Tensor]], list[torch.Tensor]]
# progress(event, **info): "entry" (id, total) when a group of work starts, "done" (id, bucket) per item
Progress = Callable[..., None]


@dataclass
class CompileResult:
    files: list[str]  # relative to the artifact folder
    extra: BackendExtra = field(default_factory=ExportExtra)  # the backend's typed manifest record


class Backend(abc.ABC):
    name: ClassVar[str]
    # Peak memory of one compile in GB, which bounds parallel compiles (`--jobs`
    # default); None where a compile is a cheap file write, done in the build's process.
    compile_memory_gb: ClassVar[int | None] = None

    @classmethod
    def from_options(cls, device: str, flags: dict) -> "Backend":
        """The backend for `aotc build --device D --compiler-flag K=V ...`."""
        if flags:
            raise BackendError(f"--compiler-flag: the {cls.name} backend takes no compiler flags")
        if device != "cpu":
            raise BackendError(f"--device {device}: the {cls.name} backend's artifacts run on the CPU; use --backend inductor for cuda")
        return cls()

    @abc.abstractmethod
    def version(self) -> str:
        """Everything about the compiler that changes its output; goes into cache keys."""

    def can_compile(self) -> str | None:
        """None when this machine can compile with the backend, else what is missing and how to get it."""
        return None

    def can_load(self) -> str | None:
        """None when this machine can load and run the backend's artifacts, else what is missing."""
        return None

    def flags(self) -> dict:
        """Normalized compiler flags; go into cache keys and the manifest."""
        return {}

    def pass_target(self) -> str | None:
        """Which backend-specific passes run on its graphs (aotc.passes.BACKEND_PASSES)."""
        return None

    def fp8_reading(self) -> str:
        """How the target reads float8_e4m3fn bytes: "e4m3fn", or "e4m3" where it reads
        them as IEEE e4m3 (trn2), so that bind rescales fp8 weights (aotc.fp8)."""
        return "e4m3fn"

    def incompatible(self, manifest: "Manifest") -> str | None:
        """Why artifacts built as the manifest says cannot run here, or None."""
        built = manifest.backend.version
        if built != self.version():
            return f"built with {self.name} {built}, this machine has {self.version()}"
        return None

    @abc.abstractmethod
    def compile(self, graph: "TracedGraph", out_dir: Path) -> CompileResult:
        """Compile one traced graph into files under out_dir."""

    @abc.abstractmethod
    def load(self, art_dir: Path, record: ArtifactRecord) -> Runner:
        """Load one compiled artifact from its folder; `record` is its manifest record."""

    def signature(self, art_dir: Path) -> list[tuple[list[int], str]] | None:
        """The inputs (shape, dtype name) as the artifact itself records them, read as
        data before anything is loaded; Bundle.load refuses an artifact whose signature
        is not what the manifest says (swapped or mislabeled). None: it cannot tell."""
        return None

    def finish(self, bundle: Path, manifest: "Manifest", jobs: int | None, progress: Progress) -> list[ArtifactRecord]:
        """Complete the artifacts of a bundle that the build machine could not (`aotc build --resume`).

        Returns the artifacts completed; `manifest` is updated in place for the caller to write.
        """
        return []


_BACKENDS: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    _BACKENDS[cls.name] = cls
    return cls


def backend_names() -> list[str]:
    _import_builtin()
    return sorted(_BACKENDS)


def get_backend_class(name: str) -> type[Backend]:
    _import_builtin()
    if name not in _BACKENDS:
        raise BackendError(f"unknown backend {name!r}; {did_you_mean(name, _BACKENDS)}")
    return _BACKENDS[name]


def parallel_jobs(tasks: int, gb_per_job: int) -> int:
    """Processes that fit: bounded by cores, free memory and the work there is."""
    import os

    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, min(os.cpu_count() or 1, free // (gb_per_job << 30), tasks))


def get_backend(name: str, purpose: str = "compile", **options) -> Backend:
    """A backend instance that can `purpose` ("compile" or "load") on this machine."""
    backend = get_backend_class(name)(**options)
    why = backend.can_compile() if purpose == "compile" else backend.can_load()
    if why:
        verb = "compile" if purpose == "compile" else "load bundles"
        raise BackendError(f"backend {name!r} cannot {verb} here: {why}")
    return backend


def _import_builtin() -> None:
    from . import export, inductor, neuron, xla  # noqa: F401
