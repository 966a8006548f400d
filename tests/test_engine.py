"""The engine (aotc/runtime/engine.py): continuous batching over a bundle's static buckets,
stepped by hand, so that every test is deterministic and counts steps, not seconds."""

from __future__ import annotations

import pytest
import torch

from aotc import AotcError, SamplingParams, Session
from aotc.models.loader import load_model
from aotc.runtime.engine import Engine

CHUNK = 64  # tiny_bundle's largest prefill chunk (conftest: batch buckets 1, 2, 4, chunks 16 and 64, max_seq 256)


@pytest.fixture(scope="module")
def session(tiny_bundle):
    with Session.open(tiny_bundle.out) as s:
        yield s


def engine_of(session) -> Engine:
    b = session.bundle
    return Engine(session.model, session._caches, slots=b.cache_slots, max_seq=b.max_seq, chunk=CHUNK, eos_ids=session.defaults.eos_token_ids)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def solo(session, ids: list[int], max_tokens: int, sampling=None):
    engine = engine_of(session)
    request = engine.submit(ids, max_tokens, sampling, keep_logits=True)
    engine.run()
    return request


def test_batching_changes_no_answer(session):
    """32 greedy requests, prompts of 1 to 200 tokens (max_seq 256) and 1 to 24 new tokens,
    two submitted every step: each gives what it gives alone. Where a token differs, it is
    at a near-tie of the solo run's logits, under the fidelity rule's tolerance."""
    g = torch.Generator().manual_seed(0)
    asks = [(prompt(int(n), i), int(m)) for i, (n, m) in enumerate(zip(torch.randint(1, 201, (32,), generator=g), torch.randint(1, 25, (32,), generator=g)))]
    asks[0] = (prompt(200, 99), 24)  # the longest first: it prefills while the others join and leave
    engine = engine_of(session)
    requests, pending, rows_seen = [], list(asks), set()
    while pending or not engine.idle:
        for ids, m in pending[:2]:
            requests.append(engine.submit(ids, m))
        pending = pending[2:]
        engine.step()
        rows_seen.add(len(engine.decoding))
    assert {1, 2, 3, 4} <= rows_seen  # every batch bucket ran, and 3 rows padded into 4
    near_ties = []
    for (ids, m), got in zip(asks, requests):
        alone = solo(session, ids, m)
        if got.new_ids != alone.new_ids:
            step = next(i for i, (a, b) in enumerate(zip(got.new_ids, alone.new_ids)) if a != b)
            top2 = alone.logits[step].topk(2).values
            gap = (top2[0] - top2[1]).item()
            print(f"request of {len(ids)} tokens differs at new token {step}: a near-tie, gap {gap:.2e}")
            assert gap <= 1e-3 * (1 + top2[0].abs().item()), (len(ids), step, gap)
            near_ties.append(gap)
        assert got.finish_reason == alone.finish_reason or near_ties
    assert len(near_ties) <= 2, near_ties


def test_a_seeded_request_samples_the_same_alone_and_among_seven_others(session):
    warm = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    ids = prompt(40, 1)
    alone = solo(session, ids, 16, warm).new_ids
    engine = engine_of(session)
    others = [engine.submit(prompt(10 + 9 * i, 10 + i), 16, SamplingParams(temperature=1.1, seed=i)) for i in range(3)]
    mine = engine.submit(ids, 16, warm)
    others += [engine.submit(prompt(5 + i, 20 + i), 16, SamplingParams(temperature=0.9)) for i in range(4)]
    engine.run()
    assert mine.new_ids == alone and solo(session, ids, 16).new_ids != alone  # it sampled


@pytest.mark.parametrize("where, long_prompt", [("bundle", 200), ("eager", 600)])
def test_no_running_stream_waits_more_than_two_steps_while_a_long_prompt_prefills(session, tiny_dir, where, long_prompt):
    """The bundle's max_seq is 256; the 600-token prompt runs on the eager model (the
    schedule is the engine's, whatever runs the steps) with caches of 1024 positions."""
    if where == "bundle":
        engine = engine_of(session)
    else:
        model = load_model(tiny_dir).model
        engine = Engine(model, model.allocate_caches(5, 1024), slots=5, max_seq=1024, chunk=CHUNK)
    running = [engine.submit(prompt(8, i), 60) for i in range(3)]
    for _ in range(3):
        engine.step()
    assert all(len(r.new_ids) >= 1 for r in running)
    long = engine.submit(prompt(long_prompt, 7), 8)  # chunks of 64
    got = {id(r): [] for r in running}
    step = 0
    while not long.new_ids:
        engine.step()
        step += 1
        for r in running:
            got[id(r)].append(len(r.new_ids))
    assert step == -(-long_prompt // CHUNK)  # one chunk per step
    for counts in got.values():  # a token at every step of the prefill
        assert all(b - a == 1 for a, b in zip(counts, counts[1:])), counts


def test_an_aborted_request_frees_its_slot_within_a_step_and_the_next_one_leaks_nothing(session):
    """Aborted while waiting, while prefilling and while decoding: each frees its slot at
    the next step; the request placed in that slot gives its solo output, so neither
    the reused slot nor the scratch slot carries anything over."""
    engine = engine_of(session)
    b = session.bundle
    decoding = [engine.submit(prompt(6, i), 50) for i in range(3)]
    prefilling = engine.submit(prompt(180, 3), 10)
    waiting = engine.submit(prompt(5, 4), 10)  # no slot: four rows are taken
    engine.step()
    engine.step()
    assert all(r.new_ids for r in decoding) and 0 < prefilling.prefilled < 180 and waiting.slot is None
    assert engine.free == [] and b.max_batch == 4
    engine.abort(waiting)
    engine.abort(prefilling)
    engine.abort(decoding[1])
    freed = {prefilling.slot, decoding[1].slot}
    engine.step()
    assert sorted(engine.free) == sorted(freed) and waiting.slot is None
    assert [r.finish_reason for r in (waiting, prefilling, decoding[1])] == ["abort"] * 3
    late = [engine.submit(prompt(70, 30), 12), engine.submit(prompt(9, 31), 12)]
    engine.step()
    assert {r.slot for r in late} == freed
    engine.run()
    for r in late:
        assert r.new_ids == solo(session, r.prompt_ids, 12).new_ids
    assert engine.idle and sorted(engine.free) == list(range(4))


def test_a_request_that_cannot_run_is_refused_at_submit_naming_the_limit(session):
    engine = engine_of(session)
    with pytest.raises(AotcError, match="prompt: empty"):
        engine.submit([], 4)
    with pytest.raises(AotcError, match="prompt of 250 tokens with max_tokens 10 is 260 positions, more than max_seq 256"):
        engine.submit(prompt(250, 0), 10)
    with pytest.raises(AotcError, match="max_tokens: 0; expected at least 1"):
        engine.submit(prompt(5, 0), 0)
    assert engine.idle
