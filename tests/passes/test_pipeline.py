"""The pass framework: each pass its own identity, inputs replaced only by a ProgramPass
(which re-signs the program), and no aotc state beside the program in `gm.meta`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import fx, nn

import aotc
from aotc.backends import backend_names, get_backend_class
from aotc.passes import pipeline_for, run_pipeline
from aotc.passes.base import GraphPass

ROOT = Path(aotc.__file__).parent


def every_pass():
    """Each pass any backend's pipeline runs, once."""
    return list({type(p): p for name in backend_names() for p in pipeline_for(get_backend_class(name)())}.values())


def test_a_change_to_one_pass_changes_its_identity_and_no_other(tmp_path, monkeypatch):
    """The two skinny rewrites once shared a file, so a change to the matmul rewrite
    changed the linear rewrite's uuid too."""
    from aotc.passes import rewrite_skinny_matmuls

    passes = every_pass()
    assert len({p.uuid() for p in passes}) == len(passes) == len({p.name for p in passes})
    before = {p.name: p.uuid() for p in passes}
    edited = tmp_path / "rewrite_skinny_matmuls.py"
    source = Path(rewrite_skinny_matmuls.__file__).read_text()
    edited.write_text(source.replace("MATMUL_ROWS = range(2, 5)", "MATMUL_ROWS = range(2, 6)"))
    monkeypatch.setattr(rewrite_skinny_matmuls, "__file__", str(edited))  # the source uuid() reads
    after = {p.name: p.uuid() for p in passes}
    assert {name for name in before if before[name] != after[name]} == {"rewrite_skinny_matmuls"}


def _meta_keys(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, key) of each 'aotc_...' key read or written on something's `.meta`:
    x.meta["aotc_k"], x.meta.get("aotc_k") (and setdefault, pop), "aotc_k" in x.meta."""
    is_meta = lambda e: isinstance(e, ast.Attribute) and e.attr == "meta"  # noqa: E731
    is_key = lambda e: isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value.startswith("aotc_")  # noqa: E731
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_meta(node.value) and is_key(node.slice):
            found.append((node.lineno, node.slice.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_meta(node.func.value) and node.args and is_key(node.args[0]):
            found.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Compare) and is_key(node.left) and any(is_meta(c) for c in node.comparators):
            found.append((node.lineno, node.left.value))
    return found


def test_no_module_keeps_aotc_state_in_a_graph_modules_meta():
    found = [f"{f.relative_to(ROOT.parent)}:{line}: {key}" for f in sorted(ROOT.rglob("*.py")) for line, key in _meta_keys(ast.parse(f.read_text()))]
    assert not found, found
    # The scan finds each form it looks for.
    forms = 'gm.meta["aotc_r"] = 1\nx = n.meta.get("aotc_r")\ny = "aotc_r" in gm.meta\n'
    assert [line for line, _ in _meta_keys(ast.parse(forms))] == [1, 2, 3]


class Add(nn.Module):
    def forward(self, x, y):
        return x + y


class AddsAnInput(GraphPass):
    name = "adds_an_input"

    def run(self, gm: fx.GraphModule) -> int:
        first = next(iter(gm.graph.nodes))
        with gm.graph.inserting_after(first):
            gm.graph.placeholder("extra").meta["val"] = first.meta["val"]
        return 1


def test_a_graph_pass_that_changes_the_inputs_is_refused():
    """The program's signature would no longer name its graph's inputs."""
    program = torch.export.export(Add(), (torch.ones(2), torch.ones(2)), strict=False)
    with pytest.raises(RuntimeError, match="adds_an_input changed the graph's inputs; a pass that does is a ProgramPass"):
        run_pipeline(program, [AddsAnInput()])
