"""The Llama family: llama, qwen2 (qkv bias) and mistral (sliding window).

GQA/MQA attention with RoPE (default, linear and llama3 scaling), RMSNorm,
SwiGLU MLP, tied or untied embeddings. Parameter paths equal the Hugging Face
tensor names, except the final norm and LM head, which live in `LMHead` so
that they compile as one entry.

Caches are two root allocations (k and v), each [layers, slots, kv_heads,
max_seq, head_dim]: a layer's slice is contiguous and is the graph input.

Tensor parallel (aotc.parallel; `shard_specs`), as gpt-fast's tp.py and
transformers' tensor-parallel plans split it: q, k, v, gate and up by their
outputs (a rank's heads and MLP rows), o and down by their inputs, then summed
across ranks; KV heads split, or each on several ranks where the ranks outnumber
them; the LM head by vocabulary, its logits gathered. The embedding and the
norms are whole on every rank.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..entry import entry
from ..format import ShardSpec
from ..kvcache import Fp8Rows, layer_views, load, row_spec, store
from ..layout import Derived
from ..parallel import FIRST, all_gather, all_reduce, group_name, split
from .base import SCRATCH_SLOT, CausalLM
from .llama_config import LlamaConfig, local_kv_heads, rope_inv_freq
from .packing import attend_in_tiles, pack, packed_bias, packed_rows
from .registry import register_architecture


def fp8_rows(config: LlamaConfig) -> dict[str, Fp8Rows | None]:
    """The packed rows of the fp8 caches, by kind: a head's values with one scale (None:
    not fp8). fp8-values keeps the keys in bf16: their errors move every attention
    score, and fp8 keys lose answers that fp8 values keep (docs/low-precision.md, "fp8 KV caches")."""
    dtype = config.kv_cache.dtype
    rows = Fp8Rows(config.head_dim, config.head_dim, 0, config.kv_cache.fp8_max)
    return {"k": rows if dtype == "fp8" else None, "v": rows if dtype in ("fp8", "fp8-values") else None}


def key_dtype(config: LlamaConfig) -> torch.dtype:
    """What a plain key cache holds: the model's dtype, or bf16 beside fp8 values."""
    return torch.bfloat16 if config.kv_cache.dtype == "fp8-values" else config.dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inline, not rms_norm(): a compiler failure's source line (aotc bisect) is this one.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward with its weight as a tensor (a whole step's loop body)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, heads, hd]; cos, sin: [N, hd]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def visible(q_pos: torch.Tensor, max_seq: int, window: int | None) -> torch.Tensor:
    """[N, max_seq] bool: which cache positions each query position attends to."""
    k_pos = torch.arange(max_seq, device=q_pos.device)[None, :]
    q_pos = q_pos[:, None]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return mask


def softmax_attend(q, keys, values, mask, scale):
    # q: [..., Q, hd]; keys, values: [..., S, hd]; mask broadcasts to [..., Q, S]: bool
    # (True: attend), or an additive float32 bias of 0 and -inf (packing.packed_bias)
    scores = (q @ keys.transpose(-1, -2)).float() * scale
    scores = scores + mask if mask.is_floating_point() else scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(values.dtype) @ values


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, window: int | None):
        super().__init__()
        n, dt = config.parallel.tensor_parallel, config.dtype
        hd, heads, kv = config.head_dim, config.num_attention_heads // n, local_kv_heads(config)
        self.q_proj = nn.Linear(config.hidden_size, heads * hd, bias=config.qkv_bias, dtype=dt)
        self.k_proj = nn.Linear(config.hidden_size, kv * hd, bias=config.qkv_bias, dtype=dt)
        self.v_proj = nn.Linear(config.hidden_size, kv * hd, bias=config.qkv_bias, dtype=dt)
        self.o_proj = nn.Linear(heads * hd, config.hidden_size, bias=config.o_bias, dtype=dt)
        self.heads, self.kv_heads, self.head_dim = heads, kv, hd
        self.window = window  # a Python int: layers that differ compile as separate variants
        self.group = group_name(config.parallel)  # o_proj's partial sums are summed across these ranks
        self.scale = hd**-0.5
        # fp8 caches: a row per (token, head) packs the fp8 values and their one fp32 scale.
        self.k_rows, self.v_rows = fp8_rows(config).values()

    def project(self, x, cos, sin, positions, slots, k_cache, v_cache):
        # x: [N, H] -> q: [N, heads, hd]; k, v written to cache rows (slots, positions)
        n = x.shape[0]
        q = rotate(self.q_proj(x).view(n, self.heads, self.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(n, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        # One direct indexed write per cache (per region of a packed one):
        # k_cache[slots[i], :, positions[i]] = k[i]
        store(self.k_rows, k_cache, (slots, slice(None), positions), k)
        store(self.v_rows, v_cache, (slots, slice(None), positions), v)
        return q

    def decode(self, x, cos, sin, positions, slots, k_cache, v_cache):
        # x: [B, H]; row i is the sequence in cache slot i (padding rows write to the scratch slot)
        b, rep = x.shape[0], self.heads // self.kv_heads
        q = self.project(x, cos, sin, positions, slots, k_cache, v_cache)
        q = q.view(b, self.kv_heads, rep, self.head_dim)  # [B, kv, rep, hd]
        mask = visible(positions, k_cache.shape[2], self.window)[:, None, None, :]  # [B, 1, 1, S]
        rows = (slice(None, b),)
        out = softmax_attend(q, load(self.k_rows, k_cache, rows, x.dtype), load(self.v_rows, v_cache, rows, x.dtype), mask, self.scale)  # [B, kv, rep, hd]
        return all_reduce(self.o_proj(out.reshape(b, self.heads * self.head_dim)), self.group)

    def prefill(self, x, cos, sin, positions, slots, k_cache, v_cache, fresh: bool = False):
        # x: [C, H], a chunk of one or more sequences' tokens (models.packing): the first
        # may continue a sequence the cache holds, the others start here (all of them, fresh)
        c, rep, dtype = x.shape[0], self.heads // self.kv_heads, x.dtype
        q = self.project(x, cos, sin, positions, slots, k_cache, v_cache)
        q = q.view(c, self.kv_heads, rep, self.head_dim).permute(1, 2, 0, 3)  # [kv, rep, C, hd]
        cached = 0 if fresh else k_cache.shape[2]
        keys = packed_rows(self.k_rows, k_cache, slots, positions, dtype, fresh)  # [kv, cached + C, hd]
        values = packed_rows(self.v_rows, v_cache, slots, positions, dtype, fresh)
        bias = packed_bias(positions, slots, cached, self.window)  # [C, cached + C]
        attend = functools.partial(softmax_attend, scale=self.scale)
        out = attend_in_tiles(attend, q, keys, values, bias, cached)  # [kv, rep, C, hd]
        out = out.permute(2, 0, 1, 3).reshape(c, self.heads * self.head_dim)
        return all_reduce(self.o_proj(out), self.group)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, bias, dt = config.hidden_size, config.mlp_bias, config.dtype
        i = config.intermediate_size // config.parallel.tensor_parallel
        self.gate_proj = nn.Linear(h, i, bias=bias, dtype=dt)
        self.up_proj = nn.Linear(h, i, bias=bias, dtype=dt)
        self.down_proj = nn.Linear(i, h, bias=bias, dtype=dt)
        self.group = group_name(config.parallel)

    def forward(self, x):
        return all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), self.group)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, window: int | None):
        super().__init__()
        self.self_attn = LlamaAttention(config, window)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    @entry(bucket="batch", caches=("k_cache", "v_cache"), pad={"slots": SCRATCH_SLOT}, context="positions")
    def decode(self, x, cos, sin, positions, slots, k_cache, v_cache):
        h = x + self.self_attn.decode(self.input_layernorm(x), cos, sin, positions, slots, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    @entry(bucket="chunk", caches=("k_cache", "v_cache"), pad={"slots": SCRATCH_SLOT}, split=True, context="positions", fresh="prefill_fresh")
    def prefill(self, x, cos, sin, positions, slots, k_cache, v_cache):
        return self._prefill(x, cos, sin, positions, slots, k_cache, v_cache, fresh=False)

    @entry(bucket="first", caches=("k_cache", "v_cache"), pad={"slots": SCRATCH_SLOT})
    def prefill_fresh(self, x, cos, sin, positions, slots, k_cache, v_cache):
        """prefill, for a chunk whose first row is at position 0 (so every sequence starts in
        it): its rows attend to the chunk's own rows only, none of the cache's earlier
        positions (models.packing). The runtime runs it in prefill's place."""
        return self._prefill(x, cos, sin, positions, slots, k_cache, v_cache, fresh=True)

    def _prefill(self, x, cos, sin, positions, slots, k_cache, v_cache, fresh: bool):
        h = x + self.self_attn.prefill(self.input_layernorm(x), cos, sin, positions, slots, k_cache, v_cache, fresh)
        return h + self.mlp(self.post_attention_layernorm(h))

    def example_inputs(self, method: str, rows: int, shapes) -> tuple[torch.Tensor, ...]:
        a = self.self_attn
        dtype = self.input_layernorm.weight.dtype
        h = a.q_proj.in_features
        positions = torch.zeros(rows, dtype=torch.long)
        return (
            torch.zeros(rows, h, dtype=dtype),
            torch.zeros(rows, a.head_dim, dtype=dtype),
            torch.zeros(rows, a.head_dim, dtype=dtype),
            positions,
            positions.clone(),
            # [slots, kv_heads, positions, head_dim or packed bytes]: decode at a context bucket reads the first positions
            shapes.cache("k", 2),
            shapes.cache("v", 2),
        )


class LMHead(nn.Module):
    """Final norm + LM head, compiled as one entry."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        vocab = config.vocab_size // config.parallel.tensor_parallel  # a rank's part of the vocabulary
        self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False, dtype=config.dtype)
        self.group = group_name(config.parallel)

    @entry(bucket="batch")
    def forward(self, x):
        # x: [B, H] -> logits [B, vocab] float32 (each rank's [B, vocab / N], gathered)
        return all_gather(self.lm_head(self.norm(x)).float(), 1, self.group)

    def example_inputs(self, method: str, rows: int, shapes) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(rows, self.lm_head.in_features, dtype=self.norm.weight.dtype),)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, w) for w in config.layer_windows)

    def derived_weights(self) -> dict[str, Derived]:
        """Each decoder-layer weight, stacked over the layers [layers, ...]: the whole decode
        step's loop (compiled_forward) reads layer i's at index i."""
        names = [n for n, _ in self.layers[0].named_parameters()]
        return {f"layers.*.{n}": Derived("stack", tuple(f"layers.{i}.{n}" for i in range(len(self.layers)))) for n in names}

    def forward(self, x, cos, sin, positions, slots, k_cache, v_cache):
        """Each decoder layer's decode in turn, on its layer of the caches [layers, ...]."""
        for layer, k, v in zip(self.layers, layer_views(k_cache), layer_views(v_cache)):
            x = layer.decode(x, cos, sin, positions, slots, k, v)
        return x

    def compiled_forward(self, x, cos, sin, positions, slots, k_cache, v_cache, derived):
        """A torch.while_loop over the layers' stacked weights, an iteration a layer.

        Iteration i writes its keys and values into the whole caches at index i (writes
        through a layer's view of them would copy it each iteration: bench/stacked_layers.py):
        a graph whose size and build time do not grow with the layers."""
        # Plain values only in the loop's body: torch compiles it alone, as a function of its locals.
        first, n, b = self.layers[0], len(self.layers), x.shape[0]
        a, eps = first.self_attn, first.input_layernorm.eps
        heads, kv_heads, hd, scale = a.heads, a.kv_heads, a.head_dim, a.scale
        mask = visible(positions, k_cache.shape[3], a.window)[:, None, None, :]  # [B, 1, 1, S]
        stacked = {name.removeprefix("layers.*."): t for name, t in derived.items()}

        def more(i, x):
            return i < n

        def body(i, x):
            j = i.item()  # a view's offset: the layer's weights and caches are not copied
            # The bounds let Inductor index the stacks at j * stride inside one kernel for the
            # whole body; an index of unknown sign ended a kernel at each weight.
            torch._check(j >= 0)
            torch._check(j < n)
            w = {name: t.select(0, j) for name, t in stacked.items()}

            def linear(name, x):
                return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))

            h = rms_norm(x, w["input_layernorm.weight"], eps)
            q = rotate(linear("self_attn.q_proj", h).view(b, heads, hd), cos, sin)
            k = rotate(linear("self_attn.k_proj", h).view(b, kv_heads, hd), cos, sin)
            at = (i.expand(b), slots, slice(None), positions)  # k_cache[i, slots[r], :, positions[r]] = k[r]
            store(None, k_cache, at, k)
            store(None, v_cache, at, linear("self_attn.v_proj", h).view(b, kv_heads, hd))
            keys, values = k_cache.select(0, j)[:b], v_cache.select(0, j)[:b]
            out = softmax_attend(q.view(b, kv_heads, heads // kv_heads, hd), keys, values, mask, scale)
            h = x + linear("self_attn.o_proj", out.reshape(b, heads * hd))
            m = rms_norm(h, w["post_attention_layernorm.weight"], eps)
            return i + 1, h + linear("mlp.down_proj", F.silu(linear("mlp.gate_proj", m)) * linear("mlp.up_proj", m))

        with torch.no_grad():  # torch 2.13 refuses a loop that writes its inputs with grad enabled
            return torch.while_loop(more, body, (torch.zeros((), dtype=torch.long, device=x.device), x))[1]


@register_architecture(model_types=("llama",), architectures=("LlamaForCausalLM",))
class LlamaForCausalLM(CausalLM):
    config_class = LlamaConfig
    kv_cache_dtypes = ("auto", "fp8", "fp8-values")

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.head = LMHead(config)
        # A rank's head is its part of the vocabulary, the embedding whole: tied, they differ.
        self.tied = config.tie_word_embeddings and config.parallel.world_size == 1
        if self.tied:
            self.head.lm_head.weight = self.model.embed_tokens.weight
        # Host-side RoPE: cos and sin tables by position, shared by every layer and
        # step, made on first use (outside any meta or fake tensor context the model
        # was built in) and grown when a position passes their end.
        self.rope_tables = None
        # What a whole step computes its RoPE rows from, in its graph (decode_step). Built on
        # the meta device, it is made by init_buffers once the loader makes it real (meta
        # arithmetic would import torch's compiler, which a deployed bundle never needs).
        inv_freq = torch.empty(config.head_dim // 2, dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq if inv_freq.is_meta else rope_inv_freq(config), persistent=False)

    def init_buffers(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(rope_inv_freq(self.config))

    _NAMES = {"head.norm.weight": "model.norm.weight", "head.lm_head.weight": "lm_head.weight"}

    def checkpoint_name(self, param: str) -> str:
        if param == "head.lm_head.weight" and self.config.tie_word_embeddings and not self.tied:
            return "model.embed_tokens.weight"  # a rank's part of the tied embedding
        return self._NAMES.get(param, param)

    def tied_parameters(self) -> dict[str, str]:
        return {"head.lm_head.weight": "model.embed_tokens.weight"} if self.tied else {}

    @classmethod
    def shard_specs(cls, config: LlamaConfig, degree: int) -> dict[str, ShardSpec]:
        c, n, hd = config, degree, config.head_dim
        kv = c.num_key_value_heads
        kv_ways = kv if n > kv and n % kv == 0 else n  # more ranks than KV heads: each on n / kv ranks
        layer = "model.layers.*."
        q, k = split(0, c.num_attention_heads * hd, n, hd), split(0, kv * hd, kv_ways, hd)
        gate = split(0, c.intermediate_size, n)
        specs = {
            f"{layer}self_attn.q_proj.weight": q, f"{layer}self_attn.k_proj.weight": k, f"{layer}self_attn.v_proj.weight": k,
            f"{layer}self_attn.o_proj.weight": split(1, c.num_attention_heads * hd, n, hd),
            f"{layer}mlp.gate_proj.weight": gate, f"{layer}mlp.up_proj.weight": gate,
            f"{layer}mlp.down_proj.weight": split(1, c.intermediate_size, n),
            "head.lm_head.weight": split(0, c.vocab_size, n),
        }  # fmt: skip
        if c.qkv_bias:
            specs |= {f"{layer}self_attn.q_proj.bias": q, f"{layer}self_attn.k_proj.bias": k, f"{layer}self_attn.v_proj.bias": k}
        if c.o_bias:  # added once: by rank 0, before the sum
            specs[f"{layer}self_attn.o_proj.bias"] = FIRST
        if c.mlp_bias:
            specs |= {f"{layer}mlp.gate_proj.bias": gate, f"{layer}mlp.up_proj.bias": gate, f"{layer}mlp.down_proj.bias": FIRST}
        return specs

    def cache_specs(self, slots, max_seq):
        c = self.config
        rows, lead = fp8_rows(c), (c.num_hidden_layers, slots, local_kv_heads(c), max_seq)
        return {"k": row_spec(rows["k"], lead, c.head_dim, key_dtype(c)), "v": row_spec(rows["v"], lead, c.head_dim, c.dtype)}

    def cache_rows(self):
        return {kind: rows for kind, rows in fp8_rows(self.config).items() if rows is not None}

    def cache_positions(self):
        return {"k": (3, 1), "v": (3, 1)}  # [layers, slots, kv_heads, positions, row]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [N] -> cos, sin: [N, hd], rows of tables computed as transformers
        # computes them per position (float32, then cast)
        tables = self.rope_tables
        if tables is not None and tables[0].device == positions.device:
            try:
                return tables[0][positions], tables[1][positions]
            except IndexError:  # a position past the tables' end: grow them
                pass
        length = max(1024, 1 << int(positions.max()).bit_length())
        freqs = torch.arange(length, device=positions.device)[:, None].float() * rope_inv_freq(self.config).to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_tables = (emb.cos().to(self.config.dtype), emb.sin().to(self.config.dtype))
        return self.rope_tables[0][positions], self.rope_tables[1][positions]

    @torch.no_grad()  # caches are written in place, and their per-layer views kept (kvcache.layer_views)
    def run_layers(self, method: str, x, positions, slots, caches):
        cos, sin = self.rope(positions)
        for layer, k, v in zip(self.model.layers, layer_views(caches["k"]), layer_views(caches["v"])):
            x = getattr(layer, method)(x, cos, sin, positions, slots, k, v)
        return x

    @torch.no_grad()
    def prefill(self, ids, slot, caches, start=0):
        n = ids.shape[0]
        positions = torch.arange(start, start + n, device=ids.device)
        slots = torch.full((n,), slot, dtype=torch.long, device=ids.device)
        x = self.run_layers("prefill", self.model.embed_tokens(ids), positions, slots, caches)
        return self.head(x[-1:])[0]

    @torch.no_grad()
    def prefill_batch(self, prompts, slots, caches, start=0):
        p = pack(prompts, slots, start)
        x = self.run_layers("prefill", self.model.embed_tokens(p.ids), p.positions, p.slots, caches)
        return self.head(x[p.last])

    @torch.no_grad()
    def prompt_logits(self, ids: torch.Tensor, max_seq: int | None = None) -> torch.Tensor:
        """ids: [n] -> logits at every position [n, vocab], in one eager pass (the reference)."""
        n = ids.shape[0]
        caches = self.allocate_caches(1, max_seq or n)
        positions = torch.arange(n)
        x = self.run_layers("prefill", self.model.embed_tokens(ids), positions, torch.zeros(n, dtype=torch.long), caches)
        return self.head(x)

    @torch.no_grad()
    def decode(self, ids, positions, caches):
        return self.decode_tokens(ids, positions, caches)[0]

    def decode_tokens(self, ids, positions, caches):
        slots = self.batch_slots(ids.shape[0], ids.device)
        if "decode_step" in vars(self):  # bound (Bundle.bind sets the instance's own attribute): one call, no autograd
            return self.decode_step(ids, positions, slots, caches["k"], caches["v"])
        with torch.no_grad():
            return self.head(self.run_layers("decode", self.model.embed_tokens(ids), positions, slots, caches)), None

    @entry(bucket="batch", caches=("k_cache", "v_cache"), pad={"slots": SCRATCH_SLOT}, context="positions")
    def decode_step(self, ids, positions, slots, k_cache, v_cache):
        """A whole decode step, ids [B] -> logits [B, vocab] float32 and their argmax [B]:
        the RoPE rows, the embedding, every layer (LlamaModel: a loop over the stacked
        layers when compiled) and the head, in one graph, in place of a graph per layer
        (whole_step_replaces)."""
        x = self.model.embed_tokens(ids)
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # rope()'s tables' rows, computed as they are
        emb = torch.cat((freqs, freqs), dim=-1)
        logits = self.head(self.model(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype), positions, slots, k_cache, v_cache))
        return logits, logits.argmax(dim=-1)

    def whole_step_replaces(self) -> dict[str, set[tuple[type, str]]]:
        return {"decode_step": {(LlamaDecoderLayer, "decode")}}

    def whole_step_refusal(self) -> str | None:
        c = self.config
        if c.parallel.world_size > 1:
            return "several ranks: each layer's graph holds its collectives"
        if c.kv_cache.dtype != "auto":
            return f"{c.kv_cache.dtype} caches: their packed rows are written per layer"
        if len(set(c.layer_windows)) > 1:
            return "layers of different attention windows: a graph per kind of layer"
        return None

    def example_inputs(self, method: str, rows: int, shapes) -> tuple[torch.Tensor, ...]:
        positions = torch.zeros(rows, dtype=torch.long)
        return (positions.clone(), positions, positions.clone(), shapes.cache("k", 3, layers=True), shapes.cache("v", 3, layers=True))

    @classmethod
    def tiny_config(cls, *, layers, vocab_size, variant):
        config = {
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[variant]],
            "model_type": variant,
            "vocab_size": vocab_size,
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "hidden_act": "silu",
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        if variant == "llama":
            config["attention_bias"] = False
        if variant == "qwen2":
            config.update(num_key_value_heads=1, tie_word_embeddings=True, use_sliding_window=False, sliding_window=None)
        if variant == "mistral":
            config.update(sliding_window=48)
        return config

    def init_random(self, generator, *, head_std=None):
        h = self.config.hidden_size
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.data = 1 + 0.1 * torch.randn(p.shape, generator=generator)
            elif name.endswith("bias"):
                p.data = 0.1 * torch.randn(p.shape, generator=generator)
            else:
                # Unit-scale activations; the head's std sets how far apart the top logits are.
                std = (head_std or 4 / math.sqrt(h)) if name == "head.lm_head.weight" else 1 / math.sqrt(p.shape[-1])
                p.data = std * torch.randn(p.shape, generator=generator)
            p.data = p.data.to(self.config.dtype)


@register_architecture(model_types=("qwen2",), architectures=("Qwen2ForCausalLM",))
class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


@register_architecture(model_types=("mistral",), architectures=("MistralForCausalLM",))
class MistralForCausalLM(LlamaForCausalLM):
    pass
