"""Any dense decoder-only model in transformers, from transformers' own modeling code.

transformers supplies the weight names, the embeddings, rotary, norms and the
layers; aotc supplies the caches, buckets, passes, backends and runtime. The
model's own `*ForCausalLM.forward` runs eagerly around its decoder layers and
LM head, which are entries, so one compiled graph serves every layer of a
class (a variant of it, where layers differ: sliding or full, NoPE, a scale):

- **Layers.** Each decoder layer (the model's `_no_split_modules`) becomes an
  instance of a generated subclass of its own class, whose `decode` and
  `prefill` entries call the class's own `forward` with a stand-in cache
  (`_LayerCache`): its `update` is one indexed write per cache into the
  layer's cache input (aotc.kvcache, so fp8 caches, context buckets and the
  passes work as for aotc's own models), and returns the rows the layer's
  queries see. The subclass's `forward` is what the model's loop calls: it
  takes the hidden state and rotary (cos, sin) the model computed and hands
  them, with positions, slots and the layer's caches, to the entry.
- **Attention.** The "aotc" function of transformers' AttentionInterface
  (`_attention`) masks by the positions the entry passes through the layer's
  kwargs (`aotc_positions`), and the window, softcap and sinks the attention
  module passes it; transformers builds no mask for it.
- **`layer_idx`** reads as a `_LayerIndex`, which the stand-in cache ignores
  and anything else refuses, so that no layer's graph bakes in its index; a
  module's `config` groups layers by the hash of its JSON.
- **The contract** (what each layer's call passes, the shapes its attention
  writes to the cache) is learnt from one forward of the model on meta or
  fake tensors, when the model is built (`_learn`); nothing is written per
  architecture.
- **The head.** The LM head, an `nn.Linear`, becomes an entry too (`project`);
  the final norm, a softcap or a logits scale stay in the model's forward.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..entry import entry, freezer
from ..errors import ConfigError
from ..kvcache import Fp8Rows, layer_views, load, row_spec, store
from .base import SCRATCH_SLOT, CausalLM, read_dtype
from .config import ConfigReader, ModelConfig

NAME = "transformers"
ATTENTION = "aotc"
# config.json fields that say nothing about the graphs: left out of the config the bundle
# compares (eos ids are ModelConfig's runtime-only field).
_NOT_COMPARED = ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype")
# Arguments of a layer's forward that aotc fills itself.
_OURS = ("hidden_states", "attention_mask", "position_ids", "cache", "past_key_values", "position_embeddings", "use_cache", "cache_position")


def installed() -> str | None:
    """transformers' version, where it is installed."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def knows(config: dict) -> bool:
    """Whether transformers has a causal LM for this config.json (and is installed)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


@dataclass
class TransformersConfig(ModelConfig):
    model_type: str
    architecture: str  # the transformers class, e.g. Qwen3ForCausalLM
    vocab_size: int
    hf: dict  # config.json, but fields that change no graph
    num_hidden_layers: int
    max_position_embeddings: int
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: ConfigReader) -> "TransformersConfig":
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model_type = cfg.get("model_type", str)
        default = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if default is None:
            raise ConfigError(f"{cfg.source}: model_type {model_type!r} has no causal LM in transformers; aotc's generic path runs *ForCausalLM models")
        names = cfg.get("architectures", list, [default])
        architecture = next((n for n in names if isinstance(n, str) and n.endswith(("ForCausalLM", "LMHeadModel"))), None)
        if architecture is None:
            raise ConfigError(f"{cfg.source}: field 'architectures' is {names!r}; aotc's generic path runs a causal LM ({default} for {model_type})")
        hf = {k: v for k, v in cfg.config.items() if k not in _NOT_COMPARED}
        hf_config = _hf_config(model_type, hf, str(cfg.source))
        eos = cfg.config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            model_type=model_type,
            architecture=architecture,
            vocab_size=int(hf_config.vocab_size),
            hf=hf,
            num_hidden_layers=int(hf_config.num_hidden_layers),
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", None) or 4096),
            dtype=read_dtype(cfg),
            eos_token_ids=eos_ids,
        )


def _hf_config(model_type: str, fields: dict, source: str):
    from transformers.models.auto.configuration_auto import AutoConfig

    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if k != "model_type"})
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{source}: transformers refuses this config ({type(e).__name__}: {e}); fix the field it names") from None
    config._attn_implementation = ATTENTION
    return config


# -- what stands in for transformers' cache and attention -----------------------


class _LayerIndex:
    """A layer's `layer_idx` inside an entry: the stand-in cache ignores it, and any other
    use refuses, since a graph that used it would be one layer's graph only."""

    def __init__(self, where: str):
        self.where = where

    def _refuse(self, *_):
        raise ConfigError(
            f"{self.where}.layer_idx is used in the layer's forward other than to update the cache; aotc's generic path "
            "shares one graph across layers and cannot bake in a layer's index"
        )

    __index__ = __int__ = __bool__ = __add__ = __radd__ = __sub__ = __mul__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __hash__ = object.__hash__

    def __eq__(self, other):
        return self._refuse()


freezer(_LayerIndex, lambda value: "layer_idx")


def _freeze_config(config) -> str:
    # One value per config: layers that share it share their graphs, whatever it holds.
    return "config:" + hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16]


class _LayerCache:
    """What one layer's attention sees as transformers' cache, inside an entry: `update`
    writes the step's keys and values into the layer's cache inputs (one indexed write
    each) and returns the cache rows of the sequences its queries belong to."""

    def __init__(self, rows: tuple, k_cache, v_cache, positions, slots, decode: bool):
        self.rows, self.k_cache, self.v_cache = rows, k_cache, v_cache
        self.positions, self.slots, self.decode = positions, slots, decode

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        # key_states: [batch, kv heads, tokens, head dim]; a row per (sequence, token)
        b, heads, t, _ = key_states.shape
        k = key_states.transpose(1, 2).reshape(b * t, heads, key_states.shape[-1])
        v = value_states.transpose(1, 2).reshape(b * t, heads, value_states.shape[-1])
        index = (self.slots, slice(None), self.positions)
        store(self.rows[0], self.k_cache, index, k)
        store(self.rows[1], self.v_cache, index, v)
        seen = (slice(None, b),) if self.decode else (self.slots[:1],)
        return load(self.rows[0], self.k_cache, seen, key_states.dtype), load(self.rows[1], self.v_cache, seen, value_states.dtype)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention interface, as aotc runs it: query [B, heads, T, d], key and
    value [B, kv heads, S, d] (the cache rows); masked by position, so that the cache's
    positions past a sequence's own are never seen. Returns [B, T, heads, d]."""
    positions = kwargs.get("aotc_positions")  # [B, T]
    if positions is None:
        raise ConfigError(
            f"{type(module).__qualname__} called attention without the kwargs its layer was given; aotc's generic path "
            "passes positions through them, as transformers' layers do"
        )
    if attention_mask is not None:
        raise ConfigError(f"{type(module).__qualname__} was given an attention mask; aotc's generic path masks by position")
    b, heads, t, d = query.shape
    kv_heads, s = key.shape[1], key.shape[2]
    scale = d**-0.5 if scaling is None else scaling
    q = query.view(b, kv_heads, heads // kv_heads, t, d)
    scores = (q @ key[:, :, None].transpose(-1, -2)).float() * scale  # [B, kv, rep, T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(s, device=query.device)
    q_pos = positions[:, None, None, :, None]
    seen = k_pos <= q_pos
    if sliding_window:
        seen = seen & (k_pos > q_pos - sliding_window)
    scores = scores.masked_fill(~seen, float("-inf"))
    if s_aux is not None:  # attention sinks: a per-head logit that takes probability but gives no value
        sinks = s_aux.float().view(1, kv_heads, heads // kv_heads, 1, 1).expand(b, -1, -1, t, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = probs.to(value.dtype) @ value[:, :, None]  # [B, kv, rep, T, d]
    return out.reshape(b, heads, t, value.shape[-1]).transpose(1, 2), None


def _register_attention() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


# -- a step: what the model's loop hands each layer -----------------------------


class _Step:
    """The cache object the model's forward passes to its layers in aotc's runs: which
    entry to call, and each layer's cache slices (the contract learning run passes a
    `_Recorder` instead)."""

    def __init__(self, method: str, positions, slots, caches: dict):
        self.method, self.positions, self.slots = method, positions, slots
        self.layers = {kind: layer_views(c) for kind, c in caches.items()}

    def caches_of(self, layer: int) -> tuple:
        return self.layers["k"][layer], self.layers["v"][layer]


@dataclass
class _Call:
    """What the contract learning run saw of one layer."""

    tensors: dict  # the layer's tensor arguments (and rotary's pair) by name: their shapes
    writes: list  # (key shape, value shape, dtype) of each cache update
    windows: list  # the sliding window given to attention


class _Recorder:
    """transformers' cache, in the run that learns the layers' contract: records each
    update, and returns the step's own keys and values (no past)."""

    def __init__(self):
        self.calls: list[_Call] = []

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.calls[-1].writes.append((tuple(key_states.shape), tuple(value_states.shape), key_states.dtype))
        return key_states, value_states


@dataclass(frozen=True)
class Contract:
    """What every layer takes and writes, learnt from one forward (`_learn`)."""

    hidden: int
    dtype: torch.dtype  # of the hidden state
    rope: int  # the width of the rotary (cos, sin) the layers take; 0: none
    kv_heads: int
    k_dim: int
    v_dim: int
    cache_param: str  # the name of the layer's cache argument


# -- the model ---------------------------------------------------------------------


class TransformersCausalLM(CausalLM):
    """A transformers causal LM, its decoder layers and LM head compiled as entries."""

    config_class = TransformersConfig
    kv_cache_dtypes = ("auto", "fp8", "fp8-values")

    def __init__(self, config: TransformersConfig):
        super().__init__()
        _register_attention()
        _register_config_freezer()
        self.config = config
        hf_config = _hf_config(config.model_type, config.hf, "config.json")
        model_class = _model_class(config.model_type, config.architecture)
        try:
            with _default_dtype(config.dtype):
                hf = model_class(hf_config)
        except Exception as e:  # transformers' own code, given aotc's attention: say which and why
            raise ConfigError(
                f"config.json: transformers' {config.architecture} cannot be built with aotc's attention function "
                f"({type(e).__name__}: {e}); aotc's generic path runs models whose attention goes through transformers' AttentionInterface"
            ) from None
        hf.eval()
        # The transformers model is not a submodule: its children are ours, so that parameter
        # paths are the checkpoint's names (model.layers.0..., lm_head.weight).
        self.__dict__["hf"] = hf
        for name, child in hf.named_children():
            self.add_module(name, child)
        self.layer_modules = _decoder_layers(hf, config)
        self.contract = _learn(hf, self.layer_modules, config)
        rows = _fp8_rows(config, self.contract)
        code = code_identity(config.model_type, config.architecture)
        for i, layer in enumerate(self.layer_modules):
            _convert_layer(layer, i, self.contract, rows, code)
        head = hf.get_output_embeddings()
        if type(head) is nn.Linear:
            head.__class__ = LMHead
            head.__dict__["aotc_code"] = code

    @classmethod
    def code_identity(cls, config: dict) -> dict:
        parsed = TransformersConfig.from_hf(ConfigReader(config, "config.json"))
        return code_identity(parsed.model_type, parsed.architecture)

    def init_random(self, generator, *, head_std=None):
        # transformers' own init (aotc verify's random weights), drawn from the generator's seed.
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(generator.initial_seed())
            for t in [*self.parameters(), *self.buffers()]:
                t._is_hf_initialized = False
            self.hf.init_weights()
            if head_std is not None:
                self.hf.get_output_embeddings().weight.normal_(0, head_std)

    # -- checkpoint --------------------------------------------------------------
    def tied_parameters(self) -> dict[str, str]:
        # transformers' own record of its ties (expanded to parameter names), which holds
        # while loading replaces the tied Parameter objects.
        names = dict(self.named_parameters(remove_duplicate=False))
        return {k: v for k, v in (self.hf.all_tied_weights_keys or {}).items() if k in names and v in names}

    def init_buffers(self) -> None:
        # Non-persistent buffers (rotary's inverse frequencies, Gemma's embedding scale) are
        # made by transformers' own init from the config, as from_pretrained makes them:
        # every loaded tensor is marked initialized, so that init leaves it alone.
        for t in [*self.parameters(), *self.buffers()]:
            t._is_hf_initialized = True
        with torch.no_grad():
            for module in self.hf.modules():
                if module._non_persistent_buffers_set:
                    for name in module._non_persistent_buffers_set:
                        buf = module._buffers.get(name)
                        if buf is not None:
                            buf._is_hf_initialized = False
                    self.hf._init_weights(module)

    # -- caches ------------------------------------------------------------------
    def cache_specs(self, slots, max_seq):
        c, rows = self.contract, _fp8_rows(self.config, self.contract)
        lead = (self.config.num_hidden_layers, slots, c.kv_heads, max_seq)
        key_dtype = torch.bfloat16 if self.config.kv_cache.dtype == "fp8-values" else self.config.dtype
        return {"k": row_spec(rows[0], lead, c.k_dim, key_dtype), "v": row_spec(rows[1], lead, c.v_dim, self.config.dtype)}

    def cache_rows(self):
        return {kind: r for kind, r in zip("kv", _fp8_rows(self.config, self.contract)) if r is not None}

    # -- generation ----------------------------------------------------------------
    @torch.no_grad()
    def _forward(self, method: str, ids, positions, slots, caches, keep: int):
        # ids, positions: [B, T]; slots: [B * T]
        step = _Step(method, positions.reshape(-1), slots, caches)
        out = self.hf(input_ids=ids, position_ids=positions, **{self.contract.cache_param: step}, use_cache=True, logits_to_keep=keep)
        return out.logits.float()

    def prefill(self, ids, slot, caches, start=0):
        n = ids.shape[0]
        positions = torch.arange(start, start + n, device=ids.device)
        slots = torch.full((n,), slot, dtype=torch.long, device=ids.device)
        return self._forward("prefill", ids[None], positions[None], slots, caches, 1)[0, -1]

    def decode(self, ids, positions, caches):
        slots = self.batch_slots(ids.shape[0], ids.device)
        return self._forward("decode", ids[:, None], positions[:, None], slots, caches, 0)[:, -1]

    def prompt_logits(self, ids, max_seq=None):
        n = ids.shape[0]
        caches = self.allocate_caches(1, max_seq or n)
        return self._forward("prefill", ids[None], torch.arange(n)[None], torch.zeros(n, dtype=torch.long), caches, 0)[0]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    # As transformers' from_pretrained builds a model of a dtype: parameters made in it,
    # buffers that ask for float32 (rotary's) kept so.
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@functools.cache
def code_identity(model_type: str, architecture: str) -> dict:
    """transformers' version and the sha256 of the modeling module that defines the class:
    what, with aotc's own source, makes the graphs (cache keys)."""
    from transformers import __version__

    module = inspect.getmodule(_model_class(model_type, architecture))
    return {"transformers": __version__, "modeling": hashlib.sha256(inspect.getsource(module).encode()).hexdigest()}


def _model_class(model_type: str, name: str) -> type:
    # The model's own modeling module, imported by its path: `transformers.<Name>` would
    # have transformers index every model it has first (about 1.4 s of a cold start).
    import importlib

    from transformers import __version__
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    try:
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name, None)
    except ImportError:
        cls = None
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ConfigError(f"config.json: architectures names {name!r}, which transformers {__version__} does not have for model_type {model_type!r}")
    return cls


def _decoder_layers(hf: nn.Module, config: TransformersConfig) -> list[nn.Module]:
    """The decoder layers, in order: the modules of the classes transformers keeps whole
    when it splits a model across devices (_no_split_modules)."""
    names = set(getattr(hf, "_no_split_modules", None) or ())
    layers = [m for m in hf.modules() if type(m).__name__ in names]
    if len(layers) != config.num_hidden_layers:
        raise ConfigError(
            f"config.json: {config.architecture} has {len(layers)} modules of its layer classes ({', '.join(sorted(names)) or 'none'}), "
            f"and num_hidden_layers is {config.num_hidden_layers}; aotc's generic path needs one decoder layer per hidden layer"
        )
    return layers


def _fp8_rows(config: TransformersConfig, contract: Contract) -> tuple[Fp8Rows | None, Fp8Rows | None]:
    """The packed rows of fp8 caches (k, v): a head's values with one scale, as the llama
    family packs them."""
    kv = config.kv_cache
    if kv.dtype == "auto":
        return None, None
    v = Fp8Rows(contract.v_dim, contract.v_dim, 0, kv.fp8_max)
    return (Fp8Rows(contract.k_dim, contract.k_dim, 0, kv.fp8_max) if kv.dtype == "fp8" else None), v


# -- learning the contract ---------------------------------------------------------


def _learn(hf: nn.Module, layers: list[nn.Module], config: TransformersConfig) -> Contract:
    """Run the model once on two tokens where it was built (on meta or fake tensors, as
    builds and loads make it, no value is computed), recording what each layer is given
    and writes."""
    recorder = _Recorder()
    signature = inspect.signature(type(layers[0]).forward)
    params = signature.parameters
    var_kw = next((k for k, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    cache_param = "cache" if "cache" in params else "past_key_values"
    if cache_param not in params:
        raise ConfigError(f"{type(layers[0]).__name__}.forward takes no cache; aotc's generic path runs layers that keep a KV cache")

    def before(module, args, kwargs):
        bound = signature.bind(module, *args, **kwargs).arguments
        extra = bound.pop(var_kw, {})  # what the layer's **kwargs took
        given = {**bound, **extra}
        tensors = {}
        for name, value in given.items():
            if isinstance(value, torch.Tensor):
                tensors[name] = tuple(value.shape)
            elif isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
                tensors[name] = tuple(tuple(v.shape) for v in value)
        recorder.calls.append(_Call(tensors, [], []))

    hooks = [layer.register_forward_pre_hook(before, with_kwargs=True) for layer in layers]

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
        recorder.calls[-1].windows.append(sliding_window)
        return query.transpose(1, 2), None

    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)
    try:
        ids = torch.zeros(1, 2, dtype=torch.long)
        with torch.no_grad():
            hf(input_ids=ids, position_ids=torch.arange(2)[None], **{cache_param: recorder}, use_cache=True, aotc_positions=torch.arange(2)[None])
    finally:
        for h in hooks:
            h.remove()
        _register_attention()
    return _contract_of(recorder.calls, layers, config, hf.config, cache_param)


def _contract_of(calls: list[_Call], layers, config: TransformersConfig, hf_config, cache_param: str) -> Contract:
    if len(calls) != len(layers):
        raise ConfigError(f"{config.architecture}: its forward called {len(calls)} decoder layers, it has {len(layers)}; aotc's generic path runs each layer once per step")
    for i, call in enumerate(calls):
        if len(call.writes) != 1:
            what = "writes no KV cache of its own (it shares another layer's, or keeps another kind of state)" if not call.writes else f"writes the cache {len(call.writes)} times"
            raise ConfigError(f"{config.architecture}: layer {i} ({type(layers[i]).__name__}) {what}; aotc's generic path runs layers with one KV cache each")
        if len(call.windows) != 1:
            raise ConfigError(
                f"{config.architecture}: layer {i} ({type(layers[i]).__name__}) computes attention {'with code of its own' if not call.windows else f'{len(call.windows)} times'}, "
                "not once through transformers' AttentionInterface; aotc's generic path masks attention by position there, and cannot "
                "take a model whose attention reads a mask of its own"
            )
        others = sorted(set(call.tensors) - {"hidden_states", "position_embeddings", "position_ids", "attention_mask", "aotc_positions"})
        if others:
            raise ConfigError(f"{config.architecture}: its layers are given the tensors {', '.join(others)}, which aotc's generic path does not pass yet")
    shapes = {c.writes[0][:2] for c in calls}
    if len(shapes) != 1:
        raise ConfigError(f"{config.architecture}: its layers write caches of several shapes ({sorted(shapes)}); aotc's generic path needs one")
    (k_shape, v_shape), = shapes
    rope = {c.tensors["position_embeddings"][0][-1] if "position_embeddings" in c.tensors else 0 for c in calls}
    if len(rope) != 1:
        raise ConfigError(f"{config.architecture}: some of its layers are given rotary embeddings and some not; aotc's generic path needs all or none")
    # The config object's, not config.json's: the config class derives layer_types where an
    # older config.json has none (qwen2's use_sliding_window and max_window_layers).
    hf_window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    for i, call in enumerate(calls):
        expected = hf_window if (types is None or types[i] == "sliding_attention") and hf_window else None
        if types is not None and types[i] not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"config.json: layer_types[{i}] is {types[i]!r}; aotc's generic path runs full and sliding attention")
        if expected is not None and call.windows != [expected]:
            raise ConfigError(
                f"{config.architecture}: layer {i} is a sliding-window layer (sliding_window {expected}) but its attention is given "
                f"window {call.windows[0]!r}; aotc's generic path masks by the window the attention module passes"
            )
    for key in ("attention_chunk_size",):
        if getattr(hf_config, key, None):
            raise ConfigError(f"config.json: field {key!r} is set; aotc's generic path runs full and sliding attention, not chunked")
    return Contract(calls[0].tensors["hidden_states"][-1], config.dtype, rope.pop(), k_shape[1], k_shape[3], v_shape[3], cache_param)


# -- the generated classes -----------------------------------------------------------


def _convert_layer(layer: nn.Module, index: int, contract: Contract, rows: tuple, code: dict) -> None:
    """Make a decoder layer an instance of its class's aotc subclass, its layer_idx
    attributes stand-ins (`_LayerIndex`), and note its index for the model's loop."""
    layer.__class__ = _layer_class(type(layer), contract)
    for path, m in layer.named_modules():
        if isinstance(m.__dict__.get("layer_idx"), int):
            m.layer_idx = _LayerIndex(f"{type(m).__name__}")
    layer.__dict__["aotc_index"] = index  # read by forward, outside any graph
    layer.__dict__["aotc_code"] = code  # cache keys (aotc.cache.keys)
    layer.k_rows, layer.v_rows = rows


@functools.cache
def _layer_class(base: type, contract: Contract) -> type:
    params = ["x", *(("cos", "sin") if contract.rope else ()), "positions", "slots", "k_cache", "v_cache"]
    signature = inspect.signature(base.forward)  # once: forward binds with it per layer and step
    takes_positions = "position_ids" in signature.parameters

    def call(self, decode: bool, args):
        named = dict(zip(params, args))
        x, positions, slots = named["x"], named["positions"], named["slots"]
        n = x.shape[0]
        shape = (n, 1) if decode else (1, n)
        kw = {contract.cache_param: _LayerCache((self.k_rows, self.v_rows), named["k_cache"], named["v_cache"], positions, slots, decode)}
        if contract.rope:
            kw["position_embeddings"] = (named["cos"].view(*shape, -1), named["sin"].view(*shape, -1))
        if takes_positions:
            kw["position_ids"] = positions.view(shape)
        out = base.forward(self, x.view(*shape, -1), attention_mask=None, use_cache=True, aotc_positions=positions.view(shape), **kw)
        if isinstance(out, tuple):
            out = out[0]
        return out.reshape(n, -1)

    def decode(self, *args):
        return call(self, True, args)

    def prefill(self, *args):
        return call(self, False, args)

    signed = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params])
    decode.__signature__ = prefill.__signature__ = signed
    decode.__qualname__ = f"{base.__name__}.decode"
    prefill.__qualname__ = f"{base.__name__}.prefill"
    pad = {"slots": SCRATCH_SLOT}
    caches = ("k_cache", "v_cache")
    decode = entry(bucket="batch", caches=caches, pad=pad, context="positions")(decode)
    prefill = entry(bucket="chunk", caches=caches, pad=pad, split=True)(prefill)

    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        step = bound.get(contract.cache_param)
        if not isinstance(step, _Step):  # not aotc's loop: transformers' own layer
            return base.forward(self, *args, **kwargs)
        x = bound["hidden_states"]
        b, t, h = x.shape
        given = [x.reshape(b * t, h)]
        if contract.rope:
            cos, sin = bound["position_embeddings"]
            given += [cos.reshape(b * t, -1), sin.reshape(b * t, -1)]
        out = getattr(self, step.method)(*given, step.positions, step.slots, *step.caches_of(self.aotc_index))
        return out.view(b, t, h)

    def example_inputs(self, method, rows, shapes):
        dtype = contract.dtype
        positions = torch.zeros(rows, dtype=torch.long)
        # Two tensors: one object passed twice would be one graph input.
        rope = tuple(torch.zeros(rows, contract.rope, dtype=dtype) for _ in range(2)) if contract.rope else ()
        return (torch.zeros(rows, contract.hidden, dtype=dtype), *rope, positions, positions.clone(), shapes.cache("k", 2), shapes.cache("v", 2))

    return type(base.__name__, (base,), {
        "decode": decode, "prefill": prefill, "forward": forward, "example_inputs": example_inputs, "__module__": __name__,
    })  # fmt: skip


class LMHead(nn.Linear):
    """A transformers model's LM head, compiled as an entry (`project`)."""

    @entry(bucket="batch")
    def project(self, x):
        return F.linear(x, self.weight, self.bias)

    def forward(self, x):
        shape = x.shape
        return self.project(x.reshape(-1, shape[-1])).view(*shape[:-1], self.out_features)

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, self.in_features, dtype=self.weight.dtype),)


def _register_config_freezer() -> None:
    from transformers.configuration_utils import PretrainedConfig

    freezer(PretrainedConfig, _freeze_config)
