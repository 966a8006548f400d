"""The xla backend: HLO with donated caches, run on JAX's CPU, against eager."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from aotc.backends.xla import XlaBackend, dropped_overloads, import_torchax
from aotc.build import BuildOptions, build
from aotc.cli import app
from aotc.models.base import load_model
from aotc.models.tiny import write_tiny
from aotc.runtime import Bundle

from .conftest import assert_check_report, assert_generation_matches_eager

pytestmark = pytest.mark.skipif(XlaBackend().can_compile() is not None, reason=str(XlaBackend().can_compile()))

OPTIONS = dict(batch_buckets=(1, 2), chunk_buckets=(16,), max_seq=64, backend="xla", use_cache=False)


def test_torchax_needs_the_shim_on_this_torch_and_the_shim_is_narrow():
    """Pins the workaround: torchax 0.0.13 does not import on this torch, only
    named-tensor overloads are stood in for, and none is left behind."""
    plain = subprocess.run([sys.executable, "-c", "import torchax"], capture_output=True, text=True)
    assert plain.returncode != 0 and "has no overload name" in plain.stderr
    dropped = dropped_overloads()
    assert dropped and all("imname" in overload or "names" in overload for _, overload in dropped), dropped
    import_torchax()
    assert not any(hasattr(getattr(torch.ops.aten, op), overload) for op, overload in dropped)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def xla_bundle(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"xla-{request.param}")
    model = write_tiny(root / request.param, arch=request.param, layers=2)
    return model, build(BuildOptions(model, out=root / "bundle", **OPTIONS))


def test_hlo_for_every_entry_and_bucket_with_donated_caches(xla_bundle):
    _, result = xla_bundle
    arts = list(result.manifest.artifacts())
    assert sorted((e.id, a.bucket) for e, a in arts) == sorted(
        [("LlamaDecoderLayer.decode", 1), ("LlamaDecoderLayer.decode", 2), ("LlamaDecoderLayer.prefill", 16), ("LMHead.forward", 1), ("LMHead.forward", 2)]
    )
    for e, a in arts:
        folder = result.out / a.dir
        assert set(a.files) == {"hlo.pb", "hlo.txt", "model.jax"}
        text = (folder / "hlo.txt").read_text()
        assert text.startswith("HloModule ")
        # hlo.pb, what neuronx-cc compiles, is the module of hlo.txt, with every graph input.
        # (xla_client is jaxlib's HLO binding; jax exports it only under _src.)
        from jax._src.lib import xla_client

        proto = xla_client.XlaComputation((folder / "hlo.pb").read_bytes())
        assert proto.as_hlo_text() == text
        assert len(proto.program_shape().parameter_shapes()) == len(e.weights) + len(a.inputs)
        aliases = re.findall(r"\{(\d+)\}: \((\d+), \{\}, may-alias\)", text.splitlines()[0])
        n_inputs = len(e.weights) + len(a.inputs)
        caches = [len(e.weights) + i for i, x in enumerate(a.inputs) if x.kind == "cache"]
        # Each cache input is donated to the output that holds its update.
        assert sorted(int(param) for _, param in aliases) == caches, (e.id, aliases)
        assert text.splitlines()[0].count("->") == 1 and n_inputs > 0


def test_every_graph_runs_on_xla_and_matches_eager(xla_bundle):
    model_dir, result = xla_bundle
    loaded = load_model(model_dir)
    bundle = Bundle.load(result.out)
    model, g = loaded.model, torch.Generator().manual_seed(0)
    layer = model.model.layers[1]
    for (entry_id, bucket), program in bundle.programs.items():
        if entry_id == "LMHead.forward":
            x = torch.randn(bucket, 256, generator=g)
            weights = [p.detach() for p in model.head.parameters()]
            torch.testing.assert_close(program.run(weights + [x])[0], model.head(x), atol=1e-4, rtol=1e-4)
            continue
        positions = torch.randint(0, 40, (bucket,), generator=g)
        cos, sin = model.rope(positions)
        slots = torch.arange(bucket) if entry_id.endswith("decode") else torch.zeros(bucket, dtype=torch.long)
        caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq)
        k, v = (c[1].normal_(generator=g) for c in (caches["k"], caches["v"]))
        k_ref, v_ref = k.clone(), v.clone()
        x = torch.randn(bucket, 256, generator=g)
        args = [x, cos, sin, positions, slots]
        weights = [p.detach() for p in layer.parameters()]
        out = program.run(weights + args + [k, v])[0]
        expected = getattr(layer, entry_id.split(".")[1])(*args, k_ref, v_ref)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(k, k_ref)  # the caller's cache holds the update
        torch.testing.assert_close(v, v_ref)


def test_run_check_is_token_exact(xla_bundle):
    _, result = xla_bundle
    runner = CliRunner()
    for max_batch in ("1", "2"):
        r = runner.invoke(app, ["run", str(result.out), "--check", "--json", "--max-new-tokens", "6", "--max-batch", max_batch, "--prompt", "Hello", "--prompt", "What is the capital of France?", "--prompt", "one, two, three, four"])
        assert r.exit_code == 0, r.output
        report = json.loads(r.output)
        assert report["backend"] == "xla"
        assert_check_report(report, "xla")


def test_near_ties_match_eager_up_to_the_tie(xla_bundle, tmp_path):
    """The bundle's model with a head drawn at transformers' scale: top logits within 1e-2."""
    model, result = xla_bundle
    near_ties = write_tiny(tmp_path / "near-ties", arch=model.name, layers=2, head_std=0.02)
    assert assert_generation_matches_eager(result.out, near_ties) < 1e-2
