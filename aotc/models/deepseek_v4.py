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

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel
from ..entry import entry
from ..errors import ConfigError, WeightsError
from ..kvcache import Fp8Rows, layer_views, load, row_spec, store
from ..layout import Derived
from .base import SCRATCH_SLOT, CausalLM, read_dtype
from .config import ConfigReader, ModelConfig
from .registry import register_architecture

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn")


@dataclass
class DeepseekV4Config(ModelConfig):
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rate_csa: int
    compress_rate_hca: int
    rope: dict  # {"main": {...}, "compress": {...}}: rope_type, rope_theta and yarn fields
    rope_dim: int  # the trailing channels of each head that get RoPE
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: ConfigReader) -> "DeepseekV4Config":
        n = cfg.positive("num_hidden_layers")
        if cfg.get("num_key_value_heads", int, 1) != 1:
            raise ConfigError(f"{cfg.source}: DeepSeek V4 has one shared KV head; field 'num_key_value_heads' must be 1")
        act = cfg.get("hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"{cfg.source}: field 'hidden_act' is {act!r}; DeepSeek V4 uses 'silu'")
        head_dim = cfg.positive("head_dim")
        layer_types = cfg.get("layer_types", list, None) or ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))
        ]
        mlp_types = cfg.get("mlp_layer_types", list, None) or ["hash_moe"] * min(n, 3) + ["moe"] * max(0, n - 3)
        for name, types, allowed in (("layer_types", layer_types, LAYER_TYPES), ("mlp_layer_types", mlp_types, MLP_TYPES)):
            if len(types) != n:
                raise ConfigError(f"{cfg.source}: field {name!r} has {len(types)} entries, expected num_hidden_layers={n}")
            bad = [t for t in types if t not in allowed]
            if bad:
                raise ConfigError(f"{cfg.source}: field {name!r} holds {bad[0]!r}; expected one of {', '.join(allowed)}")
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(cfg.get("compress_rates", dict, None) or {})}
        for kind, rate in rates.items():  # a block length in positions: a whole number above 0
            if kind in LAYER_TYPES and (not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0):
                raise ConfigError(f"{cfg.source}: compress_rates[{kind!r}] is {rate!r}; expected a positive integer (positions per compressed entry)")
        scoring = cfg.get("scoring_func", str, "sqrtsoftplus")
        if scoring not in SCORING:
            raise ConfigError(f"{cfg.source}: field 'scoring_func' is {scoring!r}; expected one of {', '.join(SCORING)}")
        partial = cfg.get("partial_rotary_factor", float, None)
        if partial is None:
            partial = cfg.get("qk_rope_head_dim", int, 64) / head_dim
        rope = _read_rope(cfg, partial)
        eos = cfg.config.get("eos_token_id")
        return cls(
            vocab_size=cfg.positive("vocab_size"),
            hidden_size=cfg.positive("hidden_size"),
            moe_intermediate_size=cfg.positive("moe_intermediate_size"),
            num_hidden_layers=n,
            num_attention_heads=cfg.positive("num_attention_heads"),
            head_dim=head_dim,
            q_lora_rank=cfg.positive("q_lora_rank"),
            num_experts_per_tok=cfg.positive("num_experts_per_tok"),
            n_routed_experts=cfg.positive("n_routed_experts"),
            scoring_func=scoring,
            routed_scaling_factor=cfg.get("routed_scaling_factor", float, 1.0),
            max_position_embeddings=cfg.positive("max_position_embeddings", 4096),
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_types),
            compress_rate_csa=rates["compressed_sparse_attention"],
            compress_rate_hca=rates["heavily_compressed_attention"],
            rope=rope,
            rope_dim=int(head_dim * partial),
            hc_mult=cfg.positive("hc_mult", 4),
            hc_sinkhorn_iters=cfg.positive("hc_sinkhorn_iters", 20),
            hc_eps=cfg.get("hc_eps", float, 1e-6),
            swiglu_limit=cfg.get("swiglu_limit", float, 10.0),
            sliding_window=cfg.positive("sliding_window", 128),
            o_groups=cfg.positive("o_groups"),
            o_lora_rank=cfg.positive("o_lora_rank"),
            index_n_heads=cfg.positive("index_n_heads"),
            index_head_dim=cfg.positive("index_head_dim"),
            index_topk=cfg.positive("index_topk"),
            rms_norm_eps=cfg.positive_number("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", bool, False),
            dtype=read_dtype(cfg),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ()),
        )


def _read_rope(cfg: ConfigReader, partial: float) -> dict:
    # transformers writes {"main": {...}, "compress": {...}}; older configs have
    # rope_theta / compress_rope_theta and the yarn fields at the top level.
    params = cfg.get("rope_parameters", dict, None) or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:
        yarn = cfg.get("rope_scaling", dict, None) or {k: v for k, v in params.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": cfg.positive_number("rope_theta", 10000.0)}
        compress = {**yarn, "rope_theta": cfg.positive_number("compress_rope_theta", 160000.0)}
    out = {}
    for kind, p in (("main", main), ("compress", compress)):
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"{cfg.source}: rope_parameters.{kind}.rope_type is {rope_type!r}; expected one of {', '.join(ROPE_TYPES)}")
        if rope_type == "yarn":
            for key in ("factor", "original_max_position_embeddings"):
                if not isinstance(p.get(key), (int, float)):
                    raise ConfigError(f"{cfg.source}: yarn rope ({kind}) needs a number in field {key!r}, got {p.get(key)!r}")
                cfg.positive_number(key, where=p)
        out[kind] = {**p, "rope_type": rope_type, "rope_theta": cfg.positive_number("rope_theta", 10000.0, where=p), "partial_rotary_factor": partial}
    return out


def rope_inv_freq(config: DeepseekV4Config, kind: str) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim / 2] and the cos/sin scale for one rope kind (main or compress)."""
    p = config.rope[kind]
    dim, base = config.rope_dim, p["rope_theta"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if p["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    # YaRN: interpolate the low frequencies, keep the high ones, ramp between.
    factor, old = p["factor"], p["original_max_position_embeddings"]
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction(rotations):
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(correction(fast)), 0), min(math.ceil(correction(slow)), dim - 1)
    high = high + 0.001 if low == high else high
    extrapolate = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")

        def get(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = get(factor, mscale) / get(factor, mscale_all) if mscale and mscale_all else get(factor)
    return inv_freq, float(attention)


# -- caches ------------------------------------------------------------------------

# fp8 caches as DeepSeek V4 stores them: the sliding-window keys and the compressed
# entries keep their NoPE dims in fp8 with a scale per 64 and their RoPE dims in bf16;
# the indexer's keys are fp8 with a scale per 128. The compressors' per-position
# inputs stay in the model's dtype.
NOPE_GROUP, INDEX_GROUP = 64, 128


def cache_rows(c: DeepseekV4Config) -> dict[str, Fp8Rows | None]:
    """How each kind of key cache stores a row: "kv" (sliding window), "comp" (compressed
    entries) and "idx_comp" (indexer keys); None for the model's dtype."""
    if c.kv_cache.dtype != "fp8":
        return {"kv": None, "comp": None, "idx_comp": None}
    keys = Fp8Rows(c.head_dim - c.rope_dim, NOPE_GROUP, c.rope_dim, c.kv_cache.fp8_max)
    return {"kv": keys, "comp": keys, "idx_comp": Fp8Rows(c.index_head_dim, INDEX_GROUP, 0, c.kv_cache.fp8_max)}


# -- building blocks ---------------------------------------------------------------


class RMSNorm(nn.Module):
    """V4's RMSNorm: fp32 weight, multiplied in fp32, cast once at the end."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return (self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))).to(dtype)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing rope channels of x.
    x: [N, ..., D]; cos, sin: [N, R/2] -> broadcast over the middle dims."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    for _ in range(x.dim() - 2):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    pairs = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope.float() * cos + pairs.float() * sin).to(x.dtype)], dim=-1)


def rope_at(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype):
    # positions: [N] -> cos, sin: [N, R/2]
    freqs = positions[:, None].float() * inv_freq[None, :]
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: each of `groups` slices of the input has its own matrix."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group, dtype=dtype))
        self.groups = groups

    def forward(self, x):
        # x: [N, G, in] -> [N, G, out / G]
        w = self.weight.view(self.groups, -1, x.shape[-1])  # [G, out/G, in]
        return torch.einsum("ngi,goi->ngo", x, w)


class Compressor(nn.Module):
    """Gated pooling of every `rate` positions into one entry (paper §2.3).

    overlap=False (HCA): entry w pools positions [w*rate, (w+1)*rate).
    overlap=True (CSA, and the indexer): each position projects two series;
    entry w pools the first series of window w-1 with the second of window w.
    """

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float, dtype, entry_rows: Fp8Rows | None):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.wkv = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.wgate = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.entry_rows = entry_rows  # how the entries are stored (None: in the model's dtype)

    def store(self, h, slots, positions, kv_state, gate_state):
        # h: [N, hidden]; the projections of each position go to (slot, position)
        kv_state[slots, positions] = self.wkv(h)
        gate_state[slots, positions] = self.wgate(h)

    def emit(self, slots, positions, kv_state, gate_state, entries, inv_freq, scale):
        """Write the entry of every window that a token at `positions` closes.

        Every row computes the entry of the window it is in (w = position // rate,
        the one it closes if it closes one), so the shapes do not depend on the
        data. A window closed in this call gets the entry its closing row
        computed; the rows of every other window write back what is there.
        """
        # slots, positions: [N]
        rate, d = self.rate, self.dim
        w = positions // rate
        start = w * rate
        at = start[:, None] + torch.arange(rate, device=positions.device)  # [N, rate]
        rows = slots[:, None]
        kv = kv_state[rows, at]  # [N, rate, width]
        gate = gate_state[rows, at].float() + self.ape
        if self.overlap:  # the first series of the window before (none before window 0)
            first = (w == 0)[:, None, None]
            before = (at - rate).clamp(min=0)
            prev_kv = kv_state[rows, before, :d].masked_fill(first, 0)
            prev_gate = (gate_state[rows, before, :d].float() + self.ape[:, :d]).masked_fill(first, float("-inf"))
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)  # [N, 2 * rate, d]
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        pooled = (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)  # [N, d]
        cos, sin = rope_at(inv_freq, scale, start, pooled.dtype)
        entry = apply_rope(self.norm(pooled), cos, sin)
        # Rows of one (slot, window) all write one value: the closing row's entry
        # when the window closes in this call, else the entry already there.
        closes = (positions + 1) % rate == 0
        closer = (rows == slots[None, :]) & (w[:, None] == w[None, :]) & closes[None, :]  # [N, N]: row j closes row i's window
        entry = torch.where(closer.any(dim=1)[:, None], entry[closer.int().argmax(dim=1)], load(self.entry_rows, entries, (slots, w), entry.dtype))
        store(self.entry_rows, entries, (slots, w), entry)


class Indexer(nn.Module):
    """Lightning indexer: scores compressed keys per query, keeps the top-k (paper §2.3.1)."""

    def __init__(self, c: DeepseekV4Config):
        super().__init__()
        self.wq_b = nn.Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, bias=False, dtype=c.dtype)
        self.weights_proj = nn.Linear(c.hidden_size, c.index_n_heads, bias=False, dtype=c.dtype)
        self.compressor = Compressor(c.hidden_size, c.index_head_dim, c.compress_rate_csa, True, c.rms_norm_eps, c.dtype, cache_rows(c)["idx_comp"])
        self.heads, self.dim, self.topk, self.rate = c.index_n_heads, c.index_head_dim, c.index_topk, c.compress_rate_csa

    def select(self, h, q_residual, positions, cos, sin, keys):
        """-> [N, E] bool: the compressed entries each query attends to. keys: [E, dim]
        (shared by the rows) or [N, E, dim]."""
        q = apply_rope(self.wq_b(q_residual).view(-1, self.heads, self.dim), cos, sin)  # [N, Hi, Di]
        scores = F.relu(q.float() @ keys.float().transpose(-1, -2)) * self.dim**-0.5
        weights = self.weights_proj(h).float() * self.heads**-0.5  # [N, Hi]
        scores = (scores * weights[:, :, None]).sum(dim=1)  # [N, E]
        ready = torch.arange(keys.shape[-2], device=positions.device)[None, :] < ((positions + 1) // self.rate)[:, None]
        scores = scores.masked_fill(~ready, float("-inf"))
        # The top k, ties at the k-th score going to the earliest entries. A score is a sum
        # of ReLUs, so several entries can score exactly 0.0, and topk's own choice among
        # ties depends on the kernel and on the tensor's length (a decode graph reads a
        # context bucket's entries, eager the whole cache): they chose different entries.
        k = min(self.topk, keys.shape[-2])
        kth = scores.topk(k, dim=-1).values[:, -1:]  # [N, 1]: one value, however ties fall
        above, tied = scores > kth, scores == kth
        chosen = above | (tied & (tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
        return chosen & ready


class Attention(nn.Module):
    def __init__(self, c: DeepseekV4Config, layer_type: str):
        super().__init__()
        h, heads, d, dt = c.hidden_size, c.num_attention_heads, c.head_dim, c.dtype
        self.wq_a = nn.Linear(h, c.q_lora_rank, bias=False, dtype=dt)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, heads * d, bias=False, dtype=dt)
        self.wkv = nn.Linear(h, d, bias=False, dtype=dt)
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.wo_a = GroupedLinear(heads * d // c.o_groups, c.o_groups * c.o_lora_rank, c.o_groups, dt)
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, h, bias=False, dtype=dt)
        self.attn_sink = nn.Parameter(torch.zeros(heads, dtype=torch.float32))
        rows = cache_rows(c)
        self.kv_rows = rows["kv"]
        if layer_type == "compressed_sparse_attention":
            self.compressor = Compressor(h, d, c.compress_rate_csa, True, c.rms_norm_eps, dt, rows["comp"])
            self.indexer = Indexer(c)
        elif layer_type == "heavily_compressed_attention":
            self.compressor = Compressor(h, d, c.compress_rate_hca, False, c.rms_norm_eps, dt, rows["comp"])
        self.heads, self.head_dim, self.groups = heads, d, c.o_groups
        self.window, self.eps = c.sliding_window, c.rms_norm_eps
        self.rope_kind = "main" if layer_type == "sliding_attention" else "compress"
        # RoPE inverse frequencies: made from the config, not read from checkpoints.
        for kind in ("main", "compress"):
            inv_freq, scale = rope_inv_freq(c, kind)
            self.register_buffer(f"{kind}_inv_freq", inv_freq, persistent=False)
            setattr(self, f"{kind}_scale", scale)

    def rope(self, kind: str) -> tuple[torch.Tensor, float]:
        return getattr(self, f"{kind}_inv_freq"), getattr(self, f"{kind}_scale")

    def forward(self, h, ids, positions, slots, caches, one_sequence=False):
        """h: [N, hidden]; rows are tokens at `positions` of the sequences in `slots`.
        one_sequence: the rows are consecutive tokens of one sequence (prefill; padding
        rows, if any, come last), so they share one set of keys."""
        n = h.shape[0]
        cos, sin = rope_at(*self.rope(self.rope_kind), positions, h.dtype)
        q_residual = self.q_norm(self.wq_a(h))
        q = apply_rope(unweighted_rms(self.wq_b(q_residual).view(n, self.heads, self.head_dim), self.eps), cos, sin)
        kv = apply_rope(self.norm(self.wkv(h))[:, None], cos, sin)[:, 0]  # [N, D]: keys are values
        kv_cache = caches["kv"]
        store(self.kv_rows, kv_cache, (slots, positions), kv)

        # Sliding window: the cached positions up to `window` back from each row's own.
        # Keys are gathered for the window's span only, not the whole cache.
        if one_sequence:  # one span for all rows: [window + N - 1] positions, keys [S', D]
            span = positions[0] - self.window + 1 + torch.arange(self.window + n - 1, device=positions.device)
            keys = load(self.kv_rows, kv_cache, (slots[:1, None], span.clamp(0, kv_cache.shape[1] - 1)), h.dtype)[0]
            k_pos = span[None, :]
        else:  # a span per row: keys [N, window, D]
            span = positions[:, None] - self.window + 1 + torch.arange(self.window, device=positions.device)
            keys = load(self.kv_rows, kv_cache, (slots[:, None], span.clamp(0, kv_cache.shape[1] - 1)), h.dtype)
            k_pos = span
        visible = (k_pos >= 0) & (k_pos <= positions[:, None]) & (k_pos > positions[:, None] - self.window)
        if hasattr(self, "compressor"):
            comp = self.compressor
            comp.store(h, slots, positions, caches["comp_kv"], caches["comp_gate"])
            comp.emit(slots, positions, caches["comp_kv"], caches["comp_gate"], caches["comp"], *self.rope("compress"))

            def of_rows(cache, rows):  # [E, D] shared by the rows, or [N, E, D]; slots[:1], not the .item() of slots[0]
                return load(rows, cache, (slots[:1],), h.dtype)[0] if one_sequence else load(rows, cache, (slots,), h.dtype)

            entries = of_rows(caches["comp"], comp.entry_rows)
            if hasattr(self, "indexer"):
                ix = self.indexer
                ix.compressor.store(h, slots, positions, caches["idx_kv"], caches["idx_gate"])
                ix.compressor.emit(slots, positions, caches["idx_kv"], caches["idx_gate"], caches["idx_comp"], *self.rope("compress"))
                icos, isin = rope_at(*self.rope("compress"), positions, h.dtype)
                picked = ix.select(h, q_residual, positions, icos, isin, of_rows(caches["idx_comp"], ix.compressor.entry_rows))
            else:  # HCA: every entry whose window has closed
                picked = torch.arange(entries.shape[-2], device=positions.device)[None, :] < ((positions + 1) // comp.rate)[:, None]
            keys = torch.cat([keys, entries], dim=-2)
            visible = torch.cat([visible, picked], dim=1)

        # keys [S, D] (shared) or [N, S, D]: matmul folds the shared case into one product
        scores = (q @ keys.transpose(-1, -2)) * self.head_dim**-0.5  # [N, H, S]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        sink = self.attn_sink.to(scores.dtype)[None, :, None].expand(n, -1, 1)
        logits = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        out = probs.to(keys.dtype) @ keys  # [N, H, D]
        out = apply_rope(out, cos, -sin)  # values carried RoPE: rotate it back at the query position
        grouped = self.wo_a(out.reshape(n, self.groups, -1)).flatten(1)
        return self.wo_b(grouped)


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float, dtype):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.w2 = nn.Linear(inter, hidden, bias=False, dtype=dtype)
        self.w3 = nn.Linear(hidden, inter, bias=False, dtype=dtype)
        self.limit = limit

    def forward(self, x):
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    def __init__(self, c: DeepseekV4Config, hashed: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size, dtype=c.dtype))
        if hashed:  # token id -> experts, fixed in the checkpoint
            self.register_buffer("tid2eid", torch.zeros(c.vocab_size, c.num_experts_per_tok, dtype=torch.long))
        else:  # added to the scores for the choice only
            self.bias = nn.Parameter(torch.zeros(c.n_routed_experts, dtype=torch.float32))
        self.hashed, self.topk, self.scoring, self.scaling = hashed, c.num_experts_per_tok, c.scoring_func, c.routed_scaling_factor

    def forward(self, x, ids):
        logits = F.linear(x, self.weight)
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if self.hashed:
            chosen = self.tid2eid[ids]
        else:
            chosen = torch.topk(scores + self.bias, self.topk, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        return chosen, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class MoE(nn.Module):
    """The router, the routed experts and the shared expert. At expert-parallel degree N
    (--expert-parallel) this rank holds experts [rank*E/N, (rank+1)*E/N) as its experts
    0..E/N-1, and `expert_map` (a weight: each rank's own values, one graph for all)
    takes the router's choices to them: E/N where another rank holds the expert. Each
    rank computes its experts' part of every row, and one fp32 all-reduce sums the parts.

    With data-parallel attention (--data-parallel-attention) each rank's rows are its own
    sequences' tokens: one all-gather brings every rank's rows (with their token ids packed
    in, for hash routing), every rank routes them all alike, runs its experts on them, and
    one fp32 reduce-scatter sums the parts and hands each rank its own rows' sums."""

    def __init__(self, c: DeepseekV4Config, hashed: bool):
        super().__init__()
        self.gate = Gate(c, hashed)
        ways = c.parallel.expert_parallel
        n = c.n_routed_experts // ways
        self.experts = nn.ModuleList(Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, c.dtype) for _ in range(n))
        self.shared_experts = Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, c.dtype)
        self.group, self.first = (parallel.group_name(c.parallel), c.rank * n) if ways > 1 else (None, 0)
        self.data_parallel = ways > 1 and parallel.data_parallel(c.parallel)
        self.by_all_reduce = self.data_parallel and c.parallel.gather == "all-reduce"
        if self.group is not None:
            # int64, as the hash tables: an xla module narrows int64 to int32 without JAX's x64 mode,
            # and its signature check reads every int32 input as that narrowed int64.
            self.register_buffer("expert_map", torch.empty(c.n_routed_experts, dtype=torch.long), persistent=False)

    def init_map(self) -> None:
        if self.group is not None:
            n = len(self.experts)
            self.expert_map = torch.full(self.expert_map.shape, n, dtype=torch.long)
            self.expert_map[self.first : self.first + n] = torch.arange(n)

    def local(self, chosen, weights):
        """The router's choices as this rank's experts (E/N: another rank's), and their
        weights, 0 for another rank's."""
        local = self.expert_map[chosen]
        return local, weights * (local < len(self.experts))

    def derived_weights(self):
        # Compiled graphs take the experts stacked, [E, out, in], so that a decode step
        # can index the chosen experts' matrices and read no others.
        n = len(self.experts)
        return {f"stacked_{w}": Derived("stack", tuple(f"experts.{e}.{w}.weight" for e in range(n))) for w in ("w1", "w2", "w3")}

    def forward(self, x, ids):
        """Each expert once, on the tokens routed to it (a loop over the experts)."""
        if self.data_parallel:
            every, every_ids = self.gather(x, ids)
            chosen, weights = self.gate(every, every_ids)
            partial = self.each_expert(every, *self.local(chosen, weights), dtype=torch.float32)
            return self.scatter(partial).to(x.dtype) + self.shared_experts(x)
        chosen, weights = self.gate(x, ids)  # [N, k]
        if self.group is None:
            return self.each_expert(x, chosen, weights) + self.shared_experts(x)
        partial = self.each_expert(x, *self.local(chosen, weights), dtype=torch.float32)
        return parallel.all_reduce(partial, self.group).to(x.dtype) + self.shared_experts(x)

    def rank(self):
        """This rank's index, [1], from its expert map (a weight: one graph for every rank):
        the block of the map that holds its own experts."""
        n = len(self.experts)
        return ((self.expert_map < n).long().argmax() // n).view(1)

    def gather(self, x, ids):
        """Every rank's rows [ranks*N, H], in rank order, and their token ids where the router
        hashes them: one all-gather, the ids packed into the rows as int32 bits (a copy moves
        bits unchanged; a vocabulary fits in 31 bits). Gathered by all-reduce (the layout's
        gather), the ids go as float32 values, exact below 2**24, since a sum moves values,
        not bits."""
        h = x.shape[1]
        if self.by_all_reduce:
            rows = x if not self.gate.hashed else torch.cat([x.float(), ids.float()[:, None]], dim=1)
            every = parallel.all_gather_rows(rows, self.group, self.rank())
            return (every, None) if not self.gate.hashed else (every[:, :h].to(x.dtype), every[:, h].long())
        if not self.gate.hashed:
            return parallel.all_gather(x, 0, self.group), None
        packed = ids.to(torch.int32)[:, None].view(x.dtype)  # [N, 4 / itemsize]
        every = parallel.all_gather(torch.cat([x, packed], dim=1), 0, self.group)
        return every[:, :h], every[:, h:].contiguous().view(torch.int32)[:, 0].long()

    def scatter(self, partial):
        """Each rank's own rows of the sum of every rank's fp32 parts."""
        return parallel.reduce_scatter(partial, self.group, self.rank() if self.by_all_reduce else None)

    def compiled_forward(self, x, ids, derived):
        """Each token's chosen experts gathered from the stacked weights, where a step makes fewer choices than there are experts; else the loop over the experts.

        Across ranks: the rank's experts densely on every row where the choices reach their
        number, else gathered; then one fp32 all-reduce of the parts (with data-parallel
        attention: on every rank's rows, gathered, and one fp32 reduce-scatter)."""
        n = len(self.experts)
        if self.data_parallel:
            every, every_ids = self.gather(x, ids)
            return self.scatter(self.routed(every, every_ids, derived)).to(x.dtype) + self.shared_experts(x)
        chosen, weights = self.gate(x, ids)  # [N, k]
        if self.group is None:
            if chosen.numel() < n:
                out = self.gathered(x, chosen, weights, derived)
            else:  # as many choices as experts: reading every expert once is the least
                out = self.each_expert(x, chosen, weights)
            return out + self.shared_experts(x)
        return parallel.all_reduce(self.routed(x, ids, derived), self.group).to(x.dtype) + self.shared_experts(x)

    def routed(self, x, ids, derived):
        """This rank's experts' fp32 part of each row: densely where the rows' choices reach
        the rank's expert count, else gathered (another rank's choice reads expert n-1 with
        weight 0)."""
        n = len(self.experts)
        chosen, weights = self.gate(x, ids)  # [N, k]
        local, weights = self.local(chosen, weights)
        if chosen.numel() < n:
            return self.gathered(x, local.clamp(max=n - 1), weights, derived, torch.float32)
        return self.dense(x, local, weights, derived)  # static shapes on every backend: each of the rank's experts once, on every row

    def dense(self, x, local, weights, stacked):
        """The rank's experts on every row, each row weighted by its weight for the expert
        (the sum over its slots that chose it; 0 where none did), summed in fp32."""
        limit, n = self.experts[0].limit, len(self.experts)
        per_expert = (weights[..., None] * (local[..., None] == torch.arange(n, device=x.device))).sum(1)  # [N, n]
        gate = torch.einsum("nh,eih->eni", x, stacked["stacked_w1"]).clamp(max=limit)
        up = torch.einsum("nh,eih->eni", x, stacked["stacked_w3"]).clamp(min=-limit, max=limit)
        h = F.silu(gate) * up * per_expert.t()[..., None].to(up.dtype)
        return torch.einsum("eni,ehi->nh", h, stacked["stacked_w2"]).float()

    def each_expert(self, x, chosen, weights, dtype=None):
        """Each expert once on the tokens routed to it, each token once per expert: a token
        whose picks name one expert in several slots (a hash-routing table may) gets it
        weighted by the sum of those slots' weights, what transformers' sum over (token,
        slot) pairs gives."""
        out = torch.zeros_like(x, dtype=dtype)
        for e, expert in enumerate(self.experts):
            picked = chosen == e  # [N, k]
            (rows,) = picked.any(dim=-1).nonzero(as_tuple=True)  # the tokens routed to expert e
            torch._check(rows.shape[0] <= x.shape[0])  # one row per token, whatever the picks: the static bound
            w = (weights * picked).sum(dim=-1)  # [N]: the weight of expert e for each token
            out.index_add_(0, rows, (expert(x[rows]) * w[rows, None]).to(out.dtype))
        return out

    def gathered(self, x, chosen, weights, stacked, dtype=None):
        """The experts' SwiGLU on each token's chosen experts only. Written as multiply
        and sum over the indexed matrices: Inductor fuses the indexing into the
        reduction, so each chosen matrix is read once and none is copied."""
        limit = self.experts[0].limit
        xe = x[:, None, None, :]  # [N, 1, 1, H]
        gate = (xe * stacked["stacked_w1"][chosen]).sum(-1).clamp(max=limit)  # [N, k, I]
        up = (xe * stacked["stacked_w3"][chosen]).sum(-1).clamp(min=-limit, max=limit)
        h = F.silu(gate) * up * weights[..., None]
        return (h[:, :, None, :] * stacked["stacked_w2"][chosen]).sum((1, 3)).to(dtype or x.dtype)


def hyper_weights(streams, fn, base, scale, iters: int, eps: float):
    """mHC: (post [N, hc], comb [N, hc, hc], collapsed input [N, D]) from the streams [N, hc, D]."""
    n, hc, _ = streams.shape
    mix = F.linear(unweighted_rms(streams.reshape(n, -1).float(), eps), fn.float())
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(n, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)  # Sinkhorn: doubly stochastic
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


class Block(nn.Module):
    """One decoder layer; the subclasses fix which caches its entries take."""

    def __init__(self, c: DeepseekV4Config, layer_type: str, mlp_type: str):
        super().__init__()
        self.layer_type = layer_type
        hc = c.hc_mult
        self.attn = Attention(c, layer_type)
        self.ffn = MoE(c, hashed=mlp_type == "hash_moe")
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty((2 + hc) * hc, hc * c.hidden_size, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros((2 + hc) * hc, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))
        self.iters, self.eps = c.hc_sinkhorn_iters, c.hc_eps

    def mix(self, site, streams, block):
        post, comb, collapsed = hyper_weights(streams, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"), getattr(self, f"hc_{site}_scale"), self.iters, self.eps)
        out = block(collapsed)
        dtype = streams.dtype
        return post.to(dtype)[..., None] * out[:, None, :] + comb.to(dtype).transpose(-1, -2) @ streams

    def example_inputs(self, method, rows, shapes):
        dtype = self.attn.wkv.weight.dtype
        hidden = self.attn.wkv.in_features
        hc = self.hc_attn_fn.shape[1] // hidden  # the streams
        index = torch.zeros(rows, dtype=torch.long)
        args = [torch.zeros(rows, hc, hidden, dtype=dtype), index, index.clone(), index.clone()]
        # Each [slots, positions or compressed entries, ...]: decode at a context bucket reads the first positions.
        return (*args, *(shapes.cache(kind, 1) for kind in cache_kinds(self.layer_type)))

    def step(self, x, ids, positions, slots, caches, one_sequence=False):
        # x: [N, hc, hidden]
        x = self.mix("attn", x, lambda h: self.attn(self.attn_norm(h), ids, positions, slots, caches, one_sequence))
        return self.mix("ffn", x, lambda h: self.ffn(self.ffn_norm(h), ids))


class SlidingBlock(Block):
    @entry(bucket="batch", caches=("kv",), pad={"slots": SCRATCH_SLOT})
    def decode(self, x, ids, positions, slots, kv):
        return self.step(x, ids, positions, slots, {"kv": kv})

    @entry(bucket="chunk", caches=("kv",), pad={"slots": SCRATCH_SLOT}, split=True)
    def prefill(self, x, ids, positions, slots, kv):
        return self.step(x, ids, positions, slots, {"kv": kv}, one_sequence=True)


class HCABlock(Block):
    @entry(bucket="batch", caches=("kv", "comp_kv", "comp_gate", "comp"), pad={"slots": SCRATCH_SLOT}, context="positions")
    def decode(self, x, ids, positions, slots, kv, comp_kv, comp_gate, comp):
        return self.step(x, ids, positions, slots, dict(kv=kv, comp_kv=comp_kv, comp_gate=comp_gate, comp=comp))

    @entry(bucket="chunk", caches=("kv", "comp_kv", "comp_gate", "comp"), pad={"slots": SCRATCH_SLOT}, split=True)
    def prefill(self, x, ids, positions, slots, kv, comp_kv, comp_gate, comp):
        return self.step(x, ids, positions, slots, dict(kv=kv, comp_kv=comp_kv, comp_gate=comp_gate, comp=comp), one_sequence=True)


class CSABlock(Block):
    CACHES = ("kv", "comp_kv", "comp_gate", "comp", "idx_kv", "idx_gate", "idx_comp")

    @entry(bucket="batch", caches=CACHES, pad={"slots": SCRATCH_SLOT}, context="positions")
    def decode(self, x, ids, positions, slots, kv, comp_kv, comp_gate, comp, idx_kv, idx_gate, idx_comp):
        caches = dict(kv=kv, comp_kv=comp_kv, comp_gate=comp_gate, comp=comp, idx_kv=idx_kv, idx_gate=idx_gate, idx_comp=idx_comp)
        return self.step(x, ids, positions, slots, caches)

    @entry(bucket="chunk", caches=CACHES, pad={"slots": SCRATCH_SLOT}, split=True)
    def prefill(self, x, ids, positions, slots, kv, comp_kv, comp_gate, comp, idx_kv, idx_gate, idx_comp):
        caches = dict(kv=kv, comp_kv=comp_kv, comp_gate=comp_gate, comp=comp, idx_kv=idx_kv, idx_gate=idx_gate, idx_comp=idx_comp)
        return self.step(x, ids, positions, slots, caches, one_sequence=True)


BLOCKS = {"sliding_attention": SlidingBlock, "heavily_compressed_attention": HCABlock, "compressed_sparse_attention": CSABlock}
CACHE_GROUP = {"heavily_compressed_attention": "hca", "compressed_sparse_attention": "csa"}


def cache_kinds(layer_type: str) -> list[str]:
    """The cache kinds (cache_specs' keys) a layer of this type takes, in its entries' order:
    every layer's own kv, then its group's compressor state and entries (and CSA's indexer's)."""
    group = CACHE_GROUP.get(layer_type)
    if group is None:
        return ["kv"]
    return ["kv", f"{group}_kv", f"{group}_gate", f"{group}_comp"] + (["idx_kv", "idx_gate", "idx_comp"] if group == "csa" else [])


class HyperHead(nn.Module):
    def __init__(self, c: DeepseekV4Config):
        super().__init__()
        self.hc_fn = nn.Parameter(torch.empty(c.hc_mult, c.hc_mult * c.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(c.hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.eps = c.hc_eps

    def forward(self, x):
        # x: [N, hc, hidden] -> [N, hidden]
        mixes = F.linear(unweighted_rms(x.flatten(1).float(), self.eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre[..., None] * x).sum(dim=1).to(x.dtype)


class V4Head(nn.Module):
    """Hyper head + final norm + LM head, compiled as one entry."""

    def __init__(self, c: DeepseekV4Config):
        super().__init__()
        self.hc_head = HyperHead(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=c.dtype)

    @entry(bucket="batch")
    def forward(self, x):
        # x: [B, hc, hidden] -> logits [B, vocab] float32
        return self.head(self.norm(self.hc_head(x))).float()

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, self.hc_head.hc_fn.shape[0], self.head.in_features, dtype=self.head.weight.dtype),)


class V4Model(nn.Module):
    def __init__(self, c: DeepseekV4Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=c.dtype)
        self.layers = nn.ModuleList(BLOCKS[t](c, t, m) for t, m in zip(c.layer_types, c.mlp_layer_types))


@register_architecture(model_types=("deepseek_v4",), architectures=("DeepseekV4ForCausalLM",))
class DeepseekV4ForCausalLM(CausalLM):
    config_class = DeepseekV4Config
    kv_cache_dtypes = ("auto", "fp8")

    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        self.config = config
        self.model = V4Model(config)
        self.final = V4Head(config)
        if config.tie_word_embeddings:
            self.final.head.weight = self.model.embed_tokens.weight
        # cache kind -> (group name, index of each layer within its group)
        self.groups = {}
        for i, t in enumerate(config.layer_types):
            group = CACHE_GROUP.get(t)
            if group:
                self.groups.setdefault(group, []).append(i)

    # -- checkpoint names: as transformers saves them, or DeepSeek's originals --
    _FINAL = {"final.hc_head.": "model.hc_head.", "final.norm.weight": "model.norm.weight", "final.head.weight": "head.weight"}

    _EXPERT = re.compile(r"(model\.layers\.\d+\.ffn\.experts\.)(\d+)(\..+)")

    @classmethod
    def expert_specs(cls, config, degree: int):
        spec = parallel.experts(config.n_routed_experts, degree)
        names = [f"experts.*.{w}.weight" for w in ("w1", "w2", "w3")] + [f"stacked_{w}" for w in ("w1", "w2", "w3")]
        return {f"model.layers.*.ffn.{name}": spec for name in names}

    def checkpoint_name(self, param: str) -> list[str]:
        expert = self._EXPERT.fullmatch(param)
        if expert and self.config.parallel.expert_parallel > 1:  # this rank's expert j is the checkpoint's rank*E/N + j
            j = int(expert.group(2)) + self.config.rank * self.config.n_routed_experts // self.config.parallel.expert_parallel
            param = f"{expert.group(1)}{j}{expert.group(3)}"
        for ours, theirs in self._FINAL.items():
            if param.startswith(ours):
                name = theirs + param[len(ours) :]
                original = name.removeprefix("model.").replace("hc_head.hc_", "hc_head_")
                return [name, original]
        if param == "model.embed_tokens.weight":
            return [param, "embed.weight"]
        return [param, param.removeprefix("model.")]

    def tied_parameters(self):
        return {"final.head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    def init_buffers(self) -> None:
        for layer in self.model.layers:
            for kind in ("main", "compress"):
                setattr(layer.attn, f"{kind}_inv_freq", rope_inv_freq(self.config, kind)[0])
            layer.ffn.init_map()

    def check_values(self, describe) -> None:
        """A hash-routing table names experts that exist: the graphs index the stacked
        experts with it, and an index past them reads other memory or fails in a kernel."""
        n = self.config.n_routed_experts
        for i, layer in enumerate(self.model.layers):
            gate = layer.ffn.gate
            if not gate.hashed:
                continue
            bad = ((gate.tid2eid < 0) | (gate.tid2eid >= n)).nonzero()
            if len(bad):
                token, slot = bad[0].tolist()
                raise WeightsError(
                    f"{describe(f'model.layers.{i}.ffn.gate.tid2eid')} sends token {token} to expert {gate.tid2eid[token, slot].item()} "
                    f"(slot {slot}); expected expert indices 0..{n - 1}, as config.json's n_routed_experts is {n}. "
                    "The checkpoint does not belong to this config.json"
                )

    def round_max_seq(self, n: int) -> int:
        step = math.lcm(self.config.compress_rate_csa, self.config.compress_rate_hca)
        return -(-n // step) * step

    # -- caches ---------------------------------------------------------------------
    def cache_specs(self, slots, max_seq):
        c = self.config
        self._check_max_seq(max_seq)
        rows = cache_rows(c)
        specs = {"kv": row_spec(rows["kv"], (c.num_hidden_layers, slots, max_seq), c.head_dim, c.dtype)}
        if "hca" in self.groups:
            n = len(self.groups["hca"])
            specs["hca_kv"] = specs["hca_gate"] = ((n, slots, max_seq, c.head_dim), c.dtype)
            specs["hca_comp"] = row_spec(rows["comp"], (n, slots, max_seq // c.compress_rate_hca), c.head_dim, c.dtype)
        if "csa" in self.groups:
            n, e = len(self.groups["csa"]), max_seq // c.compress_rate_csa
            specs["csa_kv"] = specs["csa_gate"] = ((n, slots, max_seq, 2 * c.head_dim), c.dtype)
            specs["csa_comp"] = row_spec(rows["comp"], (n, slots, e), c.head_dim, c.dtype)
            specs["idx_kv"] = specs["idx_gate"] = ((n, slots, max_seq, 2 * c.index_head_dim), c.dtype)
            specs["idx_comp"] = row_spec(rows["idx_comp"], (n, slots, e), c.index_head_dim, c.dtype)
        return specs

    def cache_rows(self):
        rows = cache_rows(self.config)
        if rows["kv"] is None:
            return {}
        kinds = {"kv": "kv"} | ({"hca_comp": "comp"} if "hca" in self.groups else {})
        kinds |= {"csa_comp": "comp", "idx_comp": "idx_comp"} if "csa" in self.groups else {}
        return {kind: rows[r] for kind, r in kinds.items()}

    def _check_max_seq(self, max_seq):
        c = self.config
        for name, rate in (("csa", c.compress_rate_csa), ("hca", c.compress_rate_hca)):
            if name in self.groups and max_seq % rate:
                raise ConfigError(f"max_seq {max_seq} must be a multiple of the {name.upper()} compress rate {rate} (layer_types/compress_rates)")

    def layer_caches(self, i: int, caches: dict) -> list[torch.Tensor]:
        t = self.config.layer_types[i]
        group = CACHE_GROUP.get(t)
        at = self.groups[group].index(i) if group else None  # the layer's index in its group's caches
        return [layer_views(caches[kind])[i if kind == "kv" else at] for kind in cache_kinds(t)]

    # -- generation ---------------------------------------------------------------
    @torch.no_grad()  # caches are written in place, and their per-layer views kept (kvcache.layer_views)
    def run_layers(self, method, ids, positions, slots, caches):
        x = self.model.embed_tokens(ids)[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.model.layers):
            x = getattr(layer, method)(x, ids, positions, slots, *self.layer_caches(i, caches))
        return x

    @torch.no_grad()
    def prefill(self, ids, slot, caches, start=0, rows=None):
        """rows: run the chunk as that many rows, the ones past ids padding rows that write
        the scratch slot (ranks in lockstep run calls of equal rows; runtime.engine); with
        no ids at all, only padding, and no logits (None)."""
        n = ids.shape[0]
        positions = torch.arange(start, start + n, device=ids.device)
        slots = torch.full((n,), slot, dtype=torch.long, device=ids.device)
        if rows is not None and rows > n:
            pad = torch.zeros(rows - n, dtype=torch.long, device=ids.device)
            ids, positions, slots = torch.cat([ids, pad]), torch.cat([positions, pad]), torch.cat([slots, pad + SCRATCH_SLOT])
        x = self.run_layers("prefill", ids, positions, slots, caches)
        return self.final(x[n - 1 : n])[0] if n else None

    @torch.no_grad()
    def decode(self, ids, positions, caches):
        x = self.run_layers("decode", ids, positions, self.batch_slots(ids.shape[0], ids.device), caches)
        return self.final(x)

    @torch.no_grad()
    def prompt_logits(self, ids, max_seq=None):
        n = ids.shape[0]
        rate = max(self.config.compress_rate_csa, self.config.compress_rate_hca)
        caches = self.allocate_caches(1, max_seq or -(-n // rate) * rate)
        x = self.run_layers("prefill", ids, torch.arange(n, device=ids.device), torch.zeros(n, dtype=torch.long, device=ids.device), caches)
        return self.final(x)

    # -- aotc init tiny -------------------------------------------------------------
    @classmethod
    def tiny_config(cls, *, layers, vocab_size, variant):
        if layers < 3:
            raise ConfigError(f"--layers {layers}: a tiny DeepSeek V4 has every layer type, so at least 3 layers")
        kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
        return {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": vocab_size,
            "hidden_size": 128,
            "moe_intermediate_size": 64,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "q_lora_rank": 64,
            "partial_rotary_factor": 0.25,
            "num_experts_per_tok": 2,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "scoring_func": "sqrtsoftplus",
            "routed_scaling_factor": 1.5,
            "max_position_embeddings": 2048,
            "layer_types": [kinds[i % 3] for i in range(layers)],
            "mlp_layer_types": ["hash_moe"] * min(layers, 2) + ["moe"] * (layers - 2),
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.25},
            },
            "hc_mult": 2,
            "hc_sinkhorn_iters": 6,
            "hc_eps": 1e-6,
            "swiglu_limit": 10.0,
            "sliding_window": 32,
            "o_groups": 2,
            "o_lora_rank": 32,
            "index_n_heads": 8,
            "index_head_dim": 32,
            "index_topk": 4,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }

    def init_random(self, generator, *, head_std=None):
        c = self.config
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                p.data = 1 + 0.1 * torch.randn(p.shape, generator=generator)
            elif leaf in ("ape", "attn_sink", "bias") or name.endswith(("_base", "hc_base")):
                p.data = 0.5 * torch.randn(p.shape, generator=generator)
            elif name.endswith(("_scale", "hc_scale")):
                p.data = 1 + 0.1 * torch.randn(p.shape, generator=generator)
            elif name == "final.head.weight":
                p.data = (head_std or 4 / math.sqrt(c.hidden_size)) * torch.randn(p.shape, generator=generator)
            else:
                p.data = torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1])
            p.data = p.data.to(p.dtype if p.dtype == torch.float32 else c.dtype)
        for layer in self.model.layers:
            gate = layer.ffn.gate
            if gate.hashed:
                gate.tid2eid = torch.stack([torch.randperm(c.n_routed_experts, generator=generator)[: c.num_experts_per_tok] for _ in range(c.vocab_size)])
        self.init_buffers()
