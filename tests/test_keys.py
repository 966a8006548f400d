"""Cache keys: each thing that changes the compiled code changes its key, and nothing else does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from aotc.builder import BuildOptions
from aotc.builder.plan import resolve
from aotc.cache import keys
from aotc.cache.keys import build_key, cache_key, recipe_key


def options(model_dir, tmp_path, **kw):
    return BuildOptions(model_dir, out=tmp_path / "b", **{"backend": "export", "batch_buckets": (1, 2), "chunk_buckets": (16,), "max_seq": 256, **kw})


def key_of(o: BuildOptions) -> str:
    o.resolve_contexts()
    return recipe_key(o, *resolve(o))


def test_recipe_key_changes_with_each_build_option(tiny_dir, tmp_path):
    """A rebuild asking for other buckets, context buckets, cache dtype or backend flags
    must never be served the recipe of another build (its graphs would not be traced)."""
    base = key_of(options(tiny_dir, tmp_path))
    assert base == key_of(options(tiny_dir, tmp_path / "elsewhere"))  # the output folder is not part of it
    changed = {
        "batch": dict(batch_buckets=(1, 4)),
        "chunk": dict(chunk_buckets=(32,)),
        "max_seq": dict(max_seq=128),
        "context": dict(context_buckets=(64,)),
        "context (another)": dict(context_buckets=(128,)),
        "kv cache": dict(kv_cache_dtype="fp8"),
    }
    got = {name: key_of(options(tiny_dir, tmp_path, **kw)) for name, kw in changed.items()}
    assert len(set(got.values()) | {base}) == len(changed) + 1, got


def test_recipe_key_changes_with_config_backend_and_sources(tiny_dir, tmp_path, monkeypatch):
    o = options(tiny_dir, tmp_path)
    o.resolve_contexts()
    config, model_class, backend = resolve(o)
    base = recipe_key(o, config, model_class, backend)
    assert recipe_key(o, {**config, "rms_norm_eps": 1e-3}, model_class, backend) != base
    monkeypatch.setattr(type(backend), "version", lambda self: "other")
    assert recipe_key(o, config, model_class, backend) != base
    monkeypatch.undo()
    monkeypatch.setattr(keys, "_source_digest", lambda folder: "edited")
    assert recipe_key(o, config, model_class, backend) != base


def test_recipe_key_changes_with_the_checkpoints_tensors(tiny_dir, tmp_path):
    """A checkpoint re-saved in another dtype or format under the same config.json makes
    other graphs: its recipe must not serve the first one's bundle."""
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    base = key_of(options(other, tmp_path))
    tensors = load_file(other / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)
    save_file(tensors, other / "model.safetensors")
    assert key_of(options(other, tmp_path)) != base


class FakeBackend:
    name = "export"

    def __init__(self, version="1", flags=None):
        self._version, self._flags = version, flags or {}

    def version(self):
        return self._version

    def flags(self):
        return self._flags


def graph(code="x + 1", pad=0, stride=(4, 1), out_dtype="float32", weight="w.weight"):
    return SimpleNamespace(
        graph_module=SimpleNamespace(code=code, named_modules=lambda: []),  # no loop: no graph of its own inside
        inputs=[
            SimpleNamespace(kind="weight", shape=[4, 4], dtype="float32", stride=[4, 1], pad=0, path=weight),
            SimpleNamespace(kind="activation", shape=[2, 4], dtype="float32", stride=list(stride), pad=pad, path=None),
        ],
        outputs=[SimpleNamespace(shape=[2, 4], dtype=out_dtype)],
    )


def test_cache_key_changes_with_the_graph_its_metadata_and_the_backend():
    base = cache_key(graph(), FakeBackend())
    assert cache_key(graph(), FakeBackend()) == base
    others = [
        cache_key(graph(code="x + 2"), FakeBackend()),
        cache_key(graph(pad=-1), FakeBackend()),
        cache_key(graph(stride=(1, 2)), FakeBackend()),
        cache_key(graph(out_dtype="bfloat16"), FakeBackend()),
        cache_key(graph(weight="v.weight"), FakeBackend()),  # the artifact records which tensor each weight input is
        cache_key(graph(), FakeBackend(version="2")),
        cache_key(graph(), FakeBackend(flags={"max_autotune": True})),
        # the model's code where it is another package's (transformers' version and source)
        cache_key(graph(), FakeBackend(), code={"transformers": "5.24.0", "source": "a"}),
        cache_key(graph(), FakeBackend(), code={"transformers": "5.25.0", "source": "a"}),
    ]
    assert len(set(others) | {base}) == len(others) + 1
    assert cache_key(graph(), FakeBackend(), code={}) == base  # aotc's own models: no code beyond aotc's
    # a re-trace keys with the version the bundle was built with, not this machine's
    assert cache_key(graph(), FakeBackend(version="2"), version="1") == base


@pytest.mark.parametrize("field", ["format", "torch"])
def test_cache_key_changes_with_the_format_and_torch(field, monkeypatch):
    base = cache_key(graph(), FakeBackend())
    if field == "format":
        monkeypatch.setattr(keys, "FORMAT_VERSION", keys.FORMAT_VERSION + 1)
    else:
        monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cache_key(graph(), FakeBackend()) != base


def test_build_key_is_the_tuples_in_order():
    a = [("E", 1, None, "k1"), ("E", 2, None, "k2")]
    assert build_key(a) == build_key(list(a)) != build_key(a[::-1])
    assert build_key(a) != build_key([("E", 1, 64, "k1"), ("E", 2, None, "k2")])
