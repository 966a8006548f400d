"""Choosing each request's next token from a step's logits, on the host.

One `Sampler` per request: its own parameters, its own random stream (seeded per
request, so its tokens do not depend on which requests share its steps) and its own
token counts for the penalties. In the order vLLM and llama.cpp's server apply them:

    logits [vocab] (float32)
      -> repetition_penalty (prompt and output tokens: a positive logit divided, a negative multiplied)
      -> presence_penalty, frequency_penalty (output tokens: minus p once, minus f per time)
      -> temperature (0: the argmax, and nothing after this applies)
      -> top_k, top_p, min_p (each keeps the most likely tokens it allows; the first always stays)
      -> one draw from what is left

`logprobs` are the model's own: log_softmax of the step's logits before any of the
above, as vLLM reports them by default, so that they measure the model and not the
settings.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import AotcError


class SamplingError(AotcError):
    """A sampling parameter out of its range."""


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens. The defaults are greedy decoding."""

    temperature: float = 0.0  # 0: the argmax
    top_k: int = 0  # 0: every token
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: a stream of its own from os.urandom
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # report the chosen token's log-probability and the top N (0: the chosen one's only)

    def __post_init__(self):
        def bad(field: str, expected: str):
            raise SamplingError(f"{field}: {getattr(self, field)!r}; expected {expected}")

        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            bad("temperature", "a number >= 0 (0: greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0: off)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad("top_p", "a number in (0, 1] (1: off)")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            bad("min_p", "a number in [0, 1] (0: off)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63):
            bad("seed", "an integer in [0, 2^63)")
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and -2 <= value <= 2):
                bad(field, "a number in [-2, 2] (0: off), as OpenAI's API allows")
        if not (isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            bad("repetition_penalty", "a number > 0 (1: off)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "an integer in [0, 20], as OpenAI's top_logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Choice:
    """One step's pick for one request."""

    token: int
    logprob: float | None = None  # the model's log-probability of `token` (SamplingParams.logprobs)
    top: list[tuple[int, float]] | None = None  # the N most likely tokens and their log-probabilities


class Sampler:
    """One request's token picker (module docstring)."""

    def __init__(self, params: SamplingParams, prompt: list[int]):
        self.params = params
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        # The tokens the penalties read: repetition's sees the prompt and the output, presence's
        # and frequency's the output only (OpenAI's definition, vLLM's and llama.cpp's too).
        self.seen = set(prompt)
        self.counts: dict[int, int] = {}

    def choose(self, logits: torch.Tensor) -> Choice:
        """The next token from one row's logits [vocab]; remembers it for the penalties."""
        logits = logits.float()
        token = self._pick(self._penalized(logits))
        choice = Choice(token)
        if self.params.logprobs is not None:
            model = torch.log_softmax(logits, dim=-1)
            choice.logprob = model[token].item()
            if self.params.logprobs:
                values, ids = model.topk(self.params.logprobs)
                choice.top = list(zip(ids.tolist(), values.tolist()))
        self.seen.add(token)
        self.counts[token] = self.counts.get(token, 0) + 1
        return choice

    def _penalized(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        repeated = p.repetition_penalty != 1 and self.seen
        present = (p.presence_penalty or p.frequency_penalty) and self.counts
        if not (repeated or present):
            return logits
        logits = logits.clone()  # the step's logits stay as the model gave them (logprobs, other rows)
        if repeated:
            ids = torch.tensor(sorted(self.seen))
            picked = logits[ids]
            logits[ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if present:
            ids = torch.tensor(list(self.counts))
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
        return logits

    def _pick(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(greedy(logits))
        probs = kept_probabilities(logits / p.temperature, p.top_k, p.top_p, p.min_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of [rows, vocab] logits, [rows] int64: the first of equal maxima,
    and a NaN before any number, as torch.argmax. Host float32 logits go through numpy,
    whose argmax is vectorized where torch's CPU argmax is a scalar loop (SmolLM2's 49152
    logits: 63 us a row, numpy 3 us; 253 against 22 us for 8 rows)."""
    if type(logits) is torch.Tensor and logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(np.asarray(logits.numpy().argmax(axis=-1)))  # one row: a 0-d array
    return logits.argmax(dim=-1)


def kept_probabilities(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """softmax(logits) with what top_k, top_p and min_p drop set to 0, renormalized: the
    distribution a draw is made from. top_p keeps the smallest set of most likely tokens
    whose probabilities reach top_p; min_p keeps the tokens at least min_p times as likely
    as the most likely one. The most likely token always stays."""
    probs = torch.softmax(logits, dim=-1)
    if top_k or top_p < 1 or min_p > 0:
        sorted_probs, order = probs.sort(descending=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if top_k:
            keep[top_k:] = False
        if top_p < 1:
            before = sorted_probs.cumsum(0) - sorted_probs  # the mass of the more likely tokens
            keep &= before < top_p
        if min_p > 0:
            keep &= sorted_probs >= min_p * sorted_probs[0]
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs * keep)
        probs = probs / probs.sum()
    return probs
