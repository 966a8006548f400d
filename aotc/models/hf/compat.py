"""Which transformers releases the generic path (aotc.models.hf) runs on, and the
private transformers names it leans on, each with why and when it can go.

The generic path runs transformers' own modeling code, so it needs some of
transformers' internals: how it finds a model's decoder layers, how it marks
tensors it has initialised, how its loader renames and merges checkpoint
tensors. None of these is a documented API, so a release may rename one. This
table is the one list of them: `check()` looks each up before the generic path
reads a config, and tests/test_transformers_compat.py looks each up in CI, so a
release that drops one fails with its name, not with an AttributeError deep in
a build.

A release newer than those tested is allowed with a warning when every name is
still there: the cache keys carry transformers' version and the modeling
module's source (a new release never reuses an old graph), and `aotc run
--check` compares the bundle with that release's own eager model. Refusing it
would make users downgrade a transformers that the rest of their environment
wants. An older release is refused: its cache and attention interfaces differ.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from dataclasses import dataclass

from ...errors import ConfigError

# The minor releases the conformance matrix (tests/test_transformers_path.py) runs on:
# CI on the one the `test` extra installs, the other under `slow`
# (test_conformance_on_the_other_tested_release). pyproject's `hf` and `test` extras
# and INSTALL accept exactly these (a test holds them together).
TESTED = ("5.24", "5.25")
INSTALL = "pip install 'transformers>=5.24,<5.26'"


class UntestedTransformersWarning(UserWarning):
    """transformers is newer than the releases aotc's generic path was tested with."""


@dataclass(frozen=True)
class Private:
    """A private transformers name aotc uses: `name` on the object at dotted path `owner`
    (an attribute, or with `read=True` a name that owner's source reads or sets, such as
    a flag transformers keeps on tensors or an attribute it sets on instances)."""

    owner: str
    name: str
    why: str
    until: str  # when aotc can stop using it
    read: bool = False

    def present(self) -> bool:
        try:
            obj = _resolve(self.owner)
        except (ImportError, AttributeError):
            return False
        if self.read:
            return self.name in inspect.getsource(obj)
        return hasattr(obj, self.name)

    def __str__(self) -> str:
        return f"{self.owner}.{self.name}"


_PTM = "transformers.modeling_utils.PreTrainedModel"
_LOADING = "transformers.core_model_loading"
_LOADER = "the checkpoint layout transformers' loader converts (mixtral's renamed experts, per-expert tensors merged)"
_UNTIL_LOADER = "transformers documents its conversion mapping as an API, or aotc loads checkpoints through from_pretrained"

PRIVATE = (
    Private(_PTM, "_no_split_modules", "the classes of a model's decoder layers, each made an entry (hf._decoder_layers)",
            "transformers names a model's decoder layer classes in a public attribute"),
    Private("transformers.initialization", "_is_hf_initialized", "marks loaded tensors so that transformers' init leaves them "
            "alone and makes only the non-persistent buffers (hf.init_buffers); unmarks them for aotc verify's random weights",
            "transformers has a public call that makes a model's non-persistent buffers from its config", read=True),
    Private(_PTM, "_init_weights", "makes one module's non-persistent buffers (rotary frequencies, Gemma's embedding scale) "
            "as from_pretrained does (hf.init_buffers)", "as for _is_hf_initialized"),
    Private(f"{_PTM}.post_init", "all_tied_weights_keys", "which parameters share storage (the tied LM head), read after "
            "loading replaced the tied Parameter objects (hf.tied_parameters)",
            "transformers exposes its expanded tie map publicly", read=True),
    Private("transformers.conversion_mapping", "get_model_conversion_mapping", _LOADER, _UNTIL_LOADER),
    *(Private(_LOADING, n, _LOADER, _UNTIL_LOADER) for n in ("Concatenate", "MergeModulelist", "WeightConverter", "WeightRenaming", "apply_renamings", "dot_natural_key")),
    *(Private(f"{_LOADING}.WeightConverter", n, _LOADER, _UNTIL_LOADER) for n in ("rename_source_key", "operations", "source_patterns")),
    Private("transformers.models.auto.modeling_auto", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "which model types transformers has a "
            "causal LM for, and its class name (hf.knows, TransformersConfig.from_hf), without importing every model",
            "transformers exports the auto classes' name mappings at its top level"),
    Private("transformers.models.auto.configuration_auto", "model_type_to_module_name", "imports one model's modeling module "
            "by its path (hf._model_class): the public `transformers.<Name>` indexes every model first, about 1.4 s of a cold start",
            "transformers' lazy top-level import costs no more than one module's import"),
    Private("transformers.activations", "ACT2FN", "the activation names a config's hidden_act may take, checked before a model "
            "is built (hf._check_fields)", "transformers validates hidden_act in its config classes"),
)  # fmt: skip


def _resolve(path: str):
    # The longest importable module prefix, then attributes.
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def missing() -> list[Private]:
    """The private names the installed transformers lacks."""
    return [p for p in PRIVATE if not p.present()]


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@functools.cache
def check(version: str | None = None) -> None:
    """Refuses a transformers older than tested, or one that lacks a private name aotc
    uses, naming the releases tested and the pip command; warns once for a newer one."""
    if version is None:
        from transformers import __version__ as version
    tested = ", ".join(TESTED)
    if _minor(version) < _minor(TESTED[0]):
        raise ConfigError(f"transformers {version} is older than the releases aotc's generic path is tested with ({tested}); run: {INSTALL}")
    gone = missing()
    if gone:
        names = "; ".join(f"{p} (needed for {p.why})" for p in gone)
        raise ConfigError(f"transformers {version} lacks what aotc's generic path uses: {names}. aotc is tested with transformers {tested}; run: {INSTALL}")
    if _minor(version) > _minor(TESTED[-1]):
        warnings.warn(
            f"transformers {version} is newer than the releases aotc's generic path is tested with ({tested}); every private "
            "name it uses is present. Check a bundle with `aotc run --check`, or run: " + INSTALL,
            UntestedTransformersWarning,
            stacklevel=2,
        )
