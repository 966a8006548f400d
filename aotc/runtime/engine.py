"""Continuous batching over a model's static buckets: a request joins at the next step
and leaves when it is done.

The engine owns a model (eager, or bound to a bundle) and its caches, and runs one step
at a time (`step()`), in the thread that calls it. Each cache slot but the last holds at
most one request; the last is the scratch slot that padding rows write. A step:

    1. frees the slots of finished and aborted requests; waiting requests take free
       slots, first come first served (with the prefix cache, each takes the longest
       prefix of its prompt that any slot holds, copied into its slot, and its prefill
       starts after it: runtime.prefix);
    2. one decode call over every decoding row, row i in slot i (the dispatcher pads them
       to the smallest batch bucket and context bucket that hold them, padding rows
       writing the scratch slot), each row's next token chosen by its request's sampler;
    3. one prefill chunk: the oldest prefilling request's next tokens, then as many of
       the not yet started requests as fit, packed into the same chunk
       (models/packing.py: only a chunk's first sequence continues one the cache holds).
       A request whose prompt ends in the chunk gets its first token.

Decode first, then one chunk: a long prompt delays the running streams by at most one
chunk per step (vllm-neuron's and vLLM's chunked-prefill order), and with nothing
decoding, chunks run back to back. A finished row leaves at once, and a new request
joins at the next step, where static groups kept every row stepping until the whole
group ended and new prompts waiting for the next group.

Data-parallel attention (a bundle built with --data-parallel-attention): each rank of the
launch runs its own requests in its own cache slots, and its MoE layers meet the other
ranks' in collectives, so the ranks step in lockstep. Every rank runs this same engine
over every request (the same submissions in the same order, the same decisions); the
global slot r * max_batch + l is slot l of rank r, a new request takes the rank with the
most free slots, and a rank runs only its own slots' rows:
    - one decode call of as many rows as the rank that needs the most (its highest
      decoding slot + 1), at the context bucket of the furthest row of any rank; a rank
      with fewer rows runs dead rows, one with none only dead rows;
    - one prefill call per rank: its oldest prefilling request's next tokens, padded to
      as many rows as the longest of the ranks' (a rank with nothing to prefill runs
      padding rows into its scratch slot);
    - one all-gather of the step's chosen tokens (of their logits, where a row samples or
      keeps its logits), after which every rank takes every row's token alike.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..errors import AotcError
from ..kvcache import Regions, copy_positions
from ..models.base import CausalLM
from ..parallel import data_parallel, settled
from .dispatch import context_floor, known_top, step_memos
from .prefix import PrefixIndex
from .sampling import Choice, Sampler, SamplingParams, greedy

GREEDY = SamplingParams()
DEFAULT_CHUNK = 128  # prompt tokens per step where no bundle says (the eager model, which takes any length)


@dataclass(eq=False)
class Request:
    """One prompt in the engine: what was asked, and what it has produced so far."""

    id: int
    prompt_ids: list[int]
    max_tokens: int
    sampler: Sampler | None  # None: greedy, no logprobs (the argmax of the step's row)
    on_token: Callable[["Request"], bool | None] | None  # after each new token; True ends the request (a stop string)
    keep_logits: bool = False
    forced: list[int] | None = None  # teacher forcing: these tokens, in place of the chosen ones
    stop_ids: frozenset[int] = frozenset()  # the model's eos ids and the request's own stop token ids
    new_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # per new token, [vocab] float32 (if kept)
    choices: list[Choice] = field(default_factory=list)  # per new token, with logprobs (if asked for)
    finish_reason: str | None = None  # "stop": a stop token or on_token ended it; "length"; "abort"
    stopped: bool = False  # on_token ended it (a stop string)
    slot: int | None = None
    prefilled: int = 0  # prompt tokens in the cache
    cached: int = 0  # of them, copied from another sequence's cache by the prefix cache (runtime.prefix), not computed
    first_token_at: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """The position of the token the next decode reads (the last one chosen)."""
        return len(self.prompt_ids) + len(self.new_ids) - 1


@dataclass
class EngineStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_steps: int = 0
    steps: int = 0
    exchange_s: float = 0.0  # data-parallel ranks: the all-gathers of each step's tokens
    idle_calls: int = 0  # data-parallel ranks: calls this rank ran with no row of its own, in lockstep
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of them, found in a slot and not prefilled


class Engine:
    """Continuous batching (module docstring) over `model` and its `caches` (allocated for
    `slots` cache slots, the last the scratch slot, and `max_seq` positions). max_batch:
    the most rows decoding at once (at most slots - 1: the bundle's largest batch bucket),
    on each rank where the model's ranks run data-parallel attention (module docstring).
    chunk: the most prompt tokens one step prefills (the bundle's prefill chunk).
    prefix_cache: reuse what slots hold of a new prompt's prefix (runtime.prefix); where
    the model or its caches cannot, `prefix_off` says why and none is reused."""

    def __init__(self, model: CausalLM, caches: dict, *, slots: int, max_seq: int, max_batch: int | None = None,
                 chunk: int = 128, eos_ids: Iterable[int] = (), prefix_cache: bool = False):  # fmt: skip
        if slots < 2:
            raise AotcError(f"slots: {slots}; expected at least 2 (one request and the scratch slot)")
        self.model, self.caches, self.max_seq, self.chunk = model, caches, max_seq, chunk
        self.max_batch = min(max_batch or slots - 1, slots - 1)
        self.eos = frozenset(eos_ids)
        self.device = next(model.parameters()).device
        layout = model.config.parallel
        # Data-parallel ranks: this rank, and how many share out the requests.
        self.rank, self.ranks = (model.config.rank, layout.world_size) if data_parallel(layout) else (0, 1)
        self.capacity = self.max_batch * self.ranks  # requests holding a slot at once
        self._memos = step_memos(model)  # found once, not per step
        self.free = list(range(self.capacity))  # each rank's scratch slot (slots - 1) is never handed out
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []  # in the order they took their slots
        self.decoding: list[Request] = []
        self.stats = EngineStats()
        self._ids = itertools.count()
        # The last decode's chosen tokens and positions, as tensors, and the largest position,
        # while no request has joined or left the decoding rows since: the next decode's
        # inputs without a list.
        self._carry: tuple[torch.Tensor, torch.Tensor, int] | None = None
        # The ranks of a parallel service: agree(tokens) returns rank 0's tokens for the
        # step's rows (a broadcast), so that every rank's requests go on alike.
        self.agree: Callable[[list[int]], list[int]] | None = None
        self.positions = model.cache_positions()  # each cache kind's (positions dim, positions per row), for the prefix cache's copies
        self.prefix_off = self._prefix_refusal() if prefix_cache else "not asked for"
        self.prefix = PrefixIndex(self.capacity) if self.prefix_off is None else None

    def _prefix_refusal(self) -> str | None:
        """Why this engine cannot reuse prefixes, or None."""
        if self.ranks > 1:
            return "data-parallel attention ranks each hold their own requests' slots"
        if self.positions is None:
            return f"{type(self.model).__name__} keeps a cache that is not indexed by position alone (cache_positions)"
        for kind in self.positions:
            cache = self.caches[kind]
            for part in cache.tensors.values() if isinstance(cache, Regions) else [cache]:
                device = None if isinstance(part, torch.Tensor) else part[0].device
                if device is not None and not device.copies:
                    return f"{type(device).__name__} has no copy between cache slots"
        return None

    # -- requests ---------------------------------------------------------------
    def submit(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams | None = None, **more) -> Request:
        """Queue a request (request()'s arguments); refused here where it cannot run."""
        request = self.request(prompt_ids, max_tokens, sampling, **more)
        self.add(request)
        return request

    def request(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams | None = None, *,
                on_token: Callable[[Request], bool | None] | None = None, keep_logits: bool = False,
                forced: list[int] | None = None, stop_ids: Iterable[int] = (), ignore_eos: bool = False) -> Request:  # fmt: skip
        """A request, checked, not yet queued (add()): refused (AotcError naming the limit)
        where it cannot run. It reads nothing that steps change, so another thread may call
        it while the engine steps (runtime.service). stop_ids: token ids that end it, beside
        the model's eos ids (ignore_eos: instead of them, so that it runs to max_tokens but
        for these, as a benchmark's fixed lengths need)."""
        if not prompt_ids:
            raise AotcError("prompt: empty; a request needs at least one prompt token")
        if max_tokens < 1:
            raise AotcError(f"max_tokens: {max_tokens}; expected at least 1")
        if len(prompt_ids) + max_tokens > self.max_seq:
            raise AotcError(
                f"prompt of {len(prompt_ids)} tokens with max_tokens {max_tokens} is {len(prompt_ids) + max_tokens} "
                f"positions, more than max_seq {self.max_seq}; shorten the prompt or lower max_tokens"
            )
        sampling = sampling or GREEDY
        sampler = None if sampling.greedy and sampling.logprobs is None else Sampler(sampling, prompt_ids)
        stops = frozenset(stop_ids) if ignore_eos else self.eos | frozenset(stop_ids)
        return Request(next(self._ids), list(prompt_ids), max_tokens, sampler, on_token, keep_logits, forced, stops)

    def add(self, request: Request) -> None:
        """Queue a request made by request(): it takes a slot at a step when one is free."""
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """End a request; its slot is free for the next step's requests."""
        if not request.done:
            request.finish_reason = "abort"

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)

    def run(self) -> None:
        """Step until every request is done."""
        while not self.idle:
            self.step()

    # -- one step ---------------------------------------------------------------
    def step(self) -> None:
        self._release()
        while self.waiting and self.free:
            request = self.waiting.popleft()
            if request.done:  # aborted while waiting
                continue
            request.slot = self._free_slot() if self.prefix is None else self._placed(request)
            self.prefilling.append(request)
        if self.ranks > 1:
            self._lockstep()
        else:
            if self.decoding:
                self._decode()
            if self.prefilling:
                self._prefill()
        if not (self.prefilling or self.decoding) and self.waiting:  # a bug of the engine's, not the caller's
            raise RuntimeError(f"engine stuck: {len(self.waiting)} requests wait and no slot is free or in use (free: {self.free})")
        self._release()  # what ended in this step: the engine is idle as soon as the last one is done
        self.stats.steps += 1

    def _free_slot(self) -> int:
        """The lowest free slot; across data-parallel ranks, of the rank with the most free."""
        if self.ranks == 1:
            return self.free.pop(0)
        per = [0] * self.ranks
        for slot in self.free:
            per[slot // self.max_batch] += 1
        rank = max(range(self.ranks), key=lambda r: (per[r], -r))
        slot = next(s for s in self.free if s // self.max_batch == rank)
        self.free.remove(slot)
        return slot

    def _placed(self, request: Request) -> int:
        """A free slot for the request, holding the longest prefix of its prompt that any
        slot holds: the slot itself where it is free, else copied there (one copy per cache
        kind and region, on the caches' device). Its prefill starts after the prefix."""
        prompt, index = request.prompt_ids, self.prefix
        source, n = index.lookup(prompt)
        slot = source if source in self.free else index.pick(self.free)
        self.free.remove(slot)
        if n and source != slot:
            for kind, (dim, per) in self.positions.items():
                copy_positions(self.caches[kind], dim, source, slot, n // per)
            index.touch(source)
        index.hold(slot, prompt[:n])  # what the slot held past the prefix is overwritten from here
        request.prefilled = request.cached = n
        self.stats.prefix_queries += len(prompt)
        self.stats.prefix_hits += n
        return slot

    def _release(self) -> None:
        for group in (self.prefilling, self.decoding):
            if any(r.done for r in group):
                self._free([r for r in group if r.done])
                group[:] = [r for r in group if not r.done]
                self._carry = None

    def _free(self, requests: list[Request]) -> None:
        """The slots of ended requests are free; with the prefix cache, each keeps what its
        request wrote: the prompt as far as it was prefilled and, once it was, every chosen
        token but the last (no step fed that one back)."""
        self.free = sorted(self.free + [r.slot for r in requests])
        for r in requests if self.prefix is not None else ():
            whole = r.prefilled == len(r.prompt_ids)
            self.prefix.hold(r.slot, r.prompt_ids + r.new_ids[:-1] if whole else r.prompt_ids[: r.prefilled])
            self.prefix.touch(r.slot)

    def _decode(self) -> None:
        # Row i of a decode graph is cache slot i, and its attention reads slots 0..B-1 as a
        # view (no gather of whole cache lines). So a step decodes slots 0 to the highest
        # decoding one; a slot in that range that is not decoding is a dead row, whose output
        # is dropped and whose write lands where its slot's owner writes before it reads: a
        # free slot's position 0, a prefilling request's next position. Slots are taken
        # lowest first, so dead rows are the holes that leaving requests make, until the next
        # requests fill them.
        rows = self.decoding  # in slot order
        b = rows[-1].slot + 1
        if self._carry is not None:
            ids, positions, top = self._carry[0], self._carry[1] + 1, self._carry[2] + 1
        elif b == len(rows):
            ids = torch.tensor([r.new_ids[-1] for r in rows], device=self.device)
            positions = [r.position for r in rows]
            top = max(positions)
            positions = torch.tensor(positions, device=self.device)
        else:
            owner = {r.slot: r for r in rows}
            filling = {r.slot: r.prefilled for r in self.prefilling}
            ids = torch.tensor([owner[s].new_ids[-1] if s in owner else 0 for s in range(b)], device=self.device)
            reach = max(r.position for r in rows)
            positions = [owner[s].position if s in owner else filling[s] if s in filling else self._dead_position(s, reach) for s in range(b)]
            top = max(positions)
            positions = torch.tensor(positions, device=self.device)
        t0 = time.perf_counter()
        known_top(self._memos, positions, top)  # its context bucket without reading it
        logits, argmax = self.model.decode_tokens(ids, positions, self.caches)  # [B, vocab], [B] or None
        if b != len(rows):
            live = [r.slot for r in rows]
            logits, argmax = logits[live], None if argmax is None else argmax[live]
        chosen = self._take(rows, logits, argmax)
        # Lists cost half of a step's host work (tens of microseconds): while the same rows
        # decode on, the next step takes these tensors.
        self._carry = (chosen, positions, top) if chosen is not None and b == len(rows) else None
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.decode_steps += 1

    def _dead_position(self, slot: int, reach: int) -> int:
        """Where a free slot's dead decode row writes: position 0, or with the prefix cache
        just past what the slot holds, which it keeps up to `reach` (the step's furthest
        row: a dead row must not take the step to a larger context bucket)."""
        if self.prefix is None:
            return 0
        held = self.prefix.held[slot]
        if len(held) > reach:
            self.prefix.hold(slot, held[:reach])
        return min(len(held), reach)

    def _prefill(self) -> None:
        # The oldest request's next tokens first (it may continue what the cache holds), then
        # requests not yet started, each from position 0, while the chunk has room.
        pieces, room = [], self.chunk
        for request in self.prefilling:
            if room == 0 or (pieces and request.prefilled):
                break
            n = min(room, len(request.prompt_ids) - request.prefilled)
            pieces.append((request, request.prefilled, n))
            room -= n
        t0 = time.perf_counter()
        ids = [torch.tensor(r.prompt_ids[start : start + n], device=self.device) for r, start, n in pieces]
        logits = self.model.prefill_batch(ids, [r.slot for r, _, _ in pieces], self.caches, start=pieces[0][1])
        finished, rows = [], []
        for i, (request, start, n) in enumerate(pieces):
            request.prefilled = start + n
            self.stats.prefill_tokens += n
            if self.prefix is not None:  # a running prompt's prefix is found as soon as it is written
                self.prefix.hold(request.slot, request.prompt_ids[: request.prefilled])
            if request.prefilled == len(request.prompt_ids):
                finished.append(request)
                rows.append(i)
        if finished:
            self._take(finished, logits[rows])
            self.prefilling = [r for r in self.prefilling if r not in finished]
            self._free([r for r in finished if r.done])  # its first token ended it
            started = [r for r in finished if not r.done]
            if started:
                self.decoding = sorted(self.decoding + started, key=lambda r: r.slot)
                self._carry = None
        self.stats.prefill_s += time.perf_counter() - t0

    def _lockstep(self) -> None:
        """One step of data-parallel ranks (module docstring): this rank's decode and prefill
        calls, as large as the largest rank's, then the all-gather of every rank's rows."""
        mb, mine = self.max_batch, self.rank
        decoding = [[r for r in self.decoding if r.slot // mb == k] for k in range(self.ranks)]
        rows = max((d[-1].slot % mb + 1 for d in decoding if d), default=0)
        pieces = []  # per rank: (request, start, tokens) or None
        for k in range(self.ranks):
            request = next((r for r in self.prefilling if r.slot // mb == k), None)
            pieces.append(None if request is None else (request, request.prefilled, min(self.chunk, len(request.prompt_ids) - request.prefilled)))
        chunk = max((p[2] for p in pieces if p), default=0)
        if not rows and not chunk:
            return
        out = []
        if rows:
            t0 = time.perf_counter()
            owner = {r.slot % mb: r for r in decoding[mine]}
            filling = {r.slot % mb: r.prefilled for r in self.prefilling if r.slot // mb == mine}
            ids = torch.tensor([owner[s].new_ids[-1] if s in owner else 0 for s in range(rows)], device=self.device)
            positions = torch.tensor([owner[s].position if s in owner else filling.get(s, 0) for s in range(rows)], device=self.device)
            self.stats.idle_calls += not decoding[mine]
            with context_floor(self._memos, max(r.position for r in self.decoding) + 1):
                # A copy: on a resident device the prefill below may run the head's graph again.
                out.append(self.model.decode(ids, positions, self.caches).to(torch.float32, copy=True))  # [rows, vocab]
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.decode_steps += 1
        if chunk:
            t0 = time.perf_counter()
            piece = pieces[mine]
            if piece is None:  # padding rows into the scratch slot only
                self.stats.idle_calls += 1
                self.model.prefill(torch.zeros(0, dtype=torch.long, device=self.device), 0, self.caches, rows=chunk)
                out.append(torch.zeros(1, self.model.config.vocab_size, device=self.device))
            else:
                request, start, n = piece
                ids = torch.tensor(request.prompt_ids[start : start + n], device=self.device)
                out.append(self.model.prefill(ids, request.slot % mb, self.caches, start=start, rows=chunk).to(torch.float32, copy=True)[None])
            self.stats.prefill_s += time.perf_counter() - t0
        # Every rank's rows: their tokens, or their logits where a row samples or keeps them.
        t0 = time.perf_counter()
        ending = [p[0] for p in pieces if p and p[1] + p[2] == len(p[0].prompt_ids)]
        full = any(r.sampler is not None or r.keep_logits for r in [*self.decoding, *ending])
        mine_rows = torch.cat(out)
        every = self._gather(mine_rows if full else mine_rows.argmax(dim=-1))  # [ranks, rows + (1 if chunk)]
        self.stats.exchange_s += time.perf_counter() - t0

        def take(requests, at):  # each request's row of every rank's rows: its logits, or its token
            picked = torch.stack([every[r.slot // mb, at(r)] for r in requests])
            self._take(requests, picked, None) if full else self._take(requests, None, picked)

        if rows:
            take([r for d in decoding for r in d], lambda r: r.slot % mb)  # in global slot order, as self.decoding
        for p in pieces:
            if p is not None:
                request, start, n = p
                request.prefilled = start + n
                self.stats.prefill_tokens += n
        if ending:
            take(ending, lambda r: rows)  # the prefill row follows the decode rows
            self.prefilling = [r for r in self.prefilling if r not in ending]
            self.free = sorted(self.free + [r.slot for r in ending if r.done])  # its first token ended it
            started = [r for r in ending if not r.done]
            self.decoding = sorted(self.decoding + started, key=lambda r: r.slot)

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's `mine`, stacked in rank order."""
        import torch.distributed as dist

        mine = mine.contiguous()
        every = [torch.empty_like(mine) for _ in range(self.ranks)]
        dist.all_gather(every, mine)
        settled(mine, *every)
        return torch.stack(every)

    def _take(self, rows: list[Request], logits: torch.Tensor | None, argmax: torch.Tensor | None = None) -> torch.Tensor | None:
        """Each row's next token from its row of logits [rows, vocab] (or, where every row
        takes the argmax and keeps no logits, from `argmax`, [rows]; given both, a greedy
        row's token is argmax's, the logits' argmax a graph computed); ends the rows that are
        done. Returns the tokens as a tensor where that is the argmax's own (every row greedy)."""
        argmax = greedy(logits) if argmax is None else argmax
        tokens = argmax.tolist()
        plain = True
        for i, request in enumerate(rows):
            if request.done:  # aborted during the step
                continue
            if request.forced is not None:
                tokens[i], plain = request.forced[len(request.new_ids)], False
            elif request.sampler is not None:
                choice = request.sampler.choose(logits[i])
                tokens[i], plain = choice.token, False
                if choice.logprob is not None:
                    request.choices.append(choice)
        if self.agree is not None:  # the ranks of a parallel service: each takes rank 0's tokens
            agreed = self.agree(tokens)
            plain, tokens = plain and agreed == tokens, agreed
        now = time.perf_counter()
        for i, (request, token) in enumerate(zip(rows, tokens)):
            if request.done:
                continue
            request.new_ids.append(token)
            if request.first_token_at is None:
                request.first_token_at = now
            if request.keep_logits:
                request.logits.append(logits[i].float().clone())
            request.stopped = bool(request.on_token is not None and request.on_token(request))
            if request.forced is not None:
                if len(request.new_ids) == len(request.forced):
                    request.finish_reason = "length"
            elif request.stopped or token in request.stop_ids:
                request.finish_reason = "stop"
            elif len(request.new_ids) == request.max_tokens:
                request.finish_reason = "length"
        return argmax if plain else torch.tensor([r.new_ids[-1] for r in rows], device=self.device)
