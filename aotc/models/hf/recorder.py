"""The stand-in cache of a learning run: what each layer is given and writes, recorded (aotc.models.hf.contract)."""

from __future__ import annotations

from dataclasses import dataclass

from ...kvcache import layer_views


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

    layer: str  # its class
    tensors: dict  # the layer's tensor arguments (and rotary's pair) by name: their shapes
    writes: list  # (key shape, value shape, dtype) of each cache update
    windows: list  # the sliding window given to attention


class _Recorder:
    """transformers' cache, in the run that learns the layers' contract: records each
    update, and returns the step's own keys and values (no past). Anything else asked of
    it is recorded and missing: the contract learning run refuses a model that needs it."""

    def __init__(self):
        self.calls: list[_Call] = []
        self.asked: list[tuple[str, str]] = []  # (where, attribute)

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.calls[-1].writes.append((tuple(key_states.shape), tuple(value_states.shape), key_states.dtype))
        return key_states, value_states

    def __getattr__(self, name):
        if not name.startswith("__"):
            where = f"layer {len(self.calls) - 1} ({self.calls[-1].layer})" if self.calls else "its forward (before any layer)"
            self.asked.append((where, name))  # a getattr with a default asks too: only a failure refuses
        raise AttributeError(name)
