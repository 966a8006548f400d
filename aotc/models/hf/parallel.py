"""Tensor parallelism for the generic path, from transformers' own plan.

A transformers config class states how its model splits (`base_model_tp_plan`:
module patterns of the base model, such as `layers.*.self_attn.q_proj`, to a
parallel style). aotc maps each style onto its shard records (`ShardSpec`) and
builds each rank's model as transformers' own code with the rank's sizes: its
query and KV heads (`head_dim` kept), its part of the MLP. Where a rank holds a
partial sum, the module's class becomes an aotc subclass that sums it across
the ranks inside the graph:

- **colwise** (and `colwise_gather_output`, `colwise_rep`): the output rows
  split, in whole heads for attention. A fused projection (Phi-3's `qkv_proj`,
  `gate_up_proj`) splits each of its blocks, so attention stays split where
  transformers gathers the fused output (`ShardSpec.blocks`).
- **rowwise** (and `rowwise_split_input`, `rowwise_rep`): the input columns
  split, the output summed by one all-reduce; a bias is added once, by rank 0.
- **replicated** styles and the embedding's: whole on every rank.
- **A norm across all heads** (OLMo 2's q and k norms, which the plan honours
  by gathering q, k and v): split with its heads, its mean of squares summed
  across the ranks by an all-reduce (`_split_norm_class`), so that attention
  stays split.
- **The head** splits by vocabulary and gathers its logits, as the llama
  family's does; a tied head reads its rows of the embedding.

Any other style, a model without a plan, or a tensor whose size follows the
heads or the MLP but that the plan does not split (gpt-oss's attention, whose
plan names the embedding only), is refused at build, naming the style or the
tensor.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import torch
from torch import nn

from ... import parallel
from ...errors import ConfigError
from ...format import ShardSpec

# transformers' parallel styles (transformers/distributed/tensor_parallel.py) that aotc
# takes: how a rank holds the module's weight. None: whole on every rank.
_STYLES = {
    "colwise": "colwise", "colwise_rep": "colwise", "colwise_gather_output": "colwise",
    "rowwise": "rowwise", "rowwise_rep": "rowwise", "rowwise_split_input": "rowwise",
    "replicated_with_grad_allreduce": None, "replicate": None, "embedding_rowwise": None, "embedding_colwise": None,
}  # fmt: skip
# transformers' expert-parallel styles (base_model_ep_plan) that aotc takes: a stacked
# experts tensor, split along its experts ("split"), and the experts module that routes
# tokens to them (aotc's expert map: None).
_EP_STYLES = {"grouped_gemm": "split", "ep_dispatch_experts": None}
# Fused projections: the parts of their output rows, in order.
_FUSED = {"qkv_proj": ("q", "kv", "kv"), "gate_up_proj": ("mlp", "mlp")}


@dataclass(frozen=True)
class Sizes:
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int | None


def sizes(hf_config) -> Sizes:
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    intermediate = getattr(hf_config, "intermediate_size", None)
    return Sizes(heads, kv, head_dim, int(intermediate) if intermediate else None)


def local_fields(fields: dict, hf_config, degree: int) -> dict:
    """config.json's fields for one rank's model at `degree` ranks: its heads (a KV head
    on several ranks where the ranks outnumber them), its part of the MLP, head_dim kept,
    and the head untied (a rank's head is its rows of the vocabulary, the embedding whole)."""
    s = sizes(hf_config)
    out = {**fields, "num_attention_heads": s.heads // degree, "num_key_value_heads": max(1, s.kv_heads // degree), "head_dim": s.head_dim, "tie_word_embeddings": False}
    if s.intermediate is not None:
        out["intermediate_size"] = s.intermediate // degree
    return out


def full_shapes(model_class: type, fields: dict, model_type: str) -> dict[str, tuple[int, ...]]:
    """The whole (unsplit) model's parameter shapes."""
    return _meta_shapes(model_class, json.dumps(fields, sort_keys=True), model_type)[0]


@functools.cache
def _meta_shapes(model_class: type, config_json: str, model_type: str) -> tuple[dict[str, tuple[int, ...]], str, str]:
    """The whole model's parameter shapes (built on the meta device: no memory, no
    init), its base model's prefix and its output embedding's parameter path."""
    from transformers.models.auto.configuration_auto import AutoConfig

    config = AutoConfig.for_model(model_type, **{k: v for k, v in json.loads(config_json).items() if k != "model_type"})
    with torch.device("meta"):
        model = model_class(config)
    head = model.get_output_embeddings()
    head_path = next((name for name, m in model.named_modules() if m is head), "")
    return {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}, model.base_model_prefix, head_path


def shard_specs(model_class: type, fields: dict, hf_config, architecture: str, degree: int) -> dict[str, ShardSpec] | None:
    """transformers' tensor-parallel plan of the model, as aotc's shard records at `degree`
    ranks ({parameter path, `*` for a layer index: spec}); None where it has none."""
    plan = getattr(hf_config, "base_model_tp_plan", None) or None
    if plan is None:
        return None
    shapes, prefix, head_path = _meta_shapes(model_class, json.dumps(fields, sort_keys=True), hf_config.model_type)
    s = sizes(hf_config)
    kv_ways = s.kv_heads if degree > s.kv_heads and degree % s.kv_heads == 0 else degree
    ways, units = {"q": degree, "kv": kv_ways, "mlp": degree}, {"q": s.head_dim, "kv": s.head_dim, "mlp": 1}
    specs: dict[str, ShardSpec] = {}
    for pattern, style in plan.items():
        if style not in _STYLES:
            raise ConfigError(
                f"config.json: transformers' tensor-parallel plan for {architecture} (base_model_tp_plan) splits {prefix}.{pattern} "
                f"as {style!r}, which aotc does not take (it takes {', '.join(sorted(_STYLES))}); build it with --tensor-parallel 1"
            )
        how = _STYLES[style]
        full = f"{prefix}.{pattern}"
        weights = _matching(shapes, f"{full}.weight")
        if how is None or not weights:  # whole, or a module this model's layers do not have
            continue
        if len({shapes[w] for w in weights}) != 1 or len(shapes[weights[0]]) != 2:
            raise ConfigError(f"config.json: {architecture}'s {full}.weight is not one [out, in] matrix in every layer; aotc splits linear layers")
        out_rows, in_cols = shapes[weights[0]]
        leaf = pattern.rsplit(".", 1)[-1]
        roles = _FUSED.get(leaf) or (("kv",) if leaf in ("k_proj", "v_proj") else ("q",) if "attn" in pattern else ("mlp",))
        size = out_rows if how == "colwise" else in_cols
        blocks = [_role_size(r, s, size, roles) for r in roles]
        if sum(blocks) != size:
            raise ConfigError(
                f"config.json: {architecture}'s {full}.weight has {size} rows, not the {' + '.join(map(str, blocks))} of its fused {', '.join(roles)}; aotc cannot split it"
            )
        # A fused tensor's blocks split alike: KV heads repeated past their count would not
        # (parallel.misfit then names the tensor and the degrees that split it).
        part_ways = ways[roles[0]] if len({ways[r] for r in roles}) == 1 else degree
        spec = ShardSpec("split", 0 if how == "colwise" else 1, blocks, part_ways, units[roles[0]])
        specs[f"{full}.weight"] = spec
        specs[f"{full}.bias"] = ShardSpec("split", 0, blocks, spec.ways, spec.unit) if how == "colwise" else parallel.FIRST
        if how == "colwise" and roles[0] in ("q", "kv") and len(roles) == 1:
            specs |= _norms_across_heads(shapes, full, size, spec)
    if head_path:
        vocab = shapes[f"{head_path}.weight"][0]
        specs[f"{head_path}.weight"] = specs[f"{head_path}.bias"] = parallel.split(0, vocab, degree)
    return specs


def expert_specs(model_class: type, fields: dict, hf_config, architecture: str, degree: int) -> dict[str, ShardSpec] | None:
    """transformers' expert-parallel plan of the model as aotc's shard records at `degree`
    ranks: each stacked experts tensor split along its experts; None where it has none."""
    plan = getattr(hf_config, "base_model_ep_plan", None) or None
    if plan is None:
        return None
    shapes, prefix, _ = _meta_shapes(model_class, json.dumps(fields, sort_keys=True), hf_config.model_type)
    specs = {}
    for pattern, style in plan.items():
        if style not in _EP_STYLES:
            raise ConfigError(
                f"config.json: transformers' expert-parallel plan for {architecture} (base_model_ep_plan) splits {prefix}.{pattern} "
                f"as {style!r}, which aotc does not take (it takes {', '.join(sorted(_EP_STYLES))}); build it with --expert-parallel 1"
            )
        names = _matching(shapes, f"{prefix}.{pattern}")
        if _EP_STYLES[style] is not None and names:
            specs[f"{prefix}.{pattern}"] = parallel.split(0, shapes[names[0]][0], degree)
    return specs


def _role_size(role: str, s: Sizes, size: int, roles: tuple) -> int:
    if len(roles) == 1:
        return size
    if role == "q":
        return s.heads * s.head_dim
    if role == "kv":
        return s.kv_heads * s.head_dim
    return size // roles.count("mlp")  # gate and up: equal halves


def _matching(shapes: dict, pattern: str) -> list[str]:
    regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
    return [n for n in shapes if regex.fullmatch(n)]


def _norms_across_heads(shapes: dict, projection: str, size: int, spec: ShardSpec) -> dict[str, ShardSpec]:
    """The modules beside a q or k projection that normalise its output across all heads
    (a 1-D weight of its size: OLMo 2's q_norm, k_norm), split as it is. A per-head norm
    (Qwen 3's, a weight of head_dim) stays whole."""
    attention = projection.rsplit(".", 1)[0]
    beside = re.compile(re.escape(attention).replace(r"\*", r"\d+") + r"\.(\w+)\.weight")
    return {f"{attention}.{m.group(1)}.weight": spec for name, shape in shapes.items() if shape == (size,) and (m := beside.fullmatch(name))}


# -- a rank's modules ------------------------------------------------------------


@functools.cache
def _rowwise_class(base: type) -> type:
    def forward(self, x):
        return parallel.all_reduce(base.forward(self, x), self.group)  # the ranks' partial sums, summed

    return type(base.__name__, (base,), {"forward": forward, "__module__": __name__})


@functools.cache
def _split_norm_class(base: type) -> type:
    def forward(self, x):
        # An RMS norm over every rank's heads: the mean of squares of the whole row is the
        # sum of the ranks' sums over their columns, over every rank's width (a KV head held
        # by several ranks is counted by each, and its width too).
        dtype, h = x.dtype, x.float()
        variance = parallel.all_reduce(h.pow(2).sum(-1, keepdim=True), self.group) / (h.shape[-1] * self.ranks)
        return (self.weight * (h * torch.rsqrt(variance + self.variance_epsilon))).to(dtype)

    return type(base.__name__, (base,), {"forward": forward, "__module__": __name__})


def _check_rms_norm(module: nn.Module, name: str) -> None:
    """A norm aotc splits must be the RMS norm `_split_norm_class` computes: checked on
    random values against the module's own forward."""
    # The model is built on meta or fake tensors; this runs on real ones. torch has no
    # public way out of a fake mode (torch 2.13).
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    size, eps = module.weight.shape[0], getattr(module, "variance_epsilon", None)
    if eps is not None:
        with unset_fake_temporarily():
            g = torch.Generator().manual_seed(0)
            x, w = torch.randn(3, size, generator=g, device="cpu"), 1 + 0.1 * torch.randn(size, generator=g, device="cpu")
            theirs = torch.func.functional_call(module, {"weight": w}, (x,))
            ours = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
            if torch.allclose(theirs, ours, rtol=1e-5, atol=1e-6):
                return
    raise ConfigError(
        f"--tensor-parallel: {name} ({type(module).__name__}) normalises across every head and is not the RMS norm aotc splits "
        "(the mean of squares summed across the ranks); build it with --tensor-parallel 1"
    )


def place(model: nn.Module, specs: dict[str, ShardSpec], full_shapes: dict[str, tuple[int, ...]], group: str, world: int, architecture: str) -> None:
    """Make a rank's modules sum or gather across the ranks where the plan splits them,
    after checking that every parameter has the rank's shape the plan gives it: one whose
    size follows the heads or the MLP and that the plan leaves whole is refused."""
    for name, p in model.named_parameters():
        spec = parallel.spec_of(specs, name)
        expected = parallel.rank_shape(spec, full_shapes[name]) if name in full_shapes else tuple(p.shape)
        if tuple(p.shape) != expected:
            said = f"splits it to {list(expected)}" if spec is not None else "keeps it whole"
            raise ConfigError(
                f"--tensor-parallel {world}: {architecture}'s {name} is {list(full_shapes[name])} whole and {list(p.shape)} on a rank "
                f"(its size follows the heads or the MLP), and transformers' plan (base_model_tp_plan) {said}; aotc cannot split "
                "this model so: build it with --tensor-parallel 1"
            )
    for path, module in model.named_modules():
        spec = parallel.spec_of(specs, f"{path}.weight")
        if spec is None or spec.kind != "split":
            continue
        if spec.dim == 1 and isinstance(module, nn.Linear):
            module.__class__ = _rowwise_class(type(module))
            module.group = group
        elif module.weight.dim() == 1:
            _check_rms_norm(module, path)
            module.__class__ = _split_norm_class(type(module))
            module.group, module.ranks = group, world


def split_experts(module: nn.Module, path: str, specs: dict[str, ShardSpec], ways: int, group: str) -> None:
    """An experts module as one rank's part: its experts' blocks of each stacked tensor the
    plan splits, and a map (a buffer: each rank's own values, one graph for every rank)
    from the router's choices to them."""
    count = None
    for name, p in list(module.named_parameters(recurse=False)):
        if parallel.spec_of(specs, f"{path}.{name}") is not None:
            count = p.shape[0]
            setattr(module, name, nn.Parameter(p.new_empty(count // ways, *p.shape[1:]), requires_grad=False))
    if count is None:
        raise ConfigError(f"--expert-parallel {ways}: transformers' expert-parallel plan splits none of {path}'s tensors; build it with --expert-parallel 1")
    module.num_experts = count // ways
    # int64: an xla module narrows int32 inputs (as DeepSeek V4's map)
    module.register_buffer("expert_map", module.down_proj.new_empty(count, dtype=torch.long), persistent=False)
    module.group = group


def init_expert_map(module: nn.Module, rank: int) -> None:
    """Rank `rank`'s map: the router's expert e is the rank's expert e - rank * n where it
    holds it, else n (another rank's)."""
    n, count = module.num_experts, module.expert_map.shape[0]
    local = torch.full((count,), n, dtype=torch.long)
    local[rank * n : (rank + 1) * n] = torch.arange(n)
    module.expert_map = local
