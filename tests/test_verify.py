"""`aotc verify`: every artifact against eager, hlo.pb run as it is, padding confined to
the scratch slot, and the neuron lint."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from typer.testing import CliRunner

import aotc
from aotc.backends.neuronx_cc import lint
from aotc.builder import BuildOptions, build
from aotc.cli import app
from aotc.errors import BundleError
from aotc.format import artifact_dir
from aotc.models.loader import load_model
from aotc.models.tiny import write_tiny
from aotc.runtime import Bundle
from aotc.runtime.verify import verify

from .conftest import assert_verify_catches_differences, perturbing, rehash, wrap_programs

OPTIONS = dict(batch_buckets=(1, 3), chunk_buckets=(16,), max_seq=64)


@pytest.fixture(scope="module")
def xla_bundles(tiny_dir, tmp_path_factory):
    """The tiny model on xla, and the same model with another rms_norm_eps: graphs of the
    same signature that compute something else."""
    root = tmp_path_factory.mktemp("verify")
    other = write_tiny(root / "other-eps", layers=2, rms_norm_eps=0.5)
    return (
        build(BuildOptions(tiny_dir, out=root / "xla", backend="xla", **OPTIONS)).out,
        build(BuildOptions(other, out=root / "xla-other", backend="xla", **OPTIONS)).out,
    )


@pytest.fixture(scope="module")
def other_eps_export(tmp_path_factory):
    """tiny_bundle's graphs for the model with another rms_norm_eps: same signatures."""
    root = tmp_path_factory.mktemp("verify-export")
    other = write_tiny(root / "other-eps", layers=2, rms_norm_eps=0.5)
    return build(BuildOptions(other, out=root / "b", batch_buckets=(1, 2, 4), chunk_buckets=(16, 64), max_seq=256, backend="export")).out


def test_token_ids_beside_their_logits_are_judged_as_choices():
    """A whole decode step's argmax output: each row's token is eager's (or, in lower
    precision, the float32 reference's) argmax, or a near-tie with it within the error
    allowed at that logit, as `aotc run --check` judges a run's tokens; not its ids' values
    against a tolerance (bf16 SmolLM2's decode_step at batch 4: two ids 67 apart, a near-tie)."""
    from aotc.runtime.verify import ArtifactCheck, _compare

    logits = torch.tensor([[0.0, 5.0, 4.9999, 1.0], [2.0, 0.0, 0.0, 0.5]])
    want = [logits, logits.argmax(dim=-1)]  # ids [1, 0]

    def problems(ids, truth=None):
        check = ArtifactCheck("LlamaForCausalLM.decode_step", 2, None, 2, "", 1e-3)
        _compare([logits, torch.tensor(ids)], want, check, "model.pt2 output", truth)
        return check.problems

    assert problems([1, 0]) == [] and problems([2, 0]) == []  # 4.9999 ties 5.0 within 1e-3 x (1 + 5)
    assert problems([3, 0]) == ["model.pt2 output 1 chose token 3 at row 0 where the reference's is 1, 4 above it (a near-tie is within 0.001 x (1 + |top logit|))"]
    assert problems([1, 4]) == ["model.pt2 output 1 chose token 4 at row 1, outside the 4 logits"]
    # Lower precision: against the float32 reference's logits, within twice eager's error.
    truth = [logits + torch.tensor([[0.0, 0.0, 0.05, 0.0], [0.0] * 4]), want[1]]
    # The reference's top is 2 (5.0499); eager's error, 0.05 / (1 + 5.05), allows twice that x (1 + 5.05) = 0.1 below it.
    assert problems([1, 0], truth) == [] and problems([2, 0], truth) == []
    assert problems([3, 0], truth)[0].startswith("model.pt2 output 1 chose token 3 at row 0")
    # An integer output that is not eager's argmax of a float output is compared as values.
    check = ArtifactCheck("X.forward", 2, None, 2, "", 1e-3)
    _compare([logits, torch.tensor([0, 0])], [logits, torch.tensor([0, 1])], check, "out", None)
    assert check.problems and "differs by up to 1" in check.problems[0]


def test_export_bundle_verifies_every_artifact(tiny_bundle, monkeypatch):
    report = assert_verify_catches_differences(monkeypatch, tiny_bundle.out)
    got = {(a.entry, a.bucket, a.rows) for a in report.artifacts}
    # one row under each bucket where that still maps to it: padding runs
    assert got == {
        ("LlamaDecoderLayer.decode", 1, 1), ("LlamaDecoderLayer.decode", 2, 2), ("LlamaDecoderLayer.decode", 4, 3),
        ("LlamaDecoderLayer.prefill", 16, 15), ("LlamaDecoderLayer.prefill", 64, 63),
        ("LlamaDecoderLayer.prefill_fresh", 16, 15), ("LlamaDecoderLayer.prefill_fresh", 64, 63),
        ("LMHead.forward", 1, 1), ("LMHead.forward", 2, 2), ("LMHead.forward", 4, 3),
    }  # fmt: skip


def test_xla_bundle_runs_hlo_pb_as_it_is(xla_bundles):
    report = verify(xla_bundles[0])
    assert report.passed, [(a.entry, a.bucket, a.problems) for a in report.artifacts]
    assert all(a.reference == "hlo.pb" and a.reference_vs == "model.jax" and a.reference_max_abs == 0.0 for a in report.artifacts)


def test_a_replaced_hlo_pb_fails_naming_the_artifact(xla_bundles, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(xla_bundles[0], bundle)
    target = "entries/LlamaDecoderLayer.decode/b3-c64/hlo.pb"
    shutil.copy(xla_bundles[1] / target, bundle / target)  # same signature, rms_norm_eps 0.5
    rehash(bundle)
    r = CliRunner().invoke(app, ["verify", str(bundle)], env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output
    assert "LlamaDecoderLayer.decode bucket 3 context 64: hlo.pb output against model.jax 0 differs" in " ".join(r.output.split())
    report = verify(bundle)
    assert [(a.entry, a.bucket) for a in report.artifacts if not a.passed] == [("LlamaDecoderLayer.decode", 3)]


def test_padding_that_reaches_a_real_slot_fails(tiny_bundle, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle.out, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    for e in manifest["entries"]:
        for a in e["artifacts"]:
            for i in a["inputs"]:
                if i["name"] == "slots":
                    i["pad"] = 1  # padding rows write slot 1, a real sequence's, not the scratch slot
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    report = verify(bundle)
    failed = {(a.entry, a.bucket): a.problems for a in report.artifacts if not a.passed}
    assert set(failed) == {("LlamaDecoderLayer.decode", 4)} | {(f"LlamaDecoderLayer.{m}", b) for m in ("prefill", "prefill_fresh") for b in (16, 64)}
    for problems in failed.values():
        assert any(re.search(r"wrote [kv]_cache at \(1, [\d, ]+\) \(slot 1\), where eager wrote nothing", p) for p in problems), problems


def test_padding_rows_that_write_no_scratch_slot_fail(tiny_bundle, monkeypatch):
    """Steps whose padding rows write nothing (each cache's scratch slot put back after the
    call): their writes went elsewhere or nowhere, so each padded artifact fails, saying so."""
    from aotc.runtime import verify as verify_mod

    slots = tiny_bundle.manifest.shapes.cache_slots

    def scratch_kept(key, run):
        def step(args):
            kept = [a[slots - 1].clone() if a.dim() > 1 and a.shape[0] == slots else None for a in args]  # caches: [slots, ...]
            outs = run(args)
            for a, k in zip(args, kept):
                if k is not None:
                    a[slots - 1] = k
            return outs

        return step

    load = verify_mod.Bundle.load

    def loading(*a, **k):
        bundle = load(*a, **k)
        wrap_programs(bundle, scratch_kept)
        return bundle

    monkeypatch.setattr(verify_mod.Bundle, "load", loading)
    failed = _problems(verify(tiny_bundle.out))
    prefill = {("LlamaDecoderLayer.prefill", b, c) for b in (16, 64) for c in (16, 64, 256) if c >= b}  # 16, 64: the chunk contexts
    prefill |= {("LlamaDecoderLayer.prefill_fresh", b, None) for b in (16, 64)}
    assert set(failed) == {("LlamaDecoderLayer.decode", 4, 256)} | prefill, failed
    for problems in failed.values():
        assert problems == [f"program.pt2: the padding rows wrote nothing into any cache's scratch slot {slots - 1}"], problems


@pytest.mark.slow  # 40 s here; CI verifies a simulated neuron bundle (test_neuron.py) and hlo.pb on xla (test_xla_bundle_runs_hlo_pb_as_it_is)
def test_neuron_cross_build_verifies_through_hlo_pb(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no neuronx-cc: the artifacts stay pending
    out = build(BuildOptions(tiny_dir, out=tmp_path / "n", backend="neuron", use_cache=False, jobs=1, **OPTIONS)).out
    report = assert_verify_catches_differences(monkeypatch, out, reference=True)
    assert all(a.reference == "hlo.pb" and a.reference_vs == "eager" for a in report.artifacts)
    assert not any(a.lint for a in report.artifacts)  # int32 indices, no f64, no custom call
    # A lint finding is a warning, and an error with --strict.
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["entries"][0]["artifacts"][0]["extra"]["lint"] = ["add_3 at model.py:1: %add.1 add: f64, which neuronx-cc does not compute"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    runner = CliRunner()
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0
    r = runner.invoke(app, ["verify", str(out), "--strict"])
    assert r.exit_code == 1 and "neuron lint: add_3 at model.py:1" in r.output


def test_random_weights_without_a_model_folder(tiny_bundle, tmp_path, monkeypatch):
    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle.out, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["model"]["source"] = str(tmp_path / "gone")
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    report = assert_verify_catches_differences(monkeypatch, bundle)
    assert report.weights == "random"


def test_lint_names_the_node_and_its_source_line():
    import jax
    import jax.numpy as jnp

    def f(x, i):
        with jax.named_scope("add_1"):
            return x.astype(jnp.float64) + 1, i + i

    with jax.enable_x64(True):
        pb = jax.jit(f).lower(jnp.zeros((2,), jnp.float32), jnp.zeros((2,), jnp.int64)).compiler_ir("hlo").as_serialized_hlo_module_proto()
    found = lint(pb, {"add_1": "model.py:12"})
    assert any(x.startswith("add_1 at model.py:12: ") and "f64" in x for x in found)
    assert any("add_1 at model.py:12: " in x and "64-bit integer (s64[2])" in x for x in found)


class _IgnoresAnInput(torch.nn.Module):
    @aotc.entry(bucket="batch")
    def step(self, x, unused):
        return x + 1

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, 4), torch.zeros(rows, dtype=torch.long))


def test_hlo_pb_takes_every_graph_input_even_unread_ones():
    """The runtime passes every input positionally: an HLO that dropped one unread
    (jit's default) would shift the rest, as it did for DeepSeek V4's token ids."""
    from jax._src.lib import xla_client

    from aotc.backends import Specs
    from aotc.backends.xla_lower import lower
    from aotc.trace import Shapes, find_variants, trace

    shapes = Shapes(slots=3, max_seq=8)
    graph = trace(find_variants(torch.nn.ModuleList([_IgnoresAnInput()]), shapes)[0], 2, shapes)
    module = xla_client.XlaComputation(lower(graph.program, Specs(graph.inputs, graph.outputs)).hlo_proto).get_hlo_module().to_string()
    entry = module[module.index("ENTRY") :]
    assert entry.count(" parameter(") == 2


def test_entry_bucket_and_context_choose_what_verify_and_inspect_show(tiny_dir, tmp_path):
    out = build(BuildOptions(tiny_dir, out=tmp_path / "b", backend="export", batch_buckets=(1, 2), chunk_buckets=(16,), max_seq=64, context_buckets=(32,))).out
    report = verify(out, entry_id="LlamaDecoderLayer.decode", bucket=2, context=64)
    assert report.passed and [(a.entry, a.bucket, a.context) for a in report.artifacts] == [("LlamaDecoderLayer.decode", 2, 64)]
    assert [(a.bucket, a.context) for a in verify(out, entry_id="LlamaDecoderLayer.decode", bucket=1).artifacts] == [(1, 32)]  # the smallest
    assert sorted((a.bucket, a.context) for a in verify(out, entry_id="LlamaDecoderLayer.decode").artifacts) == [(1, 32), (1, 64), (2, 32), (2, 64)]
    # What verify loads: the chosen artifacts only; such a bundle refuses to be bound.
    partial = Bundle.load(out, only={("LlamaDecoderLayer.decode", 2, 64)})
    assert list(partial.programs) == [("LlamaDecoderLayer.decode", 2, 64)]
    with pytest.raises(BundleError, match=r"loaded with 1 of its artifacts \(only=\); load them all to run it"):
        partial.bind(load_model(tiny_dir).model)
    r = CliRunner().invoke(app, ["inspect", str(out), "--entry", "LlamaDecoderLayer.decode", "--bucket", "2", "--context", "64"], env={"COLUMNS": "200"})
    rows = [line for line in r.output.splitlines() if "LlamaDecoderLayer" in line]
    assert r.exit_code == 0 and len(rows) == 1 and "│ 2 " in rows[0] and "│ 64 " in rows[0], r.output
    for args, said in [
        (["--entry", "LlamaDecoderLayer.decode", "--bucket", "2", "--context", "48"], "--context 48: LlamaDecoderLayer.decode has context buckets 32, 64"),
        (["--entry", "LlamaDecoderLayer.decode", "--bucket", "3"], "--bucket 3: LlamaDecoderLayer.decode has buckets 1, 2"),
        (["--entry", "LlamaDecoderLayer.decode.c32"], "--entry LlamaDecoderLayer.decode.c32: the bundle has no such entry; it has LlamaDecoderLayer.decode,"),
        (["--bucket", "1"], "--bucket chooses among one entry's artifacts; pass --entry too"),
    ]:
        for command in ("verify", "inspect"):
            r = CliRunner().invoke(app, [command, str(out), *args])
            assert r.exit_code == 2 and said in " ".join(r.output.split()), (command, r.output)


def _problems(report):
    return {(a.entry, a.bucket, a.context): a.problems for a in report.artifacts if not a.passed}


def test_an_artifact_whose_output_differs_fails_naming_it(tiny_bundle, other_eps_export, tmp_path):
    """One graph replaced by the other model's (same signature, rms_norm_eps 0.5), hashes
    fixed: the head's output differs; a decoder layer's output and cache writes both do."""
    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle.out, bundle)
    for entry, b, c in [("LMHead.forward", 2, None), ("LlamaDecoderLayer.decode", 4, 256)]:
        shutil.copy(other_eps_export / artifact_dir(entry, b, c) / "program.pt2", bundle / artifact_dir(entry, b, c) / "program.pt2")
    rehash(bundle)
    failed = _problems(verify(bundle))
    assert set(failed) == {("LMHead.forward", 2, None), ("LlamaDecoderLayer.decode", 4, 256)}
    head, layer = failed["LMHead.forward", 2, None], failed["LlamaDecoderLayer.decode", 4, 256]
    assert len(head) == 1 and "program.pt2 output 0 differs by up to" in head[0], head
    assert any("output 0 differs by up to" in p for p in layer) and any("wrote k_cache differently from eager where eager wrote" in p for p in layer), layer
    r = CliRunner().invoke(app, ["verify", str(bundle)], env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "LMHead.forward bucket 2: program.pt2 output 0 differs" in " ".join(r.output.split()), r.output


def test_a_prefill_chunk_is_verified_after_a_first_one(tiny_bundle, tmp_path):
    """A chunk graph that attends only within a window of 64 (a mistral's, same signature)
    agrees with full attention on a first chunk of up to 64 rows; verify runs a chunk after a
    first one, which reads the cache history, so the 64-row graph fails and the 16-row one
    (positions 16..30, all within the window) passes."""
    windowed = write_tiny(tmp_path / "windowed", layers=2, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    other = build(BuildOptions(windowed, out=tmp_path / "w", batch_buckets=(4,), chunk_buckets=(16, 64), max_seq=256, backend="export")).out
    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle.out, bundle)
    for chunk in (16, 64):
        name = artifact_dir("LlamaDecoderLayer.prefill", chunk, 256)
        shutil.copy(other / name / "program.pt2", bundle / name / "program.pt2")
    rehash(bundle)
    failed = _problems(verify(bundle, entry_id="LlamaDecoderLayer.prefill"))
    assert set(failed) == {("LlamaDecoderLayer.prefill", 64, 256)}, failed
    assert any("output 0 differs by up to" in p for p in failed["LlamaDecoderLayer.prefill", 64, 256])


def test_a_chunk_as_long_as_max_seq_is_verified_from_position_0(tiny_dir, tmp_path, monkeypatch):
    """Where a second chunk would not fit (chunk 64 of max_seq 64), the chunk verify runs
    starts at position 0; and verify builds no autograd graph (a real model's weights are
    parameters that ask for gradients: every eager call would keep its activations)."""
    from aotc.runtime import verify as verify_mod

    out = build(BuildOptions(tiny_dir, out=tmp_path / "b", batch_buckets=(1,), chunk_buckets=(16, 64), max_seq=64, backend="export")).out
    grad_modes = []
    record = verify_mod._record

    def recording(*args):
        grad_modes.append(torch.is_grad_enabled())
        return record(*args)

    monkeypatch.setattr(verify_mod, "_record", recording)
    report = verify(out, entry_id="LlamaDecoderLayer.prefill")
    assert report.passed, _problems(report)
    assert sorted((a.bucket, a.context) for a in report.artifacts) == [(16, 16), (16, 64), (64, 64)] and grad_modes and not any(grad_modes)


def test_a_chunk_as_long_as_its_context_bucket_is_verified_from_position_0(tiny_dir, tmp_path):
    """Chunk 32 at context buckets 32 and 64: the 32-position graph cannot take a chunk
    after a first one (positions 32 to 62), so verify runs it from position 0."""
    out = build(BuildOptions(tiny_dir, out=tmp_path / "b", batch_buckets=(1,), chunk_buckets=(32,), max_seq=64, context_buckets=(32,), backend="export")).out
    report = verify(out, entry_id="LlamaDecoderLayer.prefill")
    assert report.passed, _problems(report)
    assert sorted((a.bucket, a.context) for a in report.artifacts) == [(32, 32), (32, 64)]


def test_cache_writes_that_differ_fail_with_their_own_message(tiny_bundle, monkeypatch):
    """Prefill steps whose outputs are the graph's but whose cache writes are not."""
    from aotc.runtime import verify as verify_mod

    load = verify_mod.Bundle.load

    def loading(*a, **k):
        bundle = load(*a, **k)
        cache = perturbing("cache")
        wrap_programs(bundle, lambda key, run: cache(key, run) if key[0] == "LlamaDecoderLayer.prefill" else run)
        return bundle

    monkeypatch.setattr(verify_mod.Bundle, "load", loading)
    failed = _problems(verify(tiny_bundle.out))
    assert set(failed) == {("LlamaDecoderLayer.prefill", b, c) for b in (16, 64) for c in (16, 64, 256) if c >= b}  # 16, 64: the chunk contexts
    for problems in failed.values():
        assert [p.partition(":")[0] for p in problems] == [f"program.pt2 wrote {c} differently from eager where eager wrote" for c in ("k_cache", "v_cache")], problems


def test_two_context_buckets_are_each_verified_within_their_positions(context_bundle, monkeypatch):
    """Each context bucket's graph runs at positions it holds (a position past 64 would
    make the dispatcher refuse the c64 graph), and each is compared: the c64 programs
    changed, only the c64 artifacts fail."""
    from aotc.runtime import verify as verify_mod

    report = verify(context_bundle, entry_id="LlamaDecoderLayer.decode")
    assert report.passed, _problems(report)
    assert sorted((a.bucket, a.context) for a in report.artifacts) == [(1, 64), (1, 256), (2, 64), (2, 256)]
    load = verify_mod.Bundle.load

    def loading(*a, **k):
        bundle = load(*a, **k)
        out = perturbing("output")
        wrap_programs(bundle, lambda key, run: out(key, run) if key[2] == 64 else run)
        return bundle

    monkeypatch.setattr(verify_mod.Bundle, "load", loading)
    failed = _problems(verify(context_bundle, entry_id="LlamaDecoderLayer.decode"))
    assert set(failed) == {("LlamaDecoderLayer.decode", 1, 64), ("LlamaDecoderLayer.decode", 2, 64)}
    assert all(any("output 0 differs by up to" in p for p in ps) for ps in failed.values())


def test_an_fp8_bundle_verifies_with_random_weights_quantized_as_recorded(tmp_path, monkeypatch):
    """Without its model folder, verify draws random weights and quantizes each stored one
    to the recorded format, so eager reads what the graphs take: it passes, and still
    catches changed outputs and cache writes."""
    model = write_tiny(tmp_path / "llama-fp8", layers=2, quantize="fp8")
    out = build(BuildOptions(model, out=tmp_path / "b", backend="export", batch_buckets=(1, 2), chunk_buckets=(16,), max_seq=64)).out
    shutil.rmtree(model)
    report = assert_verify_catches_differences(monkeypatch, out)
    assert report.weights == "random" and len(report.artifacts) == 7  # decode 1 and 2, prefill at the chunk context 16 and at 64 and fresh, head 1 and 2
