"""The backend contract: one file per backend, in two halves, each owning its artifact kind.

    compile half  compile(program, specs, out_dir) -> CompileResult
                  the post-pass ExportedProgram and the typed records of its inputs
                  and outputs (format.TensorSpec) in; files and a typed extra record out
    load half     load(art_dir, record) -> Program
                  one artifact, checked against its manifest record, ready to run

A backend declares its artifact kind beside them: the files every artifact
holds (`files`, `required_files`), its typed manifest record (`extra_type`),
its fidelity tolerance factor, whether its compiler needs static shapes, the
passes that pay off on it, and a reference runner of its own artifacts for
`aotc verify`. The manifest reader, the fidelity check, verify, bisect and the
pass pipeline read these from the registry; nothing outside `aotc/backends/`
names a backend.

A backend imports its vendor SDK only inside its methods, so the CLI and the
other backends work on a machine without that SDK. What compiling needs
(`can_compile`) is not what loading needs (`can_load`): a deploy host runs
inductor packages without a C++ compiler, and NEFFs without JAX. This module
imports neither the tracer nor the passes, so loading a bundle does not either.

The registry finds a backend by its file: backend NAME lives in
`aotc/backends/NAME.py` and registers itself with `@register_backend` when
imported. A plugin module (`--plugin`) may register one of its own.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from ..errors import BackendError
from ..format import ArtifactRecord, TensorSpec
from .registry import get_backend_class

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from ..format import Manifest

# progress(event, **info): "entry" (id, total) when a group of work starts, "done" (id, bucket; a
# build's artifacts also context, source and seconds) per item
Progress = Callable[..., None]


@dataclass
class NoExtra:
    """The extra record of a backend that needs none (the manifest's `"extra": {}`)."""


@dataclass
class Specs:
    """A graph's inputs and outputs as the manifest records them: every input in the
    order the graph takes them (weights first, kind "weight"), then the outputs."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    @property
    def weight_paths(self) -> list[str]:
        """Which tensor of the instance each weight input is (WeightSpec.key), in input
        order: what each artifact records of itself, so that a manifest or recipe whose
        weights are crossed is refused (format.crossed_weights)."""
        return [s.path for s in self.inputs if s.kind == "weight"]

    @property
    def caches(self) -> list[int]:
        """Input positions of the caches (the inputs a graph may write)."""
        return [i for i, s in enumerate(self.inputs) if s.kind == "cache"]


@dataclass
class CompileResult:
    files: list[str]  # relative to the artifact folder
    extra: Any = field(default_factory=NoExtra)  # the backend's typed manifest record (its extra_type)


class Device:
    """Where a backend's programs keep what they take and give between calls. This one is
    the host's: torch tensors as they are (export and inductor, whose code runs where
    the tensors are, a CUDA device included). A backend whose programs run elsewhere
    (JAX arrays, Neuron device tensors) has its own, with `resident` set."""

    # Values live in the device's own arrays, not torch tensors: the runtime allocates
    # caches here (DeviceBuffer), puts activations, and reads outputs back (runtime.resident).
    resident: ClassVar[bool] = False

    def place(self, weight: torch.Tensor) -> Any:
        """A weight where the programs read it, once per tensor for every program that takes it."""
        return weight

    def put(self, t: torch.Tensor, key: Any = None) -> Any:
        """A copy of a host tensor on the device. `key` names the graph input it is for, so a
        device may refill a buffer of its own for it (the Neuron runtime's write_from_numpy)."""
        return t

    def get(self, value, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host copy of a device value (of `dtype`, where the device's type stands for
        another: the Neuron runtime reports fp8 as int8)."""
        return value

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        """A zeroed cache allocation on the device."""
        return torch.zeros(shape, dtype=dtype)

    def hold(self, t: torch.Tensor) -> Any:
        """A cache allocation of the device's own holding a host tensor's values (readers
        such as aotc verify start a cache from values)."""
        return t

    # A resident device that copies between cache slots itself (copy_positions); the prefix
    # cache (runtime.prefix) needs it. Host tensors are copied by torch, on their own device.
    copies: ClassVar[bool] = False

    def copy_positions(self, buffer: "DeviceBuffer", dim: int, src: int, dst: int, n: int) -> Any:
        """A layer's cache allocation (a resident device's) with positions 0..n-1 of slot src
        (dim 0 is the slot, `dim` the positions) copied into slot dst by the device itself:
        the array that replaces buffer.value (a donated JAX array is written in place)."""
        raise NotImplementedError(f"{type(self).__name__} has no copy between cache slots")

    def copy_with(self, steps: dict[tuple[tuple[int, ...], str, int], "Step"]) -> None:
        """A backend's copy programs (Backend.slot_copies), bound here: by the allocation's
        (shape, dtype name, positions dim), each run as step.run([allocation, src, dst, n])."""
        raise NotImplementedError(f"{type(self).__name__} copies between cache slots without programs")


HOST = Device()


class DeviceBuffer:
    """A cache allocation on a resident device: one layer's (or one region of it). `value`
    is the device's array; a call that writes the cache replaces it with the array it
    returns (JAX: the donated input's own buffer)."""

    __slots__ = ("device", "value", "shape", "dtype")

    def __init__(self, device: Device, value, shape: tuple[int, ...], dtype: torch.dtype):
        self.device, self.value, self.shape, self.dtype = device, value, torch.Size(shape), dtype

    def to_host(self) -> torch.Tensor:
        """A host copy (readers such as verify and tests; never held across a call)."""
        return self.device.get(self.value, self.dtype)

    def __repr__(self):
        return f"DeviceBuffer({list(self.shape)}, {self.dtype})"


class Weights:
    """One instance's weight inputs, in the order the graphs take them, each made when a
    program first asks for it (a derived or rescaled weight is made once, and a later
    sharded bind reads only its part)."""

    def __init__(self, makers: list[Callable[[], torch.Tensor]]):
        self.makers = makers
        self.made: dict[int, torch.Tensor] = {}

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> "Weights":
        return cls([lambda t=t: t for t in tensors])

    def __len__(self) -> int:
        return len(self.makers)

    def tensor(self, i: int) -> torch.Tensor:
        if i not in self.made:
            self.made[i] = self.makers[i]()
        return self.made[i]

    def tensors(self) -> list[torch.Tensor]:
        return [self.tensor(i) for i in range(len(self.makers))]


@dataclass
class Step:
    """A program bound to one instance's weights. `run(args, call=0)` takes the method's own
    arguments in the graph's order (activations as the device's values, caches as its
    allocations) and returns the outputs as the device's values; it never takes a weight.
    `call` counts the consecutive calls of one split method call (a prompt's chunks): a
    device that writes outputs into buffers of its own keeps one set per call."""

    device: Device
    run: Callable[[list], list]
    weights: list = field(default_factory=list)  # what it took them as: the host's tensors, or the device's arrays


def one_device(backend: str, rank: int, world_size: int) -> None:
    """bind's check where a backend's bundles run on one device."""
    if world_size != 1 or rank != 0:
        raise BackendError(f"bind(rank={rank}, world_size={world_size}): {backend} bundles are built for one device; bind with rank 0 and world_size 1")


def joined_ranks(backend: str, rank: int, world_size: int) -> None:
    """bind's check where a backend's graphs hold torch.distributed collectives: one rank,
    or rank `rank` of the `world_size` ranks of the process group this process joined
    (which the graphs' collectives run on)."""
    if world_size == 1 and rank == 0:
        return
    import torch.distributed as dist

    joined = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
    if joined != (rank, world_size):
        raise BackendError(
            f"bind(rank={rank}, world_size={world_size}): this process is {'rank %d of %d' % joined if joined else 'in no process group'}; "
            f"{backend} graphs run their collectives on the process group the ranks join (aotc run starts them; aotc.parallel.join)"
        )


class Program(abc.ABC):
    """One loaded artifact: a graph of one entry at one bucket."""

    label: str  # what runs, as reports name it: the file (model.jax) or the backend

    @abc.abstractmethod
    def bind(self, weights: Weights, *, rank: int = 0, world_size: int = 1) -> Step:
        """Place the instance's weights where the program runs, once, and return the step
        that runs it on the method's arguments alone."""


class Bisector(abc.ABC):
    """How `aotc bisect` compiles one part of a graph, for backends whose compiler takes a
    graph it can be handed in parts (HLO)."""

    @abc.abstractmethod
    def lower(self, program: "ExportedProgram", specs: Specs) -> torch.fx.GraphModule:
        """The graph as the compiler sees it, whose node ranges are compiled alone."""

    @abc.abstractmethod
    def attempt(self, gm: torch.fx.GraphModule, folder: Path, argv0: list[str] | None) -> "Attempted":
        """Compile `gm` in `folder`; argv0: a command run in place of the compiler's."""


@dataclass
class Attempted:
    """One compile of a part of a graph (aotc bisect)."""

    code: str | None  # the compiler's error code (NCC_...) or "exit status N"; None when it compiled
    command: list[str]  # as run in the attempt's folder
    input: str  # the file the compiler took, in that folder
    log: str  # the compiler's output, in that folder


class Backend(abc.ABC):
    name: ClassVar[str]
    # -- the artifact kind ------------------------------------------------------
    files: ClassVar[tuple[str, ...]] = ()  # what every artifact holds; the reader requires each listed
    extra_type: ClassVar[type] = NoExtra  # the typed record of its manifest `extra` field
    # x the dtype's tolerance (runtime.check): a compiler that sums in another order than
    # eager moves logits further, and flips near-ties in a top-k inside the model sooner.
    tolerance_factor: ClassVar[float] = 1.0
    # Its compiler needs every size static: data-dependent ops are stripped first (aotc.passes).
    static_shapes: ClassVar[bool] = False
    # Its programs take a strided view of a cache (a context bucket's first positions).
    # Where not (JAX and the Neuron runtime have no strided views), a context bucket's graph
    # takes the whole layer cache and slices it itself; the manifest records that shape.
    views: ClassVar[bool] = True
    # Peak memory of one compile in GB, which bounds parallel compiles (`--jobs`
    # default); None where a compile is a cheap file write, done in the build's process.
    compile_memory_gb: ClassVar[int | None] = None
    # Its graphs may hold torch.distributed's functional collectives, run on the process
    # group the ranks join (aotc.parallel): a tensor-parallel bundle can be built with it.
    collectives_in_graph: ClassVar[bool] = False
    # How its graphs gather rows from every rank and scatter sums back (data-parallel
    # attention): "collectives" (all-gather, reduce-scatter) or "all-reduce" (rows placed
    # at their rank's block, summed) where its runtime cannot run the former safely.
    gathers_with: ClassVar[str] = "collectives"
    # Its loaded programs, or its reference runner, read the artifact's files after load:
    # where not, Bundle.load removes its checked copy of them once the programs are loaded,
    # so that a killed run leaves none behind.
    reads_files_loaded: bool = True
    # Its device copies between cache slots only through a compiled program (the Neuron
    # runtime has no device-to-device copy): the build compiles one per allocation kind
    # (builder.copies) into the bundle, and bind gives them to the device (Device.copy_with).
    slot_copies: ClassVar[bool] = False
    # Its programs run a torch.while_loop whose body indexes its inputs by the loop counter
    # (a data-dependent offset): a model's whole decode step is one graph
    # (CausalLM.whole_step_replaces), not a graph per layer.
    loops: bool = False

    @classmethod
    def from_options(cls, device: str, flags: dict) -> "Backend":
        """The backend for `aotc build --device D --compiler-flag K=V ...`."""
        if flags:
            raise BackendError(f"--compiler-flag: the {cls.name} backend takes no compiler flags")
        if device != "cpu":
            raise BackendError(f"--device {device}: the {cls.name} backend's artifacts run on the CPU; use the inductor backend for cuda")
        return cls()

    @classmethod
    def required_files(cls, extra) -> tuple[str, ...]:
        """The files an artifact with this extra record must list (its sha256 checked before load)."""
        return cls.files

    @classmethod
    def findings(cls, extra) -> list[str]:
        """What the build found in the artifact that its compiler's guide warns of (verify --strict fails on them)."""
        return []

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

    def passes(self) -> list:
        """The graph passes that pay off on this backend only, run after the common pipeline
        (aotc.passes.pipeline_for); imported when asked for, at build time."""
        return []

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

    def opening(self, manifest: "Manifest") -> None:
        """Called once per bundle, after `incompatible` and before its artifacts load (xla
        points JAX's compilation cache at the bundle's own folder)."""

    @abc.abstractmethod
    def compile(self, program: "ExportedProgram", specs: Specs, out_dir: Path) -> CompileResult:
        """Compile one post-pass program into files under out_dir."""

    @abc.abstractmethod
    def load(self, art_dir: Path, record: ArtifactRecord) -> Program:
        """Load one compiled artifact from its folder; `record` is its manifest record."""

    def device_for(self, rank: int = 0, world_size: int = 1) -> Device:
        """Where this backend's programs keep their values for one rank (one per rank and
        backend instance: the programs of a bundle share it)."""
        return HOST

    def reference(self, art_dir: Path, record: ArtifactRecord) -> Program | None:
        """A second runner of the same artifact's files, which `aotc verify` checks the loaded
        program (or, where none loads here, eager) against; None where there is none."""
        return None

    def signature(self, art_dir: Path) -> list[tuple[list[int], str]] | None:
        """The inputs (shape, dtype name) as the artifact itself records them, read as
        data before anything is loaded; Bundle.load refuses an artifact whose signature
        is not what the manifest says (swapped or mislabeled). None: it cannot tell."""
        return None

    def weight_paths(self, art_dir: Path) -> list[str] | None:
        """Which tensor each weight input is (Specs.weight_paths) as the artifact itself
        records it, read before anything is loaded; Bundle.load and a build recipe refuse
        an artifact whose record is not its entry's weights. None: it records none."""
        return None

    def bisector(self) -> Bisector | None:
        """How aotc bisect compiles parts of a graph; None where it cannot."""
        return None

    def finish(self, bundle: Path, manifest: "Manifest", jobs: int | None, progress: Progress) -> list[ArtifactRecord]:
        """Complete the artifacts of a bundle that the build machine could not (`aotc build --resume`).

        Returns the artifacts completed; `manifest` is updated in place for the caller to write.
        """
        return []


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
