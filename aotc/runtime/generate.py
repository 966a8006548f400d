"""Batched generation: chunked prefill, then batched decode; greedy unless a prompt's
SamplingParams say otherwise (aotc.runtime.sampling).

The loop is the same for the eager model and for a model bound to a bundle;
only the entry methods differ. Prompts run in groups of at most `max_batch`;
sequence i of a group lives in cache slot i, and the slot past the last
(`slots - 1`) is the scratch slot that padding rows write to. A group's prompts
are prefilled together (CausalLM.prefill_batch: their rows packed into shared
chunks, where the model can), then decoded together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..errors import AotcError
from ..kvcache import Regions
from ..models.base import CausalLM
from .dispatch import is_bound
from .sampling import Choice, Sampler, SamplingParams
from .threads import ThreadGovernor


@dataclass
class Sequence:
    prompt_ids: list[int]
    new_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # per new token, [vocab] float32 (if kept)
    choices: list[Choice] = field(default_factory=list)  # per new token, with its logprobs (if asked for)
    stopped: bool = False  # on_token ended it (a stop string)


@dataclass
class Generation:
    sequences: list[Sequence]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0  # from the call to the first token of the first group
    prefill_tokens: int = 0
    decode_steps: int = 0

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
            raise AotcError(
                f"prompt {i} has {len(p)} tokens; with {asked}{max_new_tokens} that is "
                f"{len(p) + max_new_tokens} positions, more than {limit}"
            )


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
    on_token: Callable[[int, Sequence], None] | None = None,
    threads: int | None = None,
    forced: list[list[int]] | None = None,
    caches: dict | None = None,
    sampling: list[SamplingParams] | None = None,
) -> Generation:
    """Generation, greedy unless `sampling` (one SamplingParams per prompt) says otherwise.
    Stops a sequence at any of eos_ids (default: the model config's eos_token_ids).
    on_token(i, sequence) runs after sequence i (of all prompts) gains a token, for
    streaming; a true result ends that sequence there (a stop string). threads: torch's intra-op threads; by
    default as many as other processes leave CPUs free, re-read as it runs
    (aotc.runtime.threads); torch's count is restored at the end.

    forced: the tokens each sequence takes, in place of its argmax, and where it stops
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
    # A sampler per prompt where any prompt samples or asks for logprobs; else the argmax of the batch.
    samplers = None
    if sampling is not None and any(not p.greedy or p.logprobs is not None for p in sampling):
        samplers = [Sampler(p, list(prompt)) for p, prompt in zip(sampling, prompts)]
    slots = slots or max_batch + 1
    eos = set(getattr(model.config, "eos_token_ids", ()) if eos_ids is None else eos_ids) if stop_at_eos else set()
    device = next(model.parameters()).device
    # Compiled graphs take a packed cache's regions as allocations of their own.
    if caches is None:
        caches = model.allocate_caches(slots, max_seq, device, split=is_bound(model))
    else:
        _check_caches(model, caches, slots, max_seq)
    result = Generation([Sequence(list(p)) for p in prompts])
    governor = ThreadGovernor(threads)
    try:
        t_start = time.perf_counter()
        for g in range(0, len(prompts), max_batch):
            group = result.sequences[g : g + max_batch]
            t0 = time.perf_counter()
            governor.step()
            logits = model.prefill_batch([torch.tensor(s.prompt_ids, device=device) for s in group], list(range(len(group))), caches)
            result.prefill_s += time.perf_counter() - t0
            result.prefill_tokens += sum(len(s.prompt_ids) for s in group)
            done = [False] * len(group)
            ids = _next(logits, forced, g, 0, samplers, group, done)
            done = _append(group, ids.tolist(), logits, eos, keep_logits, done, on_token, g, forced)
            if g == 0:
                result.ttft_s = time.perf_counter() - t_start
            t0 = time.perf_counter()
            # Every row steps on, finished ones too (their tokens are dropped): the next ids
            # are the last argmax and the positions one more, no tensors made from lists.
            positions = torch.tensor([len(s.prompt_ids) for s in group], device=device)
            for step in range(1, max_new_tokens):
                if all(done):
                    break
                governor.step()
                logits = model.decode(ids, positions, caches)  # [B, vocab]
                ids = _next(logits, forced, g, step, samplers, group, done)
                done = _append(group, ids.tolist(), logits, eos, keep_logits, done, on_token, g, forced)
                positions = positions + 1
                result.decode_steps += 1
            result.decode_s += time.perf_counter() - t0
    finally:
        governor.restore()
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


def _next(logits: torch.Tensor, forced, first: int, step: int, samplers=None, group=(), done=()) -> torch.Tensor:
    """The tokens a step takes: the argmax, each row's sampler's choice, or the forced ones
    (a finished row: any)."""
    if samplers is not None and forced is None:
        ids = logits.argmax(dim=-1)
        for i, (s, finished) in enumerate(zip(group, done)):
            if not finished:
                choice = samplers[first + i].choose(logits[i])
                ids[i] = choice.token
                if choice.logprob is not None:
                    s.choices.append(choice)
        return ids
    if forced is None:
        return logits.argmax(dim=-1)
    rows = forced[first : first + logits.shape[0]]
    return torch.tensor([f[step] if step < len(f) else 0 for f in rows], device=logits.device)


def _append(group, next_ids: list[int], logits, eos, keep_logits, done, on_token, first: int, forced=None) -> list[bool]:
    out = []
    for i, (s, token, row, finished) in enumerate(zip(group, next_ids, logits, done)):
        if not finished:
            s.new_ids.append(token)
            if keep_logits:
                s.logits.append(row.clone())
            if on_token is not None and on_token(first + i, s):
                s.stopped = True
        out.append(finished or s.stopped or token in eos or (forced is not None and len(s.new_ids) == len(forced[first + i])))
    return out
