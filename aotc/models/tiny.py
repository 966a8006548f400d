"""`aotc init tiny`: small random models in the exact Hugging Face layout.

The folder holds config.json (HF field names), model.safetensors (HF tensor
names) and tokenizer.json, so it goes through the same loader as a real
checkpoint. The defaults make the embedded default model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .base import checkpoint_names, checkpoint_tensors, parse_config
from .corpus import CORPUS
from ..errors import ConfigError
from .registry import get_architecture

DEFAULT_ARCH = "llama"
DEFAULT_LAYERS = 4
DEFAULT_SEED = 0
TOKENIZER_VOCAB = 512
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: bos 1, eos 2 as in the tiny configs



def make_tokenizer(vocab_size: int = TOKENIZER_VOCAB) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the embedded corpus (deterministic)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tok


def write_tiny(out: Path, *, arch: str = DEFAULT_ARCH, layers: int = DEFAULT_LAYERS, seed: int = DEFAULT_SEED, force: bool = False, **overrides) -> Path:
    """Write a random model folder; `overrides` change config.json fields (e.g. hidden_size).
    A folder that is not empty is replaced only with force=True."""
    out = Path(out)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty folder; aotc init tiny writes a new model folder. Choose another path, or pass --force to replace it")
    architecture = get_architecture(arch)
    tokenizer = make_tokenizer()
    config = architecture.model_class.tiny_config(layers=layers, vocab_size=tokenizer.get_vocab_size(), variant=arch)
    config.update(overrides)
    return write_model(out, config, tokenizer, seed=seed)


def write_model(out: Path, config: dict, tokenizer: Tokenizer, *, seed: int = DEFAULT_SEED) -> Path:
    """Write config.json, tokenizer.json and random weights (HF names) into `out`, atomically."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save(str(tmp / "tokenizer.json"))
        _, arch, parsed = parse_config(tmp)
        model = arch.model_class(parsed)
        model.init_random(torch.Generator().manual_seed(seed))
        tensors = {checkpoint_names(model, name)[0]: t.detach().contiguous() for name, t in checkpoint_tensors(model).items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
