"""A Session's engine on a thread of its own, taking requests from any thread or asyncio
task: what a server runs.

    with Session.open("artifacts/tiny") as session, session.service() as service:
        handle = service.submit("The capital of France is", max_tokens=16)
        for event in handle:              # TokenEvents as the tokens come
            print(event.text, end="")
        print(handle.result().finish_reason)

        async def ask(prompt):            # from asyncio: the same handle, awaited
            handle = service.submit(prompt, sampling=SamplingParams(temperature=0.7))
            async for event in handle:
                ...
            return await handle           # the Completion

One thread, the engine's, owns the model and its caches and steps the engine
(runtime.engine): callers only enqueue and wait. A request is checked in the
caller's thread when it is submitted (an AotcError names what is wrong); each new
token reaches its handle as a TokenEvent, with the text it completes less what a
stop string may still claim. A handle left before its end (its iterator closed, or
abort()) ends its request at the next step, and its slot goes to the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import queue
import struct
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from ..errors import AotcError
from ..parallel import settled
from .completion import Completion, Prompt, TokenEvent, token_events
from .engine import Engine, Request
from .sampling import SamplingParams
from .threads import ThreadGovernor

if TYPE_CHECKING:  # a Service is opened by Session.service(): session imports service, not back
    from .session import Session

_END = object()  # a handle's last event: its request ended (or the engine failed)
HEARTBEAT = 1.0  # s: an idle rank 0 plans an empty step this often, well within the process group's timeout


class QueueFull(AotcError):
    """More requests wait for a slot than the service takes (Session.service(max_waiting=))."""


class Handle:
    """One submitted request: iterate it (or `async for`) for its TokenEvents, result()
    (or `await handle`) for its Completion, abort() to end it. One reader per handle."""

    def __init__(self, service: "Service", request: Request, sampling: SamplingParams | None, emit, stops):
        self.id = request.id
        self.request = request
        self.sampling = sampling  # as the engine got it (on ranks, seeded)
        self.shed = False  # ended before it took a slot, by Service.shed()
        self.on_time: Callable[[float], None] | None = None  # on the engine thread: each token's time (perf_counter)
        self.on_end: Callable[[], None] | None = None  # on the engine thread, once the request has ended
        self._service, self._emit, self._stops = service, emit, stops
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._ended = threading.Event()
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # -- the reader's side ---------------------------------------------------------------
    def __iter__(self) -> Iterator[TokenEvent]:
        ended = False
        try:
            while (item := self._events.get()) is not _END:
                yield item
            ended = True
        finally:
            if not ended:  # the reader left early: the request ends at the next step
                self.abort()
        self._raise()

    def __aiter__(self):
        return self._aevents()

    async def _aevents(self):
        ended = False
        with self._waker() as wake:
            try:
                while True:
                    try:
                        item = self._events.get_nowait()
                    except queue.Empty:
                        await wake.wait()
                        wake.clear()
                        continue
                    if item is _END:
                        ended = True
                        break
                    yield item
            finally:
                if not ended:
                    self.abort()
        self._raise()

    def result(self, timeout: float | None = None) -> Completion:
        """The Completion, once the request has ended (finish_reason "stop", "length" or
        "abort"); raises the engine's error where it failed, TimeoutError after timeout s."""
        if not self._ended.wait(timeout):
            raise TimeoutError(f"request {self.id} has not ended after {timeout} s")
        self._raise()
        return self._completion

    def __await__(self):
        return self._result().__await__()

    async def _result(self) -> Completion:
        with self._waker() as wake:
            while not self._ended.is_set():
                await wake.wait()
                wake.clear()
        return self.result()

    def abort(self) -> None:
        """End the request: at the next step, wherever it is (waiting, prefilling, decoding)."""
        if not self._ended.is_set():
            self._service._inbox.put(("abort", self))

    def _raise(self) -> None:
        if self._error is not None:
            raise AotcError(f"request {self.id}: the engine failed: {self._error}") from self._error

    @contextlib.contextmanager
    def _waker(self):
        """An asyncio.Event that the engine thread sets (in the reader's loop) at each event."""
        waker = (asyncio.get_running_loop(), asyncio.Event())
        self._wakers.append(waker)
        try:
            yield waker[1]
        finally:
            self._wakers.remove(waker)

    # -- the engine thread's side --------------------------------------------------------
    def _token(self, request: Request) -> bool:
        if self.on_time is not None:
            self.on_time(time.perf_counter())
        return self._emit(0, request)

    def _push(self, item) -> None:
        self._events.put(item)
        for loop, wake in list(self._wakers):
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the reader's loop is closed: nobody waits there
                pass

    def _end(self, tokenizer, error: BaseException | None = None) -> None:
        r = self.request
        if error is None:
            stops = self._stops[0] if self._stops else None
            text = None if tokenizer is None else stops.text if r.stopped else tokenizer.decode(r.new_ids)
            self._completion = Completion(r.prompt_ids, r.new_ids, text, r.finish_reason, r.choices or None)
        self._error = error
        self._ended.set()
        if self.on_end is not None:
            self.on_end()
        self._push(_END)


class Service:
    """A Session's engine, stepped on a thread of its own (module docstring). Open it with
    session.service(); close it (or leave its `with`) to stop the thread. max_waiting:
    the most requests that may wait while every slot is taken; one more is refused
    (QueueFull). prefix_cache: reuse what cache slots hold of a new prompt's prefix
    (runtime.prefix)."""

    def __init__(self, session: Session, *, max_waiting: int | None = None, prefix_cache: bool = True):
        if max_waiting is not None and max_waiting < 0:
            raise AotcError(f"max_waiting: {max_waiting}; expected a count >= 0, or None for no limit")
        b = session.bundle
        self.session, self.max_waiting = session, max_waiting
        self.engine = Engine(
            session.model, session._caches, slots=b.cache_slots, max_seq=b.max_seq, chunk=max(b.manifest.shapes.chunk),
            eos_ids=session.defaults.eos_token_ids, prefix_cache=prefix_cache,
        )  # fmt: skip
        self.rank, self.world_size = session.rank, session.world_size
        self.error: BaseException | None = None  # what stopped the engine thread, if it failed
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # submit's checks against close() and max_waiting
        self._queued = 0  # submitted, not yet handed to the engine
        self._closing = False
        self._deadline: float | None = None  # close(timeout): when what is still running is aborted
        self._live: list[Handle] = []
        self._new: list[Handle] = []  # taken since the last plan (rank 0 tells the other ranks)
        self._aborted: list[int] = []  # the ids of requests aborted or stopped since the last plan
        if self.world_size > 1:  # a parallel bundle: rank 0 plans each step and picks the tokens
            from ..parallel import rank_timeout

            self._heartbeat = min(HEARTBEAT, rank_timeout().total_seconds() / 4)  # the others wait in a collective meanwhile
            self._plan = _Plan(self.engine.device)
            if self.engine.ranks == 1:  # every rank runs every row: each takes rank 0's tokens
                self.engine.agree = self._agree  # (data-parallel ranks gather every rank's tokens: runtime.engine)
        self._thread = threading.Thread(target=self._loop, name="aotc-engine", daemon=True)
        self._thread.start()

    def submit(
        self, prompt: Prompt, *, max_tokens: int | None = None, chat: bool = False, sampling: SamplingParams | None = None,
        stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
    ) -> Handle:  # fmt: skip
        """Queue a prompt (text, token ids, or chat messages; chat=True sends text as a user
        turn) for up to max_tokens new tokens (default: generation_config.json's). It ends at
        the model's stop tokens (unless ignore_eos), any of stop_token_ids, or where its text
        reaches one of the stop strings. Refused here (AotcError) where it cannot run; from any thread."""
        s = self.session
        if self.rank != 0:
            raise AotcError(f"this is rank {self.rank} of {self.world_size}: submit requests on rank 0; the other ranks follow its plan")
        ids = s.encode(prompt, chat)
        new = max_tokens if max_tokens is not None else s.defaults.max_new_tokens
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise AotcError(f"sampling: expected a SamplingParams, got {type(sampling).__name__}")
        vocab = s.model.config.vocab_size
        bad = [t for t in stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise AotcError(f"stop_token_ids: {bad[0]!r} is not a token id of the model's vocabulary (0 to {vocab - 1})")
        stops = s._stops(stop)
        if self.world_size > 1 and sampling is not None and sampling.seed is None:  # the other ranks draw alike (they take rank 0's tokens, too)
            sampling = dataclasses.replace(sampling, seed=int.from_bytes(os.urandom(8), "little") >> 1)
        request = self.engine.request(ids, new, sampling, stop_ids=stop_token_ids, ignore_eos=ignore_eos)
        emit, texts = token_events(s.tokenizer, 1, new, request.stop_ids, stops, lambda event: handle._push(event))
        handle = Handle(self, request, sampling, emit, texts)
        request.on_token = handle._token
        with self._lock:
            if self.error is not None:
                raise AotcError(f"the engine failed and takes no more requests: {self.error}") from self.error
            if self._closing:
                raise AotcError("this service is closed; open another with session.service()")
            running, waiting = self.counts()
            if self.max_waiting is not None and running + waiting >= self.engine.capacity + self.max_waiting:
                raise QueueFull(f"{running} requests run and {waiting} wait for a slot ({self.engine.capacity} slots, max_waiting {self.max_waiting}); try again later")
            self._queued += 1
            self._inbox.put(("submit", handle))
        return handle

    def counts(self) -> tuple[int, int]:
        """(running, waiting): requests holding a slot, and those waiting for one."""
        e = self.engine
        return len(e.prefilling) + len(e.decoding), self._queued + len(e.waiting)

    def alive(self, timeout: float = 5.0) -> bool:
        """Whether the engine thread answers within `timeout` s, between two steps: false
        while a step hangs, or after the engine failed or was closed."""
        if self.error is not None or not self._thread.is_alive():
            return False
        answered = threading.Event()
        self._inbox.put(("ping", answered))
        return answered.wait(timeout)

    def shed(self) -> None:
        """End every request that waits for a slot (finish_reason "abort", handle.shed), at
        the next step: a server that drains sheds what has not started."""
        self._inbox.put(("shed", None))

    def close(self, timeout: float | None = None) -> None:
        """Take no more requests; let those submitted run to their end (for at most
        `timeout` s, then abort what is left; 0: abort at once), and stop the thread."""
        with self._lock:
            self._closing = True
            if timeout is not None:
                self._deadline = time.monotonic() + timeout
        self._inbox.put(("wake", None))
        self._thread.join()
        self.session._service = None
        if self.rank != 0 and self.error is not None:  # rank 0's handles report it; here nothing else would
            raise AotcError(f"rank {self.rank}'s engine failed: {self.error}") from self.error

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        self.close(timeout=0 if exc[0] is not None else None)

    # -- the engine thread ---------------------------------------------------------------
    def _loop(self) -> None:
        governor = ThreadGovernor(self.session.threads)
        try:
            with torch.no_grad():
                (self._lead if self.rank == 0 else self._follow)(governor)
        except BaseException as e:  # every reader gets it; new requests are refused naming it
            with self._lock:
                self.error = e
            self._take(block=False)
            for h in self._live:
                h._end(self.session.tokenizer, e)
            self._live.clear()
        finally:
            governor.restore()

    def _lead(self, governor: ThreadGovernor) -> None:
        """Rank 0 (or the only rank): take what callers sent, tell the other ranks (a plan),
        step, hand out what ended."""
        while True:
            self._take(block=self.engine.idle)
            closing = self._closing and (self.engine.idle or self._past_deadline())
            if closing:
                for h in self._live:  # past the deadline: what still runs is aborted
                    self._abort(h.request)
            if self.world_size > 1:
                self._plan.send(self._new, self._aborted, closing)
            self._new, self._aborted = [], []
            if not self.engine.idle:
                governor.step()
                self.engine.step()
            self._finish()
            if closing:
                return

    def _follow(self, governor: ThreadGovernor) -> None:
        """Another rank: rank 0's plan, then the same step (its graphs' collectives with it)."""
        mine: dict[int, Request] = {}
        while True:
            new, aborted, closing = self._plan.receive()
            for ids, max_tokens, sampling, stop_ids, rid in new:
                # stop_ids is rank 0's whole set (its eos ids unless ignore_eos), and its id is
                # rank 0's: callers' threads number requests in another order than they arrive.
                request = self.engine.request(ids, max_tokens, sampling, stop_ids=stop_ids, ignore_eos=True)
                request.id = rid
                mine[rid] = request
                self.engine.add(request)
            for rid in aborted:
                if rid in mine:
                    self.engine.abort(mine[rid])
            if not self.engine.idle:
                governor.step()
                self.engine.step()
            mine = {rid: r for rid, r in mine.items() if not r.done}
            if closing:
                return

    def _abort(self, request: Request) -> None:
        if not request.done:
            self.engine.abort(request)
        self._aborted.append(request.id)

    def _agree(self, tokens: list[int]) -> list[int]:
        import torch.distributed as dist

        chosen = torch.tensor(tokens, dtype=torch.int64, device=self.engine.device)
        dist.broadcast(chosen, src=0)
        settled(chosen)
        return chosen.tolist()

    def _take(self, block: bool) -> None:
        """What callers sent: new requests into the engine, aborts; blocks for one when asked
        (on ranks, for at most HEARTBEAT s: the other ranks wait in a collective meanwhile)."""
        while True:
            try:
                kind, handle = self._inbox.get(timeout=self._wait()) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                with self._lock:
                    self._queued -= 1
                self._live.append(handle)
                self._new.append(handle)
                self.engine.add(handle.request)
            elif kind == "abort":
                self._abort(handle.request)
            elif kind == "ping":
                handle.set()
            elif kind == "shed":
                for h in self._live:
                    if h.request.slot is None:
                        h.shed = True
                        self._abort(h.request)

    def _wait(self) -> float | None:
        waits = [self._deadline - time.monotonic()] if self._deadline is not None else []
        waits += [self._heartbeat] if self.world_size > 1 else []
        return max(0.0, min(waits)) if waits else None

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _finish(self) -> None:
        ended = [h for h in self._live if h.request.done]
        if ended:
            self._live = [h for h in self._live if not h.request.done]
            for h in ended:
                if h.request.stopped:  # a stop string, which only rank 0 reads: the others end it at the next step
                    self._aborted.append(h.id)
                h._end(self.session.tokenizer)


class _Plan:
    """Rank 0's word to the other ranks before each step, as int64 tensors broadcast from
    rank 0: a header of HEADER ints (closing, new requests, aborted ones, the body's
    length), then the body where it does not fit in the header's rest. A new request is
    its id, its lengths, max_tokens, its SamplingParams (floats as their 64 bits), its
    prompt and its stop token ids."""

    HEADER = 64

    def __init__(self, device):
        self.device = device

    def send(self, new: list[Handle], aborted: list[int], closing: bool) -> None:
        body = []
        for h in new:
            r = h.request
            body += [r.id, len(r.prompt_ids), r.max_tokens, len(r.stop_ids), *_params(h.sampling), *r.prompt_ids, *sorted(r.stop_ids)]
        body += aborted
        self._broadcast([int(closing), len(new), len(aborted), len(body)], body)

    def receive(self) -> tuple[list, list[int], bool]:
        closing, n_new, n_aborted, body = self._broadcast(None, None)
        new, at = [], 0
        for _ in range(n_new):
            rid, n, max_tokens, n_stop = body[at : at + 4]
            at += 4
            sampling = _sampling(body[at : at + len(_FIELDS)])
            at += len(_FIELDS)
            ids, stop = body[at : at + n], body[at + n : at + n + n_stop]
            at += n + n_stop
            new.append((ids, max_tokens, sampling, stop, rid))
        return new, body[at : at + n_aborted], bool(closing)

    def _broadcast(self, head: list[int] | None, body: list[int] | None):
        import torch.distributed as dist

        header = torch.zeros(self.HEADER, dtype=torch.int64, device=self.device)
        inline = self.HEADER - 4
        if head is not None:
            header[:4] = torch.tensor(head)
            if len(body) <= inline:
                header[4 : 4 + len(body)] = torch.tensor(body, dtype=torch.int64)
        dist.broadcast(header, src=0)
        settled(header)
        closing, n_new, n_aborted, length = header[:4].tolist()
        if length <= inline:
            return closing, n_new, n_aborted, header[4 : 4 + length].tolist()
        rest = torch.tensor(body, dtype=torch.int64, device=self.device) if head is not None else torch.empty(length, dtype=torch.int64, device=self.device)
        dist.broadcast(rest, src=0)
        settled(rest)
        return closing, n_new, n_aborted, rest.tolist()


_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs")
_INTS = frozenset({"top_k", "seed", "logprobs"})  # the others are floats, sent as their 64 bits


def _params(sampling: SamplingParams | None) -> list[int]:
    """A request's SamplingParams as int64s: integers as they are (None: -1), floats as their bits."""
    p = sampling or SamplingParams()
    values = [getattr(p, name) for name in _FIELDS]
    return [(-1 if v is None else v) if name in _INTS else struct.unpack("<q", struct.pack("<d", v))[0] for name, v in zip(_FIELDS, values)]


def _sampling(values: list[int]) -> SamplingParams:
    """_params' inverse."""
    return SamplingParams(**{
        name: (None if v == -1 else v) if name in _INTS else struct.unpack("<d", struct.pack("<q", v))[0]
        for name, v in zip(_FIELDS, values)
    })  # fmt: skip
