"""Tensor parallelism for the generic path, from transformers' own plans (aotc.models.hf.parallel)."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file

from aotc import parallel
from aotc.builder import BuildOptions, build
from aotc.errors import AotcError
from aotc.format import ShardSpec
from aotc.models.loader import load_model
from aotc.models.tiny import make_tokenizer

from .conftest import LOGIT_ATOL, checkpoint_reads
from .test_parallel import eager_tokens, run_json
from .test_transformers_path import CHUNK, save

# Batch 1, and batch 2 with a prompt over two chunks of 16.
PROMPTS = ["Hello", "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"]
NEW_TOKENS = 10
# The conformance matrix's parallel column: the dense models at --tensor-parallel 2, the
# MoE models at --expert-parallel 2. In CI, on export: phi3 (its fused qkv_proj and
# gate_up_proj split per block, the all-reduces and the head's gather) and mixtral (its
# experts split across the ranks, each rank reading only its experts' tensors); OLMo 2's
# norm across the ranks is checked in CI by test_a_norm_across_all_heads_sums_its_statistic_across_the_ranks.
# The rest, and every model on inductor and xla, under slow.
DEGREES = {
    "qwen3": "tensor", "gemma2": "tensor", "phi3": "tensor", "olmo2": "tensor", "starcoder2": "tensor",
    "qwen3_moe": "expert", "mixtral": "expert", "gpt_oss": "expert",
}  # fmt: skip
IN_CI = {("phi3", "export"), ("mixtral", "export")}


def model_with_tokenizer(name: str, folder):
    folder = save(name, folder, vocab_size=512)
    make_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def transformers_tokens(model_dir, report: dict, new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generation, with its own cache, for the report's prompts."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for p in report["prompts"]:
        ids = torch.tensor([p["prompt_ids"]])
        got = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(got[0, ids.shape[1] :].tolist())
    return out


def assert_ranks_match_unsharded(name: str, backend: str, tmp_path) -> None:
    """Two ranks (two processes, `aotc run --check`) give the unsharded eager model's tokens
    and transformers' greedy tokens."""
    model_dir = model_with_tokenizer(name, tmp_path / name)
    degree = {f"{DEGREES[name]}_parallel": 2}
    options = BuildOptions(
        model_dir, out=tmp_path / "ranks", batch_buckets=(1, 4), chunk_buckets=(CHUNK,), max_seq=128, backend=backend,
        use_cache=False, jobs=1, **degree,
    )  # fmt: skip
    bundle = build(options)
    assert any(w.shard is not None for e in bundle.manifest.entries for w in e.weights), "no weight of the bundle is split"
    report = run_json(bundle.out, PROMPTS, new_tokens=NEW_TOKENS, max_batch=2)
    assert report["check"]["passed"] and report["check"]["tokens_equal"], report["check"]
    assert report["check"]["max_logit_diff"] <= LOGIT_ATOL[backend]
    assert len(report["prompts"][1]["prompt_ids"]) > 2 * CHUNK
    got = [p["new_ids"] for p in report["prompts"]]
    assert got == eager_tokens(model_dir, report, NEW_TOKENS)
    assert got == transformers_tokens(model_dir, report, NEW_TOKENS)


@pytest.mark.parametrize("name, backend", sorted(IN_CI))
def test_two_ranks_of_a_transformers_model_give_the_unsharded_tokens(name, backend, tmp_path):
    assert_ranks_match_unsharded(name, backend, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name, backend", sorted({(n, b) for n in DEGREES for b in ("export", "inductor", "xla")} - IN_CI))
def test_two_ranks_of_a_transformers_model_give_the_unsharded_tokens_slow(name, backend, tmp_path):
    assert_ranks_match_unsharded(name, backend, tmp_path)


# -- the plans ---------------------------------------------------------------------


def specs_of(name: str, folder, degree: int, kind: str = "tensor") -> dict[str, ShardSpec]:
    layout = parallel.record(degree) if kind == "tensor" else parallel.record(1, experts=degree)
    model = load_model(save(name, folder), layout=layout, weights=False).model
    return (type(model).shard_specs if kind == "tensor" else type(model).expert_specs)(model.config, degree)


def test_a_plan_becomes_shards_in_whole_heads_with_kv_heads_repeated_past_their_count(tmp_path):
    """Qwen 3's plan (4 query heads, 2 KV heads of 16, MLP 160): colwise rows in whole heads,
    rowwise columns, the head by vocabulary; at 4 ranks each KV head is on 2 of them; the
    per-head q and k norms (replicated_with_grad_allreduce) whole."""
    specs = specs_of("qwen3", tmp_path / "m", 2)
    layer = "model.layers.*."
    assert specs[f"{layer}self_attn.q_proj.weight"] == ShardSpec("split", 0, [64], 2, 16)
    assert specs[f"{layer}self_attn.k_proj.weight"] == ShardSpec("split", 0, [32], 2, 16)
    assert specs[f"{layer}self_attn.o_proj.weight"] == ShardSpec("split", 1, [64], 2, 16)
    assert specs[f"{layer}self_attn.o_proj.bias"] == parallel.FIRST  # added once, before the sum
    assert specs[f"{layer}mlp.down_proj.weight"] == ShardSpec("split", 1, [160], 2, 1)
    assert specs["lm_head.weight"] == parallel.split(0, 128, 2)
    assert not any("norm" in k for k in specs)
    at4 = load_model(tmp_path / "m", layout=parallel.record(4), weights=False).model
    assert type(at4).shard_specs(at4.config, 4)[f"{layer}self_attn.v_proj.weight"] == ShardSpec("split", 0, [32], 2, 16)
    assert at4.cache_specs(3, 128)["k"][0] == (3, 3, 1, 128, 16)  # one KV head per rank


def test_fused_projections_split_per_block_and_each_rank_reads_only_its_rows(tmp_path):
    """Phi-3's qkv_proj (q 64, k 32, v 32 rows) and gate_up_proj (2 x 160): each rank takes
    its half of each block, read as byte ranges, so attention and the MLP stay split."""
    model_dir = save("phi3", tmp_path / "phi3")
    specs = specs_of("phi3", tmp_path / "phi3", 2)
    assert specs["model.layers.*.self_attn.qkv_proj.weight"] == ShardSpec("split", 0, [64, 32, 32], 2, 16)
    assert specs["model.layers.*.mlp.gate_up_proj.weight"] == ShardSpec("split", 0, [160, 160], 2, 1)
    with checkpoint_reads() as reads:
        parts = [load_model(model_dir, layout=parallel.record(2), rank=r).model for r in range(2)]
    assert "model.layers.0.self_attn.qkv_proj.weight" in reads.sliced and "model.layers.0.self_attn.qkv_proj.weight" not in reads.whole
    full = load_model(model_dir).model.model.layers[1]
    qkv = [p.model.layers[1].self_attn.qkv_proj.weight for p in parts]
    whole = full.self_attn.qkv_proj.weight
    for block, (start, size) in enumerate([(0, 64), (64, 32), (96, 32)]):
        half = size // 2
        for r in range(2):
            torch.testing.assert_close(qkv[r][[0, 32, 48][block] : [0, 32, 48][block] + half], whole[start + r * half : start + (r + 1) * half], rtol=0, atol=0)


def test_a_norm_across_all_heads_splits_with_its_heads(tmp_path):
    """OLMo 2 normalises q and k across all heads: its norms split with the projections (a
    rank holds its heads' weights) and compute their mean of squares across the ranks."""
    specs = specs_of("olmo2", tmp_path / "m", 2)
    assert specs["model.layers.*.self_attn.q_norm.weight"] == specs["model.layers.*.self_attn.q_proj.weight"] == ShardSpec("split", 0, [64], 2, 16)
    assert specs["model.layers.*.self_attn.k_norm.weight"] == ShardSpec("split", 0, [32], 2, 16)
    model = load_model(tmp_path / "m", layout=parallel.record(2), weights=False).model
    norm = model.model.layers[0].self_attn.q_norm
    assert norm.weight.shape == (32,) and type(norm).forward is not transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm.forward


def test_a_norm_across_all_heads_sums_its_statistic_across_the_ranks(tmp_path, monkeypatch):
    """Two ranks' OLMo 2 q norms, each on its half of the heads, give the whole norm's rows:
    the mean of squares is every rank's sum over the whole width (the all-reduce stands in
    for the ranks' sum here)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from aotc.models.hf import parallel as hf_parallel

    g = torch.Generator().manual_seed(0)
    whole = Olmo2RMSNorm(64, eps=1e-6)
    whole.weight.data = 1 + 0.1 * torch.randn(64, generator=g)
    x = torch.randn(3, 64, generator=g)
    halves = x.split(32, dim=-1)
    monkeypatch.setattr(parallel, "all_reduce", lambda t, group: sum(h.float().pow(2).sum(-1, keepdim=True) for h in halves))
    out = []
    for r in range(2):
        norm = Olmo2RMSNorm(32, eps=1e-6)
        norm.weight.data = whole.weight.data[r * 32 : (r + 1) * 32].clone()
        norm.__class__ = hf_parallel._split_norm_class(Olmo2RMSNorm)
        norm.group, norm.ranks = "0", 2
        out.append(norm(halves[r]))
    torch.testing.assert_close(torch.cat(out, dim=-1), whole(x))


def test_experts_split_whole_and_each_rank_reads_only_its_experts_tensors(tmp_path):
    """Mixtral's 8 experts at --expert-parallel 2 (its checkpoint, as transformers saves it, one
    tensor per expert and projection): rank r holds experts 4r..4r+3, read from their own
    tensors only, and maps the router's choices to them (another rank's: 4, weight 0)."""
    model_dir = save("mixtral", tmp_path / "mixtral")
    specs = specs_of("mixtral", tmp_path / "mixtral", 2, "expert")
    assert specs["model.layers.*.mlp.experts.gate_up_proj"] == parallel.split(0, 8, 2)
    full = load_model(model_dir).model.model.layers[1].mlp.experts
    for r in range(2):
        with checkpoint_reads() as reads:
            part = load_model(model_dir, layout=parallel.record(1, experts=2), rank=r).model.model.layers[1].mlp.experts
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in reads.whole if ".experts." in n}
        assert experts == set(range(4 * r, 4 * r + 4)) and not reads.sliced
        torch.testing.assert_close(part.gate_up_proj, full.gate_up_proj[4 * r : 4 * r + 4], rtol=0, atol=0)
        torch.testing.assert_close(part.down_proj, full.down_proj[4 * r : 4 * r + 4], rtol=0, atol=0)
        assert part.expert_map.tolist() == [4] * (4 * r) + [0, 1, 2, 3] + [4] * (4 - 4 * r)
    # A checkpoint with the experts stacked, one tensor per projection: each rank reads its rows.
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(model_dir / "config.json", fused / "config.json")
    whole = load_model(model_dir).model
    save_file({k: v.contiguous() for k, v in whole.state_dict().items()}, fused / "model.safetensors")
    with checkpoint_reads() as reads:
        part = load_model(fused, layout=parallel.record(1, experts=2), rank=1).model.model.layers[1].mlp.experts
    assert "model.layers.1.mlp.experts.gate_up_proj" in reads.sliced
    torch.testing.assert_close(part.gate_up_proj, full.gate_up_proj[4:], rtol=0, atol=0)


def test_a_tied_head_reads_its_rows_of_the_embedding(tmp_path):
    """A tied head (llama through transformers, tie_word_embeddings): a rank's head is its rows
    of the embedding, the embedding whole."""
    model_dir = save("llama", tmp_path / "llama")
    parts = [load_model(model_dir, modeling="transformers", layout=parallel.record(2), rank=r).model for r in range(2)]
    embed = load_model(model_dir, modeling="transformers").model.model.embed_tokens.weight
    torch.testing.assert_close(torch.cat([p.lm_head.weight for p in parts]), embed, rtol=0, atol=0)
    torch.testing.assert_close(parts[1].model.embed_tokens.weight, embed, rtol=0, atol=0)


@pytest.mark.parametrize("name, degree, message", [
    ("gpt2", 2, r"--tensor-parallel 2: GPT2LMHeadModel has no tensor-parallel plan in aotc .*base_model_tp_plan\); build it with --tensor-parallel 1"),
    ("qwen3", 3, r"--tensor-parallel 3: model\.layers\.\*\.self_attn\.q_proj\.weight has 64 rows \(4 heads of 16\) along dim 0, which do not split into 3 equal parts; valid degrees for this model: 1, 2, 4"),
    ("gpt_oss", 2, r"--tensor-parallel 2: GptOssForCausalLM's model\.layers\.0\.self_attn\.sinks is \[4\] whole and \[2\] on a rank .* transformers' plan \(base_model_tp_plan\) keeps it whole"),
    ("mixtral", 2, r"MixtralForCausalLM's model\.layers\.0\.mlp\.experts\.gate_up_proj is \[8, 96, 64\] whole and \[8, 48, 64\] on a rank"),
    ("phi3", 4, r"--tensor-parallel 4: model\.layers\.\*\.self_attn\.qkv_proj\.weight has 128 rows \(8 heads of 16\) along dim 0, which do not split into 4 equal parts; valid degrees for this model: 1, 2$"),
    ("qwen3", -2, r"--expert-parallel 2: Qwen3ForCausalLM has no expert-parallel plan in aotc .*base_model_ep_plan\); build it with --expert-parallel 1"),
    ("mixtral", -3, r"--expert-parallel 3: model\.layers\.\*\.mlp\.experts\.gate_up_proj has 8 rows along dim 0, which do not split into 3 equal parts; valid degrees for this model: 1, 2, 4, 8"),
])  # fmt: skip
def test_a_model_or_degree_that_does_not_split_is_refused_naming_why(name, degree, message, tmp_path):
    """degree < 0: --expert-parallel -degree."""
    layout = parallel.record(degree) if degree > 0 else parallel.record(1, experts=-degree)
    with pytest.raises(AotcError, match=message):
        load_model(save(name, tmp_path / name), layout=layout, weights=False)


def test_data_parallel_attention_is_refused_on_the_generic_path(tmp_path):
    with pytest.raises(AotcError, match=r"--data-parallel-attention: aotc's generic path runs attention whole on every rank; build MixtralForCausalLM without it"):
        load_model(save("mixtral", tmp_path / "m"), layout=parallel.record(1, experts=2, data_parallel_attention=True), weights=False)


def test_a_style_aotc_cannot_take_is_refused_naming_it_and_the_module(tmp_path, monkeypatch):
    plan = {**transformers.Qwen3Config.base_model_tp_plan, "layers.*.mlp.down_proj": "packed_rowwise"}
    monkeypatch.setattr(transformers.Qwen3Config, "base_model_tp_plan", plan)
    with pytest.raises(AotcError, match=r"splits model\.layers\.\*\.mlp\.down_proj as 'packed_rowwise', which aotc does not take"):
        load_model(save("qwen3", tmp_path / "m"), layout=parallel.record(2), weights=False)
