"""What a model folder says about generating: stop tokens and a length.

Instruct checkpoints keep their stop tokens in generation_config.json: Llama 3
Instruct lists three eos ids there and one in config.json, and stopping only
at config.json's runs past the end of a turn. transformers' `generate` takes
generation_config.json's first, and so does aotc.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .config import model_file, read_json_object

GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_NEW_TOKENS = 32


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...]
    eos_from: str  # the file that gave them: generation_config.json, config.json or "none"
    max_new_tokens: int
    max_new_tokens_from: str  # generation_config.json or "aotc default"


def _eos(value, source: Path, vocab) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{source}: field 'eos_token_id' is {value!r}; expected a token id or a list of token ids")
    beyond = [i for i in ids if isinstance(vocab, int) and i >= vocab]
    if beyond:
        raise ConfigError(
            f"{source}: field 'eos_token_id' is {value!r}; token {beyond[0]} is beyond the vocabulary (config.json's vocab_size is {vocab}), "
            "so the model could never stop at it. Give the ids of the model's stop tokens"
        )
    return tuple(ids)


def generation_defaults(model_dir: Path, config: dict) -> GenerationDefaults:
    """Stop tokens: generation_config.json's eos_token_id, else config.json's. Length:
    generation_config.json's max_new_tokens, else aotc's default."""
    path = model_file(model_dir, GENERATION_CONFIG)
    gen = read_json_object(path) if path.is_file() else {}
    vocab = config.get("vocab_size")
    eos, eos_from = _eos(gen.get("eos_token_id"), path, vocab), GENERATION_CONFIG
    if eos is None:
        eos, eos_from = _eos(config.get("eos_token_id"), Path(model_dir) / "config.json", vocab), "config.json"
    if eos is None:
        eos, eos_from = (), "none"
    length = gen.get("max_new_tokens")
    if length is None:
        return GenerationDefaults(eos, eos_from, DEFAULT_MAX_NEW_TOKENS, "aotc default")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ConfigError(f"{path}: field 'max_new_tokens' is {length!r}; expected a positive integer")
    return GenerationDefaults(eos, eos_from, length, GENERATION_CONFIG)
