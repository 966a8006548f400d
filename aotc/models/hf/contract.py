"""The layer contract, learnt from one meta forward of the model, and the generated layer and head classes that make the layers and the head entries."""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ... import parallel
from ...entry import entry
from ...errors import ConfigError
from ...kvcache import Fp8Rows
from ..base import SCRATCH_SLOT
from .config import ATTENTION, EXPERTS, TransformersConfig
from .recorder import _Call, _Recorder, _Step
from .standins import _KernelFuncs, _LayerCache, _LayerIndex, _register_attention, _register_experts

# The attention masks transformers builds that aotc's attention reproduces by position.
_MASKS = ("create_causal_mask", "create_sliding_window_causal_mask")


_LEARNING = threading.Lock()  # _learn's patch of transformers' globals (see there)


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


def _fp8_rows(config: TransformersConfig, contract: Contract) -> tuple[Fp8Rows | None, Fp8Rows | None]:
    """The packed rows of fp8 caches (k, v): a head's values with one scale, as the llama
    family packs them."""
    kv = config.kv_cache
    if kv.dtype == "auto":
        return None, None
    v = Fp8Rows(contract.v_dim, contract.v_dim, 0, kv.fp8_max)
    return (Fp8Rows(contract.k_dim, contract.k_dim, 0, kv.fp8_max) if kv.dtype == "fp8" else None), v


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
        recorder.calls.append(_Call(type(module).__name__, tensors, [], []))

    hooks = [layer.register_forward_pre_hook(before, with_kwargs=True) for layer in layers]

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
        recorder.calls[-1].windows.append(sliding_window)
        return query.transpose(1, 2), None

    from transformers.integrations.moe import ExpertsInterface
    from transformers.modeling_utils import AttentionInterface

    # transformers takes the attention and experts functions from its global registries, by
    # the name in the config, and the mask builders from the modeling module's globals: no
    # hook per model or per call. So the recorder's stand-ins replace aotc's own in them for
    # this one meta forward and are put back after it, under _LEARNING, so that two
    # learnings in one process never interleave (a transformers model run meanwhile by
    # code other than aotc's, in another thread, would still see them). Remove the lock when
    # transformers takes these functions per model or per call.
    with _LEARNING:
        AttentionInterface.register(ATTENTION, attention)
        # No value is computed: the experts' output has its input's shape (and `nonzero` has
        # no meta kernel).
        ExpertsInterface.register(EXPERTS, lambda module, hidden_states, *_: torch.zeros_like(hidden_states))
        # The masks the model builds: transformers builds none for aotc's attention, which
        # masks by position, so any other than causal and sliding would be lost.
        modeling = inspect.getmodule(type(hf))
        creators = {n: f for n, f in vars(modeling).items() if n.startswith("create_") and getattr(f, "__module__", None) == "transformers.masking_utils"}
        masks: list[tuple[str, list[str]]] = []

        def recording(name, create):
            def record(*args, **kwargs):
                masks.append((name, [k for k in ("or_mask_function", "and_mask_function") if kwargs.get(k) is not None]))
                return create(*args, **kwargs)

            return record

        for name, create in creators.items():
            setattr(modeling, name, recording(name, create))
        try:
            ids = torch.zeros(1, 2, dtype=torch.long)
            with torch.no_grad():
                hf(input_ids=ids, position_ids=torch.arange(2)[None], **{cache_param: recorder}, use_cache=True, aotc_positions=torch.arange(2)[None])
        except AttributeError as e:
            if not recorder.asked or e.args != (recorder.asked[-1][1],):  # not what the recorder lacked
                raise
            where, name = recorder.asked[-1]
            raise ConfigError(
                f"{config.architecture}: {where} asks transformers' cache for {name!r}; aotc's stand-in cache has update() only "
                "(one indexed write per layer and step, at the positions the step gives, not from the cache's length)"
            ) from None
        finally:
            for h in hooks:
                h.remove()
            vars(modeling).update(creators)
            _register_attention()
            _register_experts()
    for name, extra in masks:
        if name not in _MASKS or extra:
            raise ConfigError(
                f"{config.architecture}: its forward builds its attention mask with {name}{' and an ' + ' and '.join(extra) if extra else ''}; "
                "aotc's generic path masks by position (causal, and the sliding window the attention module passes), not by that mask"
            )
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
    ((k_shape, v_shape),) = shapes
    rope = {c.tensors["position_embeddings"][0][-1] if "position_embeddings" in c.tensors else 0 for c in calls}
    if len(rope) != 1:
        raise ConfigError(f"{config.architecture}: some of its layers are given rotary embeddings and some not; aotc's generic path needs all or none")
    # The config object's, not config.json's: the config class derives layer_types where an
    # older config.json has none (qwen2's use_sliding_window and max_window_layers).
    hf_window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    for i, call in enumerate(calls):
        expected = hf_window if (types is None or types[i] == "sliding_attention") and hf_window else None
        if expected is not None and call.windows != [expected]:
            raise ConfigError(
                f"{config.architecture}: layer {i} is a sliding-window layer (sliding_window {expected}) but its attention is given "
                f"window {call.windows[0]!r}; aotc's generic path masks by the window the attention module passes"
            )
    return Contract(calls[0].tensors["hidden_states"][-1], config.dtype, rope.pop(), k_shape[1], k_shape[3], v_shape[3], cache_param)


def _convert_layer(layer: nn.Module, index: int, contract: Contract, rows: tuple) -> None:
    """Make a decoder layer an instance of its class's aotc subclass, its layer_idx
    attributes stand-ins (`_LayerIndex`), and note its index for the model's loop."""
    layer.__class__ = _layer_class(type(layer), contract)
    for path, m in layer.named_modules():
        if isinstance(m.__dict__.get("layer_idx"), int):
            m.layer_idx = _LayerIndex(f"{type(m).__name__}")
        if type(m.__dict__.get("_kernel_funcs")) is dict:  # the instance's own, not a class default
            m._kernel_funcs = _KernelFuncs(m._kernel_funcs)
    layer.aotc_index = index
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
        if not decode:
            kw["aotc_slots"] = slots
        out = base.forward(self, x.view(*shape, -1), attention_mask=None, use_cache=True, aotc_positions=positions.view(shape), **kw)
        if isinstance(out, tuple):
            out = out[0]
        return out.reshape(n, -1)

    def decode(self, *args):
        return call(self, True, args)

    def prefill(self, *args):
        return call(self, False, args)

    signed = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params]
    )
    decode.__signature__ = prefill.__signature__ = signed
    decode.__qualname__ = f"{base.__name__}.decode"
    prefill.__qualname__ = f"{base.__name__}.prefill"
    pad = {"slots": SCRATCH_SLOT}
    caches = ("k_cache", "v_cache")
    decode = entry(bucket="batch", caches=caches, pad=pad, context="positions")(decode)
    prefill = entry(bucket="chunk", caches=caches, pad=pad, split=True, context="positions")(prefill)

    def forward(self, *args, **kwargs):
        # transformers' loops pass the hidden state first and the rest by name: read them so
        # (binding the signature for each layer and step costs more than the graph's call
        # overhead); anything else binds.
        bound = {"hidden_states": args[0], **kwargs} if len(args) == 1 and "hidden_states" not in kwargs else signature.bind(self, *args, **kwargs).arguments
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
        "__annotations__": {"aotc_index": int},  # the layer's index in the model's loop: forward reads it, outside any graph
    })  # fmt: skip


class LMHead(nn.Linear):
    """A transformers model's LM head, compiled as an entry (`project`). Across ranks
    (`group`), each holds its rows of the vocabulary and the logits are gathered: by an
    all-reduce of each rank's logits placed at its block (`rank_index`, a buffer: one
    graph for every rank). AOTInductor runs an all-gather through its proxy executor,
    which hands gloo Python tensors; gloo's worker then lets go of them under the GIL
    that the next graph holds while it waits for its own all-reduce, and the ranks hung
    (torch 2.13, parallel.settled)."""

    group: str | None = None

    @entry(bucket="batch")
    def project(self, x):
        logits = F.linear(x, self.weight, self.bias)  # [B, V / ranks]
        if self.group is None:
            return logits
        every = parallel.all_gather_rows(logits, self.group, self.rank_index)  # [ranks * B, V / ranks]
        return every.view(-1, *logits.shape).transpose(0, 1).reshape(logits.shape[0], -1)

    def forward(self, x):
        shape = x.shape
        return self.project(x.reshape(-1, shape[-1])).view(*shape[:-1], -1)

    def example_inputs(self, method, rows, shapes):
        return (torch.zeros(rows, self.in_features, dtype=self.weight.dtype),)
