"""What a generation gives back, as the Session, its Service and the CLI stream and return
it: each prompt's Completion, its TokenEvents as the tokens come, the Timings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

from .check import CheckReport
from .generate import Generation
from .sampling import Choice
from .stops import StopText

# A prompt: text, token ids, or a conversation ({"role", "content"} dicts).
Prompt = Union[str, Sequence[int], Sequence[dict]]


@dataclass(frozen=True)
class Timings:
    """Seconds, of one generate() call (load_s and setup_s: of Session.open)."""

    load_s: float  # Bundle.load
    setup_s: float  # all of Session.open: the bundle, the weights, binding, the caches
    ttft_s: float  # from the call to the first token
    prefill_s: float
    prefill_tokens: int
    decode_s: float
    decode_steps: int
    decode_tokens_per_s: float
    exchange_s: float = 0.0  # data-parallel ranks: the per-step all-gathers of every rank's tokens
    idle_calls: int = 0  # data-parallel ranks: calls this rank ran in lockstep with no row of its own


@dataclass(frozen=True)
class Completion:
    """What one prompt generated."""

    prompt_ids: list[int]
    ids: list[int]  # the new tokens
    text: str | None  # their text, special tokens left out, cut before a stop string (None: no tokenizer.json)
    finish_reason: str  # "stop": a stop token (the last id) or stop string ended it; "length": max_new_tokens did; "abort": a Service handle was aborted
    logprobs: list[Choice] | None = None  # per new token, where SamplingParams.logprobs asked for them


class Completions(list):
    """The completions of one generate() call, in prompt order, and its timings; with
    check=True, the fidelity check of this same generation against eager (.check)."""

    def __init__(self, items: list[Completion], timings: Timings, check: CheckReport | None = None):
        super().__init__(items)
        self.timings, self.check = timings, check


@dataclass(frozen=True)
class TokenEvent:
    """One new token of prompt `index`: its id, and the text it completes. A character split
    across tokens comes whole with its last token, so the deltas join to the full text."""

    index: int
    token_id: int
    text: str


def token_events(tokenizer, n: int, new: int, eos_ids, stop: Sequence[str], on_token: Callable[[TokenEvent], None] | None):
    """runtime.generate's on_token for n prompts of at most `new` tokens: each new token as a
    TokenEvent with the text it completes, less what a stop string holds back; it returns
    True (the sequence ends) where the text reaches a stop string. Also the StopTexts, for
    completions(). (None, None) where there is nothing to call and no stop string."""
    if on_token is None and not stop:
        return None, None
    texts, eos = TextDeltas(tokenizer, n), set(eos_ids)
    stops = [StopText(stop) for _ in range(n)] if stop else None

    def emit(i: int, s) -> bool:
        last = len(s.new_ids) == new or s.new_ids[-1] in eos
        text, stopped = texts.step(i, s.new_ids, last), False
        if stops:
            text, stopped = stops[i].feed(text)
            text += stops[i].flush() if last and not stopped else ""
        if on_token is not None:
            on_token(TokenEvent(i, s.new_ids[-1], text))
        return stopped

    return emit, stops


def completions(gen: Generation, tokenizer, eos_ids, load_s: float, setup_s: float, check: CheckReport | None = None,
                stops: list[StopText] | None = None) -> Completions:  # fmt: skip
    """A runtime Generation as Completions: each sequence's text (special tokens left out;
    cut before its stop string, where one of `stops` ended it) and finish reason, the
    generation's timings (load_s, setup_s: what opening took)."""
    eos = set(eos_ids)
    items = [
        Completion(
            s.prompt_ids, s.new_ids,
            None if tokenizer is None else stops[i].text if s.stopped else tokenizer.decode(s.new_ids),
            "stop" if s.stopped or (s.new_ids and s.new_ids[-1] in eos) else "length",
            s.choices or None,
        )
        for i, s in enumerate(gen.sequences)
    ]  # fmt: skip
    t = Timings(load_s, setup_s, gen.ttft_s, gen.prefill_s, gen.prefill_tokens, gen.decode_s, gen.decode_steps, gen.decode_tokens_per_s, gen.exchange_s, gen.idle_calls)
    return Completions(items, t, check)


class TextDeltas:
    """Per prompt, the text each new token completes (tokenizers' DecodeStream, which holds
    back a character split across tokens), special tokens left out. A sequence's last token
    also brings what is still held back, as the whole decode writes it (a character cut off
    at the end: U+FFFD), so that the deltas join to Completion.text."""

    def __init__(self, tokenizer, n: int):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.streams = [DecodeStream(skip_special_tokens=True) for _ in range(n)] if tokenizer is not None else None
        self.sent = [""] * n

    def step(self, i: int, ids: list[int], last: bool) -> str:
        if self.streams is None:
            return ""
        text = self.streams[i].step(self.tokenizer, ids[-1]) or ""
        self.sent[i] += text
        if last:
            whole = self.tokenizer.decode(ids)
            if whole.startswith(self.sent[i]):
                text += whole[len(self.sent[i]) :]
                self.sent[i] = whole
        return text
