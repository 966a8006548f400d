"""The inductor backend: AOTInductor packages with weights as inputs.

The default run compiles one small bundle of seven graphs (jobs 2). Its serial twin,
a bundle with two context buckets, the portable build and the qwen2 and mistral builds
are marked slow.
"""

from __future__ import annotations

import json
import re
import shutil
import zipfile

import pytest
import torch
from typer.testing import CliRunner

from aotc.backends import inductor
from aotc.backends.inductor import PORTABLE_FLAGS, InductorBackend, compiled_isa, cpu_target
from aotc.builder import BuildOptions, build, default_backend
from aotc.builder.plan import make_plan
from aotc.cli import app
from aotc.errors import BundleError
from aotc.models.loader import load_model
from aotc.models.tiny import write_tiny
from aotc.runtime import Bundle, generate
from aotc.trace import find_variants, whole_step_refusal

from .conftest import assert_check_report, assert_generation_matches_eager, cross_weights, record_contexts, rehash, swapped_copy

pytestmark = pytest.mark.skipif(InductorBackend().can_compile() is not None, reason="no C++ compiler for AOTInductor")

# Decode at 1 row and at 8, the most that rewrite_skinny_linears rewrites (2 to 7 rows pad to 8).
OPTIONS = dict(batch_buckets=(1, 8), chunk_buckets=(16,), max_seq=96, backend="inductor")
STEP = "LlamaForCausalLM.decode_step"
# CI's bundle has one context bucket (each decode graph reads all 96 positions): the graphs of
# a second bucket are the same code at another length, and the step across buckets is the
# dispatcher's, which CI checks on export (test_bound.py, test_kvcache.py).
CONTEXTS = dict(OPTIONS, context_buckets=(32,))


@pytest.fixture(scope="module")
def inductor_bundles(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("inductor")
    # No compile cache: the build really compiles every artifact, in two worker processes.
    return (build(BuildOptions(tiny_dir, out=root / "j2", jobs=2, use_cache=False, **OPTIONS)),)


def files(result):
    return {(e.id, a.bucket, a.context): a.files for e, a in result.manifest.artifacts()}


PORTABLE = {"cpp.march": "x86-64-v3", "cpp.simdlen": 256}


def test_the_exact_instruction_set_is_recorded_and_portable_flags_narrow_it(inductor_bundles):
    """The manifest holds the extensions g++ enables for Inductor's flags (-march=native and
    its vector ISA flags), resolved; --compiler-flag cpp.march/cpp.simdlen give a fleet
    target, with another cache key."""
    march, isa = compiled_isa({})
    for _, a in inductor_bundles[0].manifest.artifacts():
        assert (a.extra.march, a.extra.isa) == (march, list(isa)) and march != "native"
    portable_march, portable = compiled_isa(PORTABLE)
    assert portable_march == "x86-64-v3" and {"avx2", "fma"} <= set(portable) and not [f for f in portable if f.startswith("avx512")]
    assert set(portable) <= set(isa)
    assert cpu_target(PORTABLE) != cpu_target({})
    assert PORTABLE_FLAGS == " ".join(f"--compiler-flag {k}={v}" for k, v in PORTABLE.items())


def test_a_cpu_without_an_extension_the_code_uses_is_refused_at_load(inductor_bundles, monkeypatch):
    out = inductor_bundles[0].out
    used = inductor_bundles[0].manifest.entries[0].artifacts[0].extra.isa
    lacking = used[-1]
    host = inductor.host_isa()
    monkeypatch.setattr(inductor, "host_isa", lambda: host - {lacking})
    with pytest.raises(BundleError, match=rf"its code uses {lacking}, which this CPU lacks \(compiled with -march=.*\); .*{PORTABLE_FLAGS}"):
        Bundle.load(out)
    monkeypatch.setattr(inductor, "host_isa", lambda: frozenset(used) | {"somethingelse"})  # a CPU with more: fine
    Bundle.load(out)


@pytest.mark.slow
def test_a_portable_build_has_no_avx512_instructions(tiny_dir, tmp_path):
    import subprocess

    result = build(BuildOptions(tiny_dir, out=tmp_path / "b", use_cache=False, compiler_flags=PORTABLE, **OPTIONS))
    for e, a in result.manifest.artifacts():
        assert not [f for f in a.extra.isa if f.startswith("avx512")], e.id
        with zipfile.ZipFile(result.out / a.dir / "model.pt2") as z:
            so = next(n for n in z.namelist() if n.endswith(".so"))
            (tmp_path / "m.so").write_bytes(z.read(so))
        code = subprocess.run(["objdump", "-d", str(tmp_path / "m.so")], capture_output=True, text=True, check=True).stdout
        assert "%zmm" not in code and "%ymm" in code, e.id  # AVX2 vectors, no AVX-512 ones


def test_a_parallel_build_compiles_each_artifact_into_one_package(inductor_bundles):
    parallel = inductor_bundles[0]
    assert parallel.jobs == 2 and parallel.count("uncached") == 7  # decode at 1 and 8, prefill at the chunk context 16 and at 96 and fresh, the head at 1 and 8
    assert len(files(parallel)) == 7
    assert all(list(f) == ["model.pt2"] for f in files(parallel).values())


@pytest.mark.slow  # a second uncompiled build (90 s here)
def test_parallel_build_is_identical_to_serial(inductor_bundles, tiny_dir, tmp_path):
    parallel = inductor_bundles[0]
    serial = build(BuildOptions(tiny_dir, out=tmp_path / "j1", jobs=1, use_cache=False, **OPTIONS))
    assert serial.jobs == 1 and serial.count("uncached") == parallel.count("uncached") == 7
    assert files(parallel) == files(serial)
    assert sorted(p.relative_to(parallel.out) for p in parallel.out.rglob("*")) == sorted(p.relative_to(serial.out) for p in serial.out.rglob("*"))


def test_skinny_linears_rewritten_in_cpu_decode(inductor_bundles):
    """The inductor-cpu pipeline ran rewrite_skinny_linears and rewrite_skinny_matmuls: decode's
    matmuls of 1 to 8 rows (attention: 2 query heads per KV head), not prefill's 16. In the
    whole step they are in the loop's body, where the passes run too (without them the 100m
    model's step took 1.44x as long at batch 8)."""
    changes = {(e.id, a.bucket, a.context): {p.name: p.changes for p in a.passes} for e, a in inductor_bundles[0].manifest.artifacts()}
    for bucket in (1, 8):
        assert changes[(STEP, bucket, 96)]["rewrite_skinny_linears"] == 8  # q, k, v, o, gate, up, down in the loop; the head
        assert changes[(STEP, bucket, 96)]["rewrite_skinny_matmuls"] == 2  # q @ k^T, p @ v
    assert changes[("LlamaDecoderLayer.prefill", 16, 96)]["rewrite_skinny_linears"] == 0
    assert changes[("LlamaDecoderLayer.prefill", 16, 96)]["rewrite_skinny_matmuls"] == 0  # 16 query rows per head


def test_decode_is_one_whole_step_graph_whatever_the_layer_count(inductor_bundles, tiny_dir, tmp_path):
    """Decode is LlamaForCausalLM.decode_step: every layer in one graph (a loop over the layers'
    weights, stacked), in place of a graph per layer; the same artifacts at 3 layers as at 2.
    Where no whole step is built (fp8 caches, a backend without loops), decode stays a graph per layer."""
    m = inductor_bundles[0].manifest
    ids = [e.id for e in m.entries]
    assert STEP in ids and "LlamaDecoderLayer.decode" not in ids and inductor_bundles[0].per_layer is None
    step = m.entry(STEP)
    q = next(w for w in step.weights if w.path == "model.layers.*.self_attn.q_proj.weight")
    assert (step.instances, q.shape, q.transform, q.sources) == ([""], [2, 256, 256], "stack", ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"])
    for art in step.artifacts:
        assert [i.shape for i in art.inputs if i.kind == "cache"] == [[2, 9, 2, 96, 64]] * 2  # every layer's allocation, written in place
        assert loop_body_kernels(inductor_bundles[0].out / "entries" / STEP / f"b{art.bucket}-c{art.context}" / "model.pt2") == 1
    three = make_plan(BuildOptions(write_tiny(tmp_path / "three", layers=3), out=tmp_path / "b3", **OPTIONS))
    assert sorted((v.entry_id, b, v.context) for v, b in three.tasks) == sorted((e.id, a.bucket, a.context) for e, a in m.artifacts())
    fp8 = make_plan(BuildOptions(tiny_dir, out=tmp_path / "fp8", kv_cache_dtype="fp8", **OPTIONS))
    no_loops = find_variants(three.loaded.model, three.shapes, loops=False)
    for variants in (fp8.variants, no_loops):
        assert "LlamaDecoderLayer.decode" in {v.entry_id for v in variants} and STEP not in {v.entry_id for v in variants}
    assert whole_step_refusal(fp8.loaded.model, loops=True) == "fp8 caches: their packed rows are written per layer"  # what aotc build says


def loop_body_kernels(package) -> int:
    """How many kernels the generated code of a whole step's loop body calls an iteration. Its
    C++ runs the body in `while (1) {` at four spaces' indent; an offset computed outside
    the kernels (an index whose sign Inductor does not know) would end a kernel there."""
    with zipfile.ZipFile(package) as z:
        [code] = [z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp")]
    body = code.split("// subgraph: while_loop_body_graph", 1)[1].split("\n    }\n", 1)[0]
    assert "_index_clamped" not in body  # Inductor's code for such an offset
    return len(re.findall(r"^\s+cpp_fused\w*\(", body, re.M))


def test_bind_stacks_each_layer_weight_once_and_decode_returns_its_argmax(inductor_bundles, tiny_dir):
    model = load_model(tiny_dir).model
    want = [layer.mlp.up_proj.weight.detach().clone() for layer in model.model.layers]
    bundle = Bundle.load(inductor_bundles[0].out)
    bundle.bind(model)
    # The stack is the one copy: each layer's weight is a view of it, read by the prefill graphs and eager code alike.
    assert len({layer.mlp.up_proj.weight.untyped_storage().data_ptr() for layer in model.model.layers}) == 1
    assert all(torch.equal(layer.mlp.up_proj.weight, w) for layer, w in zip(model.model.layers, want))
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
    logits, argmax = model.decode_tokens(torch.tensor([5, 6, 7]), torch.tensor([0, 0, 0]), caches)
    assert logits.shape == (3, 512) and argmax.tolist() == logits.argmax(-1).tolist()


def test_layer_weights_that_cannot_stack_are_an_error_naming_both(inductor_bundles, tiny_dir):
    """One layer's weight in another dtype than the others' (a model edited after the build):
    bind names it and the first layer's, and which stack they were to make, not a torch error."""
    model = load_model(tiny_dir).model
    up = model.model.layers[1].mlp.up_proj
    up.weight.data = up.weight.data.to(torch.bfloat16)
    with pytest.raises(
        BundleError,
        match=r"weight model\.layers\.1\.mlp\.up_proj\.weight is \[688, 256\] torch\.bfloat16, but model\.layers\.0\.mlp\.up_proj\.weight is \[688, 256\] torch\.float32; the weights stacked into model\.layers\.\*\.mlp\.up_proj\.weight must agree",
    ):
        Bundle.load(inductor_bundles[0].out).bind(model)


def test_packages_hold_no_weights(inductor_bundles):
    """Every parameter is a runtime input: no package has constants baked in."""
    bundle = inductor_bundles[0]
    for entry, art in bundle.manifest.artifacts():
        loader = torch._C._aoti.AOTIModelPackageLoader(str(bundle.out / art.dir / "model.pt2"), "model", True, 1, -1)
        assert loader.get_constant_fqns() == []
        in_spec = torch.utils._pytree.treespec_loads(loader.get_call_spec()[0])
        assert in_spec.num_leaves == len(entry.weights) + len(art.inputs)


@pytest.mark.parametrize("lengths", [(7,), (5, 40, 21)])
def test_generation_token_exact(inductor_bundles, tiny_dir, lengths):
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(inductor_bundles[0].out)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    kw = dict(max_batch=bundle.max_batch, max_seq=bundle.max_seq, slots=bundle.cache_slots, keep_logits=True, stop_at_eos=False)
    bundle.bind(loaded.model)
    compiled = generate(loaded.model, prompts, 12, **kw)
    Bundle.unbind(loaded.model)
    eager = generate(loaded.model, prompts, 12, **kw)
    for c, e in zip(compiled.sequences, eager.sequences):
        assert c.new_ids == e.new_ids
        torch.testing.assert_close(torch.stack(c.logits), torch.stack(e.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # 3 more graphs; CI crosses context buckets on export (test_bound.py)
def test_decode_crosses_a_context_bucket_token_exact(tiny_dir, tmp_path):
    """A sequence that grows past 32 positions moves from the graphs that read 32 cache
    positions to those that read 96, at the step its position reaches 32; every token and
    logit is eager's, which reads all 96."""
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(build(BuildOptions(tiny_dir, out=tmp_path / "b", **CONTEXTS)).out)
    manifest = bundle.manifest
    assert manifest.shapes.context == [32, 96]
    (entry,) = [e for e in manifest.entries if e.method == "decode_step"]  # one entry, its artifacts per context bucket
    assert entry.id == STEP and entry.context_arg == "positions"
    assert sorted((a.context, a.bucket) for a in entry.artifacts) == [(32, 1), (32, 8), (96, 1), (96, 8)]
    for art in entry.artifacts:  # every layer's caches, their first positions
        caches = [i for i in art.inputs if i.kind == "cache"]
        assert [c.shape for c in caches] == [[2, 9, 2, art.context, 64]] * 2 and [c.stride for c in caches] == [[110592, 12288, 6144, 64, 1]] * 2
    prompt = torch.randint(3, 512, (27,), generator=torch.Generator().manual_seed(5)).tolist()
    kw = dict(max_batch=1, max_seq=bundle.max_seq, slots=bundle.cache_slots, keep_logits=True, stop_at_eos=False)
    bundle.bind(loaded.model)
    used = record_contexts(loaded.model.decode_step)
    compiled = generate(loaded.model, [prompt], 12, **kw)
    Bundle.unbind(loaded.model)
    eager = generate(loaded.model, [prompt], 12, **kw)
    # Decode steps feed positions 27..37: 27..31 fit in 32 positions, 32.. need the 96.
    assert used == [32] * 5 + [96] * 6
    assert compiled.sequences[0].new_ids == eager.sequences[0].new_ids
    torch.testing.assert_close(torch.stack(compiled.sequences[0].logits), torch.stack(eager.sequences[0].logits), atol=1e-4, rtol=1e-4)


def test_near_ties_match_eager_up_to_the_tie(inductor_bundles, near_tie_dir):
    """A head drawn at transformers' scale: top logits within 1e-2 of each other."""
    assert assert_generation_matches_eager(inductor_bundles[0].out, near_tie_dir) < 1e-2


def test_cache_is_written_in_place_and_padding_goes_to_scratch(inductor_bundles, tiny_dir):
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(inductor_bundles[0].out)
    bundle.bind(loaded.model)
    model = loaded.model
    caches = {k: v.fill_(7.0) for k, v in model.allocate_caches(bundle.cache_slots, bundle.max_seq).items()}  # slots 0 to 7, scratch 8
    model.prefill(torch.arange(3, 20), 0, caches)  # 17 tokens: chunks of 16 + 1 padded
    assert not caches["k"][:, 0, :, :17].eq(7.0).any()  # the caller's cache was updated
    assert caches["k"][:, 1].eq(7.0).all()  # the other sequence's slot untouched
    assert not caches["k"][:, 8].eq(7.0).all()  # padding tokens wrote the scratch slot


def test_cache_with_other_strides_is_an_error(inductor_bundles, tiny_dir):
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(inductor_bundles[0].out)
    bundle.bind(loaded.model)
    model = loaded.model
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq)
    positions = torch.tensor([4])
    wide = torch.zeros(2, bundle.cache_slots, 2, bundle.max_seq, 2 * 64)[..., :64]  # every layer's, a non-contiguous slice, right shape
    with pytest.raises(BundleError, match=r"cache 'k_cache' has shape \[2, 9, 2, 96, 64\] strides \[221184, 24576, 12288, 128, 1\]"):
        model.decode_step(positions, positions, positions, wide, caches["v"])


def test_weight_with_other_strides_is_an_error(inductor_bundles, tiny_dir):
    loaded = load_model(tiny_dir)
    head = loaded.model.head.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach().t().contiguous().t())  # same shape and values, column-major
    with pytest.raises(BundleError, match=r"weight head.lm_head.weight has strides \[1, 512\]"):
        Bundle.load(inductor_bundles[0].out).bind(loaded.model)
    # A layer's weights are stacked at bind (contiguous whatever they were): the same values, and they run.
    loaded = load_model(tiny_dir)
    up = loaded.model.model.layers[1].mlp.up_proj
    want = up.weight.detach().clone()
    up.weight = torch.nn.Parameter(up.weight.detach().t().contiguous().t())
    Bundle.load(inductor_bundles[0].out).bind(loaded.model)
    assert up.weight.is_contiguous() and torch.equal(up.weight, want)


def test_bundle_runs_with_new_weights(inductor_bundles, tiny_dir, tmp_path):
    """Weights are not in the bundle: a checkpoint with other values runs, token-exact."""
    new = write_tiny(tmp_path / "retrained", layers=2, seed=123)
    runner = CliRunner()
    args = ["run", str(inductor_bundles[0].out), "--max-new-tokens", "8", "--check", "--json", "--prompt", "Hello"]
    old = json.loads(runner.invoke(app, args).output)
    result = runner.invoke(app, args + ["--model", str(new)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert_check_report(report, "inductor")
    assert report["prompts"][0]["new_ids"] != old["prompts"][0]["new_ids"]


def test_incompatible_target_is_refused(inductor_bundles, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(inductor_bundles[0].out, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["backend"]["version"] = "torch-0.0-riscv64-DEFAULT"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"cannot run here: built with inductor torch-0.0-riscv64-DEFAULT"):
        Bundle.load(copy)


def test_bundle_runs_and_checks_without_a_compiler_importing_only_what_running_needs(inductor_bundles, tmp_path):
    """A deploy host without g++ loads and runs an inductor bundle; nothing of the
    tracer, the passes, dynamo or JAX is imported to do it."""
    import os
    import subprocess
    import sys

    bindir = tmp_path / "bin"  # PATH holds the interpreter and nothing else
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(bindir)}
    assert shutil.which("g++", path=env["PATH"]) is None and shutil.which("c++", path=env["PATH"]) is None
    bundle = inductor_bundles[0].out
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "aotc.cli", "run", str(bundle), "--prompt", "Hello", "--max-new-tokens", "4", "--check"], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every token matches eager" in r.stdout
    # `python -X importtime` lists every module the command imported, nested ones included.
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:") and "|" in line}
    assert {"aotc", "aotc.runtime.session", "torch"} <= imported
    assert not {m for m in imported if m.split(".")[0] in ("jax", "torchax") or m.startswith(("aotc.trace", "aotc.passes", "aotc.builder", "torch._dynamo"))}, sorted(imported)
    script = (
        "import sys\n"
        "from aotc.models.loader import load_model\n"
        "from aotc.runtime import Bundle, generate\n"
        f"b = Bundle.load({str(bundle)!r})\n"
        "loaded = load_model(b.manifest.model.source)\n"
        "b.bind(loaded.model)\n"
        "generate(loaded.model, [[1, 2, 3]], 4, max_batch=1, max_seq=b.max_seq, slots=b.cache_slots)\n"
        "print(sorted(m for m in ('aotc.trace', 'aotc.passes', 'aotc.builder', 'torch._dynamo', 'torch._inductor.codegen', 'jax', 'torchax') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_swapped_packages_are_refused_at_load(inductor_bundles, tiny_dir, tmp_path):
    """A package records the inputs it was compiled for: two packages swapped (their
    sha256 fixed in the manifest) are refused before anything runs."""
    bundle = swapped_copy(inductor_bundles[0].out, tmp_path / "swapped", other=8, entry="LlamaForCausalLM.decode_step")
    with pytest.raises(BundleError, match=r"is not LlamaForCausalLM.decode_step bucket 1 context 96 as the manifest says \(input \d+ is \(\[8"):
        Bundle.load(bundle)


def test_crossed_weights_are_refused_at_load(inductor_bundles, tmp_path):
    """A package's inputs carry no names, so each records its weight paths in its metadata,
    which the loader's get_metadata() reads: gate_proj and up_proj crossed in the manifest
    are refused; so is a package whose metadata files disagree (whichever the loader reads),
    or that records none."""
    bundle = tmp_path / "crossed"
    shutil.copytree(inductor_bundles[0].out, bundle)
    cross_weights(bundle / "manifest.json")
    with pytest.raises(
        BundleError, match=r"entries/LlamaDecoderLayer\.\w+/b\d+\S*: the artifact takes weight \d+ as 'mlp.gate_proj.weight', the entry lists 'mlp.up_proj.weight' there"
    ):
        Bundle.load(bundle)
    shutil.rmtree(bundle)
    shutil.copytree(inductor_bundles[0].out, bundle)
    package = next(bundle.glob("entries/LMHead.forward/*/model.pt2"))
    with zipfile.ZipFile(package) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    (kernel,) = [n for n in members if n.endswith("kernel_metadata.json")]
    members[kernel] = members[kernel].replace(b"norm.weight", b"lm_head.weight")
    _rewrite(package, members, bundle)
    with pytest.raises(BundleError, match=r"LMHead.forward/b\d+/model.pt2: its metadata files record different weights"):
        Bundle.load(bundle)
    # No record at all (both files without the key): refused, naming what is missing.
    for name in [n for n in members if n.endswith("_metadata.json")]:
        metadata = json.loads(members[name])
        metadata.pop("aotc_weights")
        members[name] = json.dumps(metadata).encode()
    _rewrite(package, members, bundle)
    with pytest.raises(BundleError, match=r"model.pt2: its aotc_weights metadata \(which tensor each weight input is\) is None, not a list of weight paths"):
        Bundle.load(bundle)


def _rewrite(package, members: dict[str, bytes], bundle) -> None:
    """Write the package's members back (edited) and fix the bundle's hashes."""
    with zipfile.ZipFile(package, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    rehash(bundle)


def test_default_backend_falls_back_to_export_without_a_compiler(monkeypatch):
    assert default_backend() == ("inductor", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    backend, why = default_backend()
    assert backend == "export" and "no g++ or c++ is on PATH" in why


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_qwen2_and_mistral_token_exact(arch, tmp_path):
    model = write_tiny(tmp_path / arch, arch=arch, layers=2)
    out = tmp_path / "bundle"
    runner = CliRunner()
    r = runner.invoke(app, ["build", str(model), "--backend", "inductor", "--buckets", "1,4", "--prefill-chunk", "32", "--max-seq", "512", "-o", str(out)])
    assert r.exit_code == 0, r.output
    for max_batch in ("1", "3"):
        r = runner.invoke(app, ["run", str(out), "--check", "--json", "--max-batch", max_batch, "--max-new-tokens", "16"])
        assert r.exit_code == 0, r.output
        assert_check_report(json.loads(r.output), "inductor")


@pytest.mark.parametrize("gcc, cpuinfo", [
    ("sse4.2", "sse4_2"), ("sse4.1", "sse4_1"), ("avx512f", "avx512f"), ("avx512bf16", "avx512_bf16"), ("avx512vnni", "avx512_vnni"),
    ("avxvnni", "avx_vnni"), ("amx-tile", "amx_tile"), ("f16c", "f16c"), ("fma", "fma"), ("avx2", "avx2"),
    ("sse3", "pni"), ("pclmul", "pclmulqdq"), ("bmi", "bmi1"), ("bmi2", "bmi2"), ("rdrnd", "rdrand"), ("sahf", "lahf_lm"), ("sha", "sha_ni"), ("lzcnt", "abm"),
])  # fmt: skip
def test_gcc_and_cpuinfo_names_of_an_extension_meet(gcc, cpuinfo):
    from aotc.backends.inductor import _gcc_normal, _normal

    assert _gcc_normal(gcc) == _normal(cpuinfo)


def test_the_recorded_extensions_include_those_named_differently(monkeypatch):
    """Where this CPU has BMI1 and SSE3, code for -march=native records them (cpuinfo's
    names bmi1 and pni), so a CPU without them is refused."""
    import aotc.backends.inductor as inductor

    monkeypatch.setattr(inductor, "host_isa", lambda: frozenset({"bmi1", "pni", "avx2", "fma"}))
    inductor.gcc_isa.cache_clear()
    try:
        _, isa = inductor.gcc_isa("haswell")
    finally:
        inductor.gcc_isa.cache_clear()
    assert set(isa) == {"bmi1", "pni", "avx2", "fma"}


def test_a_killed_run_leaves_nothing_in_the_temp_folder(inductor_bundles, tmp_path):
    """aotc unpacks each checked package itself and removes it once loaded: neither its copy
    nor torch's own extraction (aotinductor_*) is left by a run killed with SIGKILL."""
    from .test_temp_folder import assert_a_killed_run_leaves_nothing

    assert_a_killed_run_leaves_nothing(inductor_bundles[0].out, tmp_path)
