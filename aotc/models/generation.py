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
    # Said after a run where a stop token is beyond the vocabulary: the model never produces
    # it (transformers' save_pretrained writes its class's default ids, even for a tiny vocabulary).
    note: str | None = None


def _eos(value, source: Path) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{source}: field 'eos_token_id' is {value!r}; expected a token id or a list of token ids")
    return tuple(ids)


def _unreachable(eos: tuple[int, ...], source: Path, vocab) -> str | None:
    beyond = [i for i in eos if isinstance(vocab, int) and not isinstance(vocab, bool) and i >= vocab]
    if not beyond:
        return None
    said = f"{source}'s eos_token_id {list(eos) if len(eos) > 1 else eos[0]} is beyond the vocabulary (config.json's vocab_size is {vocab})"
    if len(beyond) == len(eos):
        return f"{said}: the model never produces a stop token, so a sequence ends only at the token limit"
    return f"{said}: the model never produces {', '.join(map(str, beyond))}, so only the others end a sequence"


def generation_defaults(model_dir: Path, config: dict) -> GenerationDefaults:
    """Stop tokens: generation_config.json's eos_token_id, else config.json's. Length:
    generation_config.json's max_new_tokens, else aotc's default."""
    path = model_file(model_dir, GENERATION_CONFIG)
    gen = read_json_object(path) if path.is_file() else {}
    eos, eos_from = _eos(gen.get("eos_token_id"), path), GENERATION_CONFIG
    if eos is None:
        eos, eos_from = _eos(config.get("eos_token_id"), Path(model_dir) / "config.json"), "config.json"
    if eos is None:
        eos, eos_from = (), "none"
    note = _unreachable(eos, path if eos_from == GENERATION_CONFIG else Path(model_dir) / "config.json", config.get("vocab_size"))
    length = gen.get("max_new_tokens")
    if length is None:
        return GenerationDefaults(eos, eos_from, DEFAULT_MAX_NEW_TOKENS, "aotc default", note)
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ConfigError(f"{path}: field 'max_new_tokens' is {length!r}; expected a positive integer")
    return GenerationDefaults(eos, eos_from, length, GENERATION_CONFIG, note)
