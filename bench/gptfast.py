"""The strongest PyTorch-native baseline: an idiomatic static-cache Llama
(gpt-fast style) for `torch.compile(fullgraph=True, dynamic=False)`.

Written the way gpt-fast writes it: fused wqkv, caches as module buffers
updated with `index_copy_`, RoPE tables as buffers, one causal mask buffer,
`scaled_dot_product_attention` (with enable_gqa rather than repeating the kv
heads). It loads the same Hugging Face weights as aotc's model, and the
benchmark checks that both give the same logits before timing anything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aotc.models.llama import LlamaConfig, rope_inv_freq


class KVCache(nn.Module):
    def __init__(self, batch, kv_heads, max_seq, head_dim, dtype):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, kv_heads, max_seq, head_dim, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(batch, kv_heads, max_seq, head_dim, dtype=dtype))

    def update(self, input_pos, k, v):
        # input_pos: [T]; k, v: [B, kv, T, hd]
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


def apply_rope(x, cos, sin):
    # x: [B, T, heads, hd]; cos, sin: [T, hd]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[None, :, None] + rotated * sin[None, :, None]


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.wqkv = nn.Linear(c.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=c.qkv_bias)
        self.wo = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.o_bias)
        self.kv_cache: KVCache | None = None

    def forward(self, x, cos, sin, mask, input_pos):
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).split([self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = apply_rope(q.view(b, t, self.heads, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(b, t, self.kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.w3 = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.w2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attention = Attention(c)
        self.feed_forward = FeedForward(c)
        self.attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, mask, input_pos):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.output = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def setup_caches(self, batch: int, max_seq: int):
        c = self.config
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(batch, c.num_key_value_heads, max_seq, c.head_dim, c.dtype)
        freqs = torch.arange(max_seq).float()[:, None] * rope_inv_freq(c)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(c.dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(c.dtype), persistent=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool)), persistent=False)

    def forward(self, idx, input_pos):
        # idx: [B, T]; input_pos: [T] -> logits [B, T, vocab]
        mask = self.causal_mask[None, None, input_pos]
        cos, sin = self.cos[input_pos], self.sin[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x)).float()


def from_aotc(model) -> Transformer:
    """A Transformer with the weights of an aotc LlamaForCausalLM (shared, not copied where possible)."""
    c = model.config
    t = Transformer(c).to(c.dtype).eval()
    t.tok_embeddings.weight = model.model.embed_tokens.weight
    t.norm.weight = model.head.norm.weight
    t.output.weight = model.head.lm_head.weight
    for ours, theirs in zip(model.model.layers, t.layers):
        a = ours.self_attn
        theirs.attention.wqkv.weight = nn.Parameter(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach())
        if c.qkv_bias:
            theirs.attention.wqkv.bias = nn.Parameter(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach())
        theirs.attention.wo.weight = a.o_proj.weight
        if c.o_bias:
            theirs.attention.wo.bias = a.o_proj.bias
        theirs.feed_forward.w1.weight = ours.mlp.gate_proj.weight
        theirs.feed_forward.w3.weight = ours.mlp.up_proj.weight
        theirs.feed_forward.w2.weight = ours.mlp.down_proj.weight
        theirs.attention_norm.weight = ours.input_layernorm.weight
        theirs.ffn_norm.weight = ours.post_attention_layernorm.weight
    return t
