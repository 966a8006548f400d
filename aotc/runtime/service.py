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
import queue
import threading
import time
from typing import Iterator, Sequence

import torch

from ..errors import AotcError
from .engine import Engine, Request
from .sampling import SamplingParams
from .session import Completion, Prompt, Session, TokenEvent, token_events
from .threads import ThreadGovernor

_END = object()  # a handle's last event: its request ended (or the engine failed)


class QueueFull(AotcError):
    """More requests wait for a slot than the service takes (Session.service(max_waiting=))."""


class Handle:
    """One submitted request: iterate it (or `async for`) for its TokenEvents, result()
    (or `await handle`) for its Completion, abort() to end it. One reader per handle."""

    def __init__(self, service: "Service", request: Request, emit, stops):
        self.id = request.id
        self.request = request
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

    def _waker(self):
        handle = self

        class Registered:  # wakes an asyncio reader (its loop, its event) at each event
            def __enter__(self):
                self.waker = (asyncio.get_running_loop(), asyncio.Event())
                handle._wakers.append(self.waker)
                return self.waker[1]

            def __exit__(self, *exc):
                handle._wakers.remove(self.waker)

        return Registered()

    # -- the engine thread's side --------------------------------------------------------
    def _token(self, request: Request) -> bool:
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
        self._push(_END)


class Service:
    """A Session's engine, stepped on a thread of its own (module docstring). Open it with
    session.service(); close it (or leave its `with`) to stop the thread. max_waiting:
    the most requests that may wait for a slot; one more is refused (QueueFull)."""

    def __init__(self, session: Session, *, max_waiting: int | None = None):
        if session.world_size > 1:
            raise AotcError(
                f"{session.bundle.dir} runs on {session.world_size} ranks: a service needs rank 0 to plan each step "
                "for every rank, which is not built yet; generate() runs parallel bundles"
            )
        if max_waiting is not None and max_waiting < 0:
            raise AotcError(f"max_waiting: {max_waiting}; expected a count >= 0, or None for no limit")
        b = session.bundle
        self.session, self.max_waiting = session, max_waiting
        self.engine = Engine(
            session.model, session._caches, slots=b.cache_slots, max_seq=b.max_seq, chunk=max(b.manifest.shapes.chunk),
            eos_ids=session.defaults.eos_token_ids,
        )  # fmt: skip
        self.error: BaseException | None = None  # what stopped the engine thread, if it failed
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # submit's checks against close() and max_waiting
        self._queued = 0  # submitted, not yet handed to the engine
        self._closing = False
        self._deadline: float | None = None  # close(timeout): when what is still running is aborted
        self._live: list[Handle] = []
        self._thread = threading.Thread(target=self._loop, name="aotc-engine", daemon=True)
        self._thread.start()

    def submit(
        self, prompt: Prompt, *, max_tokens: int | None = None, chat: bool = False, sampling: SamplingParams | None = None,
        stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
    ) -> Handle:  # fmt: skip
        """Queue a prompt (text, token ids, or chat messages; chat=True sends text as a user
        turn) for up to max_tokens new tokens (default: generation_config.json's). It ends at
        the model's stop tokens, any of stop_token_ids, or where its text reaches one of the
        stop strings. Refused here (AotcError) where it cannot run; from any thread."""
        s = self.session
        ids = s.encode(prompt, chat)
        new = max_tokens if max_tokens is not None else s.defaults.max_new_tokens
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise AotcError(f"sampling: expected a SamplingParams, got {type(sampling).__name__}")
        vocab = s.model.config.vocab_size
        bad = [t for t in stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise AotcError(f"stop_token_ids: {bad[0]!r} is not a token id of the model's vocabulary (0 to {vocab - 1})")
        stops = s._stops(stop)
        request = self.engine.request(ids, new, sampling, stop_ids=stop_token_ids)
        emit, texts = token_events(s.tokenizer, 1, new, request.stop_ids, stops, lambda event: handle._push(event))
        handle = Handle(self, request, emit, texts)
        request.on_token = handle._token if emit is not None else None
        with self._lock:
            if self.error is not None:
                raise AotcError(f"the engine failed and takes no more requests: {self.error}") from self.error
            if self._closing:
                raise AotcError("this service is closed; open another with session.service()")
            waiting = self._queued + len(self.engine.waiting)
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests already wait for a slot (max_waiting {self.max_waiting}); try again later")
            self._queued += 1
            self._inbox.put(("submit", handle))
        return handle

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

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        self.close(timeout=0 if exc[0] is not None else None)

    # -- the engine thread ---------------------------------------------------------------
    def _loop(self) -> None:
        governor = ThreadGovernor(self.session.threads)
        try:
            with torch.no_grad():
                while True:
                    self._take(block=self.engine.idle)
                    if self._closing and (self.engine.idle or self._past_deadline()):
                        if not self.engine.idle:
                            for h in self._live:
                                self.engine.abort(h.request)
                            self.engine.step()  # frees their slots
                        self._finish()
                        return
                    if self.engine.idle:
                        continue
                    governor.step()
                    self.engine.step()
                    self._finish()
        except BaseException as e:  # every reader gets it; new requests are refused naming it
            with self._lock:
                self.error = e
            self._take(block=False)
            for h in self._live:
                h._end(self.session.tokenizer, e)
            self._live.clear()
        finally:
            governor.restore()

    def _take(self, block: bool) -> None:
        """What callers sent: new requests into the engine, aborts; blocks for one when asked."""
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
                self.engine.add(handle.request)
            elif kind == "abort":
                self.engine.abort(handle.request)

    def _wait(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _finish(self) -> None:
        ended = [h for h in self._live if h.request.done]
        if ended:
            self._live = [h for h in self._live if not h.request.done]
            for h in ended:
                h._end(self.session.tokenizer)
