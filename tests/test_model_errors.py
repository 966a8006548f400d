"""Bad model folders get clear errors that name the file, field or tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from aotc.errors import ConfigError, WeightsError
from aotc.models.loader import load_model


@pytest.fixture()
def model(tiny_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny_dir, path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(model_type="gpt9", architectures=["GPT9ForCausalLM"]),
            r"unsupported architecture \(model_type='gpt9'.*knows model_type .*llama.* every decoder-only model transformers has",
        ),
        (dict(hidden_size=None), r"config.json: missing field 'hidden_size' \(an integer\)"),
        (dict(num_attention_heads="4"), r"field 'num_attention_heads' must be an integer, got '4' \(str\)"),
        (dict(num_attention_heads=3), r"num_attention_heads \(3\) must be a multiple of num_key_value_heads \(2\)"),
        (dict(hidden_act="gelu"), r"'hidden_act' is 'gelu'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), r"rope_type 'yarn' is not supported"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), r"rope scaling 'llama3' needs a number in field 'low_freq_factor'"),
        (dict(dtype="float8"), r"field 'dtype' is 'float8'"),
        (dict(torch_dtype="bfloat16"), r"fields 'dtype' \('float32'\) and 'torch_dtype' \('bfloat16'\) disagree; .* keep one"),
    ],
)
def test_config_errors(model, changes, message):
    edit_config(model, **changes)
    with pytest.raises(ConfigError, match=message):
        load_model(model)


def test_missing_config(tmp_path):
    tmp_path.joinpath("m").mkdir()
    with pytest.raises(ConfigError, match=r"m/config.json: missing"):
        load_model(tmp_path / "m")


def test_config_not_json(model):
    (model / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match=r"config.json: not valid JSON"):
        load_model(model)


@pytest.mark.parametrize("weights", [True, False])
def test_missing_tensor(model, weights):
    edit_weights(model, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"no tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(model, weights=weights)


@pytest.mark.parametrize("weights", [True, False])
def test_wrong_shape(model, weights):
    edit_weights(model, lambda t: t.update({"model.norm.weight": torch.ones(128)}))
    with pytest.raises(WeightsError, match=r"tensor 'model.norm.weight' has shape \[128\], expected \[256\]"):
        load_model(model, weights=weights)


def test_no_safetensors(model):
    (model / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"no model.safetensors, model.safetensors.index.json or \*.safetensors"):
        load_model(model)


def test_build_never_reads_weight_values(model, monkeypatch):
    """weights=False checks shapes from the safetensors headers and never loads a tensor."""
    from aotc.models.checkpoint import Checkpoint

    def refuse(self, names, pieces=None):
        raise AssertionError("weights were read")

    monkeypatch.setattr(Checkpoint, "load", refuse)
    fake = load_model(model, weights=False)
    assert all(type(p).__name__ == "FakeTensor" for p in fake.model.parameters())
    with pytest.raises(AssertionError, match="weights were read"):
        load_model(model, weights=True)
