"""The bad-input corpus: hostile inputs, one row each, run in-process through the CLI.

Each case asserts: the exit status (2 for an error of the user's input; 0 where the
input is recoverable and aotc goes on with a warning), a message naming the culprit,
no traceback, no file changed outside the intended output, and the model folder
unchanged. Categories: cli, model, bundle, cache, tampering, interrupt.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from aotc.cli import app

from .conftest import rehash


@dataclass
class Case:
    id: str
    category: str
    argv: Callable[["Env"], list]  # the command line, after setting up what it needs
    message: str  # a fragment the output must hold (whitespace-normalized)
    code: int = 2
    patch: Callable | None = None  # (monkeypatch) -> None: emulate what root in CI cannot (permissions, memory)
    changes: tuple[str, ...] = ()  # what may change under the case's root: the intended output (and its lock file)


@dataclass
class Env:
    root: Path
    model: Path  # a private copy of the tiny model
    bundle: Path  # a private copy of an export bundle of it
    cache: Path


# -- helpers that damage copies -----------------------------------------------------


def config(env: Env, **changes) -> Env:
    c = json.loads((env.model / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    (env.model / "config.json").write_text(json.dumps(c))
    return env


def write_generation(env: Env, **fields) -> Env:
    """The model copy with a generation_config.json of these fields."""
    (env.model / "generation_config.json").write_text(json.dumps(fields))
    return env


def write(path: Path, data) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def tensors(env: Env, change: Callable[[dict], None]) -> Env:
    t = load_file(env.model / "model.safetensors")
    change(t)
    save_file(t, env.model / "model.safetensors")
    return env


def manifest(env: Env, change: Callable[[dict], None], fix_hashes: bool = False) -> Env:
    m = json.loads((env.bundle / "manifest.json").read_text())
    change(m)
    (env.bundle / "manifest.json").write_text(json.dumps(m))
    if fix_hashes:
        rehash(env.bundle)
    return env


def _decode(m: dict) -> dict:
    """The manifest's decode entry (read per context bucket)."""
    return next(e for e in m["entries"] if e["method"] == "decode")


def artifact_file(env: Env, name: str = "program.pt2") -> Path:
    return next(env.bundle.glob(f"entries/*/b1/{name}"))


BUILD = ["build", "--backend", "export", "--no-cache", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", "64"]


def build(env: Env, *more) -> list:
    return [BUILD[0], env.model, *BUILD[1:], "-o", env.root / "out", *more]


def run(env: Env, *more) -> list:
    return ["run", env.bundle, "--max-new-tokens", "2", "--prompt", "hi", *more]


W = "model.layers.0.mlp.up_proj.weight"
OUT = ("out",)  # a build's output

CASES = [
    # -- cli: options and arguments -----------------------------------------------------
    *[Case(f"buckets-{v!r}", "cli", lambda e, v=v: build(e, "--buckets", v), "--buckets") for v in ("0", "-1", "a", "1,,x", "1.5", "1,1", "2,4,2", " ")],
    *[Case(f"prefill-chunk-{v!r}", "cli", lambda e, v=v: build(e, "--prefill-chunk", v), "--prefill-chunk") for v in ("0", "x", "16,16", "-16")],
    Case("max-seq-zero", "cli", lambda e: build(e, "--max-seq", "0"), "--max-seq"),
    *[Case(f"context-buckets-{v!r}", "cli", lambda e, v=v: build(e, "--context-buckets", v), "--context-buckets") for v in ("0", "x", "32,32", "-32")],
    Case("context-bucket-above-max-seq", "cli", lambda e: build(e, "--context-buckets", "32,128"), "--context-buckets 32,128: 128 is more than --max-seq 64"),
    Case("backend-unknown", "cli", lambda e: build(e, "--backend", "tpu"), "tpu"),
    Case("device-unknown", "cli", lambda e: build(e, "--device", "npu"), "--device"),
    Case("device-cuda-export", "cli", lambda e: build(e, "--device", "cuda"), "--device cuda"),
    Case("compiler-flag-no-equals", "cli", lambda e: build(e, "--compiler-flag", "optlevel"), "--compiler-flag"),
    Case("neuron-target-unknown", "cli", lambda e: [*build(e), "--backend", "neuron", "--compiler-flag", "target=trn9"], "target='trn9'"),
    Case("neuron-optlevel-bad", "cli", lambda e: [*build(e), "--backend", "neuron", "--compiler-flag", "optlevel=7"], "optlevel"),
    Case("neuron-flag-unknown", "cli", lambda e: [*build(e), "--backend", "neuron", "--compiler-flag", "fp8_max=224"], "neuron backend's flags are"),
    Case("neuron-on-cuda", "cli", lambda e: [*build(e), "--backend", "neuron", "--device", "cuda"], "--device cuda"),
    *[Case(f"shard-{v}", "cli", lambda e, v=v: build(e, "--shard", v), "--shard") for v in ("0/2", "3/2", "a/b", "1")],
    Case(
        "require-cache-empty",
        "cli",
        lambda e: [BUILD[0], e.model, *BUILD[1:3], "--require-cache", "--cache-dir", e.cache, "--buckets", "1", "--prefill-chunk", "16", "--max-seq", "64", "-o", e.root / "out"],
        "not in the cache",
    ),
    Case("run-max-batch-too-big", "cli", lambda e: run(e, "--max-batch", "64"), "--max-batch 64"),
    Case("run-max-new-tokens-zero", "cli", lambda e: ["run", e.bundle, "--max-new-tokens", "0"], "--max-new-tokens"),
    Case("run-prompt-not-utf8", "cli", lambda e: ["run", e.bundle, "--prompt", "\udcff\udcfe", "--max-new-tokens", "2"], "not valid UTF-8"),
    Case("run-prompt-empty", "cli", lambda e: ["run", e.bundle, "--prompt", "", "--max-new-tokens", "2"], "prompt 0 is empty"),
    Case("run-prompt-too-long", "cli", lambda e: ["run", e.bundle, "--prompt", "word " * 200, "--max-new-tokens", "2"], "more than the cache holds"),
    Case("run-expect-digest-wrong", "cli", lambda e: run(e, "--expect-digest", "00" * 32), "this is not the bundle you pinned"),
    Case("run-eager-check", "cli", lambda e: ["run", e.model, "--eager", "--check"], "nothing to compare with --eager"),
    # -- the eager path has the bundle path's checks; threads within the machine's CPUs -------------
    Case(
        "run-eager-prompt-past-max-positions",
        "cli",
        lambda e: ["run", e.model, "--eager", "--prompt", "word " * 2100, "--max-new-tokens", "2"],
        "config.json allows (max_position_embeddings 2048)",
    ),
    Case("run-eager-max-new-tokens-huge", "cli", lambda e: ["run", e.model, "--eager", "--prompt", "hi", "--max-new-tokens", str(10**12)], "1000000000002 positions, more than"),
    Case("run-eager-generation-config-huge", "model", lambda e: ["run", write_generation(e, max_new_tokens=10**12).model, "--eager", "--prompt", "hi"], "lower --max-new-tokens"),
    Case(
        "run-eager-caches-do-not-fit",
        "cli",
        lambda e: ["run", e.model, "--eager", "--prompt", "hi", "--max-new-tokens", "2"],
        "aotc run --eager: its caches take",
        patch=lambda mp: mp.setattr("aotc.models.loader.available_memory", lambda: 1000),
    ),
    Case("verify-caches-do-not-fit", "cli", lambda e: ["verify", e.bundle], "its caches take", patch=lambda mp: mp.setattr("aotc.models.loader.available_memory", lambda: 1000)),
    *[Case(f"run-threads-{n}", "cli", lambda e, n=n: run(e, "--threads", str(n)), f"--threads {n}: expected 1 to") for n in (100000, 10**9)],
    Case("run-not-a-bundle", "cli", lambda e: ["run", e.model, "--max-new-tokens", "2"], "manifest.json"),
    Case("run-missing-path", "cli", lambda e: ["run", e.root / "nowhere", "--max-new-tokens", "2"], "nowhere"),
    Case("run-plugin-missing", "cli", lambda e: run(e, "--plugin", "no_such_module_anywhere"), "no_such_module_anywhere"),
    Case("inspect-not-a-bundle", "cli", lambda e: ["inspect", e.model], "manifest.json"),
    Case("verify-not-a-bundle", "cli", lambda e: ["verify", e.model], "manifest.json"),
    *[Case(f"prune-size-{v}", "cli", lambda e, v=v: ["cache", "prune", "--max-size", v, "--cache-dir", e.cache], "--max-size") for v in ("abc", "-1", "1XB", "")],
    Case("init-out-is-a-file", "cli", lambda e: ["init", "tiny", write(e.root / "f", "x")], "not an empty folder"),
    Case("init-arch-unknown", "cli", lambda e: ["init", "tiny", e.root / "n", "--arch", "gpt9"], "gpt9"),
    Case("init-quantize-unknown", "cli", lambda e: ["init", "tiny", e.root / "n", "--quantize", "int3"], "--quantize int3"),
    Case("init-layout-unknown", "cli", lambda e: ["init", "tiny", e.root / "n", "--quantize", "fp8", "--checkpoint-layout", "gguf"], "--checkpoint-layout gguf"),
    Case("init-fp4-on-llama", "cli", lambda e: ["init", "tiny", e.root / "n", "--quantize", "fp4-experts"], "has no routed experts"),
    Case("init-set-no-equals", "cli", lambda e: ["init", "tiny", e.root / "n", "--set", "hidden_size"], "--set"),
    Case("init-layers-zero", "cli", lambda e: ["init", "tiny", e.root / "n", "--layers", "0"], "--layers"),
    Case(
        "init-layers-a-million", "cli", lambda e: ["init", "tiny", e.root / "n", "--layers", "1000000"], "Invalid value for '--layers': Input should be less than or equal to 256"
    ),
    *[
        Case(f"prune-size-strict-{v[:8]!r}", "cli", lambda e, v=v: ["cache", "prune", "--max-size", v, "--cache-dir", e.cache], w)
        for v, w in (
            ("5Ki", "--max-size '5Ki': expected a size such as 500M"),
            ("5 G", "--max-size '5 G': expected a size"),
            ("1e3", "--max-size '1e3'"),
            ("9" * 400, "--max-size 999999999999...(400 characters): more than any disk holds"),
        )
    ],  # fmt: skip
    Case(
        "prefill-chunk-above-max-seq",
        "cli",
        lambda e: build(e, "--prefill-chunk", "16,128"),
        "--prefill-chunk 16,128: 128 is more than --max-seq 64; a chunk's tokens all go into the cache",
    ),
    Case(
        "max-seq-above-the-models-positions",
        "cli",
        lambda e: build(config(e, max_position_embeddings=32)),
        "config.json's max_position_embeddings is 32, where the model's positions end",
    ),
    Case("jobs-a-million", "cli", lambda e: build(e, "--jobs", "1000000"), "--jobs 1000000: expected 1 to"),
    Case(
        "run-eos-beyond-the-vocabulary",
        "model",
        lambda e: run(write_generation(e, eos_token_id=10**9)),
        "generation_config.json's eos_token_id 1000000000 is beyond the vocabulary (config.json's vocab_size is 512): the model never produces a stop token, so a sequence ends only at the token limit",
        code=0,
    ),
    Case("bisect-export-bundle", "cli", lambda e: ["bisect", e.bundle, "--entry", "LMHead.forward", "--bucket", "1"], "export bundle"),
    Case("output-is-the-model", "cli", lambda e: [*BUILD[:1], e.model, *BUILD[1:], "-o", e.model], "would replace the model folder"),
    Case("output-inside-the-model", "cli", lambda e: [*BUILD[:1], e.model, *BUILD[1:], "-o", e.model / "b"], "would replace the model folder"),
    Case("output-around-the-model", "cli", lambda e: [*BUILD[:1], e.model, *BUILD[1:], "-o", e.model.parent], "would replace the model folder"),
    Case("output-is-a-file", "cli", lambda e: [*BUILD[:1], e.model, *BUILD[1:], "-o", write(e.root / "notes.txt", "mine")], "is a file, not a bundle folder"),
    Case(
        "output-holds-other-files",
        "cli",
        lambda e: [*BUILD[:1], e.model, *BUILD[1:], "-o", (write((e.root / "mine").mkdir() or e.root / "mine" / "todo.txt", "keep")).parent],
        "not an aotc bundle",
    ),
    # -- model folder: config.json -----------------------------------------------------
    Case("config-missing", "model", lambda e: build(e) if (e.model / "config.json").unlink() is None else None, "config.json"),
    Case("config-not-json", "model", lambda e: build(e) if write(e.model / "config.json", "{nope") else None, "config.json"),
    Case("config-a-list", "model", lambda e: build(e) if write(e.model / "config.json", "[1, 2]") else None, "config.json"),
    Case("model-type-unknown", "model", lambda e: build(config(e, model_type="gpt9", architectures=None)), "unsupported architecture"),
    Case("model-type-contradicts-architectures", "model", lambda e: build(config(e, model_type="gpt_neox")), "contradicts itself"),
    Case("model-type-qwen2-with-mistral-class", "model", lambda e: build(config(e, model_type="qwen2", architectures=["MistralForCausalLM"])), "contradicts itself"),
    *[
        Case(f"field-missing-{k}", "model", lambda e, k=k: build(config(e, **{k: None})), k)
        for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
    ],
    *[
        Case(f"field-type-{k}", "model", lambda e, k=k: build(config(e, **{k: "many"})), k)
        for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "rms_norm_eps")
    ],
    Case("field-negative-hidden", "model", lambda e: build(config(e, hidden_size=-8)), "hidden_size"),
    Case("heads-do-not-divide", "model", lambda e: build(config(e, num_key_value_heads=3)), "num_key_value_heads"),
    Case("dtype-unknown", "model", lambda e: build(config(e, dtype="float7", torch_dtype="float7")), "float7"),
    Case("rope-scaling-type-unknown", "model", lambda e: build(config(e, rope_scaling={"rope_type": "warp", "factor": 2.0})), "warp"),
    # -- config.json values of the wrong type, or that make a broken model --------------------
    Case("rope-theta-string", "model", lambda e: build(config(e, rope_theta="x")), "field 'rope_theta' must be a number, got 'x'"),
    Case(
        "rope-parameters-theta-string",
        "model",
        lambda e: build(config(e, rope_parameters={"rope_type": "default", "rope_theta": "x"})),
        "field 'rope_theta' must be a number, got 'x'",
    ),
    *[Case(f"rope-theta-{v}", "model", lambda e, v=v: build(config(e, rope_theta=v)), f"field 'rope_theta' must be a finite number above 0, got {v}") for v in (0, -1.5)],
    *[
        Case(f"rms-norm-eps-{v}", "model", lambda e, v=v: build(config(e, rms_norm_eps=v)), f"field 'rms_norm_eps' must be a finite number above 0, got {v}")
        for v in (-1e-6, float("nan"), 0)
    ],
    Case("rope-factor-zero", "model", lambda e: build(config(e, rope_scaling={"rope_type": "linear", "factor": 0})), "field 'factor' must be a finite number above 0, got 0"),
    Case(
        "rope-llama3-equal-freq-factors",
        "model",
        lambda e: build(config(e, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0, "original_max_position_embeddings": 64})),
        "needs high_freq_factor above low_freq_factor",
    ),
    Case(
        "sliding-window-zero",
        "model",
        lambda e: build(config(e, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=0)),
        "field 'sliding_window' must be a positive integer, got 0",
    ),
    Case(
        "config-integer-of-5000-digits",
        "model",
        lambda e: build(e) if write(e.model / "config.json", (e.model / "config.json").read_text().replace('"vocab_size": 512', '"vocab_size": ' + "9" * 5000)) else None,
        "not valid JSON (ValueError: Exceeds the limit",
    ),
    Case(
        "config-nested-deeply",
        "model",
        lambda e: build(e) if write(e.model / "config.json", (e.model / "config.json").read_text()[:-2] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}") else None,
        "not valid JSON (RecursionError",
    ),
    *[
        Case(
            f"v4-compress-rate-{v!r}",
            "model",
            lambda e, v=v: build(_v4(e, lambda c: c["compress_rates"].update(compressed_sparse_attention=v))),
            f"compress_rates['compressed_sparse_attention'] is {v!r}; expected a positive integer",
        )
        for v in ("x", -4, 4.7)
    ],
    Case(
        "v4-yarn-original-positions-zero",
        "model",
        lambda e: build(
            _v4(e, lambda c: c["rope_parameters"].update(compress={**c["rope_parameters"]["compress"], "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}))
        ),
        "field 'original_max_position_embeddings' must be a finite number above 0, got 0",
    ),
    Case(
        "quantization-block-disagrees",
        "model",
        lambda e: build(config(e, quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]})),
        "quantization_config.weight_block_size is [64, 64]; aotc reads fp8 weights with a scale per 128x128 block",
    ),
    Case(
        "layers-far-more-than-the-checkpoint",
        "model",
        lambda e: build(config(e, num_hidden_layers=10**7)),
        "num_hidden_layers is 10000000, but the checkpoint has tensors for layers 0 to 1 only",
    ),
    # -- model folder: weights -----------------------------------------------------------
    Case("safetensors-missing", "model", lambda e: build(e) if (e.model / "model.safetensors").unlink() is None else None, "safetensors"),
    Case(
        "safetensors-truncated",
        "model",
        lambda e: build(e) if write(e.model / "model.safetensors", (e.model / "model.safetensors").read_bytes()[:1000]) else None,
        "not a readable safetensors file",
    ),
    Case("safetensors-empty", "model", lambda e: build(e) if write(e.model / "model.safetensors", b"") else None, "not a readable safetensors file"),
    Case(
        "safetensors-header-broken",
        "model",
        lambda e: build(e) if write(e.model / "model.safetensors", struct.pack("<Q", 12) + b'{"a": broken') else None,
        "not a readable safetensors file",
    ),
    Case(
        "safetensors-header-huge",
        "model",
        lambda e: build(e) if write(e.model / "model.safetensors", struct.pack("<Q", 1 << 40) + b"{}") else None,
        "not a readable safetensors file",
    ),
    Case("weight-dtype-uint16", "model", lambda e: build(tensors(e, lambda t: t.update({W: t[W].to(torch.uint16)}))), "U16"),
    Case("weight-dtype-int32", "model", lambda e: build(tensors(e, lambda t: t.update({W: t[W].to(torch.int32)}))), f"{W}' is int32"),
    Case("weight-wrong-shape", "model", lambda e: build(tensors(e, lambda t: t.update({W: t[W][:-1]}))), f"{W}' has shape"),
    Case("weight-missing", "model", lambda e: build(tensors(e, lambda t: t.pop(W))), W),
    Case("fp8-weight-without-scale", "model", lambda e: build(tensors(e, lambda t: t.update({W: t[W].to(torch.float8_e4m3fn)}))), "low-precision weights need their block scales"),
    Case(
        "fp8-scale-wrong-shape",
        "model",
        lambda e: build(tensors(e, lambda t: t.update({W: t[W].to(torch.float8_e4m3fn), f"{W}_scale_inv": torch.ones(7, 7)}))),
        "one scale per 128x128 block",
    ),
    Case(
        "fp8-scale-wrong-dtype",
        "model",
        lambda e: build(tensors(e, lambda t: t.update({W: t[W].to(torch.float8_e4m3fn), f"{W}_scale_inv": torch.ones(6, 2, dtype=torch.int32)}))),
        "block scales are F32, BF16 or E8M0",
    ),
    Case("fp8-e5m2-weight", "model", lambda e: build(tensors(e, lambda t: t.update({W: t[W].to(torch.float8_e5m2), f"{W}_scale_inv": torch.ones(6, 2)}))), "float8_e5m2"),
    Case("index-json-corrupt", "model", lambda e: build(e) if write(e.model / "model.safetensors.index.json", "{oops") else None, "model.safetensors.index.json"),
    Case(
        "index-names-missing-shard",
        "model",
        lambda e: build(e) if write(e.model / "model.safetensors.index.json", json.dumps({"weight_map": {W: "model-00002-of-00002.safetensors"}})) else None,
        "model-00002-of-00002.safetensors",
    ),
    Case("tokenizer-corrupt", "model", lambda e: ["run", e.model, "--eager", "--max-new-tokens", "2"] if write(e.model / "tokenizer.json", "{") else None, "tokenizer.json"),
    Case("tokenizer-empty-object", "model", lambda e: ["run", e.model, "--eager", "--max-new-tokens", "2"] if write(e.model / "tokenizer.json", "{}") else None, "tokenizer.json"),
    Case("tokenizer-missing", "model", lambda e: ["run", e.model, "--eager", "--max-new-tokens", "2"] if (e.model / "tokenizer.json").unlink() is None else None, "tokenizer.json"),
    Case(
        "run-model-of-another-shape",
        "model",
        lambda e: run(config(e, intermediate_size=300)),
        "expected [300, 256] from config.json; the config and the weights do not belong together",
    ),
    Case(
        "run-model-of-another-architecture",
        "model",
        lambda e: run(config(e, model_type="qwen2", architectures=["Qwen2ForCausalLM"])),
        "checkpoint has no tensor 'model.layers.0.self_attn.q_proj.bias'",
    ),
    # -- model folder: paths stay inside it; shard indexes; files that are no files -----------
    *[
        Case(f"index-shard-{k}", "model", lambda e, v=v: build(index(e, v)), "expected the name of a shard file in")
        for k, v in (("escapes", "../../x.safetensors"), ("absolute", "/etc/passwd"), ("a-number", 5), ("a-list", ["model.safetensors"]), ("empty", ""))
    ],
    Case(
        "index-weight-map-a-list",
        "model",
        lambda e: build(e) if write(e.model / "model.safetensors.index.json", json.dumps({"weight_map": ["model.safetensors"]})) else None,
        "'weight_map' is list",
    ),
    Case("tensor-in-two-shards", "model", lambda e: build(_two_shards(e)), "is in a.safetensors too; a checkpoint holds each tensor once"),
    Case("safetensors-a-fifo", "model", lambda e: build(_fifo(e)), "model.safetensors: not a regular file"),
    *[
        Case(
            f"link-outside-{name}",
            "model",
            lambda e, name=name: build(_link_outside(e, name)) if name != "tokenizer.json" else ["run", _link_outside(e, name).model, "--eager", "--max-new-tokens", "2"],
            f"{name}: a link to",
        )
        for name in ("config.json", "model.safetensors", "tokenizer.json")
    ],
    Case("link-outside-chat-template", "model", lambda e: chat(_link_outside(chat_template(e, None), "chat_template.jinja")), "chat_template.jinja: a link to"),
    # -- model folder: the chat template, data that renders in a sandbox with limits ---------
    *[
        Case(f"template-{k}", "model", lambda e, t=t: chat(chat_template(e, t)), m)
        for k, t, m in (
            ("range-huge", "{% for i in range(10**9) %}{% endfor %}", "Range too big"),
            ("recursive-macro", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
            ("include", "{% include 'other.jinja' %}", "it includes, imports or extends 'other.jinja'"),
            ("import", "{% import 'macros.jinja' as m %}", "it includes, imports or extends 'macros.jinja'"),
            ("extends", "{% extends 'base.jinja' %}", "it includes, imports or extends 'base.jinja'"),
            ("divide-by-zero", "{{ 1/0 }}", "ZeroDivisionError"),
            ("str-plus-int", "{{ 'a' + 1 }}", "TypeError"),
            ("repeat-huge", "{{ 'x' * 4000000000 }}", "a repetition of 1 x 4000000000 items"),
            ("repeat-float", "{{ 'x' * 4e9 }}", "TypeError"),
            ("power-huge", "{{ 2 ** 100000000 }}", "2 ** 100000000 is larger than a chat template needs"),
            ("output-huge", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "its output is longer than"),
            ("syntax", "{% for %}", "failed to render"),
            # The sandbox holds: each escape tried is refused as unsafe, nothing rendered.
            ("escape-mro", "{{ ''.__class__.__mro__ }}", "access to attribute '__class__' of a str object is unsafe"),
            ("escape-subclasses", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
            ("escape-cycler", "{{ cycler.__init__.__globals__ }}", "unsafe"),
            ("escape-joiner", "{{ joiner.__init__.__globals__ }}", "unsafe"),
            ("escape-namespace", "{{ namespace.__init__.__globals__ }}", "unsafe"),
            ("escape-lipsum", "{{ lipsum.__globals__['os'] }}", "unsafe"),
            ("escape-template-reference", "{{ self._TemplateReference__context }}", "unsafe"),
            ("escape-attr-filter", "{{ ''|attr('__class__') }}", "unsafe"),
            ("escape-format", "{{ '{0.__class__}'.format(1) }}", "unsafe"),
        )
    ],
    Case(
        "template-double-loop",
        "model",
        lambda e: chat(chat_template(e, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")),
        "it took more than 0.2 s",
        patch=lambda mp: mp.setattr("aotc.chat.RENDER_SECONDS", 0.2),
    ),
    Case("template-jinja-not-utf8", "model", lambda e: chat(_jinja_bytes(e, b"{{ '\xff\xfe' }}")), "chat_template.jinja: not UTF-8 text"),
    Case("template-named-with-a-list-name", "model", lambda e: chat(chat_template(e, [{"name": ["default"], "template": "x"}])), "no chat_template"),
    # -- bundle ----------------------------------------------------------------------------
    Case("manifest-missing", "bundle", lambda e: run(e) if (e.bundle / "manifest.json").unlink() is None else None, "manifest.json"),
    Case("manifest-not-json", "bundle", lambda e: run(e) if write(e.bundle / "manifest.json", "{") else None, "manifest.json"),
    Case("manifest-a-list", "bundle", lambda e: run(e) if write(e.bundle / "manifest.json", "[1]") else None, "expected a JSON object"),
    *[Case(f"manifest-lacks-{k}", "bundle", lambda e, k=k: run(manifest(e, lambda m: m.pop(k))), k) for k in ("shapes", "entries", "backend", "model", "caches", "format_version")],
    Case("format-version-old", "bundle", lambda e: run(manifest(e, lambda m: m.update(format_version=1))), "format_version"),
    Case("format-version-new", "bundle", lambda e: run(manifest(e, lambda m: m.update(format_version=99))), "format_version"),
    Case(
        "bucket-edited",
        "bundle",
        lambda e: run(manifest(e, lambda m: m["entries"][0]["artifacts"][0].update(bucket=7))),
        "entries[0].artifacts[0].dims: expected {'batch': 7, 'context': 'C'}",
    ),
    Case(
        "bucket-a-string",
        "bundle",
        lambda e: run(manifest(e, lambda m: m["entries"][0]["artifacts"][0].update(bucket="1"))),
        "entries[0].artifacts[0].bucket: expected int, got str",
    ),
    Case("shapes-batch-negative", "bundle", lambda e: run(manifest(e, lambda m: m["shapes"].update(batch=[-1]))), "shapes"),
    Case("artifact-dir-escapes", "bundle", lambda e: run(manifest(e, lambda m: m["entries"][0]["artifacts"][0].update(dir="../../etc"))), ".."),
    Case("artifact-dir-absolute", "bundle", lambda e: run(manifest(e, lambda m: m["entries"][0]["artifacts"][0].update(dir="/tmp"))), "/tmp"),
    Case("artifact-file-missing", "bundle", lambda e: run(e) if artifact_file(e).unlink() is None else None, "program.pt2"),
    Case("artifact-file-changed", "bundle", lambda e: run(e) if write(artifact_file(e), b"not a program") else None, "sha256"),
    Case("weight-transform-unknown", "bundle", lambda e: run(manifest(e, lambda m: m["entries"][0]["weights"][0].update(transform="explode", sources=["x"]))), "transform"),
    Case(
        "weight-stored-format-unknown",
        "bundle",
        lambda e: run(manifest(e, lambda m: m["entries"][0]["weights"][0].update(stored={"format": "int3", "part": "values", "dtype": "float32", "fp8_reading": "e4m3fn"}))),
        "stored",
    ),
    Case("weight-shape-edited", "bundle", lambda e: run(manifest(e, lambda m: m["entries"][0]["weights"][0].update(shape=[3]))), "weight"),
    Case("backend-unknown-in-manifest", "bundle", lambda e: run(manifest(e, lambda m: m["backend"].update(name="tpu"))), "tpu"),
    Case("plugin-named-by-bundle", "bundle", lambda e: run(manifest(e, lambda m: m.update(plugins=["evil_module"]))), "--plugin evil_module"),
    Case("instance-not-in-model", "bundle", lambda e: run(manifest(e, lambda m: m["entries"][0].update(instances=["model.layers.99"]))), "model.layers.99"),
    Case(
        "weight-stored-dtype-edited",
        "bundle",
        lambda e: run(_stored_bundle(e, lambda w: w["stored"].update(dtype="float16"))),
        "dequantizes to float16 in the graphs, but the model's is float32",
    ),
    Case(
        "context-not-a-bucket",
        "bundle",
        lambda e: run(manifest(e, lambda m: _decode(m)["artifacts"][0]["dims"].update(context=32))),
        "(bucket, context) pairs [(1, 32)], but shapes.batch is [1] and its context buckets are [64] (shapes.context)",
    ),
    Case(
        "chunk-contexts-edited",
        "bundle",
        lambda e: run(manifest(e, lambda m: m["shapes"].update(chunk_contexts=[16, 32]))),
        "shapes.chunk_contexts: [16, 32]: expected increasing cache lengths up to max_seq (64), none a context bucket ([64]), each below the smallest context bucket a chunk bucket ([16])",
    ),
    Case(
        "context-arg-dropped",
        "bundle",
        lambda e: run(manifest(e, lambda m: _decode(m).update(context_arg=None))),
        "expected {'batch': 1} (entries[0].context_arg is None), got {'batch': 1, 'context': 64}",
    ),
    Case("cache-slots-edited", "bundle", lambda e: run(manifest(e, lambda m: m["shapes"].update(cache_slots="two"))), "cache_slots"),
    *[
        Case(f"manifest-unknown-field-{where}", "bundle", lambda e, edit=edit: run(manifest(e, edit)), f"{where}: no such field in format")
        for where, edit in (
            ("surprise", lambda m: m.update(surprise=1)),
            ("parallel.surprise", lambda m: m["parallel"].update(surprise=1)),
            ("entries[0].weights[0].surprise", lambda m: m["entries"][0]["weights"][0].update(surprise=1)),
            ("entries[0].artifacts[0].extra.surprise", lambda m: m["entries"][0]["artifacts"][0]["extra"].update(surprise=1)),
        )
    ],  # fmt: skip
    Case("backend-flags-a-list", "bundle", lambda e: run(manifest(e, lambda m: m["backend"].update(flags=[1, 2]))), "backend.flags: expected object, got array"),
    # -- cache -----------------------------------------------------------------------------
    Case("cache-ls-on-a-file", "cache", lambda e: ["cache", "ls", "--cache-dir", write(e.root / "c", "x")], "is a file, not a cache folder"),
    Case("cache-prune-on-a-file", "cache", lambda e: ["cache", "prune", "--max-size", "0", "--cache-dir", write(e.root / "c", "x")], "is a file, not a cache folder"),
    Case(
        "build-cache-dir-a-file",
        "cache",
        lambda e: [BUILD[0], e.model, *BUILD[1:2], "export", "--cache-dir", write(e.root / "c", "x"), "-o", e.root / "out"],
        "is a file, not a cache folder",
    ),
    Case("cache-key-bad-buckets", "cache", lambda e: ["cache", "key", e.model, "--buckets", "0"], "--buckets"),
    Case("cache-record-corrupt", "cache", lambda e: _corrupt_cache(e, "record"), "compiled again", code=0, changes=OUT + ("cache",)),
    Case("cache-recipe-corrupt", "cache", lambda e: _corrupt_cache(e, "recipe"), "built the normal way", code=0, changes=OUT + ("cache",)),
    Case(
        "cache-read-only",
        "cache",
        lambda e: [BUILD[0], e.model, *BUILD[1:2], "export", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", "64", "--cache-dir", e.cache, "-o", e.root / "out"],
        "the compile cache cannot be written",
        code=0,
        patch=lambda mp: mp.setattr("aotc.cache.local.tempfile.NamedTemporaryFile", _read_only),
        changes=OUT,
    ),
    Case(
        "cache-read-only-required",
        "cache",
        lambda e: [BUILD[0], e.model, *BUILD[1:2], "export", "--require-cache", "--cache-dir", e.cache, "-o", e.root / "out"],
        "--require-cache and --shard need it",
        patch=lambda mp: mp.setattr("aotc.cache.local.tempfile.NamedTemporaryFile", _read_only),
    ),
    Case("run-caches-do-not-fit", "cli", lambda e: run(e), "cannot run here: its caches take", patch=lambda mp: mp.setattr("aotc.models.loader.available_memory", lambda: 1000)),
    Case(
        "build-caches-do-not-fit-warns",
        "cli",
        lambda e: build(e),
        "this bundle will not run on this machine",
        code=0,
        patch=lambda mp: mp.setattr("aotc.models.loader.available_memory", lambda: 1000),
        changes=OUT,
    ),
    # -- interrupt: Ctrl-C (and SIGTERM, which stops the same way) at each stage ------------
    Case("interrupt-while-tracing", "interrupt", lambda e: build(e), "is as it was before this build", code=130, patch=lambda mp: mp.setattr("aotc.builder.key.trace", _interrupt)),
    Case(
        "interrupt-while-compiling",
        "interrupt",
        lambda e: build(e),
        "is as it was before this build",
        code=130,
        patch=lambda mp: mp.setattr("aotc.builder.obtain.compile_graph", _interrupt),
    ),
    Case(
        "interrupt-while-writing-the-manifest",
        "interrupt",
        lambda e: build(e),
        "is as it was before this build",
        code=130,
        patch=lambda mp: mp.setattr("aotc.builder.write_manifest", _interrupt),
    ),
    Case(
        "interrupt-replacing-a-bundle",
        "interrupt",
        lambda e: [BUILD[0], e.model, *BUILD[1:], "-o", e.bundle],
        "is as it was before this build",
        code=130,
        patch=lambda mp: mp.setattr("aotc.builder.write_manifest", _interrupt),
    ),
    Case("cache-record-leads-outside", "cache", lambda e: _record_outside(e), "compiled again", code=0, changes=OUT + ("cache",)),
    # -- tampering ---------------------------------------------------------------------------
    Case("artifact-changed-hashes-fixed-digest-pinned", "tampering", lambda e: _pinned_then_tampered(e), "this is not the bundle you pinned"),
    Case("artifact-swapped-hashes-fixed", "tampering", lambda e: run(_swap(e)), "the bundle was altered"),
    Case("program-not-a-zip-hashes-fixed", "tampering", lambda e: run(e) if write(artifact_file(e), b"PK-not-a-zip") and rehash(e.bundle) is None else None, "program.pt2"),
    Case(
        "manifest-files-listed-outside",
        "tampering",
        lambda e: run(manifest(e, lambda m: m["entries"][0]["artifacts"][0]["files"].update({"../manifest.json": "0" * 64}))),
        "manifest.json",
    ),
]


def _v4(env: Env, change: Callable[[dict], None]) -> Env:
    """The case's model replaced by a tiny DeepSeek V4, its config.json changed."""
    from aotc.models.tiny import write_tiny

    write_tiny(env.model, arch="deepseek_v4", layers=3, force=True)
    cfg = json.loads((env.model / "config.json").read_text())
    change(cfg)
    write(env.model / "config.json", json.dumps(cfg))
    return env


def chat(env: Env) -> list:
    return ["run", env.model, "--eager", "--chat", "--prompt", "hi", "--max-new-tokens", "2"]


def chat_template(env: Env, template) -> Env:
    write(env.model / "tokenizer_config.json", json.dumps({"chat_template": template} if template is not None else {}))
    return env


def _jinja_bytes(env: Env, data: bytes) -> Env:
    """chat_template.jinja is read where tokenizer_config.json has no template (the tiny model's has one)."""
    chat_template(env, None)
    (env.model / "chat_template.jinja").write_bytes(data)
    return env


def index(env: Env, shard) -> Env:
    """A shard index whose weight_map names `shard` for one tensor (the rest in model.safetensors)."""
    names = list(load_file(env.model / "model.safetensors"))
    write(env.model / "model.safetensors.index.json", json.dumps({"weight_map": {**{n: "model.safetensors" for n in names}, W: shard}}))
    return env


def _two_shards(env: Env) -> Env:
    """Two shards that both hold every tensor."""
    for name in ("a.safetensors", "b.safetensors"):
        shutil.copy(env.model / "model.safetensors", env.model / name)
    (env.model / "model.safetensors").unlink()
    names = list(load_file(env.model / "a.safetensors"))
    write(env.model / "model.safetensors.index.json", json.dumps({"weight_map": {n: ("a.safetensors" if i % 2 else "b.safetensors") for i, n in enumerate(names)}}))
    return env


def _fifo(env: Env) -> Env:
    import os

    (env.model / "model.safetensors").unlink()
    os.mkfifo(env.model / "model.safetensors")
    return env


def _link_outside(env: Env, name: str) -> Env:
    """`name` in the model folder made a link to a copy of it outside the folder."""
    outside = env.root / f"outside-{name}"
    source = env.model / name
    if source.exists():
        shutil.move(str(source), outside)
    else:
        outside.write_text("{{ messages[0].content }}")
    source.symlink_to(outside)
    return env


def _stored_bundle(env: Env, change) -> Env:
    """The case's model quantized to fp8 and an export bundle of it, then `change` applied
    to each of its stored weight records."""
    from aotc.builder import BuildOptions
    from aotc.builder import build as do_build
    from aotc.models.tiny import write_tiny

    write_tiny(env.model, layers=2, quantize="fp8", force=True)
    shutil.rmtree(env.bundle)
    do_build(BuildOptions(env.model, out=env.bundle, batch_buckets=(1,), chunk_buckets=(16,), max_seq=64, backend="export", use_cache=False))
    return manifest(env, lambda m: [change(w) for e in m["entries"] for w in e["weights"] if w["stored"]])


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def _read_only(*args, **kwargs):
    raise PermissionError(13, "Permission denied")


def _corrupt_cache(env: Env, what: str) -> list:
    """Fill the case's cache with one build, then damage its records or its recipe."""
    argv = [BUILD[0], env.model, *BUILD[1:2], "export", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", "64", "--cache-dir", env.cache, "-o", env.root / "first"]
    assert CliRunner().invoke(app, [str(a) for a in argv]).exit_code == 0
    shutil.rmtree(env.root / "first")
    pattern = {"record": "entries/*/*/record.json", "recipe": "builds/*.json"}.get(what)
    for f in env.cache.glob(pattern) if pattern else ():
        f.write_text("{ not json")
    return argv[:-1] + [env.root / "out"]


def _record_outside(env: Env) -> list:
    """A cache record naming a file outside its entry: a corrupt entry, never followed."""
    argv = _corrupt_cache(env, "none")
    for f in env.cache.glob("entries/*/*/record.json"):
        record = json.loads(f.read_text())
        record["files"] = {"../../../model/config.json": "0" * 64}
        f.write_text(json.dumps(record))
    return argv


def _pinned_then_tampered(env: Env) -> list:
    from aotc.format import read_manifest

    pinned = read_manifest(env.bundle).digest()  # what the user pinned when it was built
    write(artifact_file(env), b"evil")
    rehash(env.bundle)
    return run(env, "--expect-digest", pinned)


def _swap(env: Env) -> Env:
    a = next(env.bundle.glob("entries/LMHead.forward/b1"))
    b = next(env.bundle.glob("entries/LlamaDecoderLayer.decode/b1-c*"))
    tmp = env.root / "swap"
    shutil.move(str(a), tmp)
    shutil.move(str(b), a)
    shutil.move(str(tmp), b)
    rehash(env.bundle)
    return env


def tree(folder: Path) -> dict[str, str]:
    """Every file and its sha256; aotc's own empty lock files aside (the cache's, and the
    one beside a build's output, by which writers to one folder take turns)."""
    files = (p for p in sorted(folder.rglob("*")) if p.is_file() and not (p.name.endswith(".lock") and p.stat().st_size == 0))
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def templates(tiny_dir, tmp_path_factory):
    from aotc.builder import BuildOptions
    from aotc.builder import build as do_build

    root = tmp_path_factory.mktemp("corpus")
    bundle = do_build(BuildOptions(tiny_dir, out=root / "bundle", batch_buckets=(1,), chunk_buckets=(16,), max_seq=64, backend="export", use_cache=False)).out
    return tiny_dir, bundle


@pytest.mark.parametrize("case", CASES, ids=[f"{c.category}:{c.id}" for c in CASES])
def test_bad_input(case, templates, tmp_path, monkeypatch):
    model_template, bundle_template = templates
    env = Env(tmp_path, tmp_path / "model", tmp_path / "bundle", tmp_path / "cache")
    shutil.copytree(model_template, env.model)
    shutil.copytree(bundle_template, env.bundle)
    m = json.loads((env.bundle / "manifest.json").read_text())
    m["model"]["source"] = str(env.model)  # the bundle's own model: this case's copy
    (env.bundle / "manifest.json").write_text(json.dumps(m))
    argv = [str(a) for a in case.argv(env)]
    if case.patch:
        case.patch(monkeypatch)
    before = tree(tmp_path)
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "400"})
    said = " ".join(result.output.split())
    assert result.exit_code == case.code, said
    assert case.message in said, said
    assert "Traceback" not in result.output and (result.exception is None or isinstance(result.exception, SystemExit)), repr(result.exception)
    after = tree(tmp_path)
    if case.changes:  # the intended output, and nothing else
        mine = lambda k: k.split("/")[0] in case.changes  # noqa: E731
        after = {k: v for k, v in after.items() if not mine(k)}
        before = {k: v for k, v in before.items() if not mine(k)}
    assert after == before, sorted(set(after.items()) ^ set(before.items()))[:5]


def test_the_corpus_is_large():
    counts = {}
    for c in CASES:
        counts[c.category] = counts.get(c.category, 0) + 1
    assert len(CASES) >= 100, counts


@pytest.mark.parametrize(
    "argv, message",
    [
        (["build", "{model}", "--buckets", "1,1", "-o", "{root}/out"], "--buckets '1,1': 1 given more than once"),
        (["run", "{model}", "--max-new-tokens", "2"], "manifest.json"),
        (["cache", "ls", "--cache-dir", "{model}/config.json"], "is a file, not a cache folder"),
        (["run", "{model}", "--eager", "--max-new-tokens", "2", "--prompt", b"\xff\xfe"], "--prompt number 1 is not valid UTF-8 text"),
    ],
    ids=["build", "run", "cache", "prompt-bytes"],
)
def test_bad_input_in_a_real_process(argv, message, templates, tmp_path):
    """The exit status and stderr a shell script sees: 2, one line, no traceback."""
    import subprocess
    import sys

    model = tmp_path / "model"
    shutil.copytree(templates[0], model)
    before = tree(tmp_path)
    argv = [a.format(model=model, root=tmp_path) if isinstance(a, str) else a for a in argv]  # bytes: as a shell passes them
    r = subprocess.run([sys.executable, "-m", "aotc.cli", *argv], capture_output=True, text=True, env={**__import__("os").environ, "COLUMNS": "400"})
    assert r.returncode == 2 and message in " ".join(r.stderr.split()) and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert tree(tmp_path) == before
