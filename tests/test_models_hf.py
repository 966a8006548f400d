"""aotc's eager Llama-family models against Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation (test extra)")

from aotc.models.loader import load_model  # noqa: E402
from aotc.runtime import generate  # noqa: E402

from .conftest import hf_save  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3, max_position_embeddings=256, initializer_range=0.1)

CASES = {
    # GQA, llama3 rope scaling, untied embeddings
    "llama-gqa-llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        ),
    ),
    # MQA, tied embeddings, linear rope scaling
    "llama-mqa-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    # qkv bias; sliding window on the last two layers only, shorter than the prompt
    "qwen2-mixed-window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    # sliding window shorter than the prompt on every layer
    "mistral-window": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=8, head_dim=16),
    ),
}


def _pair(name, tmp_path_factory):
    config_name, model_name, fields = CASES[name]
    path, hf = hf_save(tmp_path_factory.mktemp(name), getattr(transformers, config_name), getattr(transformers, model_name), **fields)
    return name, path, hf, load_model(path)


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_pair(request, tmp_path_factory):
    return _pair(request.param, tmp_path_factory)


def test_prompt_logits_match_transformers(hf_pair):
    _, _, hf, ours = hf_pair
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    actual = ours.model.prompt_logits(ids)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def test_greedy_generation_matches_transformers(hf_pair):
    _, _, hf, ours = hf_pair
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 20, 27)]
    new = 12
    result = generate(ours.model, prompts, new, max_batch=4, max_seq=64, stop_at_eos=False)
    for prompt, seq in zip(prompts, result.sequences):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        assert seq.new_ids == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if "window" in n])
def test_sliding_window_matters(name, tmp_path_factory):
    """The window cases must actually exercise the window: full attention gives other logits."""
    _, _, _, ours = _pair(name, tmp_path_factory)
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(1))
    windowed = ours.model.prompt_logits(ids)
    windows = [layer.self_attn.window for layer in ours.model.model.layers]
    assert any(w == 8 for w in windows)
    for layer in ours.model.model.layers:
        layer.self_attn.window = None
    try:
        full = ours.model.prompt_logits(ids)
    finally:
        for layer, w in zip(ours.model.model.layers, windows):
            layer.self_attn.window = w
    torch.testing.assert_close(windowed[:8], full[:8])
    assert (windowed[8:] - full[8:]).abs().max() > 1e-3


def test_tiny_init_loads_in_transformers(tiny_dir):
    """`aotc init tiny` writes the exact Hugging Face layout: transformers reads it and agrees."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ours = load_model(tiny_dir)
    ids = torch.arange(3, 40)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours.model.prompt_logits(ids), expected, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    _, hf = hf_save(tmp_path / "single", transformers.LlamaConfig, transformers.LlamaForCausalLM, **dict(COMMON, num_attention_heads=4, num_key_value_heads=2))
    path = tmp_path / "sharded"
    hf.save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    ids = torch.arange(5, 25)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(load_model(path).model.prompt_logits(ids), expected, atol=2e-5, rtol=1e-4)


QWEN3 = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 64.5}, r"field 'hidden_size' must be an integer"),
        ({"num_attention_heads": 0}, r"field 'num_attention_heads' must be a positive integer, got 0"),
        ({"max_position_embeddings": 0}, r"field 'max_position_embeddings' must be a positive integer, got 0"),
        ({"rope_theta": -1}, r"field 'rope_theta' must be a finite number above 0, got -1"),
        ({"rms_norm_eps": float("nan")}, r"field 'rms_norm_eps' must be a finite number above 0, got nan"),
        ({"sliding_window": 0}, r"field 'sliding_window' must be a positive integer, got 0"),
        ({"hidden_act": "os.system"}, r"field 'hidden_act' is 'os.system'; expected one of transformers' activations"),
        ({"layer_types": ["full_attention"]}, r"field 'layer_types' is \['full_attention'\]; expected a list of one layer kind \(a string\) per layer, num_hidden_layers 2"),
        ({"layer_types": "full_attention"}, r"field 'layer_types' is 'full_attention'"),
        ({"layer_types": ["full_attention", "bogus"]}, r"transformers refuses this config \(StrictDataclassClassValidationError"),
    ],
)
def test_the_generic_path_checks_a_configs_common_fields_as_aotcs_own_do(tmp_path, change, message):
    """A generic-path config.json (qwen3) with one bad field: refused naming the file and the
    field, before transformers builds a model of it."""
    import json

    from aotc.errors import ConfigError
    from aotc.models.loader import parse_config

    (tmp_path / "config.json").write_text(json.dumps({**QWEN3, **change}))
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'config.json'}: {message}"):
        parse_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    assert parse_config(tmp_path)[2].num_hidden_layers == 2


def test_learning_a_layer_contract_takes_turns_with_any_other(tmp_path):
    """Learning the generic path's layer contract swaps transformers' global attention,
    experts and mask functions for one meta forward: it holds hf.contract._LEARNING meanwhile, so two
    learnings in one process never interleave (each would put back the other's stand-ins)."""
    import threading

    from aotc.models.hf import contract

    folder, _ = hf_save(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM, **dict(COMMON, num_attention_heads=4, num_key_value_heads=2))
    done = threading.Event()
    loading = threading.Thread(target=lambda: (load_model(folder, weights=False, modeling="transformers"), done.set()))
    with contract._LEARNING:
        loading.start()
        assert not done.wait(timeout=3), "the contract was learnt while another learning held the lock"
    loading.join(timeout=120)
    assert done.is_set()
