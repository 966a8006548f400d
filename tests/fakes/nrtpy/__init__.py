"""A test double of nrtpy, the Neuron runtime's Python API, put on sys.path by the tests
that simulate a Neuron host on the CPU. It implements exactly the documented API
(Neuron SDK docs, "nrtpy model API" and "nrtpy tensor API") and refuses what the
real one refuses:

    NrtpyTensor.from_numpy(array, name=None, core_id=0)   allocate on the device, copy once
    NrtpyTensor.write_from_numpy(array)                   refill; ValueError on another byte size
    NrtpyTensor.numpy()                                   a host copy
    NrtpyModel.load_from_neff(neff_path, name=None, core_id=0, cc_enabled=False, rank_id=0, world_size=1)
    NrtpyModel.input_tensors_info / output_tensors_info   name -> TensorMetadata(shape, size, dtype)
    NrtpyModel(inputs={name: NrtpyTensor}, outputs=None | {name: NrtpyTensor})
        outputs None: allocated and returned; given: written into them, returns None.
        An unknown name is a ValueError naming the expected ones; a tensor of another
        shape, dtype or core an AssertionError; an input that is not an NrtpyTensor (a
        numpy array) fails as the real one does, reading its tensor_ref; a missing input
        or output is an NrtError from execution.
    float8 tensors are reported as int8, as libnrt reports them.

Cores and collectives, as the Neuron runtime's guides say (configuration guide,
developer guide, nrtpy model API):
    The runtime starts once per process, at its first load or tensor: it takes the cores
    NEURON_RT_VISIBLE_CORES names (an index, a range A-B, or a list; all of the host's
    when unset) for this process alone, and core_id counts within them. The simulated
    host has $NRTPY_SIM_CORES cores (8), and where $NRTPY_SIM_HOST names a folder the
    processes that share it are one host: a core another process took is refused (a
    lock file per core). A NEFF compiled for a logical core size other than
    NEURON_LOGICAL_NC_CONFIG is refused.
    A NEFF whose HLO holds collectives loads only with cc_enabled (nrt_load_collectives),
    as rank_id of world_size > 1, with NEURON_RT_ROOT_COMM_ID naming rank 0's address,
    and replica groups within range(world_size). The first such load joins the world:
    jax.distributed with the root as coordinator; the HLO is then compiled for
    world_size replicas and each process runs its own, so the collectives really reach
    the other ranks. cc_enabled on a NEFF without collectives loads it as usual.
    Where $NRTPY_SIM_LOG is set, each process appends what it loaded and ran to
    $NRTPY_SIM_LOG.rank<rank_id> (JSON lines).

A NEFF here is what tests/fakes/neuronx-cc writes: a header line, then the HLO module
it was given. Executing one runs that HLO on XLA's CPU client. Tensor names are the
HLO's `neff_input_names` / `neff_output_names` frontend attributes, as neuronx-cc
takes them. With the compiler's fp8 flag for trn2, fp8 bytes are read as IEEE e4m3,
as trn2 reads them. The device is host memory, and `nrtpy._double.COUNTERS` counts
the bytes that cross: host -> device (from_numpy, write_from_numpy) and
device -> host (numpy()), per tensor, and per execution.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _double
from ._double import COUNTERS

MAGIC = b"NEFF-test-double\n"


class NrtpyError(RuntimeError):
    """nrtpy-level errors (a freed tensor, configure while active)."""


class NrtError(RuntimeError):
    """libnrt errors, with the status name and code."""


@dataclass
class TensorMetadata:
    shape: list[int]
    size: int  # bytes
    dtype: str


class _Runtime:
    """The process's libnrt: started once, with the cores it took for itself."""

    def __init__(self):
        host_cores = int(os.environ.get("NRTPY_SIM_CORES", "8"))
        given = os.environ.get("NEURON_RT_VISIBLE_CORES")
        self.cores = list(range(host_cores)) if given is None else _cores(given)
        if any(c >= host_cores for c in self.cores):
            raise NrtError(f"NRT Error NRT_INVALID(2): NEURON_RT_VISIBLE_CORES={given}: the host has {host_cores} NeuronCores")
        self._locks = []
        host = os.environ.get("NRTPY_SIM_HOST")
        for core in self.cores if host else ():
            f = open(Path(host) / f"core{core}.lock", "a")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise NrtError(f"NRT Error NRT_RESOURCE(4): NeuronCore {core} is in use by another process (Requested: {self.cores})") from None
            self._locks.append(f)

    def core(self, core_id: int) -> int:
        if not 0 <= core_id < len(self.cores):
            raise NrtError(f"NRT Error NRT_INVALID(2): core_id {core_id}: this process has {len(self.cores)} NeuronCores (NEURON_RT_VISIBLE_CORES)")
        return core_id


def _cores(text: str) -> list[int]:
    cores = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        cores += range(int(low), int(high or low) + 1)
    return cores


_STARTED: list = []


def _runtime() -> _Runtime:
    if not _STARTED:
        _STARTED.append(_Runtime())
    return _STARTED[0]


_COLLECTIVE = re.compile(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(.*")


def _collectives(text: str) -> list[tuple[str, list[int]]]:
    """Each collective of an HLO module's text: its opcode and the ranks its replica groups name."""
    found = []
    for m in _COLLECTIVE.finditer(text):
        line = m.group(0)
        groups = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)?\}", line)
        iota = re.search(r"replica_groups=\[[\d,]+\]<=\[(\d+)\]", line)
        ranks = [int(r) for r in re.findall(r"\d+", groups.group(1) or "")] if groups else list(range(int(iota.group(1)))) if iota else []
        found.append((m.group(1), ranks))
    return found


class NrtTensor:
    """The low-level device tensor an NrtpyTensor refers to."""

    def __init__(self, data: np.ndarray, core_id: int, name: str | None):
        self.data, self.core_id, self.name = data, core_id, name or "unnamed_tensor"
        self.size = data.nbytes


class NrtpyTensor:
    def __init__(self, tensor_ref: NrtTensor, shape, dtype, name: str | None = None):
        self.tensor_ref = tensor_ref
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.dtype = np.dtype(dtype)
        self.name = name

    @classmethod
    def from_numpy(cls, array: np.ndarray, name: str | None = None, core_id: int = 0) -> "NrtpyTensor":
        array = np.ascontiguousarray(array)
        ref = NrtTensor(array.copy(), _runtime().core(core_id), name)
        tensor = cls(ref, array.shape, array.dtype, name)
        COUNTERS.sent(tensor, array.nbytes)
        return tensor

    def write_from_numpy(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        expected = int(np.prod(self.shape)) * self.dtype.itemsize
        if array.nbytes != expected:
            raise ValueError(f"Size mismatch: source {array.nbytes} bytes, target {expected} bytes")
        self.tensor_ref.data = array.view(np.uint8).reshape(-1).copy().view(self.dtype).reshape(self.shape)
        COUNTERS.sent(self, array.nbytes)

    def numpy(self) -> np.ndarray:
        out = self.tensor_ref.data.copy()
        COUNTERS.received(self, out.nbytes)
        return out

    def __repr__(self):
        return f"NrtpyTensor(shape={self.shape}, dtype={self.dtype}, name={self.name})"


# HLO element types as libnrt reports them (fp8 as int8).
_REPORTED = {
    "f32": "float32", "bf16": "bfloat16", "f16": "float16", "s32": "int32", "s64": "int64", "u8": "uint8", "s8": "int8",
    "pred": "uint8", "f8e4m3fn": "int8", "f8e5m2": "int8", "u32": "uint32", "s16": "int16", "u16": "uint16",
}  # fmt: skip
_PARAM = re.compile(r"^\s*(\S+) = (\w+)\[([\d,]*)\][^ ]* parameter\((\d+)\)(.*)$")


class NrtpyModel:
    def __init__(self, name: str, neff_path: Path, core_id: int, header: dict, hlo: bytes, world: tuple[bool, int, int]):
        self.name, self.neff_path, self.core_id = name, neff_path, core_id
        self._fp8_as_e4m3 = header.get("fp8_as_e4m3", False)
        text = _hlo_text(hlo)
        entry = text[text.index("\nENTRY") :]
        params = {}
        for line in entry.splitlines():
            m = _PARAM.match(line)
            if m:
                _, etype, dims, number, rest = m.groups()
                named = re.search(r'neff_input_names="([^"]+)"', rest)
                params[int(number)] = (named.group(1) if named else m.group(1), etype, [int(d) for d in dims.split(",") if d])
        root = next(line for line in entry.splitlines() if line.lstrip().startswith("ROOT "))
        results = re.findall(r"(\w+)\[([\d,]*)\]", root.split("=", 1)[1].split(" tuple(")[0] if " tuple(" in root else root.split("=", 1)[1].split(")")[0])
        named = re.search(r'neff_output_names="([^"]+)"', root)
        out_names = named.group(1).split(",") if named else [f"output{i}" for i in range(len(results))]
        self._inputs = [params[i] for i in range(len(params))]
        self._outputs = [(n, etype, [int(d) for d in dims.split(",") if d]) for n, (etype, dims) in zip(out_names, results)]
        self.input_tensors_info = {n: _metadata(e, s) for n, e, s in self._inputs}
        self.output_tensors_info = {n: _metadata(e, s) for n, e, s in self._outputs}
        cc_enabled, rank_id, world_size = world
        collectives = _collectives(text)
        if collectives and not cc_enabled:
            raise NrtError(f"NRT Error NRT_INVALID(2): Failed to load model: {neff_path} holds collectives ({collectives[0][0]}); load it with cc_enabled")
        if cc_enabled:
            if world_size < 2 or not 0 <= rank_id < world_size:
                raise NrtError(f"NRT Error NRT_INVALID(2): Failed to load collectives: rank_id {rank_id} of world_size {world_size}")
            root = os.environ.get("NEURON_RT_ROOT_COMM_ID")
            if not root:
                raise NrtError("NRT Error NRT_INVALID(2): Failed to load collectives: NEURON_RT_ROOT_COMM_ID is not set (rank 0's ip:port)")
            outside = sorted({r for _, ranks in collectives for r in ranks if r >= world_size})
            if outside:
                raise NrtError(f"NRT Error NRT_INVALID(2): Failed to load collectives: replica groups name ranks {outside} outside world_size {world_size}")
            if collectives:
                _double.join(root, world_size, rank_id)
        self._rank = rank_id
        self._executable = _double.compile_hlo(hlo, world_size if collectives else 1)
        _log(rank_id, event="load", neff=str(neff_path), core_id=core_id, visible=os.environ.get("NEURON_RT_VISIBLE_CORES"),
             cc_enabled=cc_enabled, rank_id=rank_id, world_size=world_size, replicas=world_size if collectives else 1,
             collectives=[op for op, _ in collectives])  # fmt: skip

    @classmethod
    def load_from_neff(cls, neff_path, name=None, core_id=0, cc_enabled=False, rank_id=0, world_size=1) -> "NrtpyModel":
        path = Path(neff_path)
        try:
            data = path.read_bytes()
        except OSError:
            raise NrtError("NRT Error NRT_FAILURE(1): Failed to load model") from None
        if not data.startswith(MAGIC):
            raise NrtError("NRT Error NRT_FAILURE(1): Failed to load model")
        header, hlo = data[len(MAGIC) :].split(b"\n", 1)
        header = json.loads(header)
        core_id = _runtime().core(core_id)
        lnc = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
        if lnc is not None and header.get("lnc") is not None and int(lnc) != header["lnc"]:
            raise NrtError(f"NRT Error NRT_INVALID(2): Failed to load model: compiled for logical NeuronCore size {header['lnc']}, NEURON_LOGICAL_NC_CONFIG={lnc}")
        return cls(name or path.stem, path, core_id, header, hlo, (cc_enabled, rank_id, world_size))

    def __call__(self, inputs, outputs=None, save_trace=False, ntff_name=None):
        self._validate(inputs, self.input_tensors_info, "input")
        if outputs is not None:
            self._validate(outputs, self.output_tensors_info, "output")
        missing = [n for n in self.input_tensors_info if n not in inputs]
        if missing:
            raise NrtError(f"NRT Error NRT_INVALID(2): Failed to execute model: no tensor for input {missing[0]}")
        args = [self._as_hlo(inputs[n].tensor_ref.data, etype) for n, etype, _ in self._inputs]
        results = _double.execute(self._executable, args)
        COUNTERS.executed()
        _log(self._rank, event="execute", neff=str(self.neff_path))
        if outputs is None:
            return {n: NrtpyTensor.from_numpy(_reported(r, e), name=n, core_id=self.core_id) for (n, e, _), r in zip(self._outputs, results)}
        missing = [n for n in self.output_tensors_info if n not in outputs]
        if missing:
            raise NrtError(f"NRT Error NRT_INVALID(2): Failed to execute model: no tensor for output {missing[0]}")
        for (n, e, _), r in zip(self._outputs, results):  # written on the device: nothing crosses
            outputs[n].tensor_ref.data = _reported(r, e).reshape(outputs[n].shape)
        return None

    def _validate(self, given: dict, info: dict, what: str) -> None:
        unknown = sorted(set(given) - set(info))
        if unknown:
            raise ValueError(f"Unknown {what}(s) {set(unknown)} for model '{self.name}'. Expected {what}s: {list(info)}")
        for k, v in given.items():
            ref = v.tensor_ref  # a numpy array has none: AttributeError, as in the real runtime
            assert ref.core_id == self.core_id, f"{what.capitalize()} {k}: expected model and tensor on the same core, model on {self.core_id}, tensor on {ref.core_id}"
            assert v.shape == tuple(info[k].shape), f"{what.capitalize()} {k}: expected shape {tuple(info[k].shape)}, got {v.shape}"
            dtype = "int8" if v.dtype.name in ("float8_e4m3", "float8_e5m2") else v.dtype.name
            assert dtype == info[k].dtype, f"{what.capitalize()} {k}: expected dtype {info[k].dtype}, got {v.dtype.name}"

    def _as_hlo(self, data: np.ndarray, etype: str) -> np.ndarray:
        """A device tensor's bytes as the HLO parameter's type; fp8 read as the target reads it."""
        import ml_dtypes

        if etype == "f8e4m3fn":
            raw = data.view(np.uint8)
            if self._fp8_as_e4m3:  # trn2: the bytes are IEEE e4m3 (max 240, exponent 15 is inf/nan)
                return raw.view(ml_dtypes.float8_e4m3).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            return raw.view(ml_dtypes.float8_e4m3fn)
        if etype == "bf16":
            return data.view(ml_dtypes.bfloat16)
        return data


def _log(rank: int, **event) -> None:
    log = os.environ.get("NRTPY_SIM_LOG")
    if log:
        with open(f"{log}.rank{rank}", "a") as f:
            f.write(json.dumps(event) + "\n")


def _metadata(etype: str, shape: list[int]) -> TensorMetadata:
    import ml_dtypes

    reported = _REPORTED[etype]
    itemsize = np.dtype(ml_dtypes.bfloat16).itemsize if reported == "bfloat16" else np.dtype(reported).itemsize
    return TensorMetadata(list(shape), int(np.prod(shape, dtype=np.int64)) * itemsize, reported)


def _reported(result: np.ndarray, etype: str) -> np.ndarray:
    return result.view(np.int8) if etype.startswith("f8") else result


def _hlo_text(hlo: bytes) -> str:
    from jax._src.lib import xla_client

    return xla_client.XlaComputation(hlo).as_hlo_text()


def get_nrtpy_singleton():
    return _double.RUNTIME
