"""The backend seam: nothing outside aotc/backends/ names a backend, and a backend is one
file. A backend registered from this test module (a plugin, like a user's) builds,
loads, runs --check and verifies, with no other file of aotc touched."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from typer.testing import CliRunner

import aotc
from aotc.backends import Backend, CompileResult, Program, Specs, backend_names, register_backend
from aotc.backends.base import HOST, Step, Weights
from aotc.backends.export import save_program
from aotc.backends.export_archive import check_archive
from aotc.cli import app

from .conftest import assert_check_report

PACKAGE = Path(aotc.__file__).parent
# The default backend is picked by name.
MAY_NAME = {"builder/options.py"}


def _string_constants(tree: ast.AST):
    """String constants of a module, docstrings left out."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def test_no_module_outside_the_backends_names_a_backend():
    names = set(backend_names())
    assert {"export", "inductor", "xla", "neuron"} <= names
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        rel = file.relative_to(PACKAGE).as_posix()
        if rel.startswith("backends/") or rel in MAY_NAME:
            continue
        for node in _string_constants(ast.parse(file.read_text())):
            if node.value in names:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_the_scan_finds_a_backend_name(tmp_path):
    """The scan above is what catches a name: here, one hidden in a non-docstring constant."""
    tree = ast.parse('"""the xla backend"""\nFACTOR = {"xla": 5.0}\n')
    assert [n.value for n in _string_constants(tree)] == ["xla"]


# -- a backend from outside aotc -------------------------------------------------------

PROGRAM = "graph.pt2"


class InterpretedProgram(Program):
    label = PROGRAM

    def __init__(self, gm: torch.fx.GraphModule):
        self.interpreter = torch.fx.Interpreter(gm)

    def bind(self, weights: Weights, *, rank: int = 0, world_size: int = 1) -> Step:
        # The host's device: the graph runs on the model's own tensors, where they are.
        tensors = weights.tensors()
        return Step(HOST, lambda args, call=0: list(self.interpreter.run(*tensors, *args)))


@register_backend
class InterpreterBackend(Backend):
    """The post-pass program, saved by torch.export and run node by node by torch.fx.Interpreter."""

    name = "fx_interpreter"
    files = (PROGRAM,)

    def version(self) -> str:
        return f"torch-{torch.__version__}-fx-interpreter-1"

    def compile(self, program, specs: Specs, out_dir: Path) -> CompileResult:
        save_program(program, str(out_dir / PROGRAM), specs.weight_paths)
        return CompileResult([PROGRAM])

    def load(self, art_dir: Path, record) -> Program:
        check_archive(art_dir / PROGRAM)  # read as data before torch unpickles anything
        return InterpretedProgram(torch.export.load(str(art_dir / PROGRAM)).graph_module)


def test_a_backend_from_a_plugin_builds_runs_checks_and_verifies(tiny_dir, tmp_path):
    runner = CliRunner()
    out = tmp_path / "bundle"
    plugin = ["--plugin", __name__]
    r = runner.invoke(
        app, ["build", str(tiny_dir), "--backend", InterpreterBackend.name, *plugin, "--buckets", "1,2", "--prefill-chunk", "64", "--max-seq", "64", "--no-cache", "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"]["name"] == "fx_interpreter" and manifest["plugins"] == [__name__]
    assert {name for e in manifest["entries"] for a in e["artifacts"] for name in a["files"]} == {PROGRAM}
    r = runner.invoke(
        app,
        ["run", str(out), *plugin, "--check", "--json", "--max-new-tokens", "6", "--prompt", "Hello", "--prompt", "one two three four five six seven eight nine ten eleven twelve"],
    )
    assert r.exit_code == 0, r.output
    assert_check_report(json.loads(r.output), "export")  # the same aten ops as eager: export's tolerance
    r = runner.invoke(app, ["verify", str(out), *plugin, "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["passed"] and report["backend"] == "fx_interpreter" and len(report["artifacts"]) == 6
    # In a process without the plugin the bundle's backend is unknown, and the error says what to pass.
    r = subprocess.run([sys.executable, "-m", "aotc.cli", "inspect", str(out)], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    said = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and "backend.name: 'fx_interpreter' is not a backend" in said and f"built with the plugin {__name__}: pass --plugin" in said, said
    # A backend that does not say its graphs can hold collectives builds no parallel bundle.
    r = runner.invoke(app, ["build", str(tiny_dir), "--backend", InterpreterBackend.name, *plugin, "--tensor-parallel", "2", "-o", str(tmp_path / "tp")])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "--tensor-parallel 2 --backend fx_interpreter: parallel bundles are built on the export, inductor, neuron and xla backends" in said, said
    r = runner.invoke(app, ["build", str(tiny_dir), "--backend", InterpreterBackend.name, *plugin, "--expert-parallel", "2", "-o", str(tmp_path / "tp")])
    assert r.exit_code == 2 and "--expert-parallel 2 --backend fx_interpreter: parallel bundles are built on" in " ".join(r.output.split())
    assert not (tmp_path / "tp").exists()
