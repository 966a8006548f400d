"""DeepSeek V4, eager, against transformers' DeepseekV4ForCausalLM.

Which transformers output is the reference: its full-sequence forward for
prompt logits, and its cached `generate` for greedy tokens. On tiny random
configs the two disagree at some positions, and not through a difference in
how compression blocks are seen: the lightning indexer's scores are sums of
ReLUs, so a query can score several compressed entries exactly 0.0, and
`topk` breaks such ties by the length of the tensor it is given, which grows
with the sequence in the full forward and with the steps in generation
(test_transformers_paths_disagree_only_on_exact_indexer_ties). The tests use
8 indexer heads, where all-zero ties do not occur for these seeds, and check
that this is so.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation (test extra)")

from aotc.cli import app  # noqa: E402
from aotc.errors import ConfigError  # noqa: E402
from aotc.models.loader import load_model  # noqa: E402
from aotc.runtime import generate  # noqa: E402

LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"]


def hf_model(seed=0, index_n_heads=8, tables="distinct", **more):
    """A tiny random V4 with every layer type and both MoE kinds; window 8, CSA every 4, HCA every 8.
    `more`: other config fields (the same seed gives the same weights). tables="distinct":
    each hash-routing table sends a token to two different experts; "repeats": layer 0's
    is transformers' default (zeros: every token to expert 0 in both slots), layer 1's is
    random with repeats."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
        num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        layer_types=LAYERS, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=index_n_heads, index_head_dim=16, index_topk=3,
        hc_mult=2, hc_sinkhorn_iters=5, max_position_embeddings=512, partial_rotary_factor=0.5, initializer_range=0.2, **more,
    )  # fmt: skip
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers initializes these to zeros; make them matter
        for name, b in model.named_buffers():
            if name.endswith("tid2eid") and tables == "distinct":
                b.copy_(torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(b.shape[0])]))
            elif name.endswith("tid2eid") and ".layers.1." in name:
                b.copy_(torch.randint(0, 4, b.shape, generator=g))
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        for name, p in model.named_parameters():
            if name.endswith(("position_bias", "sinks", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.generation_config.eos_token_id = None  # greedy to the end on both sides
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_model()
    path = tmp_path_factory.mktemp("v4") / "hf"
    hf.save_pretrained(path)
    return path, hf, load_model(path)


@pytest.fixture(scope="module")
def repeats(tmp_path_factory):
    """A V4 whose hash-routing tables send tokens to one expert in both slots."""
    hf = hf_model(tables="repeats")
    path = tmp_path_factory.mktemp("v4-repeats") / "hf"
    hf.save_pretrained(path)
    expected = [transformers_tokens(hf, prompts, NEW) for prompts in routed_batches()]
    return path, expected


def transformers_tokens(hf, prompts, n):
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist() for p in prompts]


def ids_of(n, seed):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))


def indexer_ties(hf, ids) -> bool:
    """Whether some query's indexer scores tie at the top-k boundary (the reference is then ambiguous)."""
    scores = []
    handles = [layer.self_attn.compressor.indexer.scorer.register_forward_hook(lambda m, a, out: scores.append(out[0]))
               for layer in hf.model.layers if hasattr(getattr(layer.self_attn, "compressor", None), "indexer")]  # fmt: skip
    with torch.no_grad():
        hf(ids[None], use_cache=False)
    for h in handles:
        h.remove()
    for s in scores:  # [S, T]
        for t in range(s.shape[0]):
            ready = s[t, : (t + 1) // 4]
            if ready.numel() > 3:
                top = ready.sort(descending=True).values
                if top[2] == top[3]:
                    return True
    return False


def test_prompt_logits_match_transformers(pair):
    _, hf, ours = pair
    ids = ids_of(40, 3)  # longer than the window and than several CSA and HCA blocks
    assert not indexer_ties(hf, ids)
    with torch.no_grad():
        expected = hf(ids[None], use_cache=False).logits[0]
    torch.testing.assert_close(ours.model.prompt_logits(ids), expected, atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(pair):
    _, hf, ours = pair
    prompts = [ids_of(n, n).tolist() for n in (5, 23, 37)]
    result = generate(ours.model, prompts, 20, max_batch=4, max_seq=ours.model.round_max_seq(64), stop_at_eos=False)
    for prompt, seq in zip(prompts, result.sequences):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
        assert seq.new_ids == out[0, len(prompt) :].tolist()
        assert not indexer_ties(hf, torch.tensor(prompt + seq.new_ids))


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1, "partial_rotary_factor": 0.5}


@pytest.mark.parametrize("change", [{"scoring_func": "sigmoid"}, {"rope_parameters": YARN}], ids=["sigmoid-router", "yarn-rope"])
def test_router_and_rope_variants_match_transformers(pair, tmp_path, change):
    hf = hf_model(**change)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ids = ids_of(40, 3)
    assert not indexer_ties(hf, ids)
    with torch.no_grad():
        expected = hf(ids[None], use_cache=False).logits[0]
    torch.testing.assert_close(ours.model.prompt_logits(ids), expected, atol=1e-4, rtol=1e-4)
    # The variant is in effect: the default config's logits, same weights, differ.
    default = pair[2].model.prompt_logits(ids)
    assert (default - expected).abs().max() > 1e-2


def test_softmax_router_against_its_formula(pair):
    """transformers has no softmax scoring for V4 (it looks the name up among activations): the formula by hand."""
    gate = pair[2].model.model.layers[2].ffn.gate  # a top-k (not hashed) router
    gate.scoring = "softmax"
    try:
        x = torch.randn(5, gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
        chosen, weights = gate(x, None)
    finally:
        gate.scoring = "sqrtsoftplus"
    scores = torch.exp(x @ gate.weight.T)
    scores = scores / scores.sum(-1, keepdim=True)
    expected_chosen = (scores + gate.bias).argsort(dim=-1, descending=True)[:, : gate.topk]
    assert [sorted(r) for r in chosen.tolist()] == [sorted(r) for r in expected_chosen.tolist()]
    picked = scores.gather(1, chosen)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True) * gate.scaling)


def test_transformers_paths_disagree_only_on_exact_indexer_ties(tmp_path):
    """With 2 indexer heads, transformers' full forward is not causal: a position's
    logits change with later tokens, exactly where its indexer scores tie at 0.0."""
    hf = hf_model(index_n_heads=2)
    ids = ids_of(64, 0)
    scores = []
    hook = hf.model.layers[3].self_attn.compressor.indexer.scorer.register_forward_hook(lambda m, a, out: scores.append(out[0]))
    with torch.no_grad():
        short, long = hf(ids[None, :30], use_cache=False).logits[0], hf(ids[None, :32], use_cache=False).logits[0, :30]
    hook.remove()
    moved = ((short - long).abs().amax(-1) > 1e-3).nonzero().flatten().tolist()
    assert moved, "expected transformers' full forward to depend on later tokens here"
    first = moved[0]
    ready = scores[0][first, : (first + 1) // 4]
    assert (ready == 0).sum() >= 2  # several entries tie at exactly 0.0 ...
    assert (ready > 0).sum() < 3  # ... at the top-3 boundary
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path).model
    torch.testing.assert_close(ours.prompt_logits(ids[:30]), ours.prompt_logits(ids[:32])[:30])  # aotc is causal


def chunked_logits(model, ids, chunk):
    """Per-position logits of a prompt prefilled chunk by chunk (each chunk a separate call)."""
    caches = model.allocate_caches(1, model.round_max_seq(ids.shape[0] + 8))  # room to decode after
    rows = []
    for start in range(0, ids.shape[0], chunk):
        part = ids[start : start + chunk]
        positions = torch.arange(start, start + part.shape[0])
        x = model.run_layers("prefill", part, positions, torch.zeros_like(positions), caches)
        rows.append(model.final(x))
    return torch.cat(rows), caches


@pytest.mark.parametrize("chunk", [16, 128])
def test_chunked_prefill_equals_whole_prompt(pair, chunk):
    _, _, ours = pair
    model = ours.model
    ids = ids_of(150, 7)
    whole, whole_caches = chunked_logits(model, ids, 1000)
    chunked, chunk_caches = chunked_logits(model, ids, chunk)
    # Every query sees what its own position sees, the chunk's last token included.
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
    for kind in whole_caches:
        torch.testing.assert_close(chunk_caches[kind], whole_caches[kind], atol=1e-5, rtol=1e-5)
    # And greedy decoding continues the same from either state.
    assert greedy_from(model, chunk_caches, chunked[-1], ids.shape[0]) == greedy_from(model, whole_caches, whole[-1], ids.shape[0])


def greedy_from(model, caches, logits, position, steps=8):
    """Greedy tokens decoded from a prefilled state (sequence in slot 0), starting at `position`."""
    tokens = [int(logits.argmax())]
    for i in range(steps - 1):
        logits = model.decode(torch.tensor([tokens[-1]]), torch.tensor([position + i]), caches)[0]
        tokens.append(int(logits.argmax()))
    return tokens


def quantize_blocks(w: torch.Tensor, ue8m0: bool):
    rows, cols = w.shape
    scale = torch.zeros(-(-rows // 128), -(-cols // 128))
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = block.abs().amax().clamp(min=1e-12) / 448
            if ue8m0:
                s = torch.exp2(torch.ceil(torch.log2(s)))
            scale[i, j] = s
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / s).to(torch.float8_e4m3fn)
    if ue8m0:
        return q, (torch.log2(scale) + 127).to(torch.uint8)
    return q, scale


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_block_scaled_checkpoint(pair, tmp_path, ue8m0):
    path, _, ours = pair
    tensors = load_file(path / "model.safetensors")
    fp8_dir, deq_dir = tmp_path / "fp8", tmp_path / "dequantized"
    for d in (fp8_dir, deq_dir):
        shutil.copytree(path, d)
    quantized, dequantized = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith(".weight") and w.dim() == 2 and ("attn.w" in name or ".ffn." in name):
            q, s = quantize_blocks(w, ue8m0)
            quantized[name], quantized[name + "_scale_inv"] = q, s
            full = torch.exp2(s.float() - 127) if ue8m0 else s
            dequantized[name] = q.float() * full.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    assert any(t.dtype == torch.float8_e4m3fn for t in quantized.values())
    save_file(quantized, fp8_dir / "model.safetensors")
    save_file(dequantized, deq_dir / "model.safetensors")
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], **({"scale_fmt": "ue8m0"} if ue8m0 else {})}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    ids = ids_of(30, 11)
    fp8 = load_model(fp8_dir).model.prompt_logits(ids)
    torch.testing.assert_close(fp8, load_model(deq_dir).model.prompt_logits(ids))  # loading = dequantizing exactly
    # Each loaded weight is within e4m3's rounding (3 mantissa bits) of the original, and not identical to it.
    loaded = dict(load_model(fp8_dir).model.named_parameters())
    original = dict(ours.model.named_parameters())
    w, w0 = loaded["model.layers.1.attn.wq_b.weight"], original["model.layers.1.attn.wq_b.weight"]
    assert not torch.equal(w, w0)
    assert ((w - w0).abs() <= 2**-4 * w0.abs() + w0.abs().max() / 448 * 2**-6).all()


def test_init_tiny_has_every_layer_type_and_runs_eagerly(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["init", "tiny", str(tmp_path / "v4"), "--arch", "deepseek_v4"])
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "v4" / "config.json").read_text())
    assert set(config["layer_types"]) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert set(config["mlp_layer_types"]) == {"hash_moe", "moe"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "v4").eval()  # the layout transformers reads
    ids = ids_of(40, 1)
    with torch.no_grad():
        expected = hf(ids[None], use_cache=False).logits[0]
    torch.testing.assert_close(load_model(tmp_path / "v4").model.prompt_logits(ids), expected, atol=1e-4, rtol=1e-4)
    for model in ("v4",):
        r = runner.invoke(app, ["run", str(tmp_path / model), "--eager", "--json", "--max-new-tokens", "6", "--prompt", "Hello", "--prompt", "the quick brown fox"])
        assert r.exit_code == 0, r.output
        report = json.loads(r.output)
        assert report["backend"] == "eager"
        assert [p["new_ids"] for p in report["prompts"]] == library_generation(tmp_path / model, ["Hello", "the quick brown fox"], 6)


def test_eager_run_for_the_llama_family(tiny_dir):
    r = CliRunner().invoke(app, ["run", str(tiny_dir), "--eager", "--json", "--max-new-tokens", "5", "--prompt", "Hello"])
    assert r.exit_code == 0, r.output
    assert [p["new_ids"] for p in json.loads(r.output)["prompts"]] == library_generation(tiny_dir, ["Hello"], 5)


def library_generation(model_dir, texts, new_tokens):
    """What `aotc run --eager` must print: the library's greedy generation on the same token ids."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(t).ids for t in texts]
    model = load_model(model_dir).model
    max_seq = model.round_max_seq(max(map(len, prompts)) + new_tokens)
    return [s.new_ids for s in generate(model, prompts, new_tokens, max_batch=len(prompts), max_seq=max_seq).sequences]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 2}, "one shared KV head"),
        ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]}, "'full_attention'"),
        ({"scoring_func": "tanh"}, "'scoring_func' is 'tanh'"),
    ],
)
def test_config_errors(pair, tmp_path, change, message):
    path, _, _ = pair
    shutil.copytree(path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(change)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_model(tmp_path / "m")


NEW = 8  # tokens generated per prompt in the routing tests


def routed_batches():
    """Batch 1, and a batch of 3 (in bucket 4 when compiled)."""
    return [[ids_of(23, 5).tolist()], [ids_of(n, n).tolist() for n in (5, 23, 37)]]


def test_a_token_routed_to_one_expert_in_two_slots_matches_transformers(repeats):
    """transformers sums each (token, slot) pair, so a token a hash table sends to one
    expert twice gets it twice, each weighted by its slot: aotc's one row per token and
    expert, weighted by both slots, is the same sum (eager stopped at a torch._check)."""
    path, expected = repeats
    ours = load_model(path).model
    tables = [layer.ffn.gate.tid2eid for layer in ours.model.layers if layer.ffn.gate.hashed]
    assert (tables[0] == 0).all() and (tables[1][:, 0] == tables[1][:, 1]).any() and (tables[1][:, 0] != tables[1][:, 1]).any()
    for prompts, want in zip(routed_batches(), expected):
        result = generate(ours, prompts, NEW, max_batch=4, max_seq=64, stop_at_eos=False)
        assert [s.new_ids for s in result.sequences] == want


def test_a_routing_table_naming_an_expert_that_does_not_exist_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "v4"
    assert CliRunner().invoke(app, ["init", "tiny", str(path), "--arch", "deepseek_v4", "--layers", "3"]).exit_code == 0
    tensors = load_file(path / "model.safetensors")
    name = next(k for k in sorted(tensors) if k.endswith("tid2eid"))
    tensors[name][7, 1] = 4  # 4 routed experts: 0..3
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    r = CliRunner().invoke(app, ["run", str(path), "--eager", "--prompt", "Hello", "--max-new-tokens", "2"])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and f"model.safetensors: tensor '{name}' sends token 7 to expert 4 (slot 1); expected expert indices 0..3" in said, r.output


def test_a_shared_prefix_reuses_every_cache_kind_at_a_window_boundary_and_inside_one(pair):
    """The prefix cache on V4 (eager): the sliding window's keys, the compressors' projections
    and their entries copied between slots, for prefixes that end inside a compressor
    window and on one; each request answers as it does alone."""
    from aotc.runtime.engine import Engine

    _, _, ours = pair
    model = ours.model
    c = model.config
    slots, max_seq = 4, model.round_max_seq(256)
    caches = model.allocate_caches(slots, max_seq)
    engine = lambda prefix_cache: Engine(model, caches, slots=slots, max_seq=max_seq, chunk=64, prefix_cache=prefix_cache)  # noqa: E731
    shared = ids_of(150, 7).tolist()
    rate = max(c.compress_rate_csa, c.compress_rate_hca)
    for n in (rate * (130 // rate), rate * (130 // rate) + 3):  # on a window's end, and 3 positions into the next
        served = engine(True)
        running = served.submit(shared, 40)
        while not running.new_ids:
            served.step()
        again = served.submit(shared[:n] + ids_of(12, n).tolist(), 8)  # copied from the running request's slot
        served.run()
        alone = engine(False)
        solo = alone.submit(again.prompt_ids, 8)
        alone.run()
        assert again.cached == n and again.slot != running.slot and again.new_ids == solo.new_ids, n
