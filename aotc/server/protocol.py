"""The OpenAI API's request bodies, as aotc serve takes them, and its errors.

Bodies are decoded by msgspec into these types: a wrong type is an error naming its
path (`$.messages[0].role`), and fields aotc does not know are ignored, not refused
(OpenAI clients send new ones). Responses are plain dicts in the shapes the `openai`
client's types define (chat.completion, chat.completion.chunk, text_completion, model).
"""

from __future__ import annotations

import re

import msgspec

from ..errors import AotcError
from ..runtime.sampling import SamplingParams

MAX_STOP = 16  # stop strings a request may give (OpenAI allows 4; each is matched at every token)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class ApiError(Exception):
    """An answer other than 200: its status, and OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.headers = status, headers or {}
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict:
        if self.content is None or isinstance(self.content, str):
            return {"role": self.role, "content": self.content or ""}
        if any(p.type != "text" or p.text is None for p in self.content):
            raise ApiError(400, f"messages: content parts of type {sorted({p.type for p in self.content} - {'text'})} are not supported; aotc serves text", param="messages")
        return {"role": self.role, "content": "".join(p.text for p in self.content)}


class _Request(msgspec.Struct, kw_only=True):
    """The fields completions and chat share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI's default: 1
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: off (vLLM's and llama.cpp's extra field)
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # vLLM's extra field: run to max_tokens (benchmarks' fixed lengths)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1

    def sampling(self, logprobs: int | None) -> SamplingParams:
        fields = dict(
            temperature=1.0 if self.temperature is None else self.temperature, top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k, min_p=self.min_p or 0.0, seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty, logprobs=logprobs,
        )  # fmt: skip
        try:
            return SamplingParams(**fields)
        except AotcError as e:  # SamplingError names the field first: "temperature: -1; expected ..."
            raise ApiError(400, str(e), param=str(e).split(":", 1)[0]) from None

    def stops(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise ApiError(400, f"stop: {len(stop)} strings; at most {MAX_STOP}", param="stop")
        if any(not s for s in stop):
            raise ApiError(400, "stop: an empty string; each stop string needs at least one character", param="stop")
        return stop

    def check_common(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n: {self.n}; aotc serve gives one choice per request (n=1): send n requests", param="n")


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list
    logprobs: int | None = None  # the top N at each token (0: the chosen token's only)
    echo: bool = False
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise ApiError(400, "echo: not supported; the response holds the new text only", param="echo")
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of: {self.best_of}; not supported (1 only)", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs: {self.logprobs}; expected 0 to {MAX_TOP_LOGPROBS}", param="logprobs")

    def prompt_value(self) -> str | list[int]:
        """The prompt: text, or token ids; a list of several prompts is refused."""
        p = self.prompt
        if p == "" or p == [""]:
            raise ApiError(400, "prompt: empty; a request needs at least one prompt token", param="prompt")
        if isinstance(p, str):
            return p
        if len(p) == 1 and isinstance(p[0], str):
            return p[0]
        if p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
            return p
        if p and all(isinstance(i, (str, list)) for i in p):
            raise ApiError(400, f"prompt: a list of {len(p)} prompts; aotc serve takes one prompt per request", param="prompt")
        raise ApiError(400, "prompt: expected text, a list of token ids, or a list of one text", param="prompt")


class ChatRequest(_Request, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise ApiError(400, "messages: empty; a chat needs at least one message", param="messages")
        if self.top_logprobs is not None and not (self.logprobs and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ApiError(400, f"top_logprobs: {self.top_logprobs}; needs logprobs true and 0 to {MAX_TOP_LOGPROBS}", param="top_logprobs")

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    prompt: str | None = None
    messages: list[Message] | None = None
    model: str | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


def decode(body: bytes, type_):
    """A request body as `type_`, or a 400 naming what is wrong and where."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        # "Expected `int`, got `str` - at `$.max_tokens`"; "Object missing required field `role` - at `$.messages[0]`"
        text = str(e)
        where = text.rsplit(" - at `$", 1)[1].rstrip("`").lstrip(".") if " - at `$" in text else ""
        missing = re.match(r"Object missing required field `([^`]+)`", text)
        param = ".".join(p for p in (where, missing.group(1) if missing else "") if p) or None
        raise ApiError(400, f"invalid request body: {e}", param=param) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
