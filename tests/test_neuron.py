"""The neuron backend: the neuronx-cc driver, cross-builds and --resume.

The driver is tested against tests/fakes/neuronx-cc, a test double put on
PATH here only. A test marked `neuron` compiles and runs for real where the
Neuron SDK is installed.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import aotc
from aotc import fp8
from aotc.backends import neuron
from aotc.backends.neuron import NeuronBackend
from aotc.backends.neuronx_cc import FP8_FLAG, NeuronOptions, compiler_command, has_fp8
from aotc.builder import BuildOptions, build, resume
from aotc.cli import app
from aotc.errors import AotcError, BackendError, BundleError
from aotc.format import read_manifest
from aotc.runtime import Bundle
from aotc.trace import Shapes, find_variants, trace

from .conftest import assert_check_report

# Building lowers to HLO through JAX; the driver's own tests (command line, options, the
# fp8 check) need neither JAX nor the compiler and always run.
lowers = pytest.mark.skipif(NeuronBackend().can_compile() is not None, reason=str(NeuronBackend().can_compile()))

FAKES = Path(__file__).parent / "fakes"
# One build process: a worker would spend longer importing torch and jax than lowering these graphs.
OPTIONS = dict(batch_buckets=(1, 2), chunk_buckets=(64,), max_seq=64, backend="neuron", use_cache=False, jobs=1)


@pytest.fixture()
def stand_in(monkeypatch, tmp_path):
    """neuronx-cc on PATH is the test double; returns a reader of the argv it was called with."""
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NEURONX_CC_CALLS", str(calls))
    _forget_compiler()
    yield lambda: [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    _forget_compiler()


def _forget_compiler():
    """What aotc found of neuronx-cc is cached per process: the version, and the operators
    the lint checks against (the double's list leaves out ops that a graph of another test
    in this worker has, e.g. remainder)."""
    neuron.compiler_version.cache_clear()
    neuron.listed_operators.cache_clear()


@pytest.fixture()
def no_compiler(monkeypatch):
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "neuronx-cc").exists()))
    _forget_compiler()
    yield
    _forget_compiler()


def test_command_line_from_typed_options():
    options = NeuronOptions(target="trn1", optlevel=3, lnc=1, auto_cast="matmult", auto_cast_type="bf16")
    assert compiler_command(options, "hlo.pb", "model.neff", fp8=False) == [
        "neuronx-cc", "compile", "hlo.pb", "--framework", "XLA", "--target", "trn1", "--model-type", "transformer",
        "--optlevel=3", "--auto-cast", "matmult", "--auto-cast-type", "bf16", "--logical-nc-config", "1", "--output", "model.neff",
    ]  # fmt: skip
    assert FP8_FLAG in compiler_command(NeuronOptions(), "hlo.pb", "model.neff", fp8=True)
    assert FP8_FLAG == "--internal-hlo2tensorizer-options=--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


@pytest.mark.parametrize(
    "flags, message",
    [({"target": "trn9"}, "target='trn9'"), ({"auto_cast": "some"}, "auto_cast='some'"), ({"speed": 1}, "neuron backend's flags are")],
)
def test_bad_options_are_errors_naming_the_flag(flags, message):
    with pytest.raises(BackendError, match=re.escape(message)):
        NeuronBackend(**flags)


class Fp8CacheLayer(torch.nn.Module):
    @aotc.entry(bucket="batch", caches=("cache",))
    def step(self, x, cache):
        cache[torch.arange(x.shape[0])] = x.to(torch.float8_e4m3fn)
        return x * 2

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, 4), torch.zeros(3, 4, dtype=torch.float8_e4m3fn))


class Fp32Layer(torch.nn.Module):
    @aotc.entry(bucket="batch")
    def step(self, x):
        return x + 1

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, 4),)


def test_graphs_with_fp8_tensors_get_the_fp8_flag():
    shapes = Shapes(slots=3, max_seq=8)
    graph = lambda layer: trace(find_variants(torch.nn.ModuleList([layer]), shapes)[0], 2, shapes).graph_module  # noqa: E731
    assert has_fp8(graph(Fp8CacheLayer()))
    assert not has_fp8(graph(Fp32Layer()))


@lowers
def test_compile_with_the_compiler_present(tiny_dir, tmp_path, stand_in, monkeypatch):
    monkeypatch.setenv("FAKE_NEURONX_CC_MODE", "ok")
    result = build(BuildOptions(tiny_dir, out=tmp_path / "b", compiler_flags={"target": "trn1", "lnc": 1}, **OPTIONS))
    calls = stand_in()
    assert len(calls) == 7  # one compile per entry and bucket, and the copy between cache slots
    for _, a in result.manifest.compiled():
        folder = result.out / a.dir
        assert set(a.files) == {"hlo.pb", "hlo.txt", "command.txt", "model.neff", "compile.log"}
        assert a.pending is None
        recorded = shlex.split((folder / "command.txt").read_text())
        assert recorded[1:] in calls  # the command line kept beside the NEFF is the one that ran
        assert recorded[recorded.index("--target") + 1] == "trn1" and "--logical-nc-config" in recorded
        assert "Compiler status PASS" in (folder / "compile.log").read_text()
    assert "neuronx-cc-2.99.0.0+test-double" in result.manifest.backend.version


@pytest.mark.slow  # CI tests the lint on a jax program (test_verify.py::test_lint_names_the_node_and_its_source_line); this one lowers a whole model
@lowers
def test_ops_the_compiler_does_not_list_are_lint_findings_naming_the_source_line(tiny_dir, tmp_path, stand_in, monkeypatch):
    monkeypatch.setenv("FAKE_NEURONX_CC_MODE", "ok")
    monkeypatch.setenv("FAKE_NEURONX_CC_UNLISTED", "Rsqrt")  # this compiler's list-operators leaves rsqrt out
    neuron.listed_operators.cache_clear()
    try:
        result = build(BuildOptions(tiny_dir, out=tmp_path / "b", **OPTIONS))
    finally:
        neuron.listed_operators.cache_clear()
    lint = {f for _, a in result.manifest.artifacts() for f in a.extra.lint}
    assert lint and all("rsqrt, which neuronx-cc list-operators does not list" in f for f in lint), lint
    assert all(f.startswith("rsqrt") and 'aotc/models/llama.py", line' in f for f in lint), lint
    r = CliRunner().invoke(app, ["verify", str(result.out), "--strict"])
    assert r.exit_code == 1 and "neuron lint: rsqrt" in r.output


@lowers
def test_compiler_error_quotes_the_ncc_code_and_the_log(tiny_dir, tmp_path, stand_in, monkeypatch):
    monkeypatch.setenv("FAKE_NEURONX_CC_MODE", "error")
    with pytest.raises(BackendError, match=r"neuronx-cc failed with NCC_IBCG902; log: .*compile.log"):
        build(BuildOptions(tiny_dir, out=tmp_path / "b", **OPTIONS))
    assert not (tmp_path / "b").exists()


@lowers
def test_compiler_killed_by_signal_9_is_an_out_of_memory_message(tiny_dir, tmp_path, stand_in, monkeypatch):
    monkeypatch.setenv("FAKE_NEURONX_CC_MODE", "kill")
    with pytest.raises(BackendError, match=r"killed by signal 9, most likely for lack of memory .* --jobs N"):
        build(BuildOptions(tiny_dir, out=tmp_path / "b", **OPTIONS))


@lowers
def test_cross_build_then_resume(tiny_dir, tmp_path, monkeypatch, no_compiler):
    runner = CliRunner()
    out = tmp_path / "bundle"
    command = ["build", str(tiny_dir), "--backend", "neuron", "--cache-dir", str(tmp_path / "cache"), "--buckets", "1,2", "--prefill-chunk", "64", "--max-seq", "64"]  # fmt: skip
    r = runner.invoke(app, [*command, "--jobs", "1", "-o", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    # Built again, from the cache's recipe: the copy's files come from the cache with the rest.
    again = runner.invoke(app, [*command, "-o", str(tmp_path / "again")])
    assert again.exit_code == 0, again.output
    copied = read_manifest(tmp_path / "again").copies
    assert [c.artifact.served for c in copied] == ["cache"] and copied[0].artifact.files == read_manifest(out).copies[0].artifact.files
    assert all((tmp_path / "again" / "copies/0" / name).is_file() for name in copied[0].artifact.files)
    shown = runner.invoke(app, ["inspect", str(out)], env={"COLUMNS": "200"})
    assert "the cache copy of float32[3, 2, 64, 64] along dim 2: copies/0" in shown.output
    # Five graphs, and the copy between cache slots of the k and v allocations (one shape).
    assert "7 artifacts are pending" in said and f"aotc build --resume {out}" in said
    assert [(c.shape, c.dtype, c.dim, c.artifact.dir) for c in read_manifest(out).copies] == [([3, 2, 64, 64], "float32", 2, "copies/0")]
    for _, a in read_manifest(out).compiled():
        assert a.pending == "neuronx-cc was not on PATH on the build machine"
        assert set(a.files) == {"hlo.pb", "hlo.txt", "command.txt"}
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["copies"][0]["artifact"]["dir"] = "entries/LMHead.forward/b1"  # another artifact's folder
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"copies\[0\].artifact.dir: 'entries/LMHead.forward/b1', not 'copies/0'"):
        read_manifest(out)
    manifest["copies"][0]["artifact"]["dir"] = "copies/0"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"7 artifacts are pending, not compiled .*the cache copy of float32\[3, 2, 64, 64\] along dim 2\. .*aotc build --resume"):
        Bundle.load(out)
    r = runner.invoke(app, ["run", str(out)])
    assert r.exit_code == 2 and "LlamaDecoderLayer.decode bucket 1" in " ".join(r.output.split())
    with pytest.raises(AotcError, match="neuronx-cc is not on PATH"):
        resume(out)

    # A tampered command.txt (sha256 fixed in the manifest) is never run: resume makes
    # the compiler's argv from the manifest's typed flags.
    marker = tmp_path / "ran"
    manifest = json.loads((out / "manifest.json").read_text())
    for a in [a for e in manifest["entries"] for a in e["artifacts"]] + [c["artifact"] for c in manifest["copies"]]:
        (out / a["dir"] / "command.txt").write_text(f"touch {marker}\n")
        a["files"]["command.txt"] = hashlib.sha256((out / a["dir"] / "command.txt").read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    # On a "Neuron host": the compiler is there; resume compiles exactly the pending ones.
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NEURONX_CC_CALLS", str(calls))
    neuron.compiler_version.cache_clear()
    r = runner.invoke(app, ["build", "--resume", str(out)])
    assert r.exit_code == 0, r.output
    assert "compiled 7 pending artifacts" in r.output and "the cache copy of float32[3, 2, 64, 64] along dim 2" in " ".join(r.output.split())
    assert len(calls.read_text().splitlines()) == 7
    assert not marker.exists()
    manifest = read_manifest(out)
    assert "neuronx-cc-2.99.0.0+test-double" in manifest.backend.version
    for _, a in manifest.compiled():
        assert a.pending is None and "model.neff" in a.files
    assert " ".join(runner.invoke(app, ["build", "--resume", str(out)]).output.split()).endswith("nothing pending")
    if importlib.util.find_spec("nrtpy") is None:
        with pytest.raises(BackendError, match="running NEFFs needs the Neuron runtime's Python API"):
            Bundle.load(out)


@pytest.mark.slow  # CI builds trn2 with fp8 weights (test_trn2_fp8_bundle_flag_and_rescaled_weights)
@lowers
def test_trn2_cross_build_with_fp8_caches_carries_the_fp8_flag(tiny_dir, tmp_path, no_compiler):
    """--kv-cache-dtype fp8 for trn2: the decoder layers' graphs take fp8 cache regions and
    their compiler commands get the fp8 flag; caches quantize to trn2's 224. Traced again
    from the options the manifest records (aotc bisect), each decode artifact of its two
    context buckets has that artifact's own cache key; a manifest that says other options
    (full-precision caches) re-traces another graph, which is refused."""
    from aotc.builder.key import retrace
    from aotc.models.loader import load_model

    options = dict(OPTIONS, batch_buckets=(1,))  # one batch bucket: the cache graphs are decode's and prefill's at each context bucket
    result = build(BuildOptions(tiny_dir, out=tmp_path / "b", compiler_flags={"target": "trn2"}, kv_cache_dtype="fp8", context_buckets=(32,), **options))
    manifest = result.manifest
    assert manifest.model.kv_cache.fp8_max == 224.0
    backend = neuron.NeuronBackend(**manifest.backend.flags)
    entry = manifest.entry("LlamaDecoderLayer.decode")
    assert sorted({a.context for a in entry.artifacts}) == [32, 64]
    for art in entry.artifacts:
        assert retrace(manifest, entry, art, tiny_dir, backend).key == art.cache_key
    other = copy.deepcopy(manifest)
    other.model.kv_cache.dtype = "auto"
    with pytest.raises(AotcError, match=r"LlamaDecoderLayer.decode bucket 1 context 32 traced from .* has cache key \w+, but the bundle's artifact has"):
        retrace(other, entry, entry.artifacts[0], tiny_dir, backend)
    for e, a in result.manifest.artifacts():
        command = (result.out / a.dir / "command.txt").read_text()
        fp8_caches = any(i.dtype == "float8_e4m3fn" and i.kind == "cache" for i in a.inputs)
        assert (FP8_FLAG in command) == fp8_caches == a.extra.fp8 == e.id.startswith("LlamaDecoderLayer"), e.id
    # The prefix cache's copies: one per region of the packed rows (k's and v's alike), the fp8 one flagged.
    copies = [(c.dtype, c.shape, c.artifact.extra.fp8, FP8_FLAG in (result.out / c.artifact.dir / "command.txt").read_text()) for c in manifest.copies]
    assert copies == [("float8_e4m3fn", [2, 2, 64, 64], True, True), ("float32", [2, 2, 64, 1], False, False)], copies
    ids = torch.randint(3, 512, (20,))
    model = load_model(tiny_dir, kv_cache=result.manifest.model.kv_cache).model
    caches = model.allocate_caches(2, 64)
    model.prefill(ids, 0, caches)
    values = caches["k"][..., :64].view(torch.float8_e4m3fn).float()
    assert 112 < values.abs().max() <= 224  # each group's largest lands in the top binade under 224 (not 448's)
    # ...scaled so, not clamped there: layer 0's keys (computed before any cache read) are
    # the full-precision model's, to fp8's 3 mantissa bits
    full = load_model(tiny_dir).model
    want = full.allocate_caches(2, 64)
    full.prefill(ids, 0, want)
    got = model.model.layers[0].self_attn.k_rows.read(caches["k"][0], (), torch.float32)
    assert ((got - want["k"][0]).abs() <= want["k"][0].abs().amax(-1, keepdim=True) * 2**-4).all()


@lowers
def test_trn2_fp8_bundle_flag_and_rescaled_weights(tmp_path, stand_in, monkeypatch):
    """A trn2 bundle of an fp8 checkpoint: the fp8 flag goes to exactly the graphs with
    fp8 inputs, and bind rewrites each fp8 weight once, on the host, so that trn2's
    IEEE e4m3 reading of the bytes with the doubled scales gives the checkpoint's values."""
    import ml_dtypes
    import numpy as np

    from aotc import lowp_weights
    from aotc.layout import stored_of
    from aotc.models.loader import load_model
    from aotc.models.tiny import write_tiny
    from aotc.runtime.bundle import bound_weights

    monkeypatch.setenv("FAKE_NEURONX_CC_MODE", "ok")
    model_dir = write_tiny(tmp_path / "m", layers=2, quantize="fp8", layout="deepseek")  # E8M0 scales
    result = build(BuildOptions(model_dir, out=tmp_path / "b", compiler_flags={"target": "trn2"}, **OPTIONS))
    for e, a in result.manifest.artifacts():
        command = (result.out / a.dir / "command.txt").read_text()
        fp8_inputs = any(w.dtype == "float8_e4m3fn" for w in e.weights)
        assert (FP8_FLAG in command) == fp8_inputs == a.extra.fp8 == e.id.startswith("LlamaDecoderLayer"), e.id
    decode = next(e for e in result.manifest.entries if e.id == "LlamaDecoderLayer.decode")
    assert {w.stored.fp8_reading for w in decode.weights if w.stored} == {"e4m3"}

    reference = load_model(model_dir, stored=True).model
    model = load_model(model_dir, stored=True).model
    weights = {k: w.tensors() for k, w in bound_weights(result.manifest, model, result.out).items()}
    again = {k: w.tensors() for k, w in bound_weights(result.manifest, model, result.out).items()}  # a second bind must not rescale again
    checked = 0
    for path in decode.instances:
        original = stored_of(reference.get_submodule(path))
        for spec, t, t2 in zip(decode.weights, weights[decode.id, path], again[decode.id, path]):
            assert torch.equal(t.view(torch.uint8), t2.view(torch.uint8))
            if spec.stored is None or spec.stored.part != "values":
                continue
            before = original[spec.path]
            scale = next(w for w, s in zip(weights[decode.id, path], decode.weights) if s.path == spec.path and s.stored.part == "scale")
            assert torch.equal(scale, before.scale + 1)  # E8M0: the exponent byte + 1, a doubled scale
            as_e4m3 = torch.from_numpy(t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3).astype(np.float32))
            assert as_e4m3.abs().max() <= 224 < 240  # e4m3fn's 448, halved: within trn2's range
            trn2 = lowp_weights.dequantize("fp8", as_e4m3.to(torch.float8_e4m3fn), scale, torch.float32)  # e4m3 values, doubled scales
            want = lowp_weights.dequantize("fp8", before.values, before.scale, torch.float32)
            rows, cols = want.shape
            step = lowp_weights._expand(lowp_weights.scale_factors(before.scale), rows, cols, lowp_weights.FP8_BLOCK)
            inexact = torch.from_numpy(~fp8.HALVE_EXACT[before.values.view(torch.uint8).numpy()])
            torch.testing.assert_close(trn2[~inexact], want[~inexact], rtol=0, atol=0)
            # The 16 subnormal bytes: v/2 rounded by at most 2**-10, times the doubled scale
            assert ((trn2 - want).abs()[inexact] <= 2**-10 * (2 * step[inexact])).all() and inexact.any()
            checked += 1
    assert checked == 14  # 7 fp8 weights in each of 2 layers


@pytest.mark.neuron
@pytest.mark.skipif(shutil.which("neuronx-cc") is None or importlib.util.find_spec("nrtpy") is None, reason="needs the Neuron SDK: neuronx-cc and the Neuron runtime (nrtpy)")
def test_real_neuron_compile_and_run(tiny_dir, tmp_path):
    runner = CliRunner()
    out = tmp_path / "bundle"
    r = runner.invoke(
        app, ["build", str(tiny_dir), "--backend", "neuron", "--no-cache", "--jobs", "1", "--buckets", "1,2", "--prefill-chunk", "64", "--max-seq", "64", "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["run", str(out), "--check", "--json", "--prompt", "Hello", "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert_check_report(json.loads(r.output), "neuron")


# -- a Neuron host simulated on the CPU -------------------------------------------------
#
# neuronx-cc and nrtpy are test doubles (tests/fakes): the compiler writes its HLO into the
# NEFF, and nrtpy, with exactly the documented API, runs it on XLA's CPU client and counts
# the bytes that cross. aotc's neuron runtime then runs as it would on a Neuron host.

CROSSING = " ".join(["one two three four five six seven"] * 6)  # over two chunks of 16 tokens


@pytest.fixture()
def neuron_host(monkeypatch, stand_in):
    """The compiler double on PATH and the nrtpy double importable; its counters."""
    monkeypatch.setenv("FAKE_NEURONX_CC_MODE", "ok")
    monkeypatch.syspath_prepend(str(FAKES))
    from nrtpy._double import COUNTERS

    COUNTERS.reset()
    yield COUNTERS


def _simulated_build(model_dir, out, *flags):
    r = CliRunner().invoke(app, [
        "build", str(model_dir), "--backend", "neuron", *flags, "--buckets", "1,4", "--prefill-chunk", "16", "--max-seq", "128",
        "--context-buckets", "64", "--no-cache", "--jobs", "1", "-o", str(out),
    ])  # fmt: skip
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def simulated_bundle(tiny_dir, tmp_path_factory):
    """The tiny model built by the compiler double (a simulated Neuron host), once for the
    tests that run it."""
    out = tmp_path_factory.mktemp("simulated") / "bundle"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
        mp.setenv("FAKE_NEURONX_CC_MODE", "ok")
        mp.setenv("FAKE_NEURONX_CC_CALLS", str(out.parent / "calls.jsonl"))
        neuron.compiler_version.cache_clear()
        try:
            _simulated_build(tiny_dir, out)
        finally:
            neuron.compiler_version.cache_clear()
    return out


def _simulated_run(model_dir, out, *flags):
    _simulated_build(model_dir, out, *flags)
    _simulated_checks(out)


def _simulated_checks(out):
    runner = CliRunner()
    for prompts in (["Hello"], ["Hello", CROSSING, "the quick brown fox"]):  # batch 1, and 3 in bucket 4
        asked = [a for p in prompts for a in ("--prompt", p)]
        r = runner.invoke(app, ["run", str(out), "--check", "--json", "--max-new-tokens", "8", "--max-batch", "3", *asked])
        assert r.exit_code == 0, r.output
        check = json.loads(r.output)["check"]
        assert check["passed"] and check["tokens_equal"], check["per_prompt"]
    r = runner.invoke(app, ["verify", str(out), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    # Each NEFF ran through the runtime, and hlo.pb on XLA's CPU client against it.
    assert report["passed"] and {(a["reference"], a["reference_vs"]) for a in report["artifacts"]} == {("hlo.pb", "model.neff")}


@lowers
def test_a_simulated_neuron_host_builds_runs_check_and_verifies(simulated_bundle, neuron_host):
    _simulated_checks(simulated_bundle)
    assert neuron_host.executions > 0


@pytest.mark.slow
@lowers
def test_a_simulated_trn2_host_runs_v4_with_rescaled_fp8_weights(tmp_path, neuron_host):
    """fp8 checkpoint weights rescaled once at bind for trn2, which reads fp8 bytes as IEEE
    e4m3 (so does the double, given the compiler's fp8 flag): tokens exact."""
    from aotc.models.tiny import write_tiny

    model_dir = write_tiny(tmp_path / "v4", arch="deepseek_v4", layers=3, quantize="fp8")
    _simulated_run(model_dir, tmp_path / "bundle", "--compiler-flag", "target=trn2")


@pytest.mark.slow  # 30 s here; test_a_simulated_neuron_host_builds_runs_check_and_verifies runs the NEFFs in CI
@lowers
def test_each_neff_execution_sends_its_activations_only_and_no_cache_crosses(tiny_dir, simulated_bundle, neuron_host):
    """Bound once: weights sent at bind; caches allocated on the device (their zeros sent
    once: nrtpy has no zeroed allocation) and never sent or read again; each execution
    sends at most 1% of the weight bytes (its activations, refilled in place); only
    outputs torch reads (the logits, prefill's last row) come back."""
    from aotc.models.loader import load_model
    from aotc.runtime.engine import Engine
    from aotc.runtime.resident import buffers

    bundle, model = Bundle.load(simulated_bundle), load_model(tiny_dir).model
    bundle.bind(model)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "model.embed_tokens.weight")
    assert neuron_host.to_device >= weight_bytes  # placed at bind (and the outputs' buffers)
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq)
    held = [b.value for b in buffers(caches)]
    neuron_host.reset()
    logits = model.prefill(torch.arange(3, 43), 0, caches)  # 40 tokens: three chunks
    ids, positions = logits.argmax(-1, keepdim=True), torch.tensor([40])
    for _ in range(30):  # across the 64-position context bucket
        logits = model.decode(ids, positions, caches)
        ids, positions = logits.argmax(-1), positions + 1
    assert neuron_host.executions == 3 * 2 + 1 + 30 * 3  # 2 layers a chunk, the head once; 2 layers and the head a step
    assert max(neuron_host.before_execution) <= 0.01 * weight_bytes, max(neuron_host.before_execution)
    assert all(neuron_host.per_tensor[id(t)] == [0, 0] for t in held)  # caches: nothing sent, nothing read
    assert neuron_host.to_host == 16 * model.config.hidden_size * 4 + 31 * model.config.vocab_size * 4  # a chunk's rows for x[-1:], then logits

    # The prefix cache copies between slots with the bundle's copy NEFF (nrtpy has no copy
    # between device tensors): a prompt sharing 40 tokens with a running one prefills the
    # rest only, and answers as alone; still no cache byte crosses, and the copy sends its
    # three indices only.
    first, second = list(range(3, 50)), list(range(3, 43)) + [60, 61, 62]
    alone = []
    for prompt in (first, second):
        engine = Engine(model, caches, slots=bundle.cache_slots, max_seq=bundle.max_seq, chunk=16, prefix_cache=False)
        alone.append(engine.submit(prompt, 6))
        engine.run()
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq)  # fresh: nothing of the runs alone
    held = [b.value for b in buffers(caches)]
    engine = Engine(model, caches, slots=bundle.cache_slots, max_seq=bundle.max_seq, chunk=16, prefix_cache=True)
    assert engine.prefix_off is None
    neuron_host.reset()
    running = engine.submit(first, 6)
    while running.prefilled < len(first):
        engine.step()
    shared = engine.submit(second, 6)
    engine.run()
    assert (shared.cached, engine.stats.prefill_tokens) == (40, len(first) + 3)
    assert (running.new_ids, shared.new_ids) == (alone[0].new_ids, alone[1].new_ids)
    assert all(neuron_host.per_tensor[id(t)] == [0, 0] for t in held)
    for kind in ("k", "v"):  # both slots hold the shared 40 positions, bit for bit
        rows = caches[kind].to_host()
        assert torch.equal(rows[:, running.slot, :, :40], rows[:, shared.slot, :, :40]) and running.slot != shared.slot


def test_the_nrtpy_double_refuses_what_nrtpy_refuses(tmp_path):
    """The double's own contract (the Neuron SDK docs, "nrtpy model/tensor API"): device
    tensors only, known names, equal byte sizes."""
    import sys

    import numpy as np

    sys.path.insert(0, str(FAKES))
    try:
        import nrtpy
    finally:
        sys.path.remove(str(FAKES))
    t = nrtpy.NrtpyTensor.from_numpy(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="Size mismatch: source 8 bytes, target 24 bytes"):
        t.write_from_numpy(np.zeros(2, np.float32))
    t.write_from_numpy(np.arange(6, dtype=np.float32))
    assert t.numpy().ravel().tolist() == list(range(6))
    with pytest.raises(nrtpy.NrtError, match="Failed to load model"):
        nrtpy.NrtpyModel.load_from_neff(tmp_path / "missing.neff")
    # A NEFF as the compiler double writes one: a header line, then the HLO, named as aotc names it.
    import jax
    import jax.numpy as jnp

    pb = jax.jit(lambda x: (x * 2,)).lower(jnp.zeros((2, 3), jnp.float32)).compiler_ir("hlo").as_serialized_hlo_module_proto()
    (tmp_path / "m.neff").write_bytes(nrtpy.MAGIC + b"{}\n" + neuron.named_hlo(pb)[0])
    model = nrtpy.NrtpyModel.load_from_neff(tmp_path / "m.neff")
    assert {n: (i.shape, i.size, i.dtype) for n, i in model.input_tensors_info.items()} == {"input0": ([2, 3], 24, "float32")}
    assert list(model.output_tensors_info) == ["output0"]
    with pytest.raises(AttributeError, match="tensor_ref"):
        model(inputs={"input0": np.zeros((2, 3), np.float32)})  # a numpy array is not a device tensor
    with pytest.raises(ValueError, match=r"Unknown input\(s\) \{'x'\}"):
        model(inputs={"x": t})
    with pytest.raises(AssertionError, match="expected shape"):
        model(inputs={"input0": nrtpy.NrtpyTensor.from_numpy(np.zeros(6, np.float32))})
    out = nrtpy.NrtpyTensor.from_numpy(np.zeros((2, 3), np.float32))
    assert model(inputs={"input0": t}, outputs={"output0": out}) is None
    assert out.numpy().ravel().tolist() == [2.0 * i for i in range(6)]


class _Reduce(torch.nn.Module):
    def forward(self, x):
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x, "sum", "0"), funcol.reduce_scatter_tensor(x, "sum", 0, "0")


@lowers
def test_integer_reductions_and_the_global_view_form_are_refused_before_neuronx_cc():
    """neuronx-cc reduces in f32 and refuses an integer all-reduce or reduce-scatter
    (NCC_EVRF061/063); a channel id, global device ids or a Shardy custom call is JAX's
    global-view form, not the per-rank module it takes."""
    from aotc import parallel
    from aotc.backends.xla_lower import jitted

    texts = {}
    with parallel.tracing(parallel.record(2)):
        for dtype in (torch.float32, torch.int32):
            program = torch.export.export(_Reduce(), (torch.ones(4, 3, dtype=dtype),)).run_decompositions({})
            fn, specs = jitted(program.graph_module)
            texts[dtype] = neuron.named_hlo(fn.lower(*specs).compiler_ir("hlo").as_serialized_hlo_module_proto())[1]  # as compile() reads it
    assert neuron.refused(texts[torch.float32]) == []
    found = neuron.refused(texts[torch.int32])
    assert len(found) == 2 and all("NCC_EVRF061/063" in f for f in found), found
    assert "integer all-reduce (s32[4,3])" in found[0] and "integer reduce-scatter (s32[2,3])" in found[1], found
    # JAX's own collectives (shard_map) carry these; aotc's lowering never does.
    global_view = texts[torch.float32].replace("replica_groups={{0,1}}", "channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true", 1)
    (found,) = neuron.refused(global_view)
    assert "all-reduce" in found and "a channel id or global device ids" in found
    sdy = 'ROOT %r = f32[4,3]{1,0} custom-call(f32[4,3]{1,0} %x), custom_call_target="xla.sdy.GlobalToLocalShape"'
    assert "a Shardy custom call" in neuron.refused(sdy)[0]


@lowers
def test_a_build_whose_hlo_the_neuron_backend_refuses_stops_naming_it_and_leaves_no_bundle(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(neuron, "refused", lambda text: ["all_reduce: aotc_all_reduce.7 all-reduce: an integer all-reduce (s32[4,3])"])
    with pytest.raises(BackendError, match=r"does not hand neuronx-cc:\n  all_reduce: aotc_all_reduce.7 all-reduce: an integer all-reduce"):
        build(BuildOptions(tiny_dir, out=tmp_path / "b", batch_buckets=(1,), chunk_buckets=(16,), max_seq=64, backend="neuron", jobs=1, use_cache=False))
    assert not (tmp_path / "b").exists()


# -- ranks on NeuronCores ----------------------------------------------------------------


def _nrtpy():
    """The nrtpy double, imported from tests/fakes."""
    import sys

    sys.path.insert(0, str(FAKES))
    try:
        import nrtpy
    finally:
        sys.path.remove(str(FAKES))
    return nrtpy


def _collective_neff(path: Path, ranks: int, header: dict | None = None) -> Path:
    """A NEFF as the compiler double writes one, of a graph whose all-reduce spans `ranks` ranks."""
    from aotc import parallel
    from aotc.backends.xla_lower import jitted

    with parallel.tracing(parallel.record(ranks)):
        program = torch.export.export(_Reduce(), (torch.ones(4, 3),)).run_decompositions({})
        fn, specs = jitted(program.graph_module)
        pb = fn.lower(*specs).compiler_ir("hlo").as_serialized_hlo_module_proto()
    path.write_bytes(b"NEFF-test-double\n" + json.dumps(header or {"target": "trn2", "lnc": 2}).encode() + b"\n" + neuron.named_hlo(pb)[0])
    return path


@lowers
def test_the_nrtpy_double_refuses_collectives_loaded_as_nrt_refuses_them(tmp_path, monkeypatch):
    """A NEFF with collectives loads only for them (cc_enabled), as a rank of a world of
    more than one, with the root's address set, its replica groups within the world, and
    at the logical core size it was compiled for: each refused as NRT refuses it."""
    nrtpy = _nrtpy()
    monkeypatch.delenv("NEURON_RT_ROOT_COMM_ID", raising=False)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    two, four = _collective_neff(tmp_path / "two.neff", 2), _collective_neff(tmp_path / "four.neff", 4)
    load = nrtpy.NrtpyModel.load_from_neff
    with pytest.raises(nrtpy.NrtError, match=r"holds collectives \(all-reduce\); load it with cc_enabled"):
        load(two)
    with pytest.raises(nrtpy.NrtError, match="rank_id 0 of world_size 1"):
        load(two, cc_enabled=True)
    with pytest.raises(nrtpy.NrtError, match="rank_id 2 of world_size 2"):
        load(two, cc_enabled=True, rank_id=2, world_size=2)
    with pytest.raises(nrtpy.NrtError, match=r"NEURON_RT_ROOT_COMM_ID is not set \(rank 0's ip:port\)"):
        load(two, cc_enabled=True, rank_id=1, world_size=2)
    monkeypatch.setenv("NEURON_RT_ROOT_COMM_ID", "127.0.0.1:1")
    with pytest.raises(nrtpy.NrtError, match=r"replica groups name ranks \[2, 3\] outside world_size 2"):
        load(four, cc_enabled=True, rank_id=1, world_size=2)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    with pytest.raises(nrtpy.NrtError, match="compiled for logical NeuronCore size 2, NEURON_LOGICAL_NC_CONFIG=1"):
        load(two, cc_enabled=True, rank_id=1, world_size=2)
    with pytest.raises(nrtpy.NrtError, match=r"core_id 99: this process has \d+ NeuronCores"):
        load(two, core_id=99)


TAKE_CORE = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy, nrtpy
nrtpy.NrtpyTensor.from_numpy(numpy.zeros(1, numpy.float32))
print("took", flush=True)
sys.stdin.read()
"""


def test_two_processes_on_one_neuron_core_are_refused_as_nrt_refuses_them(tmp_path):
    """The runtime takes its visible cores for its process alone: a second process that
    asks for a core the first holds fails to start, naming the core."""
    import subprocess
    import sys

    env = dict(os.environ, NRTPY_SIM_HOST=str(tmp_path), NEURON_RT_VISIBLE_CORES="1")
    first = subprocess.Popen([sys.executable, "-c", TAKE_CORE, str(FAKES)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline() == "took\n"
        second = subprocess.run([sys.executable, "-c", TAKE_CORE, str(FAKES)], env=env, input="", capture_output=True, text=True)
        assert second.returncode != 0 and "NRT_RESOURCE(4): NeuronCore 1 is in use by another process" in second.stderr, second.stderr[-2000:]
        other = subprocess.run([sys.executable, "-c", TAKE_CORE, str(FAKES)], env=dict(env, NEURON_RT_VISIBLE_CORES="0"), input="", capture_output=True, text=True)
        assert other.returncode == 0 and other.stdout == "took\n", other.stderr[-2000:]
    finally:
        first.kill()
        first.wait()


def test_each_rank_gets_a_core_of_its_own_the_root_and_the_bundles_logical_core_size(monkeypatch):
    """rank_environment: the LOCAL_RANK-th of the launch's cores (all: the rank's index),
    the root address given or rank 0's, NEURON_LOGICAL_NC_CONFIG as the NEFFs were
    compiled (trn2's default 2, or lnc); what cannot work is refused, naming the fix."""
    from aotc.backends.neuron import rank_environment

    for name in ("NEURON_RT_VISIBLE_CORES", "NEURON_LOGICAL_NC_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NEURON_RT_ROOT_COMM_ID", "10.0.0.1:4242")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    trn2, trn1 = NeuronOptions(), NeuronOptions(target="trn1")
    assert rank_environment(trn2, 3, 4) == {"NEURON_RT_VISIBLE_CORES": "1", "NEURON_RT_ROOT_COMM_ID": "10.0.0.1:4242", "NEURON_LOGICAL_NC_CONFIG": "2"}
    assert rank_environment(NeuronOptions(lnc=1), 3, 4)["NEURON_LOGICAL_NC_CONFIG"] == "1"
    assert "NEURON_LOGICAL_NC_CONFIG" not in rank_environment(trn1, 3, 4)  # no logical cores before trn2
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")  # the launch's cores: this local rank's is the second
    assert rank_environment(trn2, 3, 4)["NEURON_RT_VISIBLE_CORES"] == "5"
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "6")  # one core, given to this rank: kept
    assert "NEURON_RT_VISIBLE_CORES" not in rank_environment(trn2, 3, 4)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "3,5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(BackendError, match="NEURON_RT_VISIBLE_CORES=3,5: 2 cores for 4 local ranks; give each rank a core of its own"):
        rank_environment(trn2, 3, 4)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "a-b")
    with pytest.raises(BackendError, match="expected a NeuronCore index or a range such as 0-3"):
        rank_environment(trn2, 3, 4)
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    with pytest.raises(
        BackendError,
        match=r"NEURON_LOGICAL_NC_CONFIG=1, but the bundle's NEFFs were compiled for logical cores of 2 \(--logical-nc-config 2\); unset it, or rebuild with --compiler-flag lnc=1",
    ):
        rank_environment(trn2, 3, 4)
