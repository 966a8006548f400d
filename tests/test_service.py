"""A Session's service (aotc/runtime/service.py): the engine on a thread of its own, taking
requests from threads and asyncio tasks. Where a test needs the engine at a given point,
it holds the engine thread at a gate between steps, never a sleep."""

from __future__ import annotations

import asyncio
import threading

import pytest

from aotc import AotcError, SamplingParams, Session
from aotc.runtime.service import QueueFull

PROMPTS = [f"hello {i} " * (1 + 3 * i) for i in range(6)]  # 3 to 50 tokens


@pytest.fixture(scope="module")
def session(tiny_bundle):
    with Session.open(tiny_bundle.out) as s:
        yield s


@pytest.fixture(scope="module")
def solo(session):
    """Each prompt's completion alone (max_batch 1: one request at a time)."""
    return session.generate(PROMPTS, max_new_tokens=20, max_batch=1)


def gated(service, when):
    """Hold the engine thread after a step where when() holds, until the gate is opened."""
    gate, step = threading.Event(), service.engine.step

    def held():
        step()
        if when():
            assert gate.wait(30), "the test never opened the gate"

    service.engine.step = held
    return gate


def test_requests_from_threads_and_asyncio_tasks_each_get_their_solo_tokens_and_text(session, solo):
    warm = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    sampled = session.generate([PROMPTS[2]], max_new_tokens=20, sampling=warm)[0]
    got = {}
    with session.service() as service:

        def ask(i):
            handle = service.submit(PROMPTS[i], max_tokens=20)
            streamed = "".join(e.text for e in handle)
            got["thread", i] = (handle.result(), streamed)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        async def tasks():
            async def one(i, sampling=None):
                handle = service.submit(PROMPTS[i], max_tokens=20, sampling=sampling)
                streamed = "".join([e.text async for e in handle])
                return await handle, streamed

            return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))), one(2, warm))

        *answers, got["sampled"] = asyncio.run(asyncio.wait_for(tasks(), 60))  # a reader never woken fails, not hangs
        got.update({("task", i): a for i, a in enumerate(answers)})
        assert service.engine.stats.decode_steps < 20 * len(PROMPTS)  # they shared steps
    for (how, i), (completion, streamed) in ((k, v) for k, v in got.items() if k != "sampled"):
        assert completion.ids == solo[i].ids and completion.finish_reason == solo[i].finish_reason, (how, i)
        assert streamed == completion.text == solo[i].text, (how, i)
    assert got["sampled"][0].ids == sampled.ids != solo[2].ids


def test_a_handle_aborted_or_left_early_ends_at_the_next_step_and_the_service_goes_on(session, solo):
    with session.service() as service:
        long = service.submit(PROMPTS[1], max_tokens=200)
        gate = gated(service, lambda: len(long.request.new_ids) == 1)
        events = iter(long)
        next(events)  # its first token; the engine is held after that step
        long.abort()
        gate.set()
        assert long.result(30).finish_reason == "abort" and len(long.result().ids) == 1
        left = service.submit(PROMPTS[3], max_tokens=200)
        gate = gated(service, lambda: len(left.request.new_ids) == 2)
        events = iter(left)
        next(events), next(events)
        events.close()  # the reader leaves: its request ends
        gate.set()
        assert left.result(30).finish_reason == "abort" and len(left.result().ids) == 2
        after = service.submit(PROMPTS[1], max_tokens=20).result(30)
        assert after.ids == solo[1].ids and not service.engine.decoding and sorted(service.engine.free) == [0, 1, 2, 3]


def test_stop_strings_and_stop_token_ids_end_a_request(session, solo):
    ids = solo[4].ids
    text = session.tokenizer.decode(ids[:6])
    stop = session.tokenizer.decode(ids[3:6])[-4:]  # a stop string that ends in the sixth token's text
    with session.service() as service:
        at_token = service.submit(PROMPTS[4], max_tokens=20, stop_token_ids=[ids[2]]).result(30)
        handle = service.submit(PROMPTS[4], max_tokens=20, stop=[stop])
        streamed = "".join(e.text for e in handle)
    assert at_token.ids == ids[: ids.index(ids[2]) + 1] and at_token.finish_reason == "stop"
    done = handle.result()
    assert done.finish_reason == "stop" and stop not in streamed and streamed == done.text == text[: text.index(stop)]


def test_what_cannot_run_is_refused_in_the_callers_thread(session):
    with session.service() as service:
        pass
    with pytest.raises(AotcError, match="this service is closed"):
        service.submit("hi")
    with session.service(max_waiting=2) as service:  # 4 slots, and 2 more waiting
        with pytest.raises(AotcError, match="is empty"):
            service.submit("")
        with pytest.raises(AotcError, match="more than max_seq 256"):
            service.submit([5] * 250, max_tokens=10)
        with pytest.raises(AotcError, match="stop_token_ids: 99999 is not a token id"):
            service.submit("hi", stop_token_ids=[99999])
        with pytest.raises(AotcError, match="sampling: expected a SamplingParams"):
            service.submit("hi", sampling={"temperature": 1})
        with pytest.raises(AotcError, match="service is running"):
            session.generate(["hi"])
        with pytest.raises(AotcError, match="already has a service"):
            session.service()
        first = service.submit("hi", max_tokens=50)
        gate = gated(service, lambda: True)
        next(iter(first))  # the engine is held after its first step
        queued = [service.submit("hi", max_tokens=4) for _ in range(5)]  # the engine has not seen them
        with pytest.raises(QueueFull, match=r"1 requests run and 5 wait for a slot \(4 slots, max_waiting 2\)"):
            service.submit("hi", max_tokens=4)
        gate.set()
        assert all(h.result(30).finish_reason == "length" for h in queued)
        service.engine.step = lambda: (_ for _ in ()).throw(RuntimeError("a graph failed"))  # the engine breaks
        broken = service.submit("hi", max_tokens=4)
        with pytest.raises(AotcError, match="request .*: the engine failed: a graph failed"):
            broken.result(30)
        with pytest.raises(AotcError, match="request .*: the engine failed: a graph failed"):
            list(broken)
        with pytest.raises(AotcError, match="the engine failed and takes no more requests: a graph failed"):
            service.submit("hi")
    assert session.generate(["hi"], max_new_tokens=2)[0].ids  # the Session runs again once it is closed


def test_the_docs_example_runs_as_written(tiny_bundle, tmp_path, monkeypatch):
    """docs/engine.md's example, run as it stands from a folder holding artifacts/tiny."""
    import contextlib
    import io
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parent.parent / "docs" / "engine.md"
    (block,) = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "tiny").symlink_to(tiny_bundle.out)
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(doc), "exec"), {})
    lines = out.getvalue().splitlines()
    with Session.open(tiny_bundle.out) as session:
        first = session.generate(["The capital of France is"], max_new_tokens=12)[0]
        sampled = [session.generate([p], max_new_tokens=12, sampling=SamplingParams(temperature=0.8, seed=s), stop=["\n"])[0] for p, s in (("Once upon a time", 1), ("Hello", 2))]
    assert out.getvalue().startswith(f"{first.text} {first.finish_reason}\n")
    assert lines[-2:] == [f"{d.finish_reason} {d.text!r}" for d in sampled]
