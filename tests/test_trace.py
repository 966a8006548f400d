"""The tracer: one graph per (class, method, variant, bucket), weights as inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aotc
from aotc.backends import get_backend_class
from aotc.entry import entries_of
from aotc.errors import TraceError
from aotc.models.loader import load_model
from aotc.models.tiny import write_tiny
from aotc.trace import Shapes, find_variants, trace

SHAPES = Shapes(slots=5, max_seq=64)  # for modules that take no cache from a model


def shapes_of(model):
    return Shapes.of(model, 5, 64)  # its caches from its cache_specs()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("trace")
    return {n: load_model(write_tiny(root / f"l{n}", layers=n), weights=False) for n in (2, 6)}


def test_graph_count_does_not_depend_on_layer_count(models):
    counts = {}
    for n, loaded in models.items():
        variants = find_variants(loaded.model, shapes_of(loaded.model))
        ids = sorted(v.entry_id for v in variants)
        assert ids == ["LMHead.forward", "LlamaDecoderLayer.decode", "LlamaDecoderLayer.prefill", "LlamaDecoderLayer.prefill_fresh"]
        decode = next(v for v in variants if v.entry_id == "LlamaDecoderLayer.decode")
        assert [p for p, _ in decode.instances] == [f"model.layers.{i}" for i in range(n)]
        counts[n] = len(variants)
    assert counts[2] == counts[6]


def test_weights_and_caches_are_graph_inputs(models):
    loaded = models[2]
    decode = next(v for v in find_variants(loaded.model, shapes_of(loaded.model)) if v.entry_id == "LlamaDecoderLayer.decode")
    g = trace(decode, 4, shapes_of(loaded.model))
    layer = loaded.model.model.layers[0]
    params = [n for n, _ in layer.named_parameters()]
    kinds = [(i.kind, i.path or i.name) for i in g.inputs]
    assert kinds == [("weight", p) for p in params] + [
        ("activation", "x"),
        ("activation", "cos"),
        ("activation", "sin"),
        ("activation", "positions"),
        ("activation", "slots"),
        ("cache", "k_cache"),
        ("cache", "v_cache"),
    ]
    sig = g.program.graph_signature
    assert all(s.kind.name == "USER_INPUT" for s in sig.input_specs)  # no lifted parameters or constants
    assert [s.kind.name for s in sig.output_specs] == ["USER_OUTPUT"]
    assert not g.program.state_dict and not g.program.constants
    # The cache update is one index_put_ per cache, directly on the cache input.
    placeholders = [n for n in g.graph_module.graph.nodes if n.op == "placeholder"]
    k_in, v_in = placeholders[-2:]
    puts = [n for n in g.graph_module.graph.nodes if n.target is torch.ops.aten.index_put_.default]
    assert [n.args[0] for n in puts] == [k_in, v_in]
    assert g.inputs[-1].shape == [5, 2, 64, 64]
    assert g.outputs[0].shape == [4, 256]


def test_one_graph_serves_every_layer(tmp_path):
    """The layer-0 graph run with layer 1's weights gives layer 1's eager output."""
    loaded = load_model(write_tiny(tmp_path / "m", layers=2))
    model = loaded.model
    decode = next(v for v in find_variants(model, shapes_of(model)) if v.entry_id == "LlamaDecoderLayer.decode")
    gm = trace(decode, 2, shapes_of(model)).graph_module
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256, generator=g)
    positions = torch.tensor([3, 7])
    cos, sin = model.rope(positions)
    slots = torch.tensor([0, 1])
    for layer in model.model.layers:
        caches = [torch.randn(5, 2, 64, 64, generator=g) for _ in range(2)]
        eager_caches = [c.clone() for c in caches]
        weights = [p.detach() for p in layer.parameters()]
        (out,) = gm(*weights, x, cos, sin, positions, slots, *caches)
        expected = layer.decode(x, cos, sin, positions, slots, *eager_caches)
        torch.testing.assert_close(out, expected)
        for c, e in zip(caches, eager_caches):
            torch.testing.assert_close(c, e)


class Block(nn.Module):
    def __init__(self, window, scale=1.0):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.window = window
        self.scale = scale

    @aotc.entry(bucket="batch")
    def step(self, x):
        return self.proj(x) * self.scale + self.window

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, 8),)


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)


def test_layers_that_differ_in_a_read_attribute_become_variants():
    model = Stack([Block(4), Block(4), Block(8), Block(4)])
    variants = find_variants(model, SHAPES)
    assert [(v.entry_id, [p for p, _ in v.instances], v.attributes) for v in variants] == [
        ("Block.step.v0", ["blocks.0", "blocks.1", "blocks.3"], {"window": 4}),
        ("Block.step.v1", ["blocks.2"], {"window": 8}),
    ]


def test_qwen2_mixed_window_layers_become_variants(tmp_path):
    path = write_tiny(tmp_path / "q", arch="qwen2", layers=3)
    import json

    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    model = load_model(path, weights=False).model
    variants = find_variants(model, shapes_of(model))
    decode = {v.entry_id: ([p for p, _ in v.instances], v.attributes) for v in variants if "decode" in v.entry_id}
    assert decode == {
        "LlamaDecoderLayer.decode.v0": (["model.layers.0"], {"self_attn.window": None}),
        "LlamaDecoderLayer.decode.v1": (["model.layers.1", "model.layers.2"], {"self_attn.window": 16}),
    }


def test_unhashable_attribute_is_an_error_naming_attribute_and_layer():
    model = Stack([Block(4), Block({"a": 1})])
    with pytest.raises(TraceError, match=r"blocks\.1\.window = \{'a': 1\}"):
        find_variants(model, SHAPES)


def test_tensor_attribute_that_is_not_a_buffer_is_an_error():
    block = Block(4)
    block.scale = torch.tensor(2.0)
    with pytest.raises(TraceError, match=r"blocks\.0\.scale is a tensor attribute.*register_buffer"):
        find_variants(Stack([block]), SHAPES)


class WritesWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    @aotc.entry(bucket="batch")
    def step(self, x):
        self.count.add_(1)
        return x + self.count

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, 4),)


def test_writing_a_weight_is_an_error():
    variant = find_variants(Stack([WritesWeight()]), SHAPES)[0]
    with pytest.raises(TraceError, match=r"writes into weight 'count'"):
        trace(variant, 1, SHAPES)


class ReturnsCache(nn.Module):
    @aotc.entry(bucket="batch", caches=("cache",))
    def step(self, x, cache):
        cache[:, 0] = x
        return cache

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, 4), torch.zeros(rows, 3, 4))


def test_returning_a_cache_is_an_error():
    variant = find_variants(Stack([ReturnsCache()]), SHAPES)[0]
    with pytest.raises(TraceError, match=r"output 0 is \(a view of\) input"):
        trace(variant, 2, SHAPES)


class ItemBranch(nn.Module):
    @aotc.entry(bucket="batch")
    def step(self, x, n):
        return x[: n.sum().item()]

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, 4), torch.ones(rows, dtype=torch.long))


def test_data_dependent_code_is_reported_with_its_source_line():
    """.item() is captured as an unbacked size; a static-shape target refuses what the
    strip pass cannot make static, naming the user's line."""
    variant = find_variants(Stack([ItemBranch()]), SHAPES)[0]
    with pytest.raises(TraceError, match=r"test_trace.py\", line \d+, in step: an output whose size depends on the data"):
        trace(variant, 2, SHAPES, get_backend_class("xla")())  # a backend that compiles static shapes only


class DataBranch(nn.Module):
    @aotc.entry(bucket="batch")
    def step(self, x, n):
        if n.sum() > 0:
            return x * 2
        return x + 1

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, 4), torch.ones(rows, dtype=torch.long))


def test_branch_on_data_is_reported_with_its_source_line():
    with pytest.raises(TraceError, match=r"DataBranch.step .* at .*test_trace.py:\d+ \(if n.sum\(\) > 0:\).*depends on tensor values"):
        find_variants(Stack([DataBranch()]), SHAPES)


def test_entry_with_non_tensor_argument_is_an_error():
    class Bad(nn.Module):
        @aotc.entry(bucket="batch")
        def step(self, x, flag):
            return x

        def example_inputs(self, method, rows, shapes):
            return (torch.zeros(rows, 4), True)

    with pytest.raises(TraceError, match=r"'flag' is True \(bool\); entry arguments must be tensors"):
        find_variants(Stack([Bad()]), SHAPES)


def test_a_fresh_form_must_be_an_entry_with_the_same_arguments():
    """@entry(fresh=...): the form the runtime runs in place of a prefill's first chunk
    from position 0 takes the same arguments and caches, bucketed by "first" (one graph per
    first-chunk bucket); an entry bucketed by "first" that no fresh= names is refused."""

    def chunked(name, fresh_args="x, positions, cache", bucket="first", **fresh):
        class Layer(nn.Module):
            @aotc.entry(bucket="chunk", caches=("cache",), split=True, context="positions", fresh=name)
            def prefill(self, x, positions, cache):
                return x

        if fresh_args is not None:
            exec(f"def form(self, {fresh_args}):\n    return x", namespace := {})
            setattr(Layer, "prefill_fresh", aotc.entry(bucket=bucket, caches=("cache",), **fresh)(namespace["form"]))
        return Layer

    assert entries_of(chunked("prefill_fresh"))["prefill"].fresh == "prefill_fresh"
    for layer, why in [
        (chunked("prefill_fresh", fresh_args=None), "prefill_fresh"),  # no such method
        (chunked("prefill_fresh", fresh_args="x, slots, cache"), "same arguments"),
        (chunked("prefill_fresh", bucket="chunk"), 'bucket="first"'),
        (chunked("prefill_fresh", split=True), "neither split"),
        (chunked("decode"), "'decode'"),
    ]:
        with pytest.raises(TraceError, match=rf"Layer.prefill: fresh=.*{why}.*are its entries"):
            entries_of(layer)
    with pytest.raises(TraceError, match=r"fresh='prefill_fresh' is for a split entry with context buckets"):
        aotc.entry(bucket="chunk", caches=("cache",), fresh="prefill_fresh")(lambda self, x, cache: x)

    class Orphan(nn.Module):
        @aotc.entry(bucket="first", caches=("cache",))
        def prefill_fresh(self, x, cache):
            return x

    with pytest.raises(TraceError, match=r'Orphan.prefill_fresh: bucket="first" is for the fresh form of a prefill entry, but no entry'):
        entries_of(Orphan)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v4"])
def test_example_caches_are_the_models_cache_specs(tmp_path, monkeypatch, arch):
    """A model states its cache shapes once (cache_specs): each entry's example caches are
    one layer's share of them, and follow when they change (here: twice the slots)."""
    from aotc.models.deepseek_v4 import cache_kinds

    model = load_model(write_tiny(tmp_path / arch, arch=arch, layers=4 if arch == "deepseek_v4" else 2), weights=False).model
    specs = type(model).cache_specs

    def more_slots(self, slots, max_seq):
        return specs(self, 2 * slots, max_seq)

    seen = []
    for cache_specs in (specs, more_slots):
        monkeypatch.setattr(type(model), "cache_specs", cache_specs)
        shapes = Shapes.of(model, 5, 64)
        layer_share = {kind: (tuple(shape[1:]), dtype) for kind, (shape, dtype) in model.cache_specs(5, 64).items()}
        got = []
        for variant in find_variants(model, shapes):
            spec, layer = variant.spec, variant.module
            args = dict(zip(spec.params, layer.example_inputs(spec.method, 2, shapes)))
            caches = [(tuple(a.shape), a.dtype) for name, a in args.items() if name in spec.caches]
            if spec.caches:
                kinds = cache_kinds(layer.layer_type) if arch == "deepseek_v4" else ["k", "v"]
                assert caches == [layer_share[k] for k in kinds], variant.entry_id
            got.append(caches)
        seen.append(got)
    assert seen[0] != seen[1]
