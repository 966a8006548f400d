"""The prefix cache (aotc/runtime/prefix.py, in the engine): a prompt that starts like one
a slot holds copies that slot's first positions and prefills only the rest; stepped by
hand on the tiny export bundle, each answer against the same request run alone without it."""

from __future__ import annotations

import pytest
import torch

from aotc import Session
from aotc.runtime.engine import Engine
from aotc.runtime.prefix import BLOCK, PrefixIndex

CHUNK = 64  # tiny_bundle's largest prefill chunk (conftest: batch buckets 1, 2, 4, chunks 16 and 64, max_seq 256)


@pytest.fixture(scope="module")
def session(tiny_bundle):
    with Session.open(tiny_bundle.out) as s:
        yield s


def engine_of(session, prefix_cache: bool = True) -> Engine:
    b = session.bundle
    return Engine(session.model, session._caches, slots=b.cache_slots, max_seq=b.max_seq, chunk=CHUNK, prefix_cache=prefix_cache)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(session, ids: list[int], max_tokens: int) -> list[int]:
    """The request's tokens in an engine of its own, without the prefix cache."""
    engine = engine_of(session, prefix_cache=False)
    request = engine.submit(ids, max_tokens)
    engine.run()
    return request.new_ids


SHARED = tokens(200, 0)  # a system prompt of 200 tokens: 12 full blocks and 8 tokens


def test_a_prompt_sharing_200_tokens_prefills_only_the_rest_and_answers_as_without(session):
    """From a finished request's slot (taken as it is, no copy), and from a prompt still
    prefilling (copied: what it has prefilled so far): the shared tokens are not prefilled
    again, and the tokens are those of the request alone."""
    engine = engine_of(session)
    assert engine.prefix_off is None
    first = engine.submit(SHARED + tokens(9, 1), 6)
    engine.run()
    computed = engine.stats.prefill_tokens
    again = engine.submit(SHARED + tokens(7, 2), 8)
    engine.run()
    assert again.cached == 200 and again.slot == first.slot  # the free slot that held it, in place
    assert engine.stats.prefill_tokens - computed == 7
    assert again.new_ids == alone(session, again.prompt_ids, 8)

    assert engine.stats.prefix_hits == 200 and engine.stats.prefix_queries == 209 + 207

    engine = engine_of(session)  # an empty index: the caches' contents are not claimed
    long_running = engine.submit(SHARED + tokens(3, 3), 40)
    engine.step()
    engine.step()
    assert long_running.prefilled == 2 * CHUNK
    beside = engine.submit(SHARED + tokens(30, 4), 10)
    engine.step()
    assert beside.slot != long_running.slot and beside.cached == 2 * CHUNK  # copied from a prompt still prefilling
    engine.run()
    assert engine.stats.prefill_tokens == 203 + 230 - 2 * CHUNK
    assert beside.new_ids == alone(session, beside.prompt_ids, 10)
    assert long_running.new_ids == alone(session, long_running.prompt_ids, 40)


def test_the_next_turn_reuses_the_answer_too(session):
    """A conversation's next prompt holds the last one's prompt and answer: all but the
    answer's last token are in the slot (no step fed that one back)."""
    engine = engine_of(session)
    turn = engine.submit(tokens(40, 5), 12)
    engine.run()
    history = turn.prompt_ids + turn.new_ids
    follow = engine.submit(history + tokens(5, 6), 8)
    engine.run()
    assert follow.cached == len(history) - 1
    assert follow.new_ids == alone(session, follow.prompt_ids, 8)


def test_a_reused_slot_leaks_nothing_and_dead_rows_keep_what_free_slots_hold(session):
    """A free slot that held a prefix sits below decoding slots (its dead decode row writes
    past what it holds, not position 0); a request takes it back and answers as alone. Then
    unrelated prompts fill every slot after prefix copies: each answers as alone."""
    engine = engine_of(session)
    held = engine.submit(SHARED + tokens(4, 7), 2)  # slot 0, ends first
    others = [engine.submit(tokens(210, 8 + i), 30) for i in range(2)]  # slots 1, 2: decode on, past position 204
    while not held.done or not all(r.new_ids for r in others):
        engine.step()
    assert held.slot == 0 and not any(r.done for r in others)
    for _ in range(4):  # decode steps over slots 0-2, slot 0 a dead row
        engine.step()
    back = engine.submit(SHARED + tokens(6, 11), 5)
    engine.run()
    assert back.slot == 0 and back.cached == 200
    assert back.new_ids == alone(session, back.prompt_ids, 5)

    short = engine.submit(tokens(20, 12), 8)  # the empty slot 3: decodes at positions 20-27 over dead rows 0-2
    engine.run()
    assert short.slot == 3
    again = engine.submit(SHARED + tokens(6, 15), 5)
    engine.run()  # slot 0 kept its first 20 to 27 tokens: a dead row must not take the step to a larger context
    assert BLOCK <= again.cached <= 27 and again.new_ids == alone(session, again.prompt_ids, 5)

    copied = [engine.submit(SHARED + tokens(5 + i, 20 + i), 4) for i in range(3)]
    engine.run()
    assert [r.cached for r in copied] == [200] * 3
    fresh = [engine.submit(tokens(50 + 10 * i, 30 + i), 6) for i in range(4)]
    engine.run()
    assert [r.cached for r in fresh] == [0] * 4
    for r in copied + fresh:
        assert r.new_ids == alone(session, r.prompt_ids, len(r.new_ids))


def test_the_index_matches_whole_blocks_by_their_tokens_and_leaves_the_last_token():
    index = PrefixIndex(3)
    prompt = list(range(100, 100 + 3 * BLOCK + 5))
    index.hold(1, prompt)
    assert index.lookup(prompt[: BLOCK - 1] + [7]) == (None, 0)  # no full block in common
    assert index.lookup(prompt[: 2 * BLOCK + 3] + [7]) == (1, 2 * BLOCK + 3)  # past the last full block, token by token
    assert index.lookup(prompt) == (1, len(prompt) - 1)  # the last token's logits choose the first new token
    index.hold(1, prompt[: BLOCK + 2])  # its request overwrote the rest
    assert index.lookup(prompt) == (1, BLOCK + 2) and len(index.slots_of) == 1
    index.hold(2, [5] * (2 * BLOCK))
    (chain,) = index.hashes[1]
    index.slots_of[chain].add(2)  # a hash that collides: slot 2 holds other tokens
    assert index.lookup(prompt) == (1, BLOCK + 2)
    index.hold(1, [])
    assert index.lookup(prompt) == (None, 0)
    assert index.pick([0, 1, 2]) == 0  # holds nothing: taken first; then the least recently used
    index.hold(0, prompt)
    index.touch(2)
    index.touch(0)
    assert index.pick([0, 2]) == 2


def test_a_model_whose_caches_cannot_be_copied_by_position_says_so(session, monkeypatch):
    monkeypatch.setattr(type(session.model), "cache_positions", lambda self: None)
    engine = engine_of(session)
    assert engine.prefix is None and "cache_positions" in engine.prefix_off
    assert engine_of(session, prefix_cache=False).prefix_off == "not asked for"
