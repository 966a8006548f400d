"""`aotc init tiny`: small random models in the exact Hugging Face layout.

The folder holds config.json (HF field names), model.safetensors (HF tensor
names), tokenizer.json and tokenizer_config.json (its special tokens and a small
chat template), so it goes through the same loader as a real checkpoint, and
`aotc run --chat` and chat messages work on it. The defaults make the embedded
default model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .. import lowp_weights
from ..errors import ConfigError
from ..format import temp_folder, write_atomic
from ..lowp_weights import FP8_BLOCK
from .checkpoint import scale_names
from .corpus import CORPUS
from .loader import checkpoint_names, checkpoint_tensors, get_architecture, parse_config

DEFAULT_ARCH = "llama"
DEFAULT_LAYERS = 4
DEFAULT_SEED = 0
TOKENIZER_VOCAB = 512
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: bos 1, eos 2 as in the tiny configs
# A turn per message, each closed by eos, as the common instruct templates (Zephyr's,
# ChatML's) write them; the role markers are plain text to this tokenizer. It renders
# system, user and assistant turns, and opens the assistant's with add_generation_prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[1], "eos_token": SPECIAL[2], "unk_token": SPECIAL[0],
    "chat_template": CHAT_TEMPLATE,
}  # fmt: skip


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


QUANTIZE = ("none", "fp8", "fp4-experts", "int8")
LAYOUTS = ("hf", "deepseek")


def write_tiny(
    out: Path, *, arch: str = DEFAULT_ARCH, layers: int = DEFAULT_LAYERS, seed: int = DEFAULT_SEED, force: bool = False,
    quantize: str = "none", layout: str = "hf", head_std: float | None = None, **overrides,
) -> Path:  # fmt: skip
    """Write a random model folder; `overrides` change config.json fields (e.g. hidden_size).
    A folder that is not empty is replaced only with force=True. `quantize`, `layout` and
    `head_std`: see write_model."""
    out = Path(out)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty folder; aotc init tiny writes a new model folder. Choose another path, or pass --force to replace it")
    architecture = get_architecture(arch)
    tokenizer = make_tokenizer()
    config = architecture.model_class.tiny_config(layers=layers, vocab_size=tokenizer.get_vocab_size(), variant=arch)
    config.update(overrides)
    return write_model(out, config, tokenizer, seed=seed, quantize=quantize, layout=layout, head_std=head_std)


def write_model(
    out: Path, config: dict, tokenizer: Tokenizer, *, seed: int = DEFAULT_SEED, quantize: str = "none", layout: str = "hf",
    head_std: float | None = None,
) -> Path:  # fmt: skip
    """Write config.json, tokenizer.json, tokenizer_config.json and random weights into `out`, atomically.

    quantize="fp8": the decoder layers' linear weights as float8_e4m3fn with a scale
    per 128 x 128 block, as DeepSeek publishes them; "fp4-experts": the routed
    experts' as packed fp4 with an E8M0 scale per 32 inputs, the rest fp8 (DeepSeek
    V4); "int8": int8 with a float32 scale per 32 inputs (Q8_0's grid). layout="hf":
    Hugging Face names, float32 `weight_scale_inv`; "deepseek": DeepSeek's own names,
    E8M0 `.scale`. head_std=0.02 draws the LM head as transformers
    initialises it, so that the top two logits are often close (near-ties); by default
    each model separates them (CausalLM.init_random).
    """
    if quantize not in QUANTIZE:
        raise ConfigError(f"--quantize {quantize}: expected one of {', '.join(QUANTIZE)}")
    if layout not in LAYOUTS:
        raise ConfigError(f"--checkpoint-layout {layout}: expected one of {', '.join(LAYOUTS)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(f".{out.name}.tmp-", out.parent)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "tokenizer.json").write_text(tokenizer.to_str())
        (tmp / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
        _, arch, parsed = parse_config(tmp)
        model = arch.model_class(parsed)
        model.init_random(torch.Generator().manual_seed(seed), **({} if head_std is None else {"head_std": head_std}))
        tensors = _checkpoint(model, quantize, layout)
        if quantize != "none":
            config = dict(config, quantization_config=dict(lowp_weights.INT8_CONFIG) if quantize == "int8" else {
                "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK),
                **({"scale_fmt": "ue8m0"} if layout == "deepseek" else {}),
            })  # fmt: skip
            if quantize == "fp4-experts":
                config["expert_dtype"] = "fp4"
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # Serialized in memory, written by Python: a full disk is then an OSError to report.
        write_atomic(tmp / "model.safetensors", save(tensors, metadata={"format": "pt"}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _checkpoint(model, quantize: str, layout: str) -> dict[str, torch.Tensor]:
    formats = {} if quantize == "none" else lowp_weights.layer_formats(model, quantize, "--quantize")
    out = {}
    for name, t in checkpoint_tensors(model).items():
        names = checkpoint_names(model, name)
        ckpt_name = names[0] if layout == "hf" else names[-1]
        fmt = formats.get(name)
        if fmt is None:
            out[ckpt_name] = t.detach().contiguous()
            continue
        values, scale = lowp_weights.quantize(fmt, t.detach(), e8m0=layout == "deepseek" or fmt == "fp4")
        if scale.dtype == torch.uint8:
            scale = scale.view(torch.float8_e8m0fnu)  # safetensors' F8_E8M0, as published
        if fmt == "fp4" and layout == "deepseek":
            values = values.view(torch.float4_e2m1fn_x2)  # safetensors' F4; the hf layout keeps U8 bytes
        out[ckpt_name] = values
        out[scale_names(ckpt_name)[0 if layout == "hf" else 1]] = scale
    return out
