"""aotc serve, as a real process on 127.0.0.1, judged by real clients: the openai SDK with
strict response validation, and httpx for raw bodies, streams and dropped sockets. One
server for the module (the tiny export bundle: 4 slots, max_seq 256); SIGTERM on a
server of its own, last. Where a test needs the server in a state (slots taken, a
request waiting), it waits for /metrics to say so, within a bound."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from aotc import SamplingParams, Session
from aotc.builder import BuildOptions, build

KEY = "sk-test-aotc"
NAME = "tiny"
QUEUE = 28  # the module server's --max-queue: 32 requests at once, 4 running and 28 waiting


class Served:
    def __init__(self, bundle, *more, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aotc.cli", "serve", str(bundle), "--port", "0", "--served-model-name", NAME, "--api-key", KEY, *more],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200", **(env or {})},
        )  # fmt: skip
        line = self.proc.stdout.readline()  # "serving tiny on http://127.0.0.1:PORT ...", once it listens
        found = re.search(r"http://([\d.]+:\d+)", line)
        assert found, line + self.proc.stderr.read()
        self.url = f"http://{found.group(1)}"
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, _strict_response_validation=True, timeout=60)
        # openai-python types a completion choice's finish_reason as never null, so its strict
        # mode refuses every chunk but the last of a completions stream, OpenAI's own included
        # (they send null, as vLLM does): those streams are read leniently, and checked raw.
        self.lenient = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def metric(self, name: str) -> float:
        text = self.http.get("/metrics").text
        found = re.search(rf"^aotc:{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def wait_for(self, what, bound: float = 30.0) -> None:
        """Until what() holds (it reads /metrics), for at most `bound` s."""
        end = time.monotonic() + bound
        while not what():
            assert time.monotonic() < end, "the server never reached the state the test waits for"
            time.sleep(0.02)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture(scope="module")
def bundle(tiny_dir, tmp_path_factory):
    """tiny_bundle's buckets (its graphs come from the compile cache) and decode graphs that
    read the first 64 positions too: 4 slots, two context buckets."""
    out = tmp_path_factory.mktemp("serve") / "tiny"
    return build(BuildOptions(tiny_dir, out=out, batch_buckets=(1, 2, 4), chunk_buckets=(16, 64), max_seq=256, context_buckets=(64,), backend="export")).out


@pytest.fixture(scope="module")
def served(bundle):
    s = Served(bundle, "--max-queue", str(QUEUE))
    yield s
    assert s.stop() == 0, s.proc.stderr.read()[-3000:]


@pytest.fixture(scope="module")
def session(bundle):
    with Session.open(bundle) as s:
        yield s


def greedy_text(session, prompt, n, chat=False, **kw):
    return session.generate([prompt], max_new_tokens=n, chat=chat, **kw)[0]


def test_completions_and_chat_parse_strictly_and_give_the_sessions_tokens(served, session):
    c = served.client
    assert [m.id for m in c.models.list().data] == [NAME]
    done = c.completions.create(model=NAME, prompt="The capital of France is", max_tokens=12, temperature=0)
    alone = greedy_text(session, "The capital of France is", 12)
    assert done.choices[0].text == alone.text and done.usage.completion_tokens == len(alone.ids) and done.choices[0].finish_reason == alone.finish_reason
    streamed = list(served.lenient.completions.create(model=NAME, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == alone.text
    _, lines = stream(served, "The capital of France is", 12)
    raw = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    assert {r["object"] for r in raw} == {"text_completion"} and [r["choices"][0]["finish_reason"] for r in raw] == [None] * (len(raw) - 1) + [alone.finish_reason]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = c.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10, temperature=0)
    alone = greedy_text(session, messages, 10)
    assert chat.choices[0].message.content == alone.text and chat.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks[:-2]] == [None] * (len(chunks) - 2)  # null until the last
    last, usage = chunks[-2], chunks[-1]
    assert last.choices[0].finish_reason == chat.choices[0].finish_reason and last.choices[0].delta.content is None
    assert usage.choices == [] and usage.usage.model_copy(update={"prompt_tokens_details": None}) == chat.usage.model_copy(update={"prompt_tokens_details": None})
    assert usage.usage.prompt_tokens_details.cached_tokens == usage.usage.prompt_tokens - 1  # the same prompt again: all but its last token
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == chat.choices[0].message.content
    assert all(ch.usage is None for ch in chunks[:-1])

    seeded = [c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=7).choices[0].text for _ in range(2)]
    sampled = greedy_text(session, "Once upon a time", 12, sampling=SamplingParams(temperature=0.9, seed=7))
    assert seeded == [sampled.text] * 2 and sampled.ids != greedy_text(session, "Once upon a time", 12).ids

    whole = greedy_text(session, "The capital of France is", 12).text
    stop = whole[3:9]  # a stop string across tokens
    pieces = [ch.choices[0].text for ch in served.lenient.completions.create(model=NAME, prompt="The capital of France is", max_tokens=12, temperature=0, stop=[stop], stream=True)]
    assert stop not in "".join(pieces) and "".join(pieces) == whole[: whole.index(stop)]
    done = c.completions.create(model=NAME, prompt="The capital of France is", max_tokens=12, temperature=0, stop=stop)
    assert done.choices[0].text == "".join(pieces) and done.choices[0].finish_reason == "stop"

    top = c.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = top.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob for t in content)


def test_32_concurrent_streams_over_4_slots_each_give_their_solo_text(served, session):
    """Prompts of 3 to 200 tokens and 8 to 40 new ones, across the 64-position context
    bucket. A text that differs from its solo run's is allowed only where the solo run
    met a near-tie (a top-2 gap under the fidelity rule's tolerance), and is printed."""
    import torch

    g = torch.Generator().manual_seed(3)
    asks = [(torch.randint(3, 500, (int(n),), generator=g).tolist(), int(m)) for n, m in zip(torch.randint(3, 201, (32,), generator=g), torch.randint(8, 41, (32,), generator=g))]

    def ask(item):
        ids, m = item
        body = {"model": NAME, "prompt": ids, "max_tokens": m, "temperature": 0, "stream": True}
        with served.http.stream("POST", "/v1/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, asks))
    differ = 0
    for (ids, m), text in zip(asks, got):
        alone = greedy_text(session, ids, m, sampling=SamplingParams(logprobs=2))
        if text != alone.text:
            gap = min(c.top[0][1] - c.top[1][1] for c in alone.logprobs)
            print(f"a prompt of {len(ids)} tokens differs from its solo run, whose smallest top-2 gap is {gap:.2e}")
            assert gap <= 1e-3, (len(ids), text, alone.text)
            differ += 1
    assert differ <= 2


def test_tokenize_and_detokenize_are_the_models_tokenizer(served, session):
    ids = session.encode("Hello there, world")
    assert served.http.post("/tokenize", json={"prompt": "Hello there, world"}).json() == {"tokens": ids, "count": len(ids), "max_model_len": 256}
    assert served.http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == session.tokenizer.decode(ids)


BAD = [
    (b"{not json", 400, None),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": 0}', 400, "top_p"),
    (b'{"model": "tiny", "prompt": "hi", "stream": "yes"}', 400, "stream"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 1000000000000}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "n": 2}', 400, "n"),
    (b'{"model": "tiny", "prompt": "hi", "echo": true}', 400, "echo"),
    (b'{"model": "tiny", "prompt": ["a", "b"]}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": []}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": [1, 99999]}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": ""}', 400, "prompt"),
    (b'{"model": "tiny"}', 400, "prompt"),
    (b'{"prompt": "hi"}', 400, "model"),
    (b'{"model": "other", "prompt": "hi"}', 404, "model"),
    (b'{"model": "tiny", "prompt": "hi", "stop": ""}', 400, "stop"),
    (b'{"model": "tiny", "prompt": "hi", "stop_token_ids": [-5]}', 400, "stop_token_ids"),
    (b'{"model": "tiny", "prompt": "hi", "logprobs": 99}', 400, "logprobs"),
    (b'{"model": "tiny", "prompt": "hi", "seed": -1}', 400, "seed"),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    (json.dumps({"model": "tiny", "prompt": "hi", "stop": ["x"] * 1000}).encode(), 400, "stop"),
    (json.dumps({"model": "tiny", "prompt": list(range(3, 400)) * 2500}).encode(), 400, "prompt"),  # 10^6 token ids
    (b'{"model": "tiny", "prompt": "' + b"a " * (5 << 20) + b'"}', 413, None),
    (b"[]", 400, None),
    (b"null", 400, None),
    (b'{"model": "tiny", "prompt": "hi", "top_k": "x"}', 400, "top_k"),
    (b'{"model": "tiny", "prompt": "hi", "top_k": -2}', 400, "top_k"),
    (b'{"model": "tiny", "prompt": "hi", "min_p": 2}', 400, "min_p"),
    (b'{"model": "tiny", "prompt": "hi", "presence_penalty": "a"}', 400, "presence_penalty"),
    (b'{"model": "tiny", "prompt": "hi", "frequency_penalty": []}', 400, "frequency_penalty"),
    (b'{"model": "tiny", "prompt": "hi", "repetition_penalty": 0}', 400, "repetition_penalty"),
    (b'{"model": "tiny", "prompt": "hi", "stop": 5}', 400, "stop"),
    (b'{"model": "tiny", "prompt": "hi", "stop": [1]}', 400, "stop[0]"),
    (b'{"model": "tiny", "prompt": "hi", "stream_options": "x"}', 400, "stream_options"),
    (b'{"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": "y"}}', 400, "stream_options.include_usage"),
    (b'{"model": "tiny", "prompt": "hi", "seed": 1.5}', 400, "seed"),
    (b'{"model": "tiny", "prompt": "hi", "logprobs": true}', 400, "logprobs"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": -1}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": 1e400}', 400, None),
    (b'{"model": 5, "prompt": "hi"}', 400, "model"),
    (b'{"model": "tiny", "prompt": 5}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": {"a": 1}}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": [[1, 2], [3]]}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": [true]}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": "hi", "n": 0}', 400, "n"),
    (b'{"model": "tiny", "prompt": "hi", "best_of": 3}', 400, "best_of"),
    (b'{"model": "tiny", "prompt": "hi"' + b', "x": 1' * 1000 + b"}", 200, None),  # unknown fields are ignored
]
BAD_CHAT = [
    (b'{"model": "tiny", "messages": []}', 400, "messages"),
    (b'{"model": "tiny", "messages": [{"content": "hi"}]}', 400, "messages[0].role"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "messages"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}', 400, "top_logprobs"),
    (b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
    (b'{"model": "tiny", "messages": [1]}', 400, "messages[0]"),
    (b'{"model": "tiny", "messages": [{"role": 5, "content": "hi"}]}', 400, "messages[0].role"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}', 400, "max_tokens"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}', 400, "logprobs"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": true}', 400, "top_logprobs"),
]
BAD_TOKENS = [
    ("/tokenize", b'{"prompt": 5}', 400, "prompt"),
    ("/tokenize", b"{}", 400, "prompt"),
    ("/detokenize", b'{"tokens": [-1]}', 400, "tokens"),
    ("/detokenize", b'{"tokens": "x"}', 400, "tokens"),
]


def test_bad_bodies_get_4xx_in_openais_shape_and_the_server_stays_up(served):
    asks = (
        [("/v1/completions", body, status, param) for body, status, param in BAD] + [("/v1/chat/completions", body, status, param) for body, status, param in BAD_CHAT] + BAD_TOKENS
    )
    assert len(asks) >= 50
    for path, body, status, param in asks:
        if status == 200:
            assert served.http.post(path, content=body).status_code == 200
            continue
        r = served.http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status, (body[:80], r.status_code, r.text[:300])
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        if param is not None:
            assert error["param"] == param, (body[:80], error)
    r = httpx.post(f"{served.url}/v1/completions", json={"model": NAME, "prompt": "hi"})  # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert served.http.get("/v1/completions").status_code == 405 and served.http.get("/nowhere").status_code == 404
    assert served.http.get("/health").status_code == 200
    assert served.client.completions.create(model=NAME, prompt="still up", max_tokens=2, temperature=0).choices[0].text is not None


def stream(served, prompt: str, max_tokens: int, **more):
    """An open streaming request: (response, its SSE lines). Long ones run to max_tokens
    (ignore_eos): they hold their slot until then, or until the client leaves."""
    more.setdefault("ignore_eos", max_tokens > 100)
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **more}
    request = served.http.build_request("POST", "/v1/completions", json=body)
    response = served.http.send(request, stream=True)
    return response, (line for line in response.iter_lines() if line.startswith("data: "))


ABORTED = 'request_success_total{finished_reason="abort",model_name="tiny"}'
LENGTH = 'request_success_total{finished_reason="length",model_name="tiny"}'


def test_clients_that_leave_free_their_slots_and_a_burst_of_four_gets_four(served):
    generated, aborted = served.metric("generation_tokens_total"), served.metric(ABORTED)
    for i in range(20):  # each leaves after i % 5 tokens: 0 is before the first
        response, lines = stream(served, f"leave {i} " * (1 + i % 7), 200)
        for _ in range(i % 5):
            next(lines)
        response.close()

    def leave(i):  # a non-streaming client that gives up waiting
        with pytest.raises(httpx.ReadTimeout):
            served.http.post("/v1/completions", json={"model": NAME, "prompt": f"slow {i}", "max_tokens": 200, "ignore_eos": True}, timeout=0.05)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(leave, range(4)))
    served.wait_for(lambda: served.metric("num_requests_running") == 0 and served.metric("num_requests_waiting") == 0)
    assert served.metric("generation_tokens_total") - generated < 24 * 200  # none ran to its end
    assert served.metric(ABORTED) - aborted == 24
    burst = [stream(served, f"burst {i}", 200) for i in range(4)]
    for _, lines in burst:
        next(lines)  # each has its first token, and none has ended: four slots at once
    assert served.metric("num_requests_running") == 4 and served.metric("num_requests_waiting") == 0
    for response, _ in burst:
        response.close()
    served.wait_for(lambda: served.metric("num_requests_running") == 0)


def test_past_the_slots_and_the_queue_a_request_gets_429_at_once(served):
    with ThreadPoolExecutor(4 + QUEUE) as pool:  # a waiting stream's headers come with its first token
        held = [pool.submit(stream, served, f"hold {i}", 248) for i in range(4 + QUEUE)]  # 4 slots, and the queue full
        served.wait_for(lambda: served.metric("num_requests_running") == 4 and served.metric("num_requests_waiting") == QUEUE)
        r = served.http.post("/v1/completions", json={"model": NAME, "prompt": "one more", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            served.client.completions.create(model=NAME, prompt="one more", max_tokens=2)
        for opened in held:  # the running ones first: their slots go to the waiting ones
            opened.result(60)[0].close()
    served.wait_for(lambda: served.metric("num_requests_running") == 0 and served.metric("num_requests_waiting") == 0)


def test_sigterm_drains_running_streams_sheds_waiting_ones_and_exits_0(bundle):
    s = Served(bundle, "--max-queue", "4", "--shutdown-timeout", "60")
    try:
        running = [stream(s, f"drain {i}", 230) for i in range(4)]
        for _, lines in running:
            next(lines)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(s.http.post, "/v1/completions", json={"model": NAME, "prompt": "queued", "max_tokens": 4})
            s.wait_for(lambda: s.metric("num_requests_waiting") == 1)
            s.proc.send_signal(signal.SIGTERM)
            shed = waiting.result(30)
        assert shed.status_code == 503 and shed.json()["error"]["code"] == "shutting_down"
        assert s.http.get("/health").status_code == 503
        assert s.http.post("/v1/completions", json={"model": NAME, "prompt": "new", "max_tokens": 2}).status_code == 503
        for response, lines in running:
            rest = list(lines)
            assert rest[-1] == "data: [DONE]" and json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(60) == 0
    finally:
        s.stop()


# Loaded by the server's interpreter at start (sitecustomize, first on PYTHONPATH): once the
# file the test names exists, every engine step raises, as a graph call that fails would.
FAULT = """\
import os, pathlib
import aotc.runtime.engine as engine
step = engine.Engine.step
def failing(self):
    if pathlib.Path(os.environ["AOTC_TEST_FAULT"]).exists():
        raise RuntimeError("a graph call failed (injected by the test)")
    return step(self)
engine.Engine.step = failing
"""


def test_an_engine_fault_ends_open_streams_with_an_error_event_and_health_turns_503(bundle, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    fault = tmp_path / "fault"
    s = Served(bundle, env={"PYTHONPATH": str(tmp_path), "AOTC_TEST_FAULT": str(fault)})
    try:
        open_streams = [stream(s, f"fault {i}", 200) for i in range(2)]
        for _, lines in open_streams:
            next(lines)
        assert s.http.get("/health").status_code == 200
        fault.touch()
        for _, lines in open_streams:
            last = json.loads(list(lines)[-1].removeprefix("data: "))
            assert last["error"]["type"] == "server_error" and "a graph call failed (injected by the test)" in last["error"]["message"], last
        assert s.http.get("/health").status_code == 503
        r = s.http.post("/v1/completions", json={"model": NAME, "prompt": "after", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
    finally:
        s.stop()


AIPERF = "aiperf==0.13.0"  # NVIDIA's load client (genai-perf's successor), in a venv of its own: its pins are not aotc's


@pytest.mark.slow
def test_aiperf_at_concurrency_16_with_cancellations_agrees_with_the_servers_counters(served, tiny_dir, request):
    """aiperf, which no one here wrote: 64 streaming requests, 16 at a time, a tenth of them
    cancelled by the client, prompts of the model's own tokenizer. Its only errors are its
    cancellations, and the server's counters equal its counts."""
    venv = request.config.cache.mkdir("aiperf-venv")
    aiperf = venv / "bin" / "aiperf"
    if not aiperf.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", AIPERF], check=True, timeout=900)
    before = {k: served.metric(k) for k in ("generation_tokens_total", "prompt_tokens_total", LENGTH, ABORTED)}
    out = request.config.cache.mkdir("aiperf-run")
    args = [
        str(aiperf), "profile", "--model", NAME, "--url", served.url, "--api-key", KEY, "--endpoint-type", "completions", "--streaming",
        "--tokenizer", str(tiny_dir), "--synthetic-input-tokens-mean", "32", "--synthetic-input-tokens-stddev", "8", "--output-tokens-mean", "16",
        "--extra-inputs", "ignore_eos:true", "--request-count", "64", "--concurrency", "16", "--request-cancellation-rate", "10",
        "--workers-max", "1", "--record-processors", "1", "--ui-type", "none", "--artifact-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads((out / "profile_export_aiperf.json").read_text())
    errors = got.get("error_summary") or []
    assert all(e["error_details"]["type"] == "RequestCancellationError" for e in errors), errors
    cancelled = sum(e["count"] for e in errors)
    assert got["request_count"]["avg"] + cancelled == 64
    delta = {k: served.metric(k) - v for k, v in before.items()}
    assert delta[LENGTH] == got["request_count"]["avg"] and delta[ABORTED] == cancelled
    completed = got["total_usage_completion_tokens"]["avg"]
    assert completed == 16 * got["request_count"]["avg"]  # ignore_eos: each ran to its max_tokens
    assert 0 <= delta["generation_tokens_total"] - completed <= 16 * cancelled  # and the cancelled ones made what they made
    assert delta["prompt_tokens_total"] == got["total_usage_prompt_tokens"]["avg"] + got.get("total_error_isl", {"avg": 0})["avg"]


def test_the_serving_pages_client_example_runs_against_the_server(served):
    """docs/serving.md's openai example, as written but for the address and the key."""
    from pathlib import Path

    page = Path(__file__).resolve().parent.parent / "docs" / "serving.md"
    (block,) = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert 'base_url="http://127.0.0.1:8000/v1", api_key="unused"' in block and 'model="tiny"' in block
    done = served.metric(LENGTH) + served.metric('request_success_total{finished_reason="stop",model_name="tiny"}')
    exec(compile(block.replace("http://127.0.0.1:8000", served.url).replace('"unused"', repr(KEY)), str(page), "exec"), {})
    served.wait_for(lambda: served.metric(LENGTH) + served.metric('request_success_total{finished_reason="stop",model_name="tiny"}') == done + 1)


def test_without_the_serve_extra_the_command_says_what_to_install(bundle, monkeypatch):
    from typer.testing import CliRunner

    from aotc.cli import app

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "aotc.server.run", raising=False)
    r = CliRunner().invoke(app, ["serve", str(bundle)])
    assert r.exit_code == 2 and "aotc serve needs the serve extra (uvicorn is missing): pip install 'aotc[serve]'" in " ".join(r.output.split()), r.output


def test_a_prompt_that_starts_like_an_earlier_one_skips_its_prefill_and_says_so(served, session):
    """The prefix cache, on by default: 200 shared prompt tokens are found, counted in
    /metrics and in usage.prompt_tokens_details.cached_tokens, and the text is the Session's."""
    shared = list(range(20, 220))
    queries, hits = served.metric("prefix_cache_queries_total"), served.metric("prefix_cache_hits_total")
    first = served.client.completions.create(model=NAME, prompt=shared + [5, 6, 7], max_tokens=8, temperature=0)
    second = served.client.completions.create(model=NAME, prompt=shared + [9, 10], max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == 200 and first.usage.prompt_tokens == 203
    assert served.metric("prefix_cache_queries_total") - queries == 203 + 202
    assert served.metric("prefix_cache_hits_total") - hits == 200 + first.usage.prompt_tokens_details.cached_tokens
    assert second.choices[0].text == greedy_text(session, shared + [9, 10], 8).text
