"""Derived weights (aotc.layout): graph inputs made from checkpoint tensors by a named transform."""

from __future__ import annotations

import json
from typing import get_args

import pytest
import torch
from torch import nn

from aotc.errors import BundleError, TraceError
from aotc.format import MANIFEST, TransformName, read_manifest
from aotc.layout import TRANSFORMS, Derived, compiled, compiled_forms, graph_weights


class Experts(nn.Module):
    def __init__(self, n=3, sources=None):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(4, 6, bias=False) for _ in range(n))
        self.norm = nn.Parameter(torch.ones(4))
        self._sources = sources or tuple(f"up.{e}.weight" for e in range(n))

    def derived_weights(self):
        return {"stacked": Derived("stack", self._sources)}

    def forward(self, x):
        """One matmul per expert."""
        return torch.stack([up(x) for up in self.up])

    def compiled_forward(self, x, derived):
        """One batched matmul over the stacked experts."""
        return x @ derived["stacked"].transpose(-1, -2)


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


def test_while_traced_the_module_runs_its_compiled_form_on_the_graph_input_and_its_sources_are_views_of_it():
    outer = Outer()
    weights = graph_weights(outer)
    value = torch.arange(72.0).reshape(3, 6, 4)
    x = torch.ones(4)
    eager = outer.mlp(x)
    with compiled(outer, weights, {"mlp.stacked": value}) as views:
        torch.testing.assert_close(outer.mlp(x), x @ value.transpose(-1, -2))  # compiled_forward, given the graph input
        assert sorted(views) == ["mlp.up.0.weight", "mlp.up.1.weight", "mlp.up.2.weight"]
        assert views["mlp.up.2.weight"].data_ptr() == value[2].data_ptr()
    torch.testing.assert_close(outer.mlp(x), eager)  # forward again
    assert "forward" not in vars(outer.mlp)
    assert compiled_forms(outer) == [compiled_forms(outer.mlp)[0]]
    form = compiled_forms(outer)[0]
    assert (form.cls, form.modules, form.eager, form.compiled) == (
        "Experts",
        1,
        "Experts.forward: One matmul per expert.",
        "Experts.compiled_forward: One batched matmul over the stacked experts.",
    )


class NoCompiledForm(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(4, 6, bias=False) for _ in range(2))

    def derived_weights(self):
        return {"stacked": Derived("stack", ("up.0.weight", "up.1.weight"))}


def test_derived_weights_without_a_compiled_form_to_read_them_are_an_error():
    module = NoCompiledForm()
    with pytest.raises(TraceError, match=r"NoCompiledForm.derived_weights\(\) declares 'stacked', but the class has no compiled_forward"):
        with compiled(module, graph_weights(module), {"stacked": torch.zeros(2, 6, 4)}):
            pass


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
