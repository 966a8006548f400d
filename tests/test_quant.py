"""Low-precision checkpoint weights (aotc.lowp_weights): fp8 with block scales and packed fp4
stay as stored in the graphs, are dequantized there, and generate exactly what eager
generates with the same weights dequantized at load."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from aotc import fp8, lowp_weights
from aotc.builder import BuildOptions, build
from aotc.cli import app
from aotc.errors import BundleError, ConfigError, WeightsError
from aotc.layout import stored_of
from aotc.models.loader import load_model
from aotc.models.tiny import write_tiny
from aotc.passes.decode_fp8_bits import DecodeFp8Bits
from aotc.runtime import Bundle, compare, generate, tolerance_for
from aotc.runtime.verify import verify

from .conftest import assert_verify_catches_differences

PROMPTS = ([1, 5, 9, 14, 3, 22, 7], [1, 40, 41, 42], [1, 100, 17, 18, 19, 20, 21, 22, 23])


def all_fp8_bytes() -> torch.Tensor:
    """Every e4m3fn byte but the two NaNs, as a [2, 127] weight."""
    b = [x for x in range(256) if x & 0x7F != 0x7F]
    return torch.tensor(b, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(2, 127)


# -- the formats, against ml_dtypes (an independent implementation) ------------------


@pytest.mark.parametrize("scale", [torch.tensor([[0.375]]), torch.tensor([[130]], dtype=torch.uint8)], ids=["float32", "e8m0"])
def test_dequantize_fp8_every_byte(scale):
    q = all_fp8_bytes()
    factor = 0.375 if scale.dtype == torch.float32 else 2.0**3  # E8M0 130 is 2**(130 - 127)
    expected = q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32) * factor
    np.testing.assert_array_equal(lowp_weights.dequantize("fp8", q, scale, torch.float32).numpy(), expected)


def test_dequantize_fp4_every_byte_low_nibble_first():
    packed = torch.arange(256, dtype=torch.uint8).reshape(8, 32)  # every pair of nibbles
    scale = torch.full((8, 2), 126, dtype=torch.uint8)  # 2**-1
    nibbles = np.stack([packed.numpy() & 15, packed.numpy() >> 4], axis=-1).reshape(8, 64)
    expected = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * 0.5  # ml_dtypes reads the low 4 bits
    np.testing.assert_array_equal(lowp_weights.dequantize("fp4", packed, scale, torch.float32).numpy(), expected)


def test_quantizers_clamp_and_round_trip():
    w = torch.randn(200, 96, generator=torch.Generator().manual_seed(0))
    w[3, 5] = 1e4  # an outlier: its block's scale grows, no value turns NaN
    for e8m0 in (False, True):
        q, s = lowp_weights.quantize_fp8_blocks(w, e8m0)
        assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (2, 1)
        assert q.float().abs().max() <= fp8.E4M3FN_MAX and not q.float().isnan().any()
        back = lowp_weights.dequantize("fp8", q, s, torch.float32)
        # 3 mantissa bits: within 2**-4 of each block's own max (the outlier's block aside,
        # the rest keep their fine scale)
        block_max = torch.stack([w[:128].abs().max(), w[128:].abs().max()]).repeat_interleave(torch.tensor([128, 72]))[:, None]
        assert ((back - w).abs() <= 2**-4 * block_max).all()
    q, s = lowp_weights.quantize_fp4(w)
    assert q.shape == (200, 48) and s.shape == (200, 3) and s.dtype == torch.uint8
    back = lowp_weights.dequantize("fp4", q, s, torch.float32)
    rows = w.abs().reshape(200, 3, 32).amax(-1).repeat_interleave(32, -1)
    # The widest e2m1 step is 4 -> 6: an error of at most 1 scale, and a scale is under a third of the block's max.
    assert ((back - w).abs() <= rows / 3 + 1e-6).all()
    with pytest.raises(ValueError, match="expected 0 < max_value <= 448"):
        fp8.quantize_fp8(w, max_value=500)
    assert fp8.quantize_fp8(w * 1e3, max_value=224).float().abs().max() == 224  # the clamp holds


def test_decode_fp8_bits_pass_equals_conversion():
    q = all_fp8_bytes()
    gm = torch.export.export(_ToFloat(), (q,)).graph_module
    assert DecodeFp8Bits()(gm).changes == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.view.dtype in targets and not any(
        n.target is torch.ops.aten.to.dtype and n.args[0].meta["val"].dtype == torch.float8_e4m3fn for n in gm.graph.nodes if n.op == "call_function"
    )
    gm.recompile()
    (out,) = gm(q)
    torch.testing.assert_close(out, q.float(), rtol=0, atol=0)  # subnormals included


class _ToFloat(torch.nn.Module):
    def forward(self, q):
        return (q.to(torch.float32),)


# -- checkpoints: aotc init --quantize, both layouts --------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lowp")
    return {
        "llama": write_tiny(root / "llama-fp8", layers=2, quantize="fp8"),
        "v4": write_tiny(root / "v4-fp4", arch="deepseek_v4", layers=3, quantize="fp4-experts", layout="deepseek"),
        "llama-int8": write_tiny(root / "llama-int8", layers=2, quantize="int8"),
    }


def headers(model_dir) -> dict[str, tuple[str, list[int]]]:
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}


def test_init_writes_both_layouts(models, tmp_path):
    hf = headers(models["llama"])
    assert hf["model.layers.0.mlp.up_proj.weight"] == ("F8_E4M3", [688, 256])
    assert hf["model.layers.0.mlp.up_proj.weight_scale_inv"] == ("F32", [6, 2])
    assert hf["model.embed_tokens.weight"][0] == "F32" and hf["lm_head.weight"][0] == "F32"  # kept as DeepSeek keeps them
    ds = headers(models["v4"])
    assert ds["layers.0.attn.wq_a.weight"][0] == "F8_E4M3" and ds["layers.0.attn.wq_a.scale"][0] == "F8_E8M0"
    assert ds["layers.0.ffn.experts.1.w2.weight"] == ("F4", [128, 64]) and ds["layers.0.ffn.experts.1.w2.scale"] == ("F8_E8M0", [128, 2])
    assert ds["layers.0.ffn.shared_experts.w2.weight"][0] == "F8_E4M3"
    config = json.loads((models["v4"] / "config.json").read_text())
    assert config["expert_dtype"] == "fp4" and config["quantization_config"]["scale_fmt"] == "ue8m0"
    hf_v4 = write_tiny(tmp_path / "v4-hf", arch="deepseek_v4", layers=3, quantize="fp4-experts")
    h = headers(hf_v4)
    assert h["model.layers.0.ffn.experts.1.w2.weight"] == ("U8", [128, 32]) and "model.layers.0.ffn.experts.1.w2.weight_scale_inv" in h
    # Both layouts load to the same weights: the fp4 experts are quantized alike in both.
    a, b = load_model(models["v4"]).model, load_model(hf_v4).model
    assert torch.equal(a.model.layers[0].ffn.experts[1].w2.weight, b.model.layers[0].ffn.experts[1].w2.weight)
    result = CliRunner().invoke(app, ["init", "tiny", str(tmp_path / "x"), "--quantize", "fp4-experts"])
    assert result.exit_code == 2 and "LlamaForCausalLM has no routed experts" in result.output


def test_load_keeps_stored_forms(models):
    both = load_model(models["llama"], stored=True).model
    layer = both.model.layers[0]
    stored = stored_of(layer)["mlp.up_proj.weight"]
    assert stored.values.dtype == torch.float8_e4m3fn and stored.scale.dtype == torch.float32
    assert torch.equal(layer.mlp.up_proj.weight, lowp_weights.dequantize("fp8", stored.values, stored.scale, torch.float32))
    # Only the graphs read these: they are not dequantized (one NaN element, expanded).
    only = load_model(models["llama"], stored={"model.layers.0.mlp.up_proj.weight"}).model
    w = only.model.layers[0].mlp.up_proj.weight
    assert w.untyped_storage().nbytes() == 4 and w.isnan().all()
    assert not only.model.layers[1].mlp.up_proj.weight.isnan().any()  # not asked for: dequantized


def test_checkpoint_errors(models, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(models["llama"], bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(
        WeightsError, match=r"fp8 tensor 'model.layers.0.mlp.up_proj.weight' has no 'model.layers.0.mlp.up_proj.weight_scale_inv' or 'model.layers.0.mlp.up_proj.scale'"
    ):
        load_model(bad)
    tensors["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(3, 3)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(WeightsError, match=r"has shape \[3, 3\], expected \[6, 2\] \(one scale per 128x128 block of \[688, 256\]\)"):
        load_model(bad, weights=False)
    # an int8 config whose block is not aotc's per-32
    int8 = tmp_path / "int8"
    shutil.copytree(models["llama-int8"], int8)
    config = json.loads((int8 / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [1, 64]
    (int8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quantization_config\.weight_block_size is \[1, 64\]; aotc reads int8 weights with a scale per 1x32 block"):
        load_model(int8, weights=False)


# -- compiled against eager ------------------------------------------------------------


def check_bundle(model_dir, backend, tmp_path, buckets=(1, 3), monkeypatch=None):
    """Build, then generate at batch 1 and batch 3 through the bundle and with eager
    (the same weights dequantized at load): every token equal, logits within tolerance."""
    out = build(BuildOptions(model_dir, out=tmp_path / backend, batch_buckets=buckets, chunk_buckets=(16,), max_seq=64, backend=backend))
    stored = [w for e in out.manifest.entries for w in e.weights if w.stored]
    assert stored, "no weight entered the graphs as stored"
    assert all(w.dtype == {"fp8": "float8_e4m3fn", "fp4": "uint8", "int8": "int8"}[w.stored.format] for w in stored if w.stored.part == "values")
    bundle = Bundle.load(out.out)
    model = load_model(model_dir, stored=True).model
    for prompts in (PROMPTS[:1], PROMPTS):
        kwargs = dict(max_batch=len(prompts), max_seq=bundle.max_seq, slots=bundle.cache_slots, keep_logits=True)
        bundle.bind(model)
        gen = generate(model, list(prompts), 12, **kwargs)
        Bundle.unbind(model)
        report = compare(gen, generate(model, list(prompts), 12, **kwargs), tolerance_for(backend))
        assert report.tokens_equal, [(p.matching_tokens, p.max_logit_diff) for p in report.per_prompt]
        assert report.max_logit_diff <= report.tolerance
    # and artifact by artifact, padding included (aotc verify); where the steps run on the
    # host, verify is also shown to fail once the steps' outputs or cache writes differ
    if monkeypatch is not None and backend in ("export", "inductor"):
        assert_verify_catches_differences(monkeypatch, out.out)
    else:
        checked = verify(out.out)
        assert checked.passed, [(a.entry, a.bucket, a.problems) for a in checked.artifacts]
    return out


# CI runs the cheap backend; the compiling ones (2 minutes together here) under slow.
@pytest.mark.parametrize("backend", ["export", pytest.param("inductor", marks=pytest.mark.slow), pytest.param("xla", marks=pytest.mark.slow)])
def test_fp8_llama_compiled_equals_eager(models, tmp_path, backend, monkeypatch):
    out = check_bundle(models["llama"], backend, tmp_path, monkeypatch=monkeypatch)
    if backend == "inductor":  # the CPU decodes fp8 by moving bits: every fp8 weight of a layer
        decode = next(e for e in out.manifest.entries if e.id == "LlamaDecoderLayer.decode")
        assert all({p.name: p.changes for p in a.passes}["decode_fp8_bits"] == 7 for a in decode.artifacts)


# export in CI; inductor (about 40 s of compiling) and xla under slow. Inductor's C++ for the
# dequantization itself runs in CI: test_dequantize_int8_every_value_and_a_partial_group.
@pytest.mark.parametrize("backend", ["export", pytest.param("inductor", marks=pytest.mark.slow), pytest.param("xla", marks=pytest.mark.slow)])
def test_int8_llama_compiled_equals_eager(models, tmp_path, backend):
    """int8 weights with a scale per 32 inputs, down_proj's 688 inputs ending in a partial
    group: every token of the bundle equal to eager's (the same weights dequantized at load)."""
    out = check_bundle(models["llama-int8"], backend, tmp_path)
    formats = {w.stored.format for e in out.manifest.entries for w in e.weights if w.stored}
    assert formats == {"int8"}


def test_dequantize_int8_every_value_and_a_partial_group():
    """Every int8 value (as the uint8 bytes graphs take) times its group's scale, a row of
    40 inputs: one group of 32, one of 8; the same in Inductor's C++ (torch 2.13 miscompiled
    a scale expanded and cut to the partial group: it read past the scales)."""
    values = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)[:80].view(2, 40)
    scale = torch.tensor([[0.5, 3.0], [0.25, -1.0]])
    expected = values.float() * torch.tensor([[0.5] * 32 + [3.0] * 8, [0.25] * 32 + [-1.0] * 8])
    for stored in (values, values.view(torch.uint8)):
        torch.testing.assert_close(lowp_weights.dequantize("int8", stored, scale, torch.float32), expected, rtol=0, atol=0)
    g = torch.Generator().manual_seed(0)
    wide = torch.randint(-127, 128, (64, 688), generator=g, dtype=torch.int8).view(torch.uint8)
    scales = torch.rand(64, 22, generator=g)
    compiled = torch.compile(lambda v, s: lowp_weights.dequantize("int8", v, s, torch.float32), backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(wide, scales), lowp_weights.dequantize("int8", wide, scales, torch.float32), rtol=0, atol=0)
    v, s = lowp_weights.quantize_int8(torch.tensor([[1.0, -2.0, 0.5] + [0.0] * 29 + [7.0]]))
    assert v.tolist() == [[64, -127, 32] + [0] * 29 + [127]] and s.shape == (1, 2)  # 63.5 rounds to even: 64


@pytest.mark.parametrize("second", ["plain", pytest.param("e8m0-scales", marks=pytest.mark.slow)])  # CI: one mix
def test_a_checkpoint_that_mixes_layer_formats_builds_a_variant_per_format(models, tmp_path, second):
    """Layer 1 plain (dequantized) or with E8M0 scales where layer 0 keeps fp8 with F32
    scales, as the README allows: each format is a variant of its own, which builds and
    generates what eager does (it raised in find_variants)."""
    from safetensors.torch import load_file, save_file

    mixed = tmp_path / "mixed"
    shutil.copytree(models["llama"], mixed)
    tensors = load_file(mixed / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.1.") and n.endswith("_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        if second == "plain":
            tensors[weight] = lowp_weights.dequantize("fp8", tensors[weight], tensors.pop(name), torch.float32)
        else:  # the scales' exponents only: powers of two as E8M0 bytes
            tensors[name] = (torch.exp2(torch.log2(tensors[name]).round()).log2() + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    save_file(tensors, mixed / "model.safetensors", metadata={"format": "pt"})
    out = check_bundle(mixed, "export", tmp_path)
    decode = [e for e in out.manifest.entries if e.id.startswith("LlamaDecoderLayer.decode")]
    assert sorted(i for e in decode for i in e.instances) == ["model.layers.0", "model.layers.1"] and len(decode) == 2


# What both reports say of V4's MoE: its compiled form is another algorithm than its eager code.
MOE = {
    "cls": "MoE", "modules": 3,
    "eager": "MoE.forward: Each expert once, on the tokens routed to it (a loop over the experts).",
    "compiled": "MoE.compiled_forward: Each token's chosen experts gathered from the stacked weights, where a step makes fewer choices than there are experts; else the loop over the experts.",
}  # fmt: skip


def test_fp4_experts_v4_compiled_equals_eager(models, tmp_path):
    """As check_bundle, through the command line (one load of the bundle each: an export
    program of a V4 block takes a second or two to deserialize): aotc run --check --json
    at batch 3, and aotc verify --json (padding rows included); both reports name the
    MoE's two algorithms."""
    out = build(BuildOptions(models["v4"], out=tmp_path / "export", batch_buckets=(3,), chunk_buckets=(16,), max_seq=64, backend="export"))
    decode = next(e for e in out.manifest.entries if e.id.endswith("Block.decode"))
    stacked = {(w.path, w.stored.part): w for w in decode.weights if w.transform}
    assert stacked["ffn.stacked_w1", "values"].shape == [4, 64, 64] and stacked["ffn.stacked_w1", "scale"].shape == [4, 64, 4]
    assert stacked["ffn.stacked_w1", "values"].dtype == "uint8" and stacked["ffn.stacked_w1", "values"].stored.format == "fp4"
    prompts = ["Hello", "the quick brown fox", "one two three four five"]
    r = CliRunner().invoke(app, ["run", str(out.out), "--check", "--json", "--max-new-tokens", "12", *(a for p in prompts for a in ("--prompt", p))])
    assert r.exit_code == 0, r.output
    check = json.loads(r.output)["check"]
    assert check["passed"] and check["tokens_equal"], check["per_prompt"]
    assert check["algorithms"] == [MOE]
    r = CliRunner().invoke(app, ["verify", str(out.out), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["passed"] and report["algorithms"] == [MOE]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inductor", "xla"])
def test_fp4_experts_v4_compiled_equals_eager_slow(models, tmp_path, backend):
    check_bundle(models["v4"], backend, tmp_path)


def test_stored_weights_are_state_of_their_module_and_move_with_the_model(models):
    """model.to() moves a stored weight's parts (they once sat in a dict beside the model,
    which .to() never saw); state_dict leaves them out, as the checkpoint names them."""
    model = load_model(models["llama"], stored=True).model
    before = stored_of(model)
    assert len(before) == 2 * 7 and all(s.values.device.type == "cpu" for s in before.values())
    model.to("meta")
    after = stored_of(model)
    assert after.keys() == before.keys()
    for path, s in after.items():
        assert (s.values.device.type, s.scale.device.type) == ("meta", "meta"), path
        assert (s.values.dtype, s.scale.dtype, s.values.shape) == (before[path].values.dtype, before[path].scale.dtype, before[path].values.shape)
    assert not [k for k in model.state_dict() if "__stored_" in k]


def test_model_args_build_the_model_a_bundle_runs(models, tmp_path):
    """Bundle.model_args, the one bundle-to-model recipe: the weights whose stored form the
    graphs take (those only, so memory holds fp8 bytes), the caches' dtype, the modeling
    code, the layout and rank; eager=True dequantizes every weight as well; rank None is
    the whole model."""
    out = build(BuildOptions(models["llama"], out=tmp_path / "b", batch_buckets=(1,), chunk_buckets=(16,), max_seq=64, backend="export", kv_cache_dtype="fp8")).out
    bundle = Bundle.load(out)
    args = bundle.model_args()
    assert args["stored"] == bundle.stored_params() and len(args["stored"]) == 2 * 7  # 7 linears in each of 2 layers
    assert args["kv_cache"] == bundle.manifest.model.kv_cache and args["kv_cache"].dtype == "fp8"
    assert (args["modeling"], args["layout"], args["rank"]) == ("auto", bundle.manifest.parallel, 0)
    loaded = load_model(models["llama"], **args)
    assert loaded.model.allocate_caches(2, 64)["k"].dtype == torch.uint8  # fp8 values and their scales, packed
    bundle.bind(loaded.model)
    kw = dict(max_batch=1, max_seq=bundle.max_seq, slots=bundle.cache_slots, stop_at_eos=False)
    got = generate(loaded.model, [[5, 9, 200, 31, 7]], 4, **kw)
    Bundle.unbind(loaded.model)
    eager_args = bundle.model_args(None, eager=True)
    assert eager_args["stored"] is True and not {"layout", "rank"} & set(eager_args)
    eager = load_model(models["llama"], **eager_args).model
    assert got.sequences[0].new_ids == generate(eager, [[5, 9, 200, 31, 7]], 4, **kw).sequences[0].new_ids


def test_bundle_of_stored_weights_refuses_a_dequantized_model(models, tmp_path):
    out = build(BuildOptions(models["llama"], out=tmp_path / "b", batch_buckets=(1,), chunk_buckets=(16,), max_seq=64, backend="export"))
    with pytest.raises(BundleError, match=r"layers.0.self_attn.q_proj.weight is a graph input stored as fp8, but the model has it dequantized"):
        Bundle.load(out.out).bind(load_model(models["llama"]).model)
    # aotc run loads what the bundle needs by itself
    result = CliRunner().invoke(app, ["run", str(out.out), "--max-new-tokens", "4", "--prompt", "hello"])
    assert result.exit_code == 0, result.output
