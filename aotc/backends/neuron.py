"""Neuron: the xla backend's HLO compiled by neuronx-cc into a NEFF.

Beside each NEFF the artifact keeps the exact command line (`command.txt`)
and the compiler's output (`compile.log`). Where neuronx-cc is not on PATH
(any machine without the Neuron SDK), the build stops after the HLO: the
artifact is marked pending in the manifest with its command line, and
`aotc build --resume BUNDLE` on a Neuron host compiles exactly the pending
ones. NEFFs are run through the Neuron runtime's Python API (nrtpy).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import AotcError, BackendError, BundleError
from ..format import ArtifactRecord, sha256_file
from . import xla, xla_lower
from .base import Backend, Bisector, CompileResult, Device, DeviceBuffer, Program, Progress, Specs, Step, Weights, joined_ranks, parallel_jobs
from .neuronx_cc import (
    COMMAND,
    COMPILE_MEMORY_GB,
    COMPILER,
    INPUT_NAME,
    LOG,
    NEFF,
    OUTPUT_NAME,
    HloBisector,
    NeuronOptions,
    compiler_command,
    compiler_version,
    has_fp8,
    lint,
    listed_operators,
    named_hlo,
    refused,
    run_compiler,
)
from .registry import register_backend

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from ..format import Manifest


@dataclass
class NeuronExtra:
    mutated: list[int]
    fp8: bool  # the graph has fp8 tensors: the compiler gets the fp8 flag
    lint: list[str]  # what the HLO has that the compiler's guide warns of (neuron.lint), by FX node
    pending: str | None  # why neuronx-cc did not run yet; None once compiled


def neff_array(t: torch.Tensor):
    """A host tensor as the NEFF's tensors hold it: fp8 bytes as int8 (as libnrt reports
    them), bf16 as ml_dtypes', int64 as int32 (the HLO computes without x64)."""
    import ml_dtypes

    t = t.detach().contiguous()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.int8).numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.int64:
        return t.to(torch.int32).numpy()
    return t.numpy()


def host_tensor(array, dtype: torch.dtype) -> torch.Tensor:
    """A NEFF tensor's numpy copy as a torch tensor of `dtype` (the bytes reinterpreted
    where libnrt's type stands for another: int8 for fp8, int32 for int64)."""
    import numpy as np

    if dtype == torch.int64:
        return torch.from_numpy(np.ascontiguousarray(array).astype(np.int64))
    raw = torch.from_numpy(np.ascontiguousarray(array).view(np.uint8).copy())
    return raw.view(dtype).reshape(array.shape)


class Staged:
    """An activation put on the device: the staging tensor of its input, refilled with
    write_from_numpy, and the host tensor it holds as of generation `gen`."""

    __slots__ = ("slot", "gen", "host")

    def __init__(self, slot: list, gen: int, host: torch.Tensor):
        self.slot, self.gen, self.host = slot, gen, host


class Output:
    """A graph's output in a buffer of its step's own (one per call of a split method),
    written again when that step runs again: `gen` says which run wrote it."""

    __slots__ = ("slot", "gen")

    def __init__(self, slot: list, gen: int):
        self.slot, self.gen = slot, gen


# The Neuron runtime's environment for one rank of a parallel run (its configuration
# guide): the cores the process takes for itself, exclusively; the address rank 0 listens
# on for the collectives' setup; and the logical core size, which must be the one the
# NEFFs were compiled for (--logical-nc-config; trn2 defaults to 2).
VISIBLE_CORES, ROOT_COMM_ID, LOGICAL_NC = "NEURON_RT_VISIBLE_CORES", "NEURON_RT_ROOT_COMM_ID", "NEURON_LOGICAL_NC_CONFIG"
DEFAULT_LNC = {"trn2": 2}  # neuronx-cc's default --logical-nc-config per target; others have no logical cores


def visible_cores(text: str) -> list[int]:
    """NEURON_RT_VISIBLE_CORES's cores: an index, a range "A-B", or a list of them by commas."""
    cores = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cores += range(int(low), int(high or low) + 1)
    except ValueError:
        cores = []
    if not cores:
        raise BackendError(f"{VISIBLE_CORES}={text!r}: expected a NeuronCore index or a range such as 0-3")
    return cores


def rank_environment(options: NeuronOptions, rank: int, world_size: int) -> dict[str, str]:
    """The Neuron runtime's environment for rank `rank` of a parallel run, set before nrtpy
    starts (libnrt reads it once): each rank takes one core of its own, the launch's
    LOCAL_RANK-th of the cores the launch was given (all of them when none was); rank 0's
    root address comes through torch's store; the logical core size is the bundle's.
    A value the user set is kept where it fits, and refused where it cannot work."""
    from ..parallel import rank0_address

    env = {}
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    given = os.environ.get(VISIBLE_CORES)
    if given is None:
        env[VISIBLE_CORES] = str(local_rank)
    else:
        cores = visible_cores(given)
        if len(cores) > 1:  # the launch's cores, one for each local rank
            if len(cores) < local_world:
                raise BackendError(f"{VISIBLE_CORES}={given}: {len(cores)} cores for {local_world} local ranks; give each rank a core of its own")
            env[VISIBLE_CORES] = str(cores[local_rank])
    env[ROOT_COMM_ID] = os.environ.get(ROOT_COMM_ID) or rank0_address("aotc/neuron-root-comm-id")
    lnc = options.lnc or DEFAULT_LNC.get(options.target)
    if lnc is not None:
        if os.environ.get(LOGICAL_NC, str(lnc)) != str(lnc):
            raise BackendError(
                f"{LOGICAL_NC}={os.environ[LOGICAL_NC]}, but the bundle's NEFFs were compiled for logical cores of {lnc} "
                f"(--logical-nc-config {lnc}); unset it, or rebuild with --compiler-flag lnc={os.environ[LOGICAL_NC]}"
            )
        env[LOGICAL_NC] = str(lnc)
    return env


def join_cores(options: NeuronOptions, rank: int, world_size: int) -> None:
    """Set this rank's Neuron runtime environment (rank_environment), before nrtpy starts."""
    joined_ranks(NeuronBackend.name, rank, world_size)
    env = rank_environment(options, rank, world_size)
    if "nrtpy" in sys.modules:  # the runtime has read its environment already
        differs = {k: v for k, v in env.items() if os.environ.get(k) != v}
        if differs:
            raise BackendError(
                f"rank {rank} of {world_size}: nrtpy was imported before aotc set the Neuron runtime's environment "
                f"({', '.join(f'{k}={v}' for k, v in differs.items())}); set these before importing nrtpy, or let aotc import it"
            )
    os.environ.update(env)


class NeuronDevice(Device):
    """A NeuronCore through nrtpy's documented API: weights made NrtpyTensors once, caches
    allocated as NrtpyTensors and written in place by the NEFFs, activations refilled
    into staging tensors of their own (write_from_numpy), results read with numpy()."""

    resident = True

    def __init__(self, core_id: int):
        import nrtpy

        self.nrtpy, self.core_id = nrtpy, core_id
        self._placed: dict[int, tuple[torch.Tensor, object]] = {}
        self._staging: dict[tuple, list] = {}  # (key, shape, dtype) -> [NrtpyTensor, generation]
        self._copies: dict[tuple, Step] = {}  # (shape, dtype name, dim) -> the bundle's copy NEFF, bound
        self._copy_args: tuple = (None, [])  # the last copy's (src, dst, n) and their staged tensors

    # nrtpy documents no copy from one device tensor to another (from_numpy, write_from_numpy
    # and numpy only): a copy between cache slots runs a NEFF of the bundle's (builder.copies).
    @property
    def copies(self) -> bool:
        return bool(self._copies)

    def copy_with(self, steps: dict) -> None:
        self._copies.update(steps)

    def copy_positions(self, buffer: DeviceBuffer, dim: int, src: int, dst: int, n: int):
        at = (tuple(buffer.shape), str(buffer.dtype).removeprefix("torch."), dim)
        step = self._copies.get(at)
        if step is None:
            raise BundleError(f"the bundle has no copy between cache slots of {at[1]}{list(at[0])} along dim {dim} (manifest copies); rebuild it with this aotc")
        # The three indices are staged once for a copy's every layer and region; the NEFF
        # writes the allocation in place (its input aliased to its output).
        if self._copy_args[0] != (src, dst, n):
            self._copy_args = ((src, dst, n), [self.put(torch.tensor([v]), key=("copy", i)) for i, v in enumerate((src, dst, n))])
        step.run([buffer, *self._copy_args[1]])
        return buffer.value

    def place(self, weight: torch.Tensor):
        found = self._placed.get(id(weight))
        if found is None or found[0] is not weight:
            found = self._placed[id(weight)] = (weight, self.nrtpy.NrtpyTensor.from_numpy(neff_array(weight), core_id=self.core_id))
        return found[1]

    def put(self, t: torch.Tensor, key=None) -> Staged:
        array = neff_array(t)
        at = (key, array.shape, array.dtype.str)
        slot = self._staging.get(at)
        if slot is None:
            slot = self._staging[at] = [self.nrtpy.NrtpyTensor.from_numpy(array, core_id=self.core_id), 0]
        else:
            slot[0].write_from_numpy(array)
        slot[1] += 1
        return Staged(slot, slot[1], t)

    def tensor(self, value):
        """The NrtpyTensor a call takes for a value: a staged activation refilled if another has
        used its staging tensor since; an output only if its step has not run again."""
        if isinstance(value, Staged):
            if value.slot[1] != value.gen:
                value.slot[0].write_from_numpy(neff_array(value.host))
                value.slot[1] += 1
                value.gen = value.slot[1]
            return value.slot[0]
        if isinstance(value, Output):
            if value.slot[1] != value.gen:
                raise BundleError(
                    "a graph's output was used after that graph ran again (its device buffer holds the newer result); "
                    "read a bound model's outputs before its next call, or clone them"
                )
            return value.slot[0]
        return value  # a weight or a cache: an NrtpyTensor of its own

    def get(self, value, dtype: torch.dtype | None = None) -> torch.Tensor:
        tensor = self.tensor(value)
        if isinstance(value, Staged):
            dtype = value.host.dtype
        return host_tensor(tensor.numpy(), dtype or torch.float32)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype):
        # nrtpy documents no zeroed allocation: the zeros are sent once, when the cache is made.
        return self.hold(torch.zeros(shape, dtype=dtype))

    def hold(self, t: torch.Tensor):
        return self.nrtpy.NrtpyTensor.from_numpy(neff_array(t), core_id=self.core_id)


class NeffProgram(Program):
    """A NEFF run through nrtpy: loaded on the rank's NeuronCore when first bound there, its
    weights placed once per instance, its caches given as outputs too (the NEFF writes
    them in place, as the HLO's input/output aliases say), each other output written
    into a buffer of the step's own."""

    label = NEFF

    def __init__(self, backend: "NeuronBackend", neff: Path, record: ArtifactRecord):
        self.backend, self.neff, self.record = backend, neff, record
        self._models: dict[int, object] = {}  # core -> NrtpyModel

    def _model(self, device: NeuronDevice, rank: int, world_size: int, count: int):
        """The NEFF loaded on the device's core once, its `count` inputs named as aotc names them."""
        model = self._models.get(device.core_id)
        if model is None:
            # A NEFF with collectives is loaded for them (nrt_load_collectives), as rank_id
            # of world_size, on the one core this rank's process sees (rank_environment).
            model = self._models[device.core_id] = device.nrtpy.NrtpyModel.load_from_neff(
                str(self.neff), core_id=device.core_id, cc_enabled=world_size > 1, rank_id=rank, world_size=world_size
            )
            expected = {INPUT_NAME.format(i) for i in range(count)}
            if set(model.input_tensors_info) != expected:
                raise BundleError(
                    f"{self.neff}: its inputs are {sorted(model.input_tensors_info)[:4]}..., not input0..input{count - 1} as aotc "
                    "names them in the HLO (neff_input_names); rebuild the bundle with this aotc"
                )
        return model

    def bind(self, weights: Weights, *, rank: int = 0, world_size: int = 1) -> Step:
        joined_ranks(NeuronBackend.name, rank, world_size)
        device = self.backend.device_for(rank, world_size)
        model = self._model(device, rank, world_size, len(weights) + len(self.record.inputs))
        placed = [device.place(weights.tensor(i)) for i in range(len(weights))]
        names = [INPUT_NAME.format(i) for i in range(len(placed) + len(self.record.inputs))]
        mutated = self.record.extra.mutated
        written = [position - len(placed) for position in mutated]  # among the method's arguments
        outputs = [(OUTPUT_NAME.format(len(mutated) + j), tuple(o.shape), getattr(torch, o.dtype)) for j, o in enumerate(self.record.outputs)]
        buffers: dict[int, list[list]] = {}  # call -> [NrtpyTensor, generation] per output

        def slots(call: int) -> list[list]:
            if call not in buffers:
                buffers[call] = [[device.allocate(shape, dtype), 0] for _, shape, dtype in outputs]
            return buffers[call]

        slots(0)  # allocated at bind, not during the first step
        weight_inputs = dict(zip(names, placed))

        def step(args: list, call: int = 0) -> list:
            inputs = dict(weight_inputs)
            for name, a in zip(names[len(placed) :], args):
                inputs[name] = device.tensor(a.value if isinstance(a, DeviceBuffer) else a)
            given = {OUTPUT_NAME.format(j): args[at].value for j, at in enumerate(written)}  # caches, in place
            mine = slots(call)
            for (name, _, _), slot in zip(outputs, mine):
                given[name] = slot[0]
                slot[1] += 1
            model(inputs=inputs, outputs=given)
            return [Output(slot, slot[1]) for slot in mine]

        return Step(device, step, placed)


@register_backend
class NeuronBackend(Backend):
    name = "neuron"
    files = (xla_lower.HLO_PROTO, xla_lower.HLO_TEXT, COMMAND)  # + NEFF and LOG once compiled
    extra_type = NeuronExtra
    tolerance_factor = xla.XlaBackend.tolerance_factor  # the same HLO, summed in the same other order
    static_shapes = True
    views = False  # the Neuron runtime takes whole device tensors
    collectives_in_graph = True  # the xla backend's per-rank HLO collectives (xla_collectives), loaded with cc_enabled
    slot_copies = True  # NeuronDevice.copy_positions runs the bundle's copy NEFFs
    compile_memory_gb = COMPILE_MEMORY_GB

    @classmethod
    def required_files(cls, extra: NeuronExtra) -> tuple[str, ...]:
        return cls.files + (() if extra.pending else (NEFF, LOG))

    @classmethod
    def findings(cls, extra: NeuronExtra) -> list[str]:
        return list(extra.lint)

    @classmethod
    def from_options(cls, device: str, flags: dict) -> "NeuronBackend":
        if device != "cpu":
            raise BackendError(f"--device {device}: the neuron backend compiles for Trainium; leave --device out")
        return cls(**flags)

    def __init__(self, **options):
        self._devices: dict[int, NeuronDevice] = {}
        try:
            self.options = NeuronOptions(**options)
        except TypeError as e:
            known = ", ".join(NeuronOptions.__dataclass_fields__)
            raise BackendError(f"--compiler-flag: {e}; the neuron backend's flags are {known}") from None

    def version(self) -> str:
        return f"{xla.XlaBackend().version()}-neuronx-cc-{compiler_version() or 'absent'}"

    def can_compile(self) -> str | None:
        # Without neuronx-cc the build still lowers to HLO and leaves the compile pending.
        return xla.XlaBackend().can_compile()

    def can_load(self) -> str | None:
        if importlib.util.find_spec("nrtpy") is None:
            return "running NEFFs needs the Neuron runtime's Python API (nrtpy, from the Neuron SDK, with torch-neuronx) on a Trainium or Inferentia host; it is not installed here"
        return None

    def flags(self) -> dict:
        return asdict(self.options)

    def fp8_reading(self) -> str:
        return "e4m3" if self.options.target == "trn2" else "e4m3fn"

    def incompatible(self, manifest) -> str | None:
        # A NEFF needs the Neuron runtime, not the compiler that made it: run hosts
        # need not have neuronx-cc, or the build machine's version of it.
        return None

    def compile(self, program: "ExportedProgram", specs: Specs, out_dir: Path) -> CompileResult:
        lowered = xla_lower.lower(program, specs)
        proto, text = named_hlo(lowered.hlo_proto)  # the NEFF's tensor names, for the runtime to bind
        bad = refused(text)
        if bad:
            raise BackendError("the graph's HLO has what the neuron backend does not hand neuronx-cc:\n  " + "\n  ".join(bad))
        (out_dir / xla_lower.HLO_PROTO).write_bytes(proto)
        (out_dir / xla_lower.HLO_TEXT).write_text(text)
        fp8 = has_fp8(program.graph_module)
        findings = lint(proto, lowered.sources, listed_operators())
        cmd = compiler_command(self.options, xla_lower.HLO_PROTO, NEFF, fp8)
        # For people reading the bundle; --resume rebuilds the command from the typed flags.
        (out_dir / COMMAND).write_text(shlex.join(cmd) + "\n")
        files = [xla_lower.HLO_PROTO, xla_lower.HLO_TEXT, COMMAND]
        if compiler_version() is None:
            return CompileResult(files, NeuronExtra(lowered.mutated, fp8, findings, f"{COMPILER} was not on PATH on the build machine"))
        run_compiler(cmd, out_dir)
        return CompileResult(files + [NEFF, LOG], NeuronExtra(lowered.mutated, fp8, findings, None))

    def finish(self, bundle: Path, manifest: "Manifest", jobs: int | None, progress: Progress) -> list[ArtifactRecord]:
        """Run neuronx-cc on each pending artifact's HLO, with the command made from the
        manifest's typed flags (never from the bundle's command.txt), then record the NEFFs."""
        from concurrent.futures import ThreadPoolExecutor

        from ..format import confined

        pending = manifest.pending()
        if not pending:
            return []
        version = compiler_version()
        if version is None:
            raise AotcError(f"--resume {bundle}: {COMPILER} is not on PATH; run this on a host with the Neuron SDK")
        root = Path(bundle).resolve()
        for label, a in pending:
            progress("entry", id=label, total=1)

        def compile_one(item):
            label, a = item
            folder = confined(root, a.dir, label)
            run_compiler(compiler_command(self.options, xla_lower.HLO_PROTO, NEFF, a.extra.fp8), folder)
            progress("done", id=label, bucket=a.bucket)

        with ThreadPoolExecutor(max_workers=jobs or parallel_jobs(len(pending), self.compile_memory_gb)) as pool:  # each compile is a subprocess
            list(pool.map(compile_one, pending))
        for _, a in pending:
            folder = root / a.dir
            for name in (NEFF, LOG):
                a.files[name] = sha256_file(folder / name)
            a.extra.pending = None
            # The artifact now depends on the compiler too.
            a.cache_key = hashlib.sha256(f"{a.cache_key}:{COMPILER}-{version}".encode()).hexdigest()
        manifest.backend.version = self.version()
        return [a for _, a in pending]

    def load(self, art_dir: Path, record: ArtifactRecord) -> Program:
        return NeffProgram(self, art_dir / NEFF, record)

    def device_for(self, rank: int = 0, world_size: int = 1) -> Device:
        # One NeuronCore per rank: at one rank, core 0 of the process's cores; at more, each
        # rank's process sees only its own core (join_cores), again core 0.
        if rank not in self._devices:
            if world_size > 1:
                join_cores(self.options, rank, world_size)
            self._devices[rank] = NeuronDevice(0)
        return self._devices[rank]

    def reference(self, art_dir: Path, record: ArtifactRecord) -> Program | None:
        return xla.hlo_reference(art_dir, record)

    def bisector(self) -> Bisector:
        return HloBisector(self.options)
