"""neuronx-cc, as the neuron backend and aotc bisect run it: its options and command line,
the operators it lists and what aotc's lint finds in an HLO against them, what it refuses,
its version, a run of it, the HLO's tensor names as the NEFF takes them, and the bisector
that shrinks a failing graph with it."""

from __future__ import annotations

import functools
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import BackendError
from . import xla_lower
from .base import Attempted, Bisector, Specs

if TYPE_CHECKING:
    from torch.export import ExportedProgram


COMPILER = "neuronx-cc"
COMPILE_MEMORY_GB = 8  # neuronx-cc's peak for one decoder-layer graph, order of magnitude
# The artifact: the xla backend's HLO files, the compiler's command line as it ran
# (for people; --resume makes its own from the typed flags), then its NEFF and output.
COMMAND, NEFF, LOG = "command.txt", "model.neff", "compile.log"
TARGETS = ("trn1", "trn2", "inf2")
AUTO_CAST = ("none", "matmult", "all")
AUTO_CAST_TYPES = ("bf16", "fp16", "tf32", "fp8_e4m3")
# trn2 reads float8_e4m3fn bytes as IEEE e4m3; aotc rescales fp8 weights to
# match (aotc/fp8.py), and this tells the compiler to accept e4m3fn graphs.
FP8_FLAG = "--internal-hlo2tensorizer-options=--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


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
    "convert": ("convertelementtype",),
    "dot": ("dot", "dotgeneral"),
    "broadcast": ("broadcast", "broadcastindim"),
    "compare": ("compare", "eq", "ne", "lt", "le", "gt", "ge"),
    "constant": ("constant", "constantliteral"),
    "maximum": ("max",),
    "minimum": ("min",),
    "multiply": ("mul",),
    "subtract": ("sub",),
    "divide": ("div",),
    "power": ("pow",),
    "negate": ("neg",),
    "and": ("logicaland", "and"),
    "not": ("logicalnot", "not"),
    "exponential": ("exp",),
    "log": ("log",),
    "shift-right-logical": ("shiftrightlogical",),
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
    for line, name, shape, opcode in _instructions(text):
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
            node = _node(line)
            where = f" at {sources[node]}" if sources and node in sources else ""
            findings.append(f"{node}{where}: {name} {opcode}: {'; '.join(what)}")
    return findings


def _instructions(text: str):
    """(line, name, shape, opcode) of each instruction of an HLO module's text."""
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            yield (line, *m.groups())


def _node(line: str) -> str:
    """The FX node an instruction came from (the op_name metadata that xla.lower scopes by node)."""
    op_name = re.search(r'op_name="[^/"]*/([^/"]+)', line)
    return op_name.group(1) if op_name else "(no FX node)"


# What neuronx-cc refuses in a module's collectives, or what would compile to something
# other than one rank's module: all-reduce and reduce-scatter reduce in f32 on Neuron and
# reject integer operands (NCC_EVRF061, NCC_EVRF063); a channel id, global device ids and
# Shardy's custom calls are JAX's global-view form, not the per-rank form NxD and nkipy
# hand the compiler (aotc lowers collectives in that form: backends/xla_collectives.py).
_REDUCING = ("all-reduce", "reduce-scatter")


def refused(hlo_text: str) -> list[str]:
    """The instructions of an HLO module (text) that the neuron backend does not hand
    neuronx-cc, each with why; empty where there are none."""
    found = []
    for line, name, shape, opcode in _instructions(hlo_text):
        why = []
        if opcode in _REDUCING and re.match(r"\(?[su]\d+\[", shape):
            why.append(f"an integer {opcode} ({shape.split('{')[0]}), which neuronx-cc refuses: it reduces in f32 (NCC_EVRF061/063)")
        if "channel_id=" in line or "use_global_device_ids=true" in line:
            why.append("a channel id or global device ids: JAX's global-view form, not one rank's module")
        if opcode == "custom-call" and 'custom_call_target="xla.sdy' in line:
            why.append("a Shardy custom call: JAX's global-view form, not one rank's module")
        if why:
            found.append(f"{_node(line)}: {name} {opcode}: {'; '.join(why)}")
    return found


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
            f"{COMPILER} was killed by signal 9, most likely for lack of memory (about {COMPILE_MEMORY_GB} GB per compile); compile fewer graphs at once with --jobs N. Log: {log}"
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
        return xla_lower.decomposed(program, specs)[0]

    def attempt(self, gm: torch.fx.GraphModule, folder: Path, argv0: list[str] | None) -> Attempted:
        (folder / xla_lower.HLO_PROTO).write_bytes(xla_lower.hlo_of(gm))
        cmd = compiler_command(self.options, xla_lower.HLO_PROTO, NEFF, has_fp8(gm))
        if argv0:
            cmd = argv0 + cmd[1:]
        try:
            run_compiler(cmd, folder)
            code = None
        except BackendError as e:
            found = re.search(r"NCC_[A-Z0-9]+", str(e))
            code = found.group(0) if found else re.sub(r".*failed ", "", str(e)).split(";")[0]
        return Attempted(code, cmd, xla_lower.HLO_PROTO, LOG)


# The NEFF's tensor names: neuronx-cc takes them from the HLO's frontend attributes
# (`neff_input_names` on each entry parameter, `neff_output_names` on the root), which
# the neuron backend writes as torch-neuronx does (named_hlo).
INPUT_NAME, OUTPUT_NAME = "input{}", "output{}"
_ENTRY_PARAMETER = re.compile(r"^(\s*\S+ = \S+ parameter\((\d+)\))(.*)$")


def named_hlo(hlo_proto: bytes) -> tuple[bytes, str]:
    """The HLO module with its NEFF tensor names, as (proto, text): parameter i of the entry
    computation is input{i}, element j of its result output{j}. Through jaxlib's HLO text
    parser, which keeps every other attribute (the input/output aliases of the caches)."""
    from jax._src.lib import xla_client
    from jaxlib import _hlo  # the HLO text parser; jax exposes none publicly (pinned in pyproject)

    lines = xla_client.XlaComputation(hlo_proto).get_hlo_module().to_string().splitlines()  # with op_name metadata, which lint reads
    entry = next(i for i, line in enumerate(lines) if line.startswith("ENTRY "))
    root = next(i for i in range(entry, len(lines)) if lines[i].lstrip().startswith("ROOT "))
    for i in range(entry + 1, len(lines)):
        m = _ENTRY_PARAMETER.match(lines[i])
        if m:
            lines[i] = f'{m.group(1)}, frontend_attributes={{neff_input_names="{INPUT_NAME.format(m.group(2))}"}}{m.group(3)}'
    results = xla_client.XlaComputation(hlo_proto).program_shape().result_shape()
    count = len(results.tuple_shapes()) if results.is_tuple() else 1
    names = ",".join(OUTPUT_NAME.format(j) for j in range(count))
    lines[root] += f', frontend_attributes={{neff_output_names="{names}"}}'
    module = _hlo.hlo_module_from_text("\n".join(lines))
    proto = module.as_serialized_hlo_module_proto()
    return proto, xla_client.XlaComputation(proto).as_hlo_text()
