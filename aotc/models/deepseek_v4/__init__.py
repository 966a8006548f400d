"""DeepSeek V4 (`model_type: deepseek_v4`) as eager inference code.

Per layer: shared-KV multi-query attention with partial interleaved RoPE, a
per-head attention sink and a grouped low-rank output projection, over a
sliding window plus, by layer type,
  * compressed_sparse_attention (CSA): entries that compress every m tokens
    (overlapping windows of 2m) and a lightning indexer that keeps the top-k
    entries per query;
  * heavily_compressed_attention (HCA): entries that compress every m' tokens;
and a mixture of experts (hash-routed `hash_moe` or top-k routed `moe`, plus a
shared expert), with the residual carried as `hc_mult` streams mixed by
manifold-constrained hyper-connections (Sinkhorn), collapsed by a hyper head.

Parameter paths follow the checkpoint (DeepSeek's names, as transformers
saves them: `model.layers.N.attn.wq_a.weight`, `...ffn.experts.E.w1.weight`).

State lives in layer-major root allocations made by the runtime, sized for
the cache slots and max_seq, indexed by (slot, position):
  kv            [layers, slots, max_seq, head_dim]      sliding-window keys (= values), after RoPE
  hca_kv/gate   [hca layers, slots, max_seq, head_dim]   compressor inputs per position
  hca_comp      [hca layers, slots, max_seq // m', head_dim]    compressed entries
  csa_kv/gate   [csa layers, slots, max_seq, 2 * head_dim]
  csa_comp      [csa layers, slots, max_seq // m, head_dim]
  idx_kv/gate   [csa layers, slots, max_seq, 2 * index_head_dim]   the indexer's compressor
  idx_comp      [csa layers, slots, max_seq // m, index_head_dim]  indexer keys
A compressed entry is written when the token that closes its window is
processed, from the per-position inputs, so prompts can be prefilled in any
chunking and give the same state.

Data-dependent steps (everything else has static shapes: top-k with a fixed
k, gathers by slot, masks):
  * MoE.forward keeps its natural form: `nonzero` finds each expert's tokens,
    then a gather and an `index_add_` of data-dependent size, with a
    `torch._check` that an expert gets at most one row per token (true by
    construction: a token that picks an expert in two slots is one row,
    weighted by both slots' weights). Traced, these
    are unbacked sizes: export and inductor compile them as they are; for
    static-shape backends (xla, neuron) the strip_data_dependent pass turns
    them into `nonzero_static` with padded rows masked out of the `index_add_`.
  * Compressor.emit is vectorized, since export cannot capture a loop over
    `tolist()`: every token computes the entry of the window it is in, and a
    window gets the entry of its closing token when that token is in the call;
    every other token writes back the entry already there.
"""

from __future__ import annotations

from .attention import INDEX_GROUP, NOPE_GROUP, Attention, Compressor, GroupedLinear, Indexer, RMSNorm, apply_rope, cache_rows, rope_at, unweighted_rms
from .config import LAYER_TYPES, MLP_TYPES, ROPE_TYPES, SCORING, DeepseekV4Config, rope_inv_freq
from .model import BLOCKS, CACHE_GROUP, Block, CSABlock, DeepseekV4ForCausalLM, HCABlock, HyperHead, SlidingBlock, V4Head, V4Model, cache_kinds, hyper_weights
from .moe import Expert, Gate, MoE

__all__ = [
    "Attention",
    "BLOCKS",
    "Block",
    "CACHE_GROUP",
    "CSABlock",
    "Compressor",
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    "Expert",
    "Gate",
    "GroupedLinear",
    "HCABlock",
    "HyperHead",
    "INDEX_GROUP",
    "Indexer",
    "LAYER_TYPES",
    "MLP_TYPES",
    "MoE",
    "NOPE_GROUP",
    "RMSNorm",
    "ROPE_TYPES",
    "SCORING",
    "SlidingBlock",
    "V4Head",
    "V4Model",
    "apply_rope",
    "cache_kinds",
    "cache_rows",
    "hyper_weights",
    "rope_at",
    "rope_inv_freq",
    "unweighted_rms",
]
