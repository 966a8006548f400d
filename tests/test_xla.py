"""The xla backend: HLO with donated caches, run on JAX's CPU, against eager."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from aotc.backends.base import DeviceBuffer, Weights
from aotc.backends.xla import XlaBackend
from aotc.backends.xla_lower import dropped_overloads, import_torchax
from aotc.builder import BuildOptions, build
from aotc.cli import app
from aotc.models.loader import load_model
from aotc.models.tiny import write_tiny
from aotc.runtime import Bundle
from aotc.runtime.resident import buffers

from .conftest import assert_check_report, assert_generation_matches_eager, cross_weights, record_contexts

pytestmark = pytest.mark.skipif(XlaBackend().can_compile() is not None, reason=str(XlaBackend().can_compile()))

# Two context buckets: decode graphs read the caches' first 32 positions, or all 64.
OPTIONS = dict(batch_buckets=(1, 2), chunk_buckets=(16,), max_seq=64, context_buckets=(32,), backend="xla", use_cache=False)


def test_torchax_needs_the_shim_on_this_torch_and_the_shim_is_narrow():
    """Pins the workaround: torchax 0.0.13 does not import on this torch, only
    named-tensor overloads are stood in for, and none is left behind."""
    plain = subprocess.run([sys.executable, "-c", "import torchax"], capture_output=True, text=True)
    assert plain.returncode != 0 and "has no overload name" in plain.stderr
    dropped = dropped_overloads()
    assert dropped and all("imname" in overload or "names" in overload for _, overload in dropped), dropped
    import_torchax()
    assert not any(hasattr(getattr(torch.ops.aten, op), overload) for op, overload in dropped)


def test_torch_compile_works_in_a_process_that_imported_torchax():
    """torchax's "jax" device claims to be an available accelerator without the hooks that
    torch.accelerator calls: torch.compile then failed in any process that had used the
    xla backend (dynamo reads the current stream)."""
    import_torchax()
    assert not torch.accelerator.is_available()
    assert torch.equal(torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3)), torch.full((3,), 3.0))


# qwen2's cells under `slow`: every xla mechanism here is llama's too, and qwen2's q/k/v
# biases run compiled against eager in CI on export (test_parallel.py's tied head and KV head).
@pytest.mark.parametrize(
    "source,to,shape",
    [(torch.bfloat16, torch.uint8, (2, 4)), (torch.uint8, torch.bfloat16, (2, 8)), (torch.float32, torch.bfloat16, (3, 2)),
     (torch.int8, torch.float32, (2, 8)), (torch.float32, torch.int32, (2, 3))],
)  # fmt: skip
def test_a_view_to_another_dtype_lowers_to_torchs_shape_and_bytes(source, to, shape):
    """x.view(dtype) keeps the rank, the last dim scaled by the item sizes' ratio (bf16
    [2,4] as uint8 is [2,8]); XLA's bitcast adds or takes a trailing dim instead."""
    import numpy as np

    from aotc.backends.xla import to_numpy, to_torch
    from aotc.backends.xla_lower import jitted

    size = torch.empty((), dtype=source).element_size()
    x = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).view(source)
    gm = torch.export.export(ViewAs(to), (x,)).run_decompositions({}).graph_module
    fn, _ = jitted(gm)
    (got,) = fn(to_numpy(x))
    got = to_torch(np.asarray(got))
    want = x.view(to)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


class ViewAs(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.view(self.dtype).clone()  # an output of its own (export refuses one that aliases an input)


@pytest.fixture(scope="module", params=["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def xla_bundle(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"xla-{request.param}")
    model = write_tiny(root / request.param, arch=request.param, layers=2)
    return model, build(BuildOptions(model, out=root / "bundle", **OPTIONS))


def test_hlo_for_every_entry_and_bucket_with_donated_caches(xla_bundle):
    _, result = xla_bundle
    arts = list(result.manifest.artifacts())
    decode = [("LlamaDecoderLayer.decode", b, c) for c in (32, 64) for b in (1, 2)] + [("LlamaDecoderLayer.prefill", 16, c) for c in (16, 32, 64)]  # 16: the chunk context
    others = [("LMHead.forward", 1, None), ("LMHead.forward", 2, None), ("LlamaDecoderLayer.prefill_fresh", 16, None)]
    assert sorted((e.id, a.bucket, a.context or 0) for e, a in arts) == sorted((e, b, c or 0) for e, b, c in decode + others)
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
        # JAX has no strided views: every graph takes the whole layer cache, a context
        # bucket's reading its first positions inside the graph.
        layer_cache = result.manifest.caches["k"].shape[1:]  # [slots, kv heads, 64 positions, head dim]
        assert [x.shape for x in a.inputs if x.kind == "cache"] == ([layer_cache] * 2 if e.id.startswith("LlamaDecoderLayer") else []), e.id


def test_every_graph_runs_on_xla_with_its_caches_donated(xla_bundle):
    """Each program bound to a layer's weights (placed on the JAX device once) and run on
    device values: outputs match eager; each cache is a JAX array donated to the call,
    whose result takes the donated buffer itself (no copy of the cache is made)."""
    model_dir, result = xla_bundle
    loaded = load_model(model_dir)
    bundle = Bundle.load(result.out)
    model, g = loaded.model, torch.Generator().manual_seed(0)
    layer = model.model.layers[1]
    for (entry_id, bucket, context), program in bundle.programs.items():
        if entry_id == "LMHead.forward":
            x = torch.randn(bucket, 256, generator=g)
            step = program.bind(Weights.of([p.detach() for p in model.head.parameters()]))
            (out,) = step.run([step.device.put(x)])
            torch.testing.assert_close(step.device.get(out), model.head(x), atol=1e-4, rtol=1e-4)
            continue
        positions = torch.randint(0, context or bundle.max_seq, (bucket,), generator=g)  # within what the graph reads
        cos, sin = model.rope(positions)
        slots = torch.arange(bucket) if ".decode" in entry_id else torch.zeros(bucket, dtype=torch.long)
        caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq)
        k, v = (c[1].normal_(generator=g) for c in (caches["k"], caches["v"]))
        k_ref, v_ref = k.clone(), v.clone()
        x = torch.randn(bucket, 256, generator=g)
        args = [x, cos, sin, positions, slots]
        step = program.bind(Weights.of([p.detach() for p in layer.parameters()]))
        device = step.device
        buffers = [DeviceBuffer(device, device.put(c), tuple(c.shape), c.dtype) for c in (k, v)]
        given = [b.value for b in buffers]
        pointers = [a.unsafe_buffer_pointer() for a in given]
        (out,) = step.run([device.put(a) for a in args] + buffers)
        assert all(a.is_deleted() for a in given), entry_id  # donated
        assert [b.value.unsafe_buffer_pointer() for b in buffers] == pointers, entry_id  # updated in place
        expected = getattr(layer, entry_id.split(".")[1])(*args, k_ref, v_ref)
        torch.testing.assert_close(device.get(out), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(buffers[0].to_host(), k_ref)  # the cache holds eager's update
        torch.testing.assert_close(buffers[1].to_host(), v_ref)


def test_a_second_load_takes_xlas_executables_from_the_bundles_private_jax_cache(xla_bundle, tmp_path, monkeypatch):
    """JAX compiles each program at its first call, on every run: an xla bundle's first
    token took seconds. The second load of a bundle reads every executable back from
    JAX's cache in aotc's (<cache>/jax/<digest>, 0700), compiling nothing."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    model_dir, result = xla_bundle
    monkeypatch.setenv("AOTC_CACHE_DIR", str(tmp_path / "cache"))
    head = load_model(model_dir).model.head
    events: list[str] = []
    listen = lambda event, **_: events.append(event.rsplit("/", 1)[1])  # noqa: E731
    jax.monitoring.register_event_listener(listen)
    counts = []
    try:
        for _ in range(2):
            events.clear()
            step = Bundle.load(result.out).programs["LMHead.forward", 2, None].bind(Weights.of([p.detach() for p in head.parameters()]))
            x = torch.randn(2, 256)
            torch.testing.assert_close(step.device.get(step.run([step.device.put(x)])[0]), head(x), atol=1e-4, rtol=1e-4)
            counts.append((events.count("cache_misses"), events.count("cache_hits")))
    finally:
        jax.monitoring.unregister_event_listener(listen)
        jax.config.update("jax_compilation_cache_dir", None)  # the tests after this one: aotc's folder again
        jax_cache.reset_cache()
    folder = tmp_path / "cache" / "jax" / result.manifest.digest()
    assert oct(folder.stat().st_mode & 0o777) == "0o700" and any(folder.iterdir())
    (missed, _), (missed_again, hit) = counts
    assert missed >= 1 and missed_again == 0 and hit >= 1, counts


def test_decode_moves_the_step_activations_only_and_copies_no_cache(xla_bundle):
    """Bound once, weights placed once; caches are JAX arrays on the device. Over decode steps
    that cross the context bucket (positions 28 to 39: 32 positions read, then 64), every
    cache stays in the buffer it was allocated in, each step sends exactly its activations
    (the embedding row, the RoPE rows, position, slot) and reads exactly the logits back."""
    model_dir, result = xla_bundle
    bundle, loaded = Bundle.load(result.out), load_model(model_dir)
    model = loaded.model
    bundle.bind(model)
    device = bundle.backend.device_for()
    graph_weights = {id(p): p.numel() * p.element_size() for n, p in model.named_parameters() if n != "model.embed_tokens.weight" or model.config.tie_word_embeddings}
    assert device.placed == sum(graph_weights.values())  # each weight once, whichever graphs take it
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq)
    logits = model.prefill(torch.arange(3, 31), 0, caches)  # 28 tokens: two chunks of 16
    held = [(b, b.value.unsafe_buffer_pointer()) for b in buffers(caches)]
    assert len(held) == 2 * len(model.model.layers)
    c = model.config
    per_step = c.hidden_size * 4 + 2 * c.head_dim * 4 + 4  # x, cos, sin (fp32), positions (int32), for every layer
    used = record_contexts(model.model.layers[0].decode)
    ids, positions = logits.argmax(-1, keepdim=True), torch.tensor([28])
    sent, received = device.sent, device.received
    for _ in range(12):
        logits = model.decode(ids, positions, caches)
        ids, positions = logits.argmax(-1), positions + 1
    assert device.sent - sent == 12 * per_step + 4  # + the batch's slots, once: the same tensor every step
    assert device.received - received == 12 * c.vocab_size * 4  # the logits
    assert used == [32] * 4 + [64] * 8
    assert [b.value.unsafe_buffer_pointer() for b, _ in held] == [p for _, p in held]  # no cache copied
    assert device.placed == sum(graph_weights.values())  # nothing placed again


def test_crossed_weights_are_refused_at_load(xla_bundle, tmp_path):
    """The JAX module takes each weight as a dict of one key, its path: gate_proj and
    up_proj crossed in the manifest are refused; the HLO's parameters are named by them."""
    import shutil

    from aotc.errors import BundleError

    _, result = xla_bundle
    hlo = next(result.out.glob("entries/LlamaDecoderLayer.decode/*/hlo.txt")).read_text()
    at = [w.path for w in result.manifest.entry("LlamaDecoderLayer.decode").weights].index("mlp.gate_proj.weight")
    assert re.search(rf"args_{at}___mlp_gate_proj_weight__\S* = f32\[\d+,\d+\]\S* parameter\({at}\)", hlo), hlo[:2000]
    bundle = tmp_path / "crossed"
    shutil.copytree(result.out, bundle)
    cross_weights(bundle / "manifest.json")
    with pytest.raises(
        BundleError, match=r"entries/LlamaDecoderLayer\.\w+/b\d+\S*: the artifact takes weight \d+ as 'mlp.gate_proj.weight', the entry lists 'mlp.up_proj.weight' there"
    ):
        Bundle.load(bundle)


def test_run_check_is_token_exact(xla_bundle):
    _, result = xla_bundle
    runner = CliRunner()
    for max_batch in ("1", "2"):
        r = runner.invoke(
            app,
            [
                "run",
                str(result.out),
                "--check",
                "--json",
                "--max-new-tokens",
                "6",
                "--max-batch",
                max_batch,
                "--prompt",
                "Hello",
                "--prompt",
                "What is the capital of France?",
                "--prompt",
                "one, two, three, four",
            ],
        )
        assert r.exit_code == 0, r.output
        report = json.loads(r.output)
        assert report["backend"] == "xla"
        assert_check_report(report, "xla")


def test_near_ties_match_eager_up_to_the_tie(xla_bundle, tmp_path):
    """The bundle's model with a head drawn at transformers' scale: top logits within 1e-2."""
    model, result = xla_bundle
    near_ties = write_tiny(tmp_path / "near-ties", arch=model.name, layers=2, head_std=0.02)
    assert assert_generation_matches_eager(result.out, near_ties) < 1e-2


def test_the_prefix_cache_copies_between_slots_on_the_device(xla_bundle):
    """A prompt sharing 40 tokens with a running one: the JAX device copies them between
    slots itself (no byte to or from the host beyond the steps' own activations and logits),
    and the request answers as it does alone."""
    from aotc.runtime.engine import Engine

    model_dir, result = xla_bundle
    bundle, model = Bundle.load(result.out), load_model(model_dir).model
    bundle.bind(model)
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq)
    device = bundle.backend.device_for()

    def engine(prefix_cache):
        return Engine(model, caches, slots=bundle.cache_slots, max_seq=bundle.max_seq, chunk=16, prefix_cache=prefix_cache)

    shared = list(range(3, 43))
    alone = engine(False)
    solo = alone.submit(shared + [50, 51], 6)
    alone.run()
    served = engine(True)
    assert served.prefix_off is None
    first = served.submit(shared + [7], 12)
    while not first.new_ids:
        served.step()
    crossed = []
    copy = device.copy_positions

    def watched(*args):  # the bytes that cross during each copy
        before = device.sent + device.received
        out = copy(*args)
        crossed.append(device.sent + device.received - before)
        return out

    device.copy_positions = watched
    second = served.submit(shared + [50, 51], 6)
    served.run()
    assert second.cached == 40 and second.slot != first.slot
    assert crossed == [0] * 2 * len(model.model.layers)  # k and v, layer by layer, on the device
    assert second.new_ids == solo.new_ids
