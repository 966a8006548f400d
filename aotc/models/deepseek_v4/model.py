"""DeepSeek V4's blocks (sliding, HCA, CSA), heads and the causal LM that runs them."""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from ... import parallel
from ...entry import entry
from ...errors import ConfigError, WeightsError
from ...kvcache import layer_views, row_spec
from ..base import SCRATCH_SLOT, CausalLM
from ..registry import register_architecture
from .attention import Attention, RMSNorm, cache_rows, unweighted_rms
from .config import DeepseekV4Config, rope_inv_freq
from .moe import MoE


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

    def cache_positions(self):
        # Every kind is indexed by position: the sliding window's keys by absolute position
        # (the window is a mask, not a ring), the compressors' per-position projections, and
        # their entries by window. A window's entry is written by the row that closes it,
        # from the projections of the window's positions read back from the cache, so a
        # prefix of any length n carries the entries of the windows it closes (n // rate)
        # and the projections of an open window's first positions; the open window's entry
        # is written when the new sequence closes it, as after any prefill chunk.
        c = self.config
        out = {"kv": (2, 1)}
        if "hca" in self.groups:
            out |= {"hca_kv": (2, 1), "hca_gate": (2, 1), "hca_comp": (2, c.compress_rate_hca)}
        if "csa" in self.groups:
            out |= {"csa_kv": (2, 1), "csa_gate": (2, 1), "csa_comp": (2, c.compress_rate_csa)}
            out |= {"idx_kv": (2, 1), "idx_gate": (2, 1), "idx_comp": (2, c.compress_rate_csa)}
        return out

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
