"""Per-expert checkpoint tensors merged into transformers' fused parameters, as its conversion mapping says."""

from __future__ import annotations

from torch import nn

from ...errors import WeightsError
from ..checkpoint import Merged


def _conversion_layout(hf: nn.Module, names) -> dict:
    """{param: checkpoint name or Merged} for the checkpoint tensors `names` that
    transformers' conversion mapping renames or merges (transformers' own renaming of a
    key, then at most one converter, as its loader applies them)."""
    # Private names (hf_compat.PRIVATE): the loader's conversion mapping and its transforms.
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming, apply_renamings, dot_natural_key

    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    layout: dict = {}
    merges: dict[str, tuple] = {}  # target -> (converter, {source pattern: names})
    for name in sorted(names, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        renamed = apply_renamings(name, renamings)
        for converter in converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                merges.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(name)
                break
        else:
            if renamed != name:
                layout[renamed] = name
    for target, (converter, by_pattern) in merges.items():
        ops = converter.operations
        kinds = [type(op) for op in ops]
        if kinds not in ([MergeModulelist], [MergeModulelist, Concatenate]):
            raise WeightsError(
                f"config.json: transformers makes {target} of the checkpoint's {', '.join(converter.source_patterns)} with "
                f"{', '.join(k.__name__ for k in kinds)}; aotc's generic path merges per-expert tensors (MergeModulelist, "
                "then Concatenate) only: save the checkpoint with transformers' own layout"
            )
        parts = tuple(tuple(by_pattern[p]) for p in converter.source_patterns if p in by_pattern)
        layout[target] = Merged(parts, stack_dim=ops[0].dim, cat_dim=ops[1].dim if len(ops) > 1 else 0)
    return layout
