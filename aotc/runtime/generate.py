"""Generation of a list of prompts, for `aotc run`, the Session and the fidelity check:
every prompt submitted to an Engine at once (runtime.engine: continuous batching, a
decode call over every running row and one prefill chunk per step), stepped until all
are done; greedy unless a prompt's SamplingParams say otherwise (runtime.sampling).

The loop is the same for the eager model and for a model bound to a bundle; only the
entry methods differ. The last cache slot (`slots - 1`) is the scratch slot that
padding rows write to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..errors import AotcError
from ..kvcache import Regions
from ..models.base import CausalLM
from .dispatch import is_bound, largest_chunk
from .engine import DEFAULT_CHUNK, Engine, Request
from .sampling import Choice, SamplingParams
from .threads import ThreadGovernor


@dataclass
class Sequence:
    prompt_ids: list[int]
    new_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # per new token, [vocab] float32 (if kept)
    choices: list[Choice] = field(default_factory=list)  # per new token, with its logprobs (if asked for)
    stopped: bool = False  # on_token ended it (a stop string)
    request: Request | None = field(default=None, repr=False)  # its request in the engine


@dataclass
class Generation:
    sequences: list[Sequence]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0  # from the call to the first token of the first group
    prefill_tokens: int = 0
    decode_steps: int = 0
    exchange_s: float = 0.0  # data-parallel ranks: the per-step all-gathers of tokens (runtime.engine)
    idle_calls: int = 0  # data-parallel ranks: lockstep calls this rank ran with no row of its own

    @property
    def new_tokens(self) -> int:
        return sum(len(s.new_ids) for s in self.sequences)

    @property
    def decode_tokens_per_s(self) -> float:
        decoded = self.new_tokens - len(self.sequences)  # the first token of each comes from prefill
        return decoded / self.decode_s if self.decode_s > 0 else 0.0


def check_lengths(prompts: list[list[int]], max_new_tokens: int, max_seq: int, limit: str | None = None, asked: str = "--max-new-tokens ") -> None:
    """Each prompt with its new tokens within max_seq positions. limit: what sets max_seq
    and how to raise it (default: a bundle's caches); asked: how the caller names the new
    tokens' count (the CLI's flag, the Python API's argument)."""
    limit = limit or f"the cache holds (max_seq {max_seq}). Shorten the prompt, lower --max-new-tokens, or rebuild with a larger --max-seq"
    for i, p in enumerate(prompts):
        if not p:
            raise AotcError(f"prompt {i} is empty; give at least one token")
        if len(p) + max_new_tokens > max_seq:
            raise AotcError(f"prompt {i} has {len(p)} tokens; with {asked}{max_new_tokens} that is {len(p) + max_new_tokens} positions, more than {limit}")


@torch.no_grad()
def generate(
    model: CausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    max_batch: int,
    max_seq: int,
    slots: int | None = None,
    stop_at_eos: bool = True,
    eos_ids: Iterable[int] | None = None,
    keep_logits: bool = False,
    on_token: Callable[[int, Sequence], bool | None] | None = None,
    threads: int | None = None,
    forced: list[list[int]] | None = None,
    caches: dict | None = None,
    sampling: list[SamplingParams] | None = None,
    chunk: int | None = None,
) -> Generation:
    """Every prompt through the engine (runtime.engine: continuous batching, at most
    max_batch rows decoding at once, `chunk` prompt tokens prefilled per step: by default
    a bound model's largest chunk bucket, as a Session's engine, else DEFAULT_CHUNK), greedy
    unless `sampling` (one SamplingParams per prompt) says otherwise. Stops a sequence at
    any of eos_ids (default: the model config's eos_token_ids). on_token(i, sequence) runs
    after sequence i (of all prompts) gains a token, for streaming; a true result ends
    that sequence there (a stop string). threads: torch's intra-op threads; by default as
    many as other processes leave CPUs free, re-read as it runs (aotc.runtime.threads);
    torch's count is restored at the end.

    forced: the tokens each sequence takes, in place of its choice, and where it stops
    (teacher forcing: another model's logits along these tokens, for runtime.check).

    caches: the model's caches for `slots` and `max_seq` (model.allocate_caches, with
    split=is_bound(model)), kept by a caller that serves request after request, as a
    server keeps them (allocating 400 MB of caches takes longer than a chat turn's
    prefill). A sequence writes each of its positions before any step reads it, so
    what an earlier call left is never seen. Default: allocated for this call."""
    if forced is not None:
        if len(forced) != len(prompts) or not all(forced):
            raise AotcError(f"forced: expected a non-empty token list per prompt ({len(prompts)}), got {[len(f) for f in forced]}")
        max_new_tokens, eos_ids = max(map(len, forced)), ()
    if max_new_tokens < 1:
        raise AotcError(f"--max-new-tokens {max_new_tokens}: expected at least 1")
    check_lengths(prompts, max_new_tokens, max_seq)
    if sampling is not None and len(sampling) != len(prompts):
        raise AotcError(f"sampling: expected one SamplingParams per prompt ({len(prompts)}), got {len(sampling)}")
    slots = slots or max_batch + 1
    eos = set(getattr(model.config, "eos_token_ids", ()) if eos_ids is None else eos_ids) if stop_at_eos else set()
    device = next(model.parameters()).device
    # Compiled graphs take a packed cache's regions as allocations of their own.
    if caches is None:
        caches = model.allocate_caches(slots, max_seq, device, split=is_bound(model))
    else:
        _check_caches(model, caches, slots, max_seq)
    chunk = chunk or largest_chunk(model) or DEFAULT_CHUNK
    engine = Engine(model, caches, slots=slots, max_seq=max_seq, max_batch=max_batch, chunk=chunk, eos_ids=eos)
    result = Generation([Sequence(list(p)) for p in prompts])
    governor = ThreadGovernor(threads)
    try:
        t_start = time.perf_counter()
        for i, (p, s) in enumerate(zip(prompts, result.sequences)):
            call = None if on_token is None else (lambda r, i=i, s=s: on_token(i, s))
            request = engine.submit(
                list(p), len(forced[i]) if forced is not None else max_new_tokens, sampling[i] if sampling is not None else None,
                on_token=call, keep_logits=keep_logits, forced=None if forced is None else forced[i],
            )  # fmt: skip
            # The sequence is the request's record: the same lists, filled as it runs.
            request.new_ids, request.logits, request.choices = s.new_ids, s.logits, s.choices
            s.request = request
        while not engine.idle:
            governor.step()
            engine.step()
    finally:
        governor.restore()
    firsts = [s.request.first_token_at for s in result.sequences if s.request.first_token_at is not None]
    result.ttft_s = min(firsts) - t_start if firsts else 0.0
    stats = engine.stats
    result.prefill_s, result.decode_s, result.prefill_tokens, result.decode_steps = stats.prefill_s, stats.decode_s, stats.prefill_tokens, stats.decode_steps
    result.exchange_s, result.idle_calls = stats.exchange_s, stats.idle_calls
    for s in result.sequences:
        s.stopped = s.request.stopped
    return result


def _check_caches(model: CausalLM, caches: dict, slots: int, max_seq: int) -> None:
    """Caches given to generate: every kind of the model's, as allocated for slots and max_seq."""
    specs = model.cache_specs(slots, max_seq)
    if set(caches) != set(specs):
        raise AotcError(f"caches: expected the kinds {sorted(specs)} (model.allocate_caches({slots}, {max_seq})), got {sorted(caches)}")
    for kind, (shape, _) in specs.items():
        cache = caches[kind]
        # A packed kind split into regions: each region holds the rows' leading dims.
        have = [tuple(t.shape[:-1]) for t in cache.tensors.values()] if isinstance(cache, Regions) else [tuple(cache.shape[:-1])]
        if any(h != tuple(shape[:-1]) for h in have):
            raise AotcError(
                f"caches[{kind!r}]: shape {have[0]} (leading dims), expected {tuple(shape[:-1])}, as "
                f"model.allocate_caches({slots}, {max_seq}) makes it (slots {slots}, max_seq {max_seq})"
            )
