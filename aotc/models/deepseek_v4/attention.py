"""DeepSeek V4's attention: RMSNorm and rotary helpers, the grouped output projection, the compressor and indexer of its compressed caches, and the attention module with its cache layouts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kvcache import Fp8Rows, load, store
from .config import DeepseekV4Config, rope_inv_freq

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
