"""TinyGPT: pre-LayerNorm GPT blocks (learned positions, GELU MLP), written for aotc.

Everything aotc needs from a model is here, through aotc's public API:
  * `@aotc.register_architecture` maps config.json's model_type to the class;
  * `@aotc.entry` marks what is compiled: `Block.decode`, `Block.prefill`, `Head.forward`;
  * `example_inputs` gives the tracer the arguments of an entry at a bucket;
  * the `aotc.CausalLM` methods (`cache_specs`, `prefill`, `decode`, ...) are
    the eager orchestration that runs around the entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import aotc


@dataclass
class TinyGPTConfig(aotc.ModelConfig):
    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_positions: int
    layer_norm_epsilon: float
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple = ()

    @classmethod
    def from_hf(cls, cfg) -> "TinyGPTConfig":
        # cfg.get / cfg.positive raise errors that name config.json and the field.
        config = cls(
            vocab_size=cfg.positive("vocab_size"),
            n_embd=cfg.positive("n_embd"),
            n_layer=cfg.positive("n_layer"),
            n_head=cfg.positive("n_head"),
            n_positions=cfg.positive("n_positions"),
            layer_norm_epsilon=cfg.get("layer_norm_epsilon", float, 1e-5),
        )
        if config.n_embd % config.n_head:
            raise aotc.AotcError(f"{cfg.source}: n_embd ({config.n_embd}) must be a multiple of n_head ({config.n_head})")
        return config

    @property
    def max_position_embeddings(self) -> int:
        return self.n_positions


class Block(nn.Module):
    def __init__(self, c: TinyGPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.ln_2 = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.c_mlp_proj = nn.Linear(4 * c.n_embd, c.n_embd)
        self.heads, self.head_dim = c.n_head, c.n_embd // c.n_head

    def attend(self, x, positions, slots, k_cache, v_cache, one_sequence: bool):
        # x: [N, E]; caches: [slots, heads, max_seq, head_dim]
        n = x.shape[0]
        q, k, v = self.c_attn(self.ln_1(x)).view(n, 3, self.heads, self.head_dim).unbind(1)
        k_cache[slots, :, positions] = k  # one indexed write per cache, in place
        v_cache[slots, :, positions] = v
        rows = slots[:1] if one_sequence else torch.arange(n)
        keys, values = k_cache[rows], v_cache[rows]  # [1 or N, heads, S, hd]
        visible = torch.arange(k_cache.shape[2])[None, :] <= positions[:, None]  # [N, S]
        if one_sequence:  # prefill: all rows are one sequence
            scores = torch.einsum("nhd,hsd->nhs", q, keys[0])
            out_values = values[0]
            out = torch.einsum("nhs,hsd->nhd", self._softmax(scores, visible), out_values)
        else:  # decode: row i is the sequence in slot i
            scores = torch.einsum("nhd,nhsd->nhs", q, keys)
            out = torch.einsum("nhs,nhsd->nhd", self._softmax(scores, visible), values)
        x = x + self.c_proj(out.reshape(n, -1))
        return x + self.c_mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    def _softmax(self, scores, visible):
        scores = scores / math.sqrt(self.head_dim)
        return scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1)

    @aotc.entry(bucket="batch", caches=("k_cache", "v_cache"), pad={"slots": aotc.SCRATCH_SLOT})
    def decode(self, x, positions, slots, k_cache, v_cache):
        return self.attend(x, positions, slots, k_cache, v_cache, one_sequence=False)

    @aotc.entry(bucket="chunk", caches=("k_cache", "v_cache"), pad={"slots": aotc.SCRATCH_SLOT}, split=True)
    def prefill(self, x, positions, slots, k_cache, v_cache):
        return self.attend(x, positions, slots, k_cache, v_cache, one_sequence=True)

    def example_inputs(self, method, rows, shapes):
        index = torch.zeros(rows, dtype=torch.long)
        # One layer's k and v caches, as cache_specs states them: [slots, heads, positions, head_dim].
        return torch.zeros(rows, self.heads * self.head_dim), index, index.clone(), shapes.cache("k", 2), shapes.cache("v", 2)


class Head(nn.Module):
    def __init__(self, c: TinyGPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)

    @aotc.entry(bucket="batch")
    def forward(self, x):
        return self.lm_head(self.ln_f(x)).float()

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, self.lm_head.in_features),)


class Transformer(nn.Module):
    def __init__(self, c: TinyGPTConfig):
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.n_positions, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))


@aotc.register_architecture(model_types=("tinygpt",), architectures=("TinyGPTForCausalLM",))
class TinyGPTForCausalLM(aotc.CausalLM):
    config_class = TinyGPTConfig

    def __init__(self, config: TinyGPTConfig):
        super().__init__()
        self.config = config
        self.transformer = Transformer(config)
        self.head = Head(config)

    def cache_specs(self, slots, max_seq):
        c = self.config
        shape = (c.n_layer, slots, c.n_head, max_seq, c.n_embd // c.n_head)
        return {"k": (shape, c.dtype), "v": (shape, c.dtype)}

    def run(self, method, ids, positions, slots, caches):
        x = self.transformer.wte(ids) + self.transformer.wpe(positions)
        for i, block in enumerate(self.transformer.h):
            x = getattr(block, method)(x, positions, slots, caches["k"][i], caches["v"][i])
        return x

    @torch.no_grad()
    def prefill(self, ids, slot, caches, start=0):
        positions = torch.arange(start, start + ids.shape[0])
        x = self.run("prefill", ids, positions, torch.full_like(positions, slot), caches)
        return self.head(x[-1:])[0]

    @torch.no_grad()
    def decode(self, ids, positions, caches):
        return self.head(self.run("decode", ids, positions, torch.arange(ids.shape[0]), caches))

    @torch.no_grad()
    def prompt_logits(self, ids, max_seq=None):
        caches = self.allocate_caches(1, max_seq or ids.shape[0])
        positions = torch.arange(ids.shape[0])
        return self.head(self.run("prefill", ids, positions, torch.zeros_like(positions), caches))

    @classmethod
    def tiny_config(cls, *, layers, vocab_size, variant):
        return {"architectures": ["TinyGPTForCausalLM"], "model_type": "tinygpt", "vocab_size": vocab_size,
                "n_embd": 128, "n_layer": layers, "n_head": 4, "n_positions": 1024, "layer_norm_epsilon": 1e-5}  # fmt: skip

    def init_random(self, generator, *, head_std=None):
        for name, p in self.named_parameters():
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.data = torch.ones_like(p)
            elif name.endswith("bias"):
                p.data = 0.02 * torch.randn(p.shape, generator=generator)
            else:
                std = 1 / math.sqrt(p.shape[-1])
                if name == "head.lm_head.weight":
                    std = head_std or 3 * std  # wide enough that the top logits are far apart
                p.data = std * torch.randn(p.shape, generator=generator)
