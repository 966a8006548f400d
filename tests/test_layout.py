"""Derived weights (aotc.layout): graph inputs made from checkpoint tensors by a named transform."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import get_args

import pytest
import torch
from torch import nn

from aotc.errors import BundleError, TraceError
from aotc.format import MANIFEST, TransformName, read_manifest
from aotc.layout import TRANSFORMS, Derived, derived, graph_weights, providing


class Experts(nn.Module):
    def __init__(self, n=3, sources=None):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(4, 6, bias=False) for _ in range(n))
        self.norm = nn.Parameter(torch.ones(4))
        self._sources = sources or tuple(f"up.{e}.weight" for e in range(n))

    def derived_weights(self):
        return {"stacked": Derived("stack", self._sources)}


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Experts()
        self.register_buffer("table", torch.zeros(2, 2))


def test_the_format_names_exactly_the_transforms_there_are():
    assert set(TRANSFORMS) == set(get_args(TransformName))


def test_a_derived_weight_replaces_its_sources_among_the_graph_inputs():
    weights = graph_weights(Outer())
    assert [w.path for w in weights] == ["mlp.norm", "table", "mlp.stacked"]
    stacked = weights[-1]
    assert (stacked.shape, stacked.stride, stacked.transform) == ([3, 6, 4], [24, 4, 1], "stack")
    assert stacked.sources == ["mlp.up.0.weight", "mlp.up.1.weight", "mlp.up.2.weight"]


def test_while_provided_the_module_sees_the_graph_input_and_its_sources_are_views_of_it():
    outer = Outer()
    weights = graph_weights(outer)
    value = torch.arange(72.0).reshape(3, 6, 4)
    assert derived(outer.mlp) is None  # eager
    with providing(outer, weights, {"mlp.stacked": value}) as views:
        assert derived(outer.mlp)["stacked"] is value
        assert sorted(views) == ["mlp.up.0.weight", "mlp.up.1.weight", "mlp.up.2.weight"]
        assert views["mlp.up.2.weight"].data_ptr() == value[2].data_ptr()
    assert derived(outer.mlp) is None


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        (("up.0.weight", "up.9.weight"), "'mlp.up.9.weight', which is not a parameter or buffer"),
        (("up.0.weight", "norm"), "transform 'stack' fails on its sources"),
    ],
)
def test_a_bad_declaration_is_an_error_naming_it(sources, message):
    outer = Outer()
    outer.mlp._sources = sources
    with pytest.raises(TraceError, match="Experts.derived_weights()") as e:
        graph_weights(outer)
    assert message in str(e.value)


def _derived_manifest(tiny_bundle, tmp_path, **fields):
    data = json.loads((tiny_bundle.out / MANIFEST).read_text())
    data["entries"][0]["weights"][0].update(fields)
    path = tmp_path / MANIFEST
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"transform": "pickle", "sources": ["a"]}, "entries[0].weights[0].transform"),
        ({"transform": "stack", "sources": []}, "a derived weight has a transform and sources"),
        ({"transform": None, "sources": ["a"]}, "a derived weight has a transform and sources"),
    ],
)
def test_the_reader_refuses_unknown_transforms_and_inconsistent_records(tiny_bundle, tmp_path, fields, message):
    with pytest.raises(BundleError) as e:
        read_manifest(_derived_manifest(tiny_bundle, tmp_path, **fields).parent)
    assert message in str(e.value)


def test_torch_compile_traces_through_the_lookup_without_a_graph_break():
    """Users torch.compile models that call aotc.derived(); a graph break there would split
    every MoE. In a fresh process: once torchax is imported (the xla tests), dynamo fails."""
    script = """
import torch
from torch import nn
from aotc.layout import derived

experts = nn.Linear(3, 3)

def forward(x):
    stacked = derived(experts)
    return x * 2 if stacked is None else x @ stacked["stacked"][0]

compiled = torch.compile(forward, fullgraph=True, backend="eager")
torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 2.0))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
