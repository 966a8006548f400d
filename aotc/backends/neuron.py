"""Neuron: the xla backend's HLO compiled by neuronx-cc into a NEFF.

Beside each NEFF the artifact keeps the exact command line (`command.txt`)
and the compiler's output (`compile.log`). Where neuronx-cc is not on PATH
(any machine without the Neuron SDK), the build stops after the HLO: the
artifact is marked pending in the manifest with its command line, and
`aotc build --resume BUNDLE` on a Neuron host compiles exactly the pending
ones. NEFFs are run through the Neuron runtime's Python API (nrtpy).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import re
import shlex
import shutil
import signal
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import AotcError, BackendError
from ..format import ArtifactRecord, sha256_file
from . import xla
from .base import HOST, Attempted, Backend, Bisector, CompileResult, Program, Progress, Specs, Step, Weights, one_device, parallel_jobs, register_backend

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from ..format import Manifest

COMPILER = "neuronx-cc"
# The artifact: the xla backend's HLO files, the compiler's command line as it ran
# (for people; --resume makes its own from the typed flags), then its NEFF and output.
COMMAND, NEFF, LOG = "command.txt", "model.neff", "compile.log"
TARGETS = ("trn1", "trn2", "inf2")
AUTO_CAST = ("none", "matmult", "all")
AUTO_CAST_TYPES = ("bf16", "fp16", "tf32", "fp8_e4m3")
# trn2 reads float8_e4m3fn bytes as IEEE e4m3; aotc rescales fp8 weights to
# match (aotc/fp8.py), and this tells the compiler to accept e4m3fn graphs.
FP8_FLAG = "--internal-hlo2tensorizer-options=--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


@dataclass
class NeuronExtra:
    mutated: list[int]
    fp8: bool  # the graph has fp8 tensors: the compiler gets the fp8 flag
    lint: list[str]  # what the HLO has that the compiler's guide warns of (neuron.lint), by FX node
    pending: str | None  # why neuronx-cc did not run yet; None once compiled


@dataclass(frozen=True)
class NeuronOptions:
    target: str = "trn2"
    model_type: str = "transformer"
    optlevel: int = 2
    lnc: int | None = None  # logical NeuronCores per graph; the compiler's default when None
    auto_cast: str = "none"
    auto_cast_type: str | None = None

    def __post_init__(self):
        checks = [
            ("target", self.target, TARGETS),
            ("auto_cast", self.auto_cast, AUTO_CAST),
            ("optlevel", self.optlevel, (1, 2, 3)),
        ]
        if self.auto_cast_type is not None:
            checks.append(("auto_cast_type", self.auto_cast_type, AUTO_CAST_TYPES))
        if self.lnc is not None:
            checks.append(("lnc", self.lnc, (1, 2)))
        for name, value, allowed in checks:
            if value not in allowed:
                raise BackendError(f"--compiler-flag {name}={value!r}: expected one of {', '.join(map(str, allowed))}")


def compiler_command(options: NeuronOptions, hlo: str, neff: str, fp8: bool) -> list[str]:
    cmd = [
        COMPILER, "compile", hlo,
        "--framework", "XLA",
        "--target", options.target,
        "--model-type", options.model_type,
        f"--optlevel={options.optlevel}",
        "--auto-cast", options.auto_cast,
    ]  # fmt: skip
    if options.auto_cast_type:
        cmd += ["--auto-cast-type", options.auto_cast_type]
    if options.lnc is not None:
        cmd += ["--logical-nc-config", str(options.lnc)]
    if fp8:
        cmd.append(FP8_FLAG)
    return cmd + ["--output", neff]


# HLO opcodes as neuronx-cc's `list-operators --framework XLA` names them (its table uses
# the XLA builder's names), where they differ beyond case and punctuation.
_OPERATOR_NAMES = {
    "convert": ("convertelementtype",), "dot": ("dot", "dotgeneral"), "broadcast": ("broadcast", "broadcastindim"),
    "compare": ("compare", "eq", "ne", "lt", "le", "gt", "ge"), "constant": ("constant", "constantliteral"),
    "maximum": ("max",), "minimum": ("min",), "multiply": ("mul",), "subtract": ("sub",), "divide": ("div",),
    "power": ("pow",), "negate": ("neg",), "and": ("logicaland", "and"), "not": ("logicalnot", "not"),
    "exponential": ("exp",), "log": ("log",), "shift-right-logical": ("shiftrightlogical",),
}
_ALWAYS = {"parameter", "tuple", "get-tuple-element", "call"}  # structure, not computation


@functools.lru_cache(maxsize=None)
def listed_operators() -> frozenset[str] | None:
    """The operators `neuronx-cc list-operators --framework XLA` lists, normalized (lower
    case, letters and digits only); None where neuronx-cc is not installed."""
    if compiler_version() is None:
        return None
    out = subprocess.run([COMPILER, "list-operators", "--framework", "XLA"], capture_output=True, text=True)
    names = set()
    for line in out.stdout.splitlines():
        first = line.strip().strip("|").split("|")[0].strip()
        if first and re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", first) and not first.lower().startswith("supported"):
            names.add(re.sub(r"[^a-z0-9]", "", first.lower()))
    return frozenset(names) or None


def _listed(opcode: str, operators: frozenset[str]) -> bool:
    names = _OPERATOR_NAMES.get(opcode, ()) + (re.sub(r"[^a-z0-9]", "", opcode),)
    return opcode in _ALWAYS or any(n in operators for n in names)


def lint(hlo_proto: bytes, sources: dict[str, str] | None = None, operators: frozenset[str] | None = None) -> list[str]:
    """What an HLO module has that neuronx-cc's CLI guide warns of, one line per finding,
    naming the FX node (from the op_name metadata that xla.lower scopes by node) and,
    with `sources` (node name -> source line), where it came from:
    dynamic dimensions, f64, 64-bit integers (the guide's --native-int64 and
    --implicit-integer-downcast govern them), custom calls; with `operators` (from
    `listed_operators()`, where neuronx-cc is installed), ops it does not list."""
    from jax._src.lib import xla_client  # jaxlib's HLO binding; jax exports it only under _src

    text = xla_client.XlaComputation(hlo_proto).get_hlo_module().to_string()
    findings = []
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        if opcode in ("tuple", "get-tuple-element"):  # they only carry what their operands made
            continue
        what = []
        if "<=" in shape or "?" in shape:
            what.append(f"a dynamic dimension ({shape})")
        if "f64" in shape:
            what.append("f64, which neuronx-cc does not compute")
        if re.search(r"\b[su]64\[", shape):
            what.append(f"a 64-bit integer ({shape.split('{')[0]}); see --native-int64 / --implicit-integer-downcast")
        if opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            what.append(f"custom call {target.group(1) if target else '?'}")
        elif operators is not None and not _listed(opcode, operators):
            what.append(f"{opcode}, which neuronx-cc list-operators does not list")
        if what:
            op_name = re.search(r'op_name="[^/"]*/([^/"]+)', line)
            node = op_name.group(1) if op_name else "(no FX node)"
            where = f" at {sources[node]}" if sources and node in sources else ""
            findings.append(f"{node}{where}: {name} {opcode}: {'; '.join(what)}")
    return findings


_INSTRUCTION = re.compile(r"\s*(?:ROOT\s+)?(\S+)\s*=\s*(\S+(?:\[[^\]]*\])?(?:\{[^}]*\})?|\([^=]*?\))\s+([a-z][a-z0-9-]*)\(")


def has_fp8(gm: torch.fx.GraphModule) -> bool:
    """The graph takes fp8 inputs (stored weights, caches): the compiler needs the flag."""
    fp8 = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
    return any(n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype in fp8 for n in gm.graph.nodes)


@functools.lru_cache(maxsize=None)
def compiler_version() -> str | None:
    """neuronx-cc's version, or None where it is not on PATH."""
    if shutil.which(COMPILER) is None:
        return None
    out = subprocess.run([COMPILER, "--version"], capture_output=True, text=True)
    found = re.search(r"(\d+\.\d+[\w.+-]*)", out.stdout + out.stderr)
    return found.group(1) if found else "unknown"


def run_compiler(cmd: list[str], cwd: Path) -> None:
    """Run neuronx-cc in `cwd`, its output to compile.log; errors name the NCC code and the log."""
    log = cwd / LOG
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode == -signal.SIGKILL:
        raise BackendError(
            f"{COMPILER} was killed by signal 9, most likely for lack of memory (about {NeuronBackend.compile_memory_gb} GB per compile); "
            f"compile fewer graphs at once with --jobs N. Log: {log}"
        )
    if proc.returncode != 0:
        codes = sorted(set(re.findall(r"NCC_[A-Z0-9]+", log.read_text(errors="replace"))))
        what = f"with {', '.join(codes)}" if codes else f"with exit status {proc.returncode}"
        raise BackendError(f"{COMPILER} failed {what}; log: {log}")
    if not (cwd / NEFF).is_file():
        raise BackendError(f"{COMPILER} exited 0 but wrote no {NEFF}; log: {log}")


class HloBisector(Bisector):
    """A part of a graph lowered to HLO as the xla backend lowers it, and compiled by
    neuronx-cc with these options (or a command given in its place, with the same argv)."""

    def __init__(self, options: NeuronOptions):
        self.options = options

    def lower(self, program: "ExportedProgram", specs: Specs) -> torch.fx.GraphModule:
        return xla.decomposed(program, specs)[0]

    def attempt(self, gm: torch.fx.GraphModule, folder: Path, argv0: list[str] | None) -> Attempted:
        (folder / xla.HLO_PROTO).write_bytes(xla.hlo_of(gm))
        cmd = compiler_command(self.options, xla.HLO_PROTO, NEFF, has_fp8(gm))
        if argv0:
            cmd = argv0 + cmd[1:]
        try:
            run_compiler(cmd, folder)
            code = None
        except BackendError as e:
            found = re.search(r"NCC_[A-Z0-9]+", str(e))
            code = found.group(0) if found else re.sub(r".*failed ", "", str(e)).split(";")[0]
        return Attempted(code, cmd, xla.HLO_PROTO, LOG)


class NeffProgram(Program):
    label = NEFF

    def __init__(self, model, mutated: list[int]):
        self.model = model
        self.in_names = list(model.input_tensors_info)
        self.out_names = list(model.output_tensors_info)
        self.mutated = mutated

    def bind(self, weights: Weights, *, rank: int = 0, world_size: int = 1) -> Step:
        one_device(NeuronBackend.name, rank, world_size)
        tensors = weights.tensors()

        def step(args: list, call: int = 0) -> list:
            inputs = [*tensors, *args]
            # The HLO's parameters and results are positional, in the graph's order.
            outs = self.model({name: a.detach().cpu().numpy() for name, a in zip(self.in_names, inputs)})
            outs = [torch.from_numpy(outs[name]) for name in self.out_names]
            for position, new in zip(self.mutated, outs):
                inputs[position].copy_(new)
            return outs[len(self.mutated) :]

        return Step(HOST, step, tensors)


@register_backend
class NeuronBackend(Backend):
    name = "neuron"
    files = (xla.HLO_PROTO, xla.HLO_TEXT, COMMAND)  # + NEFF and LOG once compiled
    extra_type = NeuronExtra
    tolerance_factor = xla.XlaBackend.tolerance_factor  # the same HLO, summed in the same other order
    static_shapes = True
    views = False  # the Neuron runtime takes whole device tensors
    compile_memory_gb = 8  # neuronx-cc's peak for one decoder-layer graph, order of magnitude

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
            return (
                "running NEFFs needs the Neuron runtime's Python API (nrtpy, from the Neuron SDK, with "
                "torch-neuronx) on a Trainium or Inferentia host; it is not installed here"
            )
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
        lowered = xla.lower(program, specs)
        (out_dir / xla.HLO_PROTO).write_bytes(lowered.hlo_proto)
        (out_dir / xla.HLO_TEXT).write_text(lowered.hlo_text)
        fp8 = has_fp8(program.graph_module)
        findings = lint(lowered.hlo_proto, lowered.sources, listed_operators())
        cmd = compiler_command(self.options, xla.HLO_PROTO, NEFF, fp8)
        # For people reading the bundle; --resume rebuilds the command from the typed flags.
        (out_dir / COMMAND).write_text(shlex.join(cmd) + "\n")
        files = [xla.HLO_PROTO, xla.HLO_TEXT, COMMAND]
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
        for e, a in pending:
            progress("entry", id=f"{e.id} b{a.bucket}", total=1)

        def compile_one(item):
            e, a = item
            folder = confined(root, a.dir, f"{e.id} bucket {a.bucket}")
            run_compiler(compiler_command(self.options, xla.HLO_PROTO, NEFF, a.extra.fp8), folder)
            progress("done", id=f"{e.id} b{a.bucket}", bucket=a.bucket)

        with ThreadPoolExecutor(max_workers=jobs or parallel_jobs(len(pending), self.compile_memory_gb)) as pool:  # each compile is a subprocess
            list(pool.map(compile_one, pending))
        for e, a in pending:
            folder = root / a.dir
            for name in (NEFF, LOG):
                a.files[name] = sha256_file(folder / name)
            a.extra.pending = None
            # The artifact now depends on the compiler too.
            a.cache_key = hashlib.sha256(f"{a.cache_key}:{COMPILER}-{version}".encode()).hexdigest()
        manifest.backend.version = self.version()
        return [a for _, a in pending]

    def load(self, art_dir: Path, record: ArtifactRecord) -> Program:
        import nrtpy

        return NeffProgram(nrtpy.NrtpyModel.load_from_neff(str(art_dir / NEFF)), record.extra.mutated)

    def reference(self, art_dir: Path, record: ArtifactRecord) -> Program | None:
        return xla.hlo_reference(art_dir, record)

    def bisector(self) -> Bisector:
        return HloBisector(self.options)
