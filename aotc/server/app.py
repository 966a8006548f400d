"""aotc serve's HTTP side: an OpenAI-compatible ASGI app (Starlette) over a Session's
service (runtime.service), which owns the model on its engine thread. Handlers only
check a request, submit it, and await its tokens; a client that goes away aborts its
request at the engine's next step.

    /v1/completions, /v1/chat/completions   streaming (SSE) or not
    /v1/models
    /tokenize, /detokenize                  as vLLM and llama.cpp have them
    /health                                 200 while the engine thread answers within 5 s
    /metrics                                Prometheus text, aotc:* named as vLLM's vllm:*
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..errors import AotcError
from ..runtime.service import Handle, QueueFull, Service
from ..runtime.session import Session
from .protocol import ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, decode

log = logging.getLogger("aotc.serve")
MAX_BODY = 8 << 20  # bytes: a body past it is a 413 (a 256k-token prompt as ids fits)
HEALTH_TIMEOUT = 5.0  # s the engine thread has to answer /health between two steps
# Seconds: latencies from a token's microseconds to a long prompt's minutes.
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own, labelled model_name."""

    def __init__(self, name: str, service: Service):
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.ttft = Histogram("aotc:time_to_first_token_seconds", "From a request's arrival to its first token", label, registry=r, buckets=BUCKETS).labels(name)
        self.itl = Histogram("aotc:inter_token_latency_seconds", "Between two tokens of a request", label, registry=r, buckets=BUCKETS).labels(name)
        self.e2e = Histogram("aotc:e2e_request_latency_seconds", "From a request's arrival to its end", label, registry=r, buckets=BUCKETS).labels(name)
        Gauge("aotc:num_requests_running", "Requests holding a cache slot", label, registry=r).labels(name).set_function(lambda: service.counts()[0])
        Gauge("aotc:num_requests_waiting", "Requests waiting for a cache slot", label, registry=r).labels(name).set_function(lambda: service.counts()[1])
        self.prompt_tokens = Counter("aotc:prompt_tokens", "Prompt tokens of the requests served", label, registry=r).labels(name)
        self.generation_tokens = Counter("aotc:generation_tokens", "Tokens generated", label, registry=r).labels(name)
        self.success = Counter("aotc:request_success", "Requests that ended, by finish reason", ["model_name", "finished_reason"], registry=r)
        # As vLLM's vllm:prefix_cache_queries and _hits, in tokens: hits are the prefill tokens saved.
        self.prefix_queries = Counter("aotc:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", label, registry=r).labels(name)
        self.prefix_hits = Counter("aotc:prefix_cache_hits", "Prompt tokens found in the prefix cache, not prefilled", label, registry=r).labels(name)
        self.name, self.service = name, service

    def ended(self, handle: Handle, arrived: float, times: list[float]) -> None:
        r = self.request_counts(handle)
        self.prompt_tokens.inc(r[0])
        self.generation_tokens.inc(r[1])
        self.success.labels(self.name, handle.request.finish_reason or "abort").inc()
        if handle.request.slot is not None and self.service.engine.prefix is not None:  # it took a slot: it was looked up
            self.prefix_queries.inc(r[0])
            self.prefix_hits.inc(handle.request.cached)
        if times:
            self.ttft.observe(times[0] - arrived)
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)
        self.e2e.observe(time.perf_counter() - arrived)

    @staticmethod
    def request_counts(handle: Handle) -> tuple[int, int]:
        return len(handle.request.prompt_ids), len(handle.request.new_ids)


class Server:
    """The app's state: the Session and its service, the served name, the API keys, and
    the requests in flight (a drain waits for them, or ends them at its deadline)."""

    def __init__(self, session: Session, service: Service, name: str, api_keys: list[str], max_body: int = MAX_BODY):
        self.session, self.service, self.name, self.api_keys, self.max_body = session, service, name, set(api_keys), max_body
        self.metrics = Metrics(name, service)
        self.draining = False
        self.cut = False  # the drain's deadline passed and ended the streams still running
        self.in_flight: set[Handle] = set()
        self.created = int(time.time())
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            exception_handlers={ApiError: self._error, 404: self._not_found, 405: self._not_allowed},
        )

    # -- endpoints ------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = decode(await self._body(request), CompletionRequest)
        body.check()
        self._model(body.model)
        prompt = body.prompt_value()
        max_tokens = body.max_tokens if body.max_tokens is not None else 16  # OpenAI's default for completions
        return await self._generate(request, body, "text_completion", prompt, max_tokens, body.sampling(body.logprobs))

    async def chat(self, request: Request) -> Response:
        body = decode(await self._body(request), ChatRequest)
        body.check()
        self._model(body.model)
        messages = [m.as_dict() for m in body.messages]
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await self._generate(request, body, "chat.completion", messages, asked, body.sampling(body.logprob_count()))

    async def models(self, request: Request) -> Response:
        self._auth(request)
        return _json({"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created, "owned_by": "aotc", "max_model_len": self.session.bundle.max_seq}]})

    async def tokenize(self, request: Request) -> Response:
        body = decode(await self._body(request), TokenizeRequest)
        if body.model is not None:
            self._model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "tokenize: give either prompt (text) or messages (a chat)", param="prompt")
        what = body.prompt if body.prompt is not None else [m.as_dict() for m in body.messages]
        ids = await asyncio.to_thread(self._encode, what)
        return _json({"tokens": ids, "count": len(ids), "max_model_len": self.session.bundle.max_seq})

    async def detokenize(self, request: Request) -> Response:
        body = decode(await self._body(request), DetokenizeRequest)
        if body.model is not None:
            self._model(body.model)
        vocab = self.session.model.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens: {bad[0]} is not a token id of the model's vocabulary (0 to {vocab - 1})", param="tokens")
        if self.session.tokenizer is None:
            raise ApiError(400, f"{self.session.model_dir} has no tokenizer.json to decode with", param="tokens")
        return _json({"prompt": self.session.tokenizer.decode(body.tokens)})

    async def health(self, request: Request) -> Response:
        if self.draining:
            return Response("draining\n", status_code=503)
        if not await asyncio.to_thread(self.service.alive, HEALTH_TIMEOUT):
            why = f"the engine failed: {self.service.error}" if self.service.error is not None else f"the engine did not answer within {HEALTH_TIMEOUT:g} s"
            return Response(why + "\n", status_code=503)
        return Response("ok\n")

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- generation -----------------------------------------------------------------------
    async def _generate(self, request: Request, body, kind: str, prompt, max_tokens: int | None, sampling) -> Response:
        if self.draining:
            raise ApiError(503, "the server is shutting down; send the request to another instance", type="service_unavailable", code="shutting_down")
        arrived = time.perf_counter()
        stops = body.stops()
        try:
            handle = await asyncio.to_thread(self._submit, prompt, max_tokens, sampling, stops, body.stop_token_ids or (), body.ignore_eos)
        except QueueFull as e:
            raise ApiError(429, str(e), type="rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"}) from None
        times: list[float] = []
        handle.on_time = times.append  # the engine thread: each token's time, for the metrics
        handle.on_end = lambda: self._record(handle, arrived, times)
        self.in_flight.add(handle)
        watcher = asyncio.create_task(_abort_on_disconnect(request, handle))
        rid = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            if not body.stream:
                try:
                    done = await handle
                finally:
                    self._ended(handle, watcher)
                self._refuse_if_shed(handle)
                return _json(self._whole(rid, kind, handle, done))
            events = handle.__aiter__()
            first = await anext(events, None)  # so that a request shed or failed before its first token gets a status
        except AotcError as e:  # the engine failed
            self._ended(handle, watcher)
            raise ApiError(500, str(e), type="server_error") from None
        except BaseException:
            self._ended(handle, watcher)
            raise
        if first is None:
            self._ended(handle, watcher)
            self._refuse_if_shed(handle)
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(self._sse(rid, kind, handle, first, events, usage, watcher), media_type="text/event-stream")

    def _submit(self, prompt, max_tokens: int | None, sampling, stops, stop_ids, ignore_eos: bool) -> Handle:
        try:
            ids = self.session.encode(prompt)  # text as it is; a chat through the model's template
            max_seq = self.session.bundle.max_seq
            if len(ids) >= max_seq:
                raise ApiError(400, f"prompt: {len(ids)} tokens; this model's context is {max_seq} tokens, the prompt's and at least one new one", param="prompt")
            if max_tokens is None:  # chat's default, as vLLM's: what the context has left
                max_tokens = max_seq - len(ids)
            if len(ids) + max_tokens > max_seq:
                raise ApiError(
                    400,
                    f"max_tokens: {max_tokens}; with the prompt's {len(ids)} tokens that is more than this model's context of {max_seq} tokens; ask for at most {max_seq - len(ids)}",
                    param="max_tokens",
                )
            return self.service.submit(ids, max_tokens=max_tokens, sampling=sampling, stop=stops, stop_token_ids=stop_ids, ignore_eos=ignore_eos)
        except QueueFull:
            raise
        except AotcError as e:
            if self.service.error is not None:  # the engine failed: the server's fault, not the client's
                raise ApiError(503, f"the engine failed and takes no more requests: {self.service.error}", type="server_error", code="engine_failed") from None
            raise ApiError(400, str(e), param=_param_of(str(e))) from None

    def _refuse_if_shed(self, handle: Handle) -> None:
        if handle.shed:
            raise ApiError(503, "the server is shutting down and this request had not started; send it again", type="service_unavailable", code="shutting_down")

    def _ended(self, handle: Handle, watcher: asyncio.Task) -> None:
        """Its handler is done with it (its request may still end at the next step)."""
        watcher.cancel()
        self.in_flight.discard(handle)

    def _record(self, handle: Handle, arrived: float, times: list[float]) -> None:
        """On the engine thread, as the request ends: its metrics and its log line."""
        self.metrics.ended(handle, arrived, times)
        prompt, new = Metrics.request_counts(handle)
        log.info("request %d: %s, %d prompt tokens, %d new, %.3f s", handle.id, handle.request.finish_reason, prompt, new, time.perf_counter() - arrived)

    async def _sse(self, rid, kind, handle: Handle, first, events, usage: bool, watcher):
        chat = kind == "chat.completion"
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(choices, **more) -> bytes:
            return _sse({"id": rid, "object": chunk_kind, "created": created, "model": self.name, "choices": choices, **more})

        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            event, step = first, 0
            while event is not None:
                logprobs = self._logprobs(handle, step, step + 1, chat)
                if chat:
                    yield chunk([{"index": 0, "delta": {"content": event.text}, "logprobs": logprobs, "finish_reason": None}])
                else:
                    yield chunk([{"index": 0, "text": event.text, "logprobs": logprobs, "finish_reason": None}])
                step += 1
                event = await anext(events, None)
            done = handle.result()
            reason = _reason(done.finish_reason)
            if reason is None:  # aborted: the drain's deadline, or the engine
                yield _sse({"error": {"message": "the server ended this stream: it is shutting down", "type": "server_error", "param": None, "code": "shutting_down"}})
                return
            if chat:
                yield chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}])
            else:
                yield chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": reason}])
            if usage:
                yield chunk([], usage=_usage(handle))
            yield b"data: [DONE]\n\n"
        except AotcError as e:  # the engine failed: an error event ends the stream
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        finally:
            await events.aclose()  # a client that left: its request ends at the next step
            self._ended(handle, watcher)

    def _whole(self, rid: str, kind: str, handle: Handle, done) -> dict:
        reason = _reason(done.finish_reason)
        if reason is None:
            raise ApiError(503, "the server ended this request: it is shutting down", type="service_unavailable", code="shutting_down")
        if kind == "chat.completion":
            message = {"role": "assistant", "content": done.text or ""}
            choice = {"index": 0, "message": message, "logprobs": self._logprobs(handle, 0, len(done.ids), True), "finish_reason": reason}
        else:
            choice = {"index": 0, "text": done.text or "", "logprobs": self._logprobs(handle, 0, len(done.ids), False), "finish_reason": reason}
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.name, "choices": [choice], "usage": _usage(handle)}

    def _logprobs(self, handle: Handle, start: int, end: int, chat: bool) -> dict | None:
        """OpenAI's logprobs of tokens start..end: chat's content list, or completions' columns."""
        choices = handle.request.choices[start:end]
        if handle.sampling is None or handle.sampling.logprobs is None or not choices:
            return None
        tok = self.session.tokenizer

        def text(i: int) -> str:
            return tok.decode([i], skip_special_tokens=False) if tok is not None else str(i)

        if chat:
            return {"content": [
                {"token": text(c.token), "logprob": c.logprob, "bytes": list(text(c.token).encode()),
                 "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode())} for t, lp in (c.top or [])]}
                for c in choices
            ]}  # fmt: skip
        return {
            "tokens": [text(c.token) for c in choices], "token_logprobs": [c.logprob for c in choices],
            "top_logprobs": [{text(t): lp for t, lp in (c.top or [])} for c in choices], "text_offset": None,
        }  # fmt: skip

    # -- checks ---------------------------------------------------------------------------
    async def _body(self, request: Request) -> bytes:
        self._auth(request)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body:
            raise ApiError(413, f"the body is {size} bytes; at most {self.max_body}", code="body_too_large")
        chunks, total = [], 0
        async for part in request.stream():
            total += len(part)
            if total > self.max_body:
                raise ApiError(413, f"the body is over {self.max_body} bytes", code="body_too_large")
            chunks.append(part)
        return b"".join(chunks)

    def _auth(self, request: Request) -> None:
        if not self.api_keys:
            return
        given = request.headers.get("authorization", "")
        if not (given.startswith("Bearer ") and given.removeprefix("Bearer ") in self.api_keys):
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", type="authentication_error", code="invalid_api_key")

    def _model(self, name: str) -> None:
        if name != self.name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.name}`", param="model", code="model_not_found")

    def _encode(self, what) -> list[int]:
        try:
            return self.session.encode(what, chat=False)
        except AotcError as e:
            raise ApiError(400, str(e), param="prompt") from None

    async def _error(self, request: Request, e: ApiError) -> Response:
        return _json(e.body, e.status, e.headers)

    async def _not_found(self, request: Request, e) -> Response:
        return _json(ApiError(404, f"no such endpoint: {request.method} {request.url.path}", code="not_found").body, 404)

    async def _not_allowed(self, request: Request, e) -> Response:
        return _json(ApiError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed").body, 405)


async def _abort_on_disconnect(request: Request, handle: Handle) -> None:
    """Abort the request when its client goes away (the body is read: what the server
    receives next is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.abort()
            return


def _reason(finish: str) -> str | None:
    return finish if finish in ("stop", "length") else None


def _usage(handle: Handle) -> dict:
    prompt, new = Metrics.request_counts(handle)
    usage = {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}
    return usage | {"prompt_tokens_details": {"cached_tokens": handle.request.cached}}  # as OpenAI's usage reports its prompt cache


def _param_of(message: str) -> str | None:
    """The field an engine or Session error names first ("prompt ...", "stop_token_ids: ...")."""
    head = message.split(":", 1)[0].split(" ", 1)[0]
    return {"prompt": "prompt", "stop": "stop", "stop_token_ids": "stop_token_ids", "max_tokens": "max_tokens"}.get(head, "max_tokens" if "max_seq" in message else None)


def _json(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, headers=headers, media_type="application/json")


def _sse(body: dict) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"
