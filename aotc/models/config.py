"""Typed reading of config.json fields, with errors that name the field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..errors import ConfigError
from ..format import KvCacheRecord, ParallelRecord
from ..kvcache import kv_cache_record
from ..parallel import SINGLE

_MISSING = object()
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list", dict: "an object"}


def model_file(model_dir: Path, name: str) -> Path:
    """The file `name` of a model folder, where it may be read: in the folder, or, where
    it is a link, to a file inside the folder or, in a Hugging Face cache snapshot
    (`models--org--name/snapshots/<commit>/`), inside that repo's `blobs/`. A link that
    leads anywhere else is refused: a model folder reads no file outside itself."""
    path = Path(model_dir) / name
    if not path.is_symlink():
        return path
    target = path.resolve()
    folder = Path(model_dir).resolve()
    inside = [folder]
    if folder.parent.name == "snapshots":  # the hub cache: snapshots link into the repo's blobs/
        inside.append(folder.parent.parent / "blobs")
    if not any(target.is_relative_to(p) for p in inside):
        raise ConfigError(f"{path}: a link to {target}, outside the model folder; copy the file into the folder instead")
    return path


def read_config(model_dir: Path) -> dict:
    path = model_file(model_dir, "config.json")
    if not Path(model_dir).is_dir():
        raise ConfigError(f"{model_dir}: not a folder; expected a model folder with config.json and *.safetensors")
    if not path.is_file():
        raise ConfigError(f"{path}: missing; a model folder needs a Hugging Face config.json")
    return read_json_object(path)


def read_json_object(path: Path) -> dict:
    """A JSON file of a model folder that holds one object (config.json, generation_config.json, ...)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an integer past Python's 4300 digits, deep nesting
        raise ConfigError(f"{path}: not valid JSON ({type(e).__name__}: {e}); fix or re-export the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass
class ModelConfig:
    """Base of every architecture's config dataclass (built by its `from_hf(ConfigReader)`)."""

    # Fields that change what the runtime does but not the compiled graphs (e.g. the
    # end-of-sequence tokens): a bundle runs with a model whose config differs only there.
    RUNTIME_ONLY: ClassVar[tuple[str, ...]] = ("eos_token_ids",)

    # What the KV caches store: set by the build (--kv-cache-dtype), not by config.json.
    kv_cache: KvCacheRecord = field(default_factory=lambda: kv_cache_record("auto", "e4m3fn"), kw_only=True)
    # How the graphs split across ranks: set by the build (--tensor-parallel), not by config.json.
    # A model builds each rank's sizes from it (CausalLM.shard_specs).
    parallel: ParallelRecord = field(default_factory=lambda: SINGLE, kw_only=True)
    # Which rank's part of the layout this model is (load_model's rank), where a model's
    # parameters depend on it (the experts a rank holds); never in a graph or a cache key.
    rank: int = field(default=0, kw_only=True)


class ConfigReader:
    """Reads fields of one config dict; every error names the file and field."""

    def __init__(self, config: dict, source: Path | str):
        self.config = config
        self.source = source

    def get(self, key: str, typ: type, default: Any = _MISSING) -> Any:
        if key not in self.config or self.config[key] is None:
            if default is _MISSING:
                raise ConfigError(f"{self.source}: missing field {key!r} ({_TYPE_NAMES.get(typ, typ.__name__)}); add it to config.json")
            return default
        value = self.config[key]
        ok = isinstance(value, typ) and not (typ in (int, float) and isinstance(value, bool))
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"{self.source}: field {key!r} must be {_TYPE_NAMES.get(typ, typ.__name__)}, got {value!r} ({type(value).__name__})")
        return value

    def positive_number(self, key: str, default: Any = _MISSING, where: dict | None = None) -> float:
        """A finite number above 0 (an epsilon, a rope base or factor), from the config or,
        where given, from a nested object of it (`rope_parameters`)."""
        source = self if where is None else ConfigReader(where, self.source)
        value = source.get(key, float, default)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{self.source}: field {key!r} must be a finite number above 0, got {value}")
        return value

    def positive(self, key: str, default: Any = _MISSING) -> int:
        value = self.get(key, int, default)
        if value is not None and value <= 0:
            raise ConfigError(f"{self.source}: field {key!r} must be a positive integer, got {value}")
        return value
