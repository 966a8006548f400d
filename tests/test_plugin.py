"""Bring your own model: the example plugin package, built and run, and plugin errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aotc.cli import app

from .conftest import assert_check_report

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "plugin"
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


@pytest.fixture()
def on_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_example_plugin_builds_and_runs(on_path):
    model, bundle = on_path / "gpt", on_path / "bundle"
    r = invoke("init", "tiny", model, "--plugin", "tinygpt.model", "--arch", "tinygpt", "--layers", 2)
    assert r.exit_code == 0, r.output
    r = invoke("build", model, "--plugin", "tinygpt.model", "--backend", "export", "--buckets", "1,2", "--prefill-chunk", "16", "--max-seq", 128, "-o", bundle)
    assert r.exit_code == 0, r.output
    assert "traced 5 graphs for 3 entries serving 5 module instances" in r.output
    assert json.loads((bundle / "manifest.json").read_text())["plugins"] == ["tinygpt.model"]
    # The bundle records its plugin, but aotc imports a module only when the user names it.
    r = invoke("run", bundle, "--check", "--max-new-tokens", 8, "--prompt", "Hello")
    assert r.exit_code == 2 and "pass --plugin tinygpt.model" in " ".join(r.output.split()), r.output
    r = invoke(
        "run",
        bundle,
        "--plugin",
        "tinygpt.model",
        "--check",
        "--json",
        "--max-new-tokens",
        8,
        "--prompt",
        "Hello",
        "--prompt",
        "the quick brown fox jumps over the lazy dog, twice over",
    )
    assert r.exit_code == 0, r.output
    assert_check_report(json.loads(r.output), "export")


def write_module(folder: Path, name: str, text: str) -> str:
    (folder / f"{name}.py").write_text(text)
    return name


def test_plugin_that_fails_to_import(on_path):
    name = write_module(on_path, "broken_plugin", "import aotc\nraise RuntimeError('no weights here')\n")
    r = invoke("init", "tiny", on_path / "m", "--plugin", name)
    assert r.exit_code == 2
    said = " ".join(r.output.split())
    assert "--plugin broken_plugin: importing it failed with RuntimeError: no weights here" in said and "broken_plugin.py:2" in said
    r = invoke("init", "tiny", on_path / "m", "--plugin", "no_such_plugin_module")
    assert r.exit_code == 2 and "ModuleNotFoundError" in r.output


def test_plugin_that_registers_nothing(on_path):
    name = write_module(on_path, "empty_plugin", "import aotc\n")
    r = invoke("init", "tiny", on_path / "m", "--plugin", name)
    assert r.exit_code == 2 and "registered no architecture" in " ".join(r.output.split())


BAD_ENTRY = """
import torch
import aotc
from tinygpt.model import TinyGPTForCausalLM, Head


class BadHead(Head):
    @aotc.entry(bucket="batch")
    def forward(self, x, temperature):
        return self.lm_head(self.ln_f(x)).float() / temperature

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, self.lm_head.in_features), 0.7)


@aotc.register_architecture(model_types=("badgpt",))
class BadGPT(TinyGPTForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.head = BadHead(config)
"""


def test_plugin_entry_with_non_tensor_input(on_path):
    name = write_module(on_path, "bad_plugin", BAD_ENTRY)
    model = on_path / "bad"
    assert invoke("init", "tiny", model, "--plugin", "tinygpt.model", "--arch", "tinygpt", "--layers", 1).exit_code == 0
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "badgpt"
    config.pop("architectures", None)  # else it names tinygpt's class, and contradicts model_type
    (model / "config.json").write_text(json.dumps(config))
    r = invoke("build", model, "--plugin", name, "--backend", "export", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", 64, "-o", on_path / "b")
    assert r.exit_code == 2
    assert "BadHead.forward: argument 'temperature' is 0.7 (float); entry arguments must be tensors" in " ".join(r.output.split())
