"""`aotc quantize` (aotc.quantize_checkpoint): low-precision checkpoints from full-precision folders,
read back by aotc's loader, and its bad inputs."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from aotc import lowp_weights
from aotc.builder import BuildOptions, build
from aotc.cli import app
from aotc.errors import ConfigError, WeightsError
from aotc.models.loader import load_model
from aotc.models.tiny import write_tiny
from aotc.quantize_checkpoint import quantize_model
from aotc.runtime import Bundle, generate

runner = CliRunner()


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("arch, fmt", [("llama", "fp8"), ("deepseek_v4", "fp8"), ("deepseek_v4", "fp4-experts")])
def test_a_quantized_folder_holds_what_init_tiny_quantize_writes(tmp_path, arch, fmt):
    """The same seed's model quantized by `aotc quantize` and written quantized by `aotc
    init tiny --quantize`: every tensor byte for byte (the head kept, by default)."""
    layers = 3 if arch == "deepseek_v4" else 2
    source = write_tiny(tmp_path / "src", arch=arch, layers=layers)
    made = quantize_model(source, tmp_path / "q", fmt)
    want = tensors(write_tiny(tmp_path / "want", arch=arch, layers=layers, quantize=fmt))
    got = tensors(made.out)
    assert sorted(got) == sorted(want)
    assert all(same_bytes(got[k], want[k]) for k in want), [k for k in want if not same_bytes(got[k], want[k])]
    assert set(made.tensors.values()) == ({"fp8", "fp4"} if fmt == "fp4-experts" else {"fp8"})
    assert made.head.startswith("kept at float32")
    config = json.loads((made.out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert (made.out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


def test_the_loader_reads_back_each_weight_as_its_dequantized_source(tmp_path):
    """fp8 values and block scales that dequantize to the source weight rounded to fp8
    (exactly); every other tensor as it was."""
    source = write_tiny(tmp_path / "src", layers=2)
    made = quantize_model(source, tmp_path / "q", "fp8")
    src, q = load_model(source).model, load_model(made.out).model
    src_params, q_params = dict(src.named_parameters()), dict(q.named_parameters())
    for name, p in src_params.items():
        if name.endswith("_proj.weight") and ".layers." in name:
            values, scale = lowp_weights.quantize_fp8_blocks(p.detach())
            torch.testing.assert_close(q_params[name], lowp_weights.dequantize("fp8", values, scale, p.dtype), rtol=0, atol=0)
            assert not torch.equal(q_params[name], p)
        else:
            assert torch.equal(q_params[name], p), name


def test_an_fp8_head_of_a_tied_model_is_written_as_its_own_tensor_and_runs_compiled(tmp_path):
    """--head fp8 on a model whose head is its embedding: lm_head.weight in fp8 beside the
    embedding at its source precision, the tie undone in config.json; a bundle's head
    graph reads the fp8 bytes, and its tokens and logits are eager's."""
    source = write_tiny(tmp_path / "src", layers=2, tie_word_embeddings=True)
    made = quantize_model(source, tmp_path / "q", "fp8", head="fp8")
    assert "untied from the embedding 'model.embed_tokens.weight'" in made.head
    got, src = tensors(made.out), tensors(source)
    assert "lm_head.weight" not in src and got["lm_head.weight"].dtype == torch.float8_e4m3fn
    assert same_bytes(got["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    config = json.loads((made.out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["modules_to_not_convert"] == []
    out = build(BuildOptions(made.out, out=tmp_path / "b", batch_buckets=(1,), chunk_buckets=(16,), max_seq=64, backend="export", use_cache=False)).out
    bundle = Bundle.load(out)
    (head,) = [e for e in bundle.manifest.entries if e.id == "LMHead.forward"]
    assert {w.dtype for w in head.weights if w.path == "lm_head.weight"} == {"float8_e4m3fn", "float32"}  # values, scales
    loaded = load_model(made.out, stored=bundle.stored_params())
    kw = dict(max_batch=1, max_seq=bundle.max_seq, slots=bundle.cache_slots, keep_logits=True, stop_at_eos=False)
    bundle.bind(loaded.model)
    compiled = generate(loaded.model, [[5, 9, 200, 31, 7]], 8, **kw)
    eager = generate(load_model(made.out).model, [[5, 9, 200, 31, 7]], 8, **kw)
    assert compiled.sequences[0].new_ids == eager.sequences[0].new_ids
    torch.testing.assert_close(torch.stack(compiled.sequences[0].logits), torch.stack(eager.sequences[0].logits), atol=1e-4, rtol=1e-4)


def test_a_sharded_source_gives_shards_of_the_same_names_and_an_index(tmp_path):
    source = write_tiny(tmp_path / "src", layers=2)
    whole = tensors(source)
    (source / "model.safetensors").unlink()
    names = sorted(whole)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in parts.items():
        save_file({k: whole[k] for k in part}, str(source / file), metadata={"format": "pt"})
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: f for f, ks in parts.items() for k in ks}}))
    made = quantize_model(source, tmp_path / "q", "fp8")
    assert sorted(p.name for p in made.out.glob("*.safetensors")) == sorted(parts)
    index = json.loads((made.out / "model.safetensors.index.json").read_text())["weight_map"]
    for name, fmt in made.tensors.items():
        assert index[f"{name}_scale_inv"] == index[name] == next(f for f, ks in parts.items() if name in ks)
    assert sorted(index) == sorted(tensors(made.out))
    load_model(made.out)


def test_bad_inputs_are_refused_naming_them_and_leave_nothing_behind(tmp_path):
    source = write_tiny(tmp_path / "src", layers=2)
    quantized = write_tiny(tmp_path / "fp8", layers=2, quantize="fp8")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [
        (dict(source=source, out=tmp_path / "o", fmt="int4"), ConfigError, "--format int4: expected one of fp8, fp4-experts"),
        (
            dict(source=source, out=tmp_path / "o", fmt="fp8", head="int8"),
            ConfigError,
            "--head int8 with --format fp8: the head is kept or takes the layers' format; pass --head keep or --head fp8",
        ),
        (dict(source=source, out=tmp_path / "o", fmt="fp8", head="int4"), ConfigError, "--head int4: expected one of keep, fp8, int8"),
        (dict(source=source, out=source, fmt="fp8"), ConfigError, "inside the source folder"),
        (dict(source=source, out=source / "q", fmt="fp8"), ConfigError, "inside the source folder"),
        (dict(source=source, out=tmp_path, fmt="fp8"), ConfigError, "holds the source folder"),
        (dict(source=source, out=tmp_path / "full", fmt="fp8"), ConfigError, "exists and is not an empty folder"),
        (dict(source=quantized, out=tmp_path / "o", fmt="fp8"), ConfigError, "quantization_config is set; the checkpoint is already quantized"),
        (dict(source=source, out=tmp_path / "o", fmt="fp4-experts"), ConfigError, "has no routed experts"),
        (dict(source=tmp_path / "full", out=tmp_path / "o", fmt="fp8"), ConfigError, "no config.json"),
    ]
    for kw, error, message in cases:
        with pytest.raises(error, match=message.replace("(", r"\(")):
            quantize_model(**kw)
    # fp8 tensors without a quantization_config: the tensors say it
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"model\.safetensors: tensor '.*' is float8_e4m3fn; the checkpoint is already quantized"):
        quantize_model(quantized, tmp_path / "o", "fp8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8", "full", "src"]
    assert sorted(p.name for p in source.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_the_command_says_what_it_quantized_and_exits_2_on_bad_input(tmp_path):
    source = write_tiny(tmp_path / "src", layers=2)
    result = runner.invoke(app, ["quantize", str(source), "-o", str(tmp_path / "q"), "--head", "fp8"])
    assert result.exit_code == 0, result.output
    assert "quantized 15 tensors to fp8" in result.output and "LM head: fp8" in result.output
    result = runner.invoke(app, ["quantize", str(source), "-o", str(source / "q")])
    assert result.exit_code == 2 and "inside the source folder" in result.output


# -- the bytes, computed independently ----------------------------------------------


def fp8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp8 values and scales as DeepSeek's format defines them, computed here with numpy and
    ml_dtypes, block by block: scale = amax / 448 in float32; values = w / scale, clamped to
    +-448, rounded to float8_e4m3fn (to nearest, ties to even)."""
    rows, cols = w.shape
    values = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    scales = np.zeros((-(-rows // 128), -(-cols // 128)), np.float32)
    for i in range(0, rows, 128):
        for j in range(0, cols, 128):
            block = w[i : i + 128, j : j + 128].astype(np.float32)
            scale = np.float32(max(np.abs(block).max(), np.float32(2.0**-100))) / np.float32(448.0)
            scales[i // 128, j // 128] = scale
            values[i : i + 128, j : j + 128] = np.clip(block / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return values, scales


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def fp4_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed e2m1 bytes (low nibble first) and E8M0 exponent bytes, one per 32 inputs: the
    scale is the least power of two 2**e with amax / 2**e <= 6 (frexp: exact); each value
    w / 2**e goes to the nearest e2m1 magnitude (a tie to the smaller), its sign in bit 3."""
    rows, cols = w.shape
    nibbles = np.zeros(w.shape, np.uint8)
    exponents = np.zeros((rows, cols // 32), np.uint8)
    for r in range(rows):
        for b in range(cols // 32):
            block = w[r, 32 * b : 32 * b + 32].astype(np.float32)
            m, p = np.frexp(np.float32(max(np.abs(block).max(), 2.0**-100)) / np.float32(6.0))
            e = int(p) if m > 0.5 else int(p) - 1  # ceil(log2(amax / 6))
            exponents[r, b] = min(max(e + 127, 1), 254)
            x = np.clip(block / np.float32(2.0 ** (int(exponents[r, b]) - 127)), -6, 6)
            mag = np.abs(np.abs(x)[:, None] - E2M1).argmin(axis=1).astype(np.uint8)  # argmin: the first, the smaller, on a tie
            nibbles[r, 32 * b : 32 * b + 32] = mag | (((x < 0) & (mag > 0)).astype(np.uint8) << 3)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), exponents


def int8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Int8 values and float32 scales, one per 32 inputs of a row (the last group of a row
    whose length is no multiple of 32: the inputs it has): scale = amax / 127 in float32;
    values = w / scale rounded to nearest, ties to even (np.rint), clamped to +-127."""
    rows, cols = w.shape
    values = np.zeros(w.shape, np.int8)
    scales = np.zeros((rows, -(-cols // 32)), np.float32)
    for r in range(rows):
        for b in range(0, cols, 32):
            block = w[r, b : b + 32].astype(np.float32)
            scale = np.float32(max(np.abs(block).max(), np.float32(2.0**-100))) / np.float32(127.0)
            scales[r, b // 32] = scale
            values[r, b : b + 32] = np.clip(np.rint(block / scale), -127, 127).astype(np.int8)
    return values, scales


def raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


@pytest.mark.parametrize("arch, fmt", [("llama", "fp8"), ("deepseek_v4", "fp4-experts"), ("llama", "int8")])
def test_the_quantized_bytes_are_the_formats_own_computed_apart_from_aotc(tmp_path, arch, fmt):
    """Every quantized tensor's values and scales, byte for byte, against the formats
    computed in this test from the source weights (numpy, ml_dtypes), not by aotc.lowp_weights;
    the sizes it reports; the linears it leaves unquantized, by transformers' module names;
    files readable where the umask lets others read (a folder made for it, parents too)."""
    import os
    import stat

    source = write_tiny(tmp_path / "src", arch=arch, layers=3 if arch == "deepseek_v4" else 2)
    old = os.umask(0o022)
    try:
        made = quantize_model(source, tmp_path / "new" / "folder" / "q", fmt)
    finally:
        os.umask(old)
    src, got = tensors(source), tensors(made.out)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in made.out.glob("*.safetensors"))
    assert made.bytes_in == sum(src[n].numel() * src[n].element_size() for n in made.tensors)
    assert made.bytes_out == sum(got[n].numel() * got[n].element_size() + got[f"{n}_scale_inv"].numel() * got[f"{n}_scale_inv"].element_size() for n in made.tensors)
    not_converted = json.loads((made.out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    if fmt == "int8":  # the head too, by default, as Q8_0
        assert not_converted == [] and made.tensors["lm_head.weight"] == "int8" and made.head == "int8"
        assert json.loads((made.out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [1, 32]
    else:
        assert not_converted == (["lm_head"] if arch == "llama" else ["head"])  # the head, kept at the source precision
    assert made.tensors and set(made.tensors.values()) == ({"fp8", "fp4"} if fmt == "fp4-experts" else {fmt})
    for name, kind in made.tensors.items():
        w = src[name].float().numpy()
        values, scales = {"fp4": fp4_blocks, "fp8": fp8_blocks, "int8": int8_blocks}[kind](w)
        assert np.array_equal(raw(got[name]), values.view(np.uint8)), name
        assert np.array_equal(raw(got[f"{name}_scale_inv"]), scales.view(np.uint8)), name


def test_a_failure_after_writing_began_leaves_nothing_beside_the_destination(tmp_path, monkeypatch):
    """A full disk while the tokenizer is copied, after every shard was written: the error
    goes to the caller, and neither the destination nor the temporary folder is left."""
    import errno
    import shutil

    source = write_tiny(tmp_path / "src", layers=1)
    (tmp_path / "out").mkdir()

    def full(*args, **kwargs):
        assert any((tmp_path / "out").glob(".q.tmp-*/model.safetensors"))  # the shard is written by now
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(OSError, match="No space left on device"):
        quantize_model(source, tmp_path / "out" / "q", "fp8")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_bad_config_a_nan_weight_a_full_disk_and_sigterm_leave_nothing_and_say_what(tmp_path, monkeypatch):
    """config.json that is not a JSON object is refused as build refuses it; a NaN or inf in
    a weight to quantize is refused naming the tensor and where (it would make its whole
    block's scale NaN); safetensors' own error on a full disk and a SIGTERM mid-write end
    the command with a message, and leave nothing beside the destination."""
    import signal
    import subprocess
    import sys

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    source = write_tiny(tmp_path / "src", layers=1)
    out = tmp_path / "out"
    out.mkdir()
    for text, message in (("[1, 2]", "expected a JSON object, got list"), ("{bad", "not valid JSON")):
        bad = write_tiny(tmp_path / f"bad{len(text)}", layers=1)
        (bad / "config.json").write_text(text)
        with pytest.raises(ConfigError, match=rf"{bad / 'config.json'}: {message}"):
            quantize_model(bad, out / "q", "fp8")
    nan = write_tiny(tmp_path / "nan", layers=1)
    weights = load_file(nan / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"][3, 7] = float("nan")
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' holds nan at \[3, 7\]"):
        quantize_model(nan, out / "q", "fp8")

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("aotc.quantize_checkpoint.save_file", full)
    r = runner.invoke(app, ["quantize", str(source), "-o", str(out / "q")])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "No space left on device" in said and "the disk is full" in said, said
    monkeypatch.undo()
    stop = (
        "import os, shutil, signal, sys\n"
        "shutil.copyfile = lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM)\n"  # after the shard is written
        "from aotc.cli import app\n"
        "app(sys.argv[1:])\n"
    )
    done = subprocess.run([sys.executable, "-c", stop, "quantize", str(source), "-o", str(out / "q")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.returncode != -signal.SIGTERM, done.stderr[-2000:]
    assert list(out.iterdir()) == []


def test_what_a_killed_quantize_left_is_swept_and_a_destination_changed_meanwhile_is_said(tmp_path, monkeypatch):
    """A SIGKILL mid-write leaves `.q.tmp-*` beside the destination: the next quantize to it
    removes it. A destination that someone fills while the weights are written is no disk
    error: the message says what happened, and the temporary folder goes."""
    import aotc.quantize_checkpoint as quantize

    source = write_tiny(tmp_path / "src", layers=1)
    out = tmp_path / "out"
    left = out / ".q.tmp-x1y2z3"
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"half")
    mine = out / ".q.tmp-notes.txt"  # a file of the same name pattern: not a folder aotc made
    mine.write_text("mine")
    quantize_model(source, out / "q", "fp8")
    assert sorted(p.name for p in out.iterdir()) == [".q.tmp-notes.txt", "q"]

    (out / "r").mkdir()
    copy = quantize._copy_files

    def and_someone_writes(src, tmp):
        copy(src, tmp)
        (out / "r" / "theirs.txt").write_text("theirs")

    monkeypatch.setattr(quantize, "_copy_files", and_someone_writes)
    with pytest.raises(ConfigError, match=r"-o .*/r: the finished folder could not take its place \(Directory not empty\): something was written there while aotc quantize ran"):
        quantize_model(source, out / "r", "fp8")
    assert sorted(p.name for p in out.iterdir()) == [".q.tmp-notes.txt", "q", "r"] and [p.name for p in (out / "r").iterdir()] == ["theirs.txt"]
