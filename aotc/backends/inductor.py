"""AOTInductor: one compiled package per (entry, bucket), weights as inputs.

The traced graph takes every parameter as a user input, so the shared object
holds no weights: the runtime hands each layer's weights and cache slice to
the one package of its class. Inductor turns the functional `index_put` +
input mutation that export makes of the cache write back into an in-place
scatter on the caller's cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import re
import shutil
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import BackendError, BundleError
from ..format import ArtifactRecord
from ..parallel import settled
from .base import HOST, Backend, CompileResult, Program, Specs, Step, Weights, joined_ranks
from .registry import register_backend

if TYPE_CHECKING:
    from torch.export import ExportedProgram

PACKAGE = "model.pt2"  # the AOTInductor package (its inner folder is named after it)
# The package's metadata key that records which tensor each weight input is: its inputs
# carry no names. AOTInductor writes the metadata as JSON files in the package (one per
# compiled file), which the loader's get_metadata() reads back.
WEIGHTS_KEY = "aotc_weights"
SERIALIZATION_ID = ".data/serialization_id"
# AOTInductor appends the gcc command lines (with this machine's temp paths) to
# the sources it packages, on some code paths and not others.
_TRAILER = re.compile(rb"\n// Compile cmd\n.*\Z", re.S)


# What a fleet of mixed x86 CPUs can share: AVX2 and FMA, no AVX-512.
PORTABLE_FLAGS = "--compiler-flag cpp.march=x86-64-v3 --compiler-flag cpp.simdlen=256"


@dataclass
class InductorExtra:
    target: str  # what the code was compiled for (in the cache key)
    march: str  # CPU code: -march as g++ resolved it ("" for CUDA)
    isa: list[str]  # CPU code: the instruction-set extensions it may use; the loading CPU must have each


class PackageProgram(Program):
    label = PACKAGE

    def __init__(self, loader):
        # boxed_run takes ownership of the list it is given and skips the pytree
        # flatten/unflatten of AOTICompiledModel.__call__: the lowest-overhead call.
        self.boxed_run = loader.boxed_run

    def bind(self, weights: Weights, *, rank: int = 0, world_size: int = 1) -> Step:
        joined_ranks(InductorBackend.name, rank, world_size)
        run, tensors = self.boxed_run, weights.tensors()  # the model's own tensors, where it was put (.to(device))

        def step(args: list, call: int = 0) -> list:
            flat = tensors.copy()  # boxed_run takes the list over
            flat += args
            return run(flat)

        def ranked(args: list, call: int = 0) -> list:
            # An output may be a collective's own buffer: the graph holds the GIL, so the
            # next one must not start before gloo lets go of it (parallel.settled).
            outs = step(args)
            settled(*outs)
            return outs

        if world_size > 1:
            return Step(HOST, ranked, tensors)

        return Step(HOST, step, tensors)


def _normal(name: str) -> str:
    """An extension's name as both gcc (-msse4.2) and /proc/cpuinfo (sse4_2) spell it."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


# Extensions that gcc and the kernel name differently (normalized): without these the
# record would leave them out, and a CPU without BMI1 or SSE3 would be let load code
# that uses them.
GCC_TO_CPUINFO = {"sse3": "pni", "pclmul": "pclmulqdq", "bmi": "bmi1", "rdrnd": "rdrand", "sahf": "lahflm", "sha": "shani", "lzcnt": "abm"}


def _gcc_normal(name: str) -> str:
    """A gcc -m<extension> name as /proc/cpuinfo names it (normalized)."""
    normal = _normal(name)
    return GCC_TO_CPUINFO.get(normal, normal)


@functools.lru_cache(maxsize=None)
def host_isa() -> frozenset[str]:
    """This CPU's instruction-set extensions, from /proc/cpuinfo (normalized names); empty
    where there is no /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    flags = next((line.split(":", 1)[1] for line in lines if line.startswith("flags")), "")
    return frozenset(_normal(f) for f in flags.split())


@functools.lru_cache(maxsize=None)
def gcc_isa(march: str, *flags: str) -> tuple[str, tuple[str, ...]]:
    """(-march as g++ resolves it, the instruction-set extensions it enables) for these
    flags, by `g++ -Q --help=target` (10 ms). Kept: the extensions that this CPU's
    /proc/cpuinfo also names, so that a loading CPU can be checked against them."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise BackendError("AOTInductor compiles C++ and no g++ or c++ is on PATH; install one (e.g. apt install g++) or use --backend export")
    command = [cxx, *([f"-march={march}"] if march else []), *flags, "-Q", "--help=target"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    enabled = {_gcc_normal(m) for m in re.findall(r"^\s+-m([\w.-]+)\s+\[enabled\]", out, re.M)}
    resolved = re.search(r"^\s+-march=\s+(\S+)", out, re.M)
    return (resolved.group(1) if resolved else march or "default"), tuple(sorted(enabled & host_isa()))


def _march(config: dict) -> str:
    march = config.get("cpp.march")
    return "native" if march is None else march  # Inductor's default


def compiled_isa(config: dict) -> tuple[str, tuple[str, ...]]:
    """What the code of a compile under these Inductor configs may use: its -march and the
    vector ISA flags Inductor adds (AVX-512 or AVX2, by cpp.simdlen and the CPU). Called
    where Inductor has compiled, so its vector ISA choice is already made (a second's
    probe otherwise)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    with inductor_config.patch(config):
        vector = str(pick_vec_isa().build_arch_flags()).split()
    return gcc_isa(_march(config), *vector)


def cpu_target(config: dict) -> str:
    """What the CPU code is compiled for, in the cache key, without importing Inductor: the
    machine, the resolved -march, a digest of the extensions g++ enables for it, and the
    vector ISA that torch reports (Inductor's default choice; cpp.simdlen, which changes
    it, is in the key with the other configs)."""
    march, isa = gcc_isa(_march(config))
    digest = hashlib.sha256(" ".join(isa).encode()).hexdigest()[:12]
    return f"{platform.machine()}-{march}-isa.{digest}-{torch.backends.cpu.get_cpu_capability()}"


@register_backend
class InductorBackend(Backend):
    name = "inductor"
    collectives_in_graph = True  # compiled into the package: its C shims and proxy executor run them
    # torch 2.13's AOTInductor runs all_gather and reduce_scatter through its proxy executor,
    # which leaves them holding tensors that Python owns; gloo's worker thread then needs the
    # GIL to let go of them, while the graph holds the GIL waiting for its next collective:
    # every rank hangs (docs/parallel.md, data-parallel attention). all_reduce has a C shim.
    gathers_with = "all-reduce"
    files = (PACKAGE,)
    extra_type = InductorExtra
    compile_memory_gb = 2

    @classmethod
    def from_options(cls, device: str, flags: dict) -> "InductorBackend":
        return cls(device=device, config=flags)

    def __init__(self, device: str = "cpu", config: dict | None = None):
        if device not in ("cpu", "cuda"):
            raise BackendError(f"--device {device!r}: expected cpu or cuda")
        self.device = device
        # On the CPU a loaded package is its shared library, mapped: its files may go. CUDA
        # kernels are loaded from their files at a graph's first call.
        self.reads_files_loaded = device == "cuda"
        # The whole step's loop is measured on the CPU (bench/whole_step.py); on CUDA each
        # iteration's .item() would wait for the GPU, untried here: a graph per layer there.
        self.loops = device == "cpu"
        self.config = dict(sorted((config or {}).items()))  # Inductor configs, e.g. {"cpp.simdlen": 256}
        if self.config:
            import torch._inductor.config as inductor_config

            known = inductor_config.get_config_copy()
            for key in self.config:
                if key not in known:
                    raise BackendError(f"--compiler-flag {key}: Inductor has no such config (see torch._inductor.config)")

    def version(self) -> str:
        return f"torch-{torch.__version__}-{self.target()}"

    def target(self) -> str:
        if self.device == "cuda":
            major, minor = torch.cuda.get_device_capability()
            return f"cuda-sm{major}{minor}-{torch.version.cuda}"
        return cpu_target(self.config)

    def incompatible(self, manifest) -> str | None:
        """CPU code runs where the CPU has every extension it was compiled with; checked from
        /proc/cpuinfo, with no compiler (a host that only loads bundles has none)."""
        if self.device == "cuda":
            return super().incompatible(manifest)
        built = manifest.backend.version
        if not built.startswith(f"torch-{torch.__version__}-{platform.machine()}-"):
            return f"built with inductor {built}, this machine runs torch {torch.__version__} on {platform.machine()}"
        host = host_isa()
        if not host:  # no /proc/cpuinfo: the torch version and machine are what can be checked
            return None
        for _, art in manifest.artifacts():
            missing = sorted(set(art.extra.isa) - host)
            if missing:
                return (
                    f"its code uses {', '.join(missing)}, which this CPU lacks (compiled with -march={art.extra.march}); "
                    f"to build once for a fleet of mixed CPUs, add {PORTABLE_FLAGS}"
                )
        return None

    def can_compile(self) -> str | None:
        if self.device == "cuda":
            return self.can_load()
        if shutil.which("g++") is None and shutil.which("c++") is None:
            return "AOTInductor compiles C++ and no g++ or c++ is on PATH; install one (e.g. apt install g++) or use --backend export"
        return None

    def can_load(self) -> str | None:
        # A package is a shared object: running it needs no compiler, only the device.
        if self.device == "cuda" and not torch.cuda.is_available():
            return "--device cuda needs a CUDA GPU and a CUDA build of torch; this machine has neither"
        return None

    def flags(self) -> dict:
        return {"device": self.device, "config": self.config}

    def passes(self) -> list:
        if self.device != "cpu":
            return []  # accelerators want the matmul, and convert fp8 themselves
        # CPU code is bound by weight reads in decode.
        from ..passes.decode_fp8_bits import DecodeFp8Bits
        from ..passes.rewrite_skinny_linears import RewriteSkinnyLinears
        from ..passes.rewrite_skinny_matmuls import RewriteSkinnyMatmuls

        return [RewriteSkinnyLinears(), RewriteSkinnyMatmuls(), DecodeFp8Bits()]

    def compile(self, program: "ExportedProgram", specs: Specs, out_dir: Path) -> CompileResult:
        from torch._inductor import aoti_compile_and_package

        # Inside out_dir, which is aotc's own staging: a compile killed mid-way leaves its
        # temp folder where the next build prunes the staging, not in the system's temp.
        with tempfile.TemporaryDirectory(prefix=".aoti-", dir=out_dir) as tmp:
            raw = Path(tmp) / PACKAGE
            configs = dict(self.config)
            configs["aot_inductor.metadata"] = {**configs.get("aot_inductor.metadata", {}), WEIGHTS_KEY: json.dumps(specs.weight_paths)}
            aoti_compile_and_package(program, package_path=str(raw), inductor_configs=configs)
            normalize_package(raw, out_dir / PACKAGE)
        if self.device == "cuda":
            return CompileResult([PACKAGE], InductorExtra(self.target(), "", []))
        march, isa = compiled_isa(self.config)
        return CompileResult([PACKAGE], InductorExtra(self.target(), march, list(isa)))

    def signature(self, art_dir: Path) -> list[tuple[list[int], str]] | None:
        return package_inputs(art_dir / PACKAGE)

    def load(self, art_dir: Path, record: ArtifactRecord) -> Program:
        # aoti_load_package() first probes the compiler for the CPU's vector ISA
        # (about 0.9 s of subprocesses per process) only to log a warning on a
        # mismatch; the bundle checks its target itself (Bundle.load). Remove
        # this when the public loader stops probing. (A swapped package is refused
        # before this: Bundle.load compares signature() with the manifest.)
        # The checked package, unpacked by aotc beside it: the loader's own extraction goes to
        # a temp folder that a killed run leaves behind, and it loads an unpacked package as is.
        unpacked = art_dir / "unpacked"
        try:
            with zipfile.ZipFile(art_dir / PACKAGE) as z:
                z.extractall(unpacked)  # names with ".." or a root are kept inside (zipfile)
        except zipfile.BadZipFile as e:
            raise BundleError(f"{art_dir / PACKAGE}: not a package aotc wrote ({e}); rebuild the bundle (aotc build)") from None
        loader = torch._C._aoti.AOTIModelPackageLoader(str(unpacked), "model", True, 1, -1)
        # The record checked against the manifest (read as data, below) must be the one the
        # loader reads: were another torch to read another file, it is refused, not trusted.
        if loader.get_metadata().get(WEIGHTS_KEY) != json.dumps(self.weight_paths(art_dir)):
            raise BundleError(f"{art_dir / PACKAGE}: the loader reads another {WEIGHTS_KEY} record than the package's metadata files hold; rebuild the bundle (aotc build)")
        return PackageProgram(loader)

    def weight_paths(self, art_dir: Path) -> list[str] | None:
        try:
            with zipfile.ZipFile(art_dir / PACKAGE) as z:
                # Every metadata file must say the same: whichever the loader reads.
                recorded = {json.loads(z.read(n)).get(WEIGHTS_KEY) for n in z.namelist() if n.endswith("_metadata.json")}
            if len(recorded) > 1:
                raise BundleError(
                    f"{art_dir / PACKAGE}: its metadata files record different weights ({sorted(map(str, recorded))}); the package was altered. Rebuild the bundle (aotc build)"
                )
            paths = json.loads(recorded.pop() or "null") if recorded else None
        except (zipfile.BadZipFile, json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError) as e:
            raise BundleError(f"{art_dir / PACKAGE}: not a package aotc wrote ({type(e).__name__}: {e}); rebuild the bundle (aotc build)") from None
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise BundleError(
                f"{art_dir / PACKAGE}: its {WEIGHTS_KEY} metadata (which tensor each weight input is) is {paths!r}, not a list of weight paths; rebuild the bundle (aotc build)"
            )
        return paths


# The generated wrapper holds each input's checks (they run only under
# AOTI_RUNTIME_CHECK_INPUTS; read here as data, so calls pay nothing):
#     int32_t arg0_1_expected_dtype = aoti_torch_dtype_float32();
#     if (256 != arg0_1_size[0]) { ...
_INPUT_DTYPE = re.compile(rb"arg(\d+)_1_expected_dtype = aoti_torch_dtype_(\w+)\(\)")
_INPUT_SIZE = re.compile(rb"if \((\d+) != arg(\d+)_1_size\[(\d+)\]\)")


def package_inputs(path: Path) -> list[tuple[list[int], str]] | None:
    """The inputs a package was compiled for, read from its generated wrapper source;
    None if the source has no such checks (another torch's codegen)."""
    with zipfile.ZipFile(path) as z:
        source = b"".join(z.read(n) for n in z.namelist() if n.endswith(".wrapper.cpp"))
    dtypes = {int(i): name.decode() for i, name in _INPUT_DTYPE.findall(source)}
    if not dtypes or sorted(dtypes) != list(range(len(dtypes))):
        return None
    dims: dict[int, dict[int, int]] = {i: {} for i in dtypes}
    for size, i, d in _INPUT_SIZE.findall(source):
        dims[int(i)][int(d)] = int(size)
    shapes = {i: [found[d] for d in range(len(found))] if sorted(found) == list(range(len(found))) else None for i, found in dims.items()}
    if any(shape is None for shape in shapes.values()):
        return None
    return [(shapes[i], dtypes[i]) for i in range(len(dtypes))]


def normalize_package(src: Path, dst: Path) -> None:
    """Rewrite an AOTInductor package so the same graph always gives the same bytes.

    Two things differ between compiles of one graph: a random serialization id
    and a trailer of gcc command lines that some code paths append to the
    packaged sources. The id becomes a digest of the other entries and the
    trailer is dropped; the shared object and metadata are kept as they are.
    """
    with zipfile.ZipFile(src) as zin:
        entries = []
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith(".cpp"):
                data = _TRAILER.sub(b"\n", data)
            entries.append((info.filename, data))
    digest = hashlib.sha256()
    for name, data in entries:
        if not name.endswith(SERIALIZATION_ID):
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    ident = str(int(digest.hexdigest(), 16) % 10**40).zfill(40).encode()
    tmp = dst.with_name(dst.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            zout.writestr(info, ident if name.endswith(SERIALIZATION_ID) else data)
    tmp.replace(dst)
