"""Sampling on the host and stop strings on streamed text (aotc/runtime/sampling.py, stops.py)."""

from __future__ import annotations

import re

import pytest
import torch
from scipy.stats import chi2

from aotc.runtime.sampling import Sampler, SamplingError, SamplingParams, kept_probabilities
from aotc.runtime.stops import StopError, StopText

# Fixed logits over 8 tokens: a few likely ones and a tail.
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def expected(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The distribution each setting defines, computed apart from the code under test."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if top_k and rank >= top_k:
            break
        if rank and mass >= top_p:
            break
        if rank and probs[i] < min_p * probs[order[0]]:
            break
        keep[i] = True
        mass += probs[i].item()
    kept = torch.where(keep, probs, 0)
    return kept / kept.sum()


@pytest.mark.parametrize("settings", [
    dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.5, top_k=3), dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.2), dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
])  # fmt: skip
def test_each_sampler_draws_the_distribution_it_defines(settings):
    """A chi-square test of 8,000 draws against the distribution computed apart, at a
    fixed seed (the test is deterministic): p > 0.001, and no draw outside what the
    setting keeps."""
    want = expected(LOGITS, **settings)
    sampler = Sampler(SamplingParams(seed=1234, **settings), prompt=[])
    n = 8_000
    counts = torch.zeros(len(LOGITS))
    for _ in range(n):
        counts[sampler._pick(LOGITS)] += 1
    assert counts[want == 0].sum() == 0, (settings, counts)
    kept = want > 0
    stat = (((counts[kept] - n * want[kept]) ** 2) / (n * want[kept])).sum().item()
    p_value = chi2.sf(stat, kept.sum().item() - 1)
    assert p_value > 1e-3, (settings, stat, counts / n, want)
    torch.testing.assert_close(kept_probabilities(LOGITS / settings["temperature"], settings.get("top_k", 0), settings.get("top_p", 1.0), settings.get("min_p", 0.0)), want.float())


def test_a_seed_gives_the_same_tokens_and_top_k_1_is_greedy():
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(50, generator=g) for _ in range(40)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    first, again = Sampler(params, [1, 2]), Sampler(params, [1, 2])
    other = Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=8), [1, 2])
    a = [first.choose(x).token for x in steps]
    assert a == [again.choose(x).token for x in steps]
    assert a != [other.choose(x).token for x in steps]
    top1 = Sampler(SamplingParams(temperature=1.3, top_k=1, seed=3), [])
    assert [top1.choose(x).token for x in steps] == [int(x.argmax()) for x in steps]
    assert [Sampler(SamplingParams(), []).choose(x).token for x in steps] == [int(x.argmax()) for x in steps]


def test_penalties_follow_their_definitions_and_leave_the_steps_logits_alone():
    logits = torch.tensor([3.0, -2.0, 2.9, 0.0])
    before = logits.clone()
    # repetition: the prompt's token 0 (positive: divided) and 1 (negative: multiplied)
    s = Sampler(SamplingParams(repetition_penalty=2.0), prompt=[0, 1])
    torch.testing.assert_close(s._penalized(logits), torch.tensor([1.5, -4.0, 2.9, 0.0]))
    assert s.choose(logits).token == 2
    torch.testing.assert_close(logits, before)
    # presence and frequency read the output only: token 2 chosen twice
    s = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[0])
    assert s.choose(logits).token == 0  # the prompt's token is not penalized
    s.choose(torch.tensor([0.0, 0.0, 9.0, 0.0]))
    s.choose(torch.tensor([0.0, 0.0, 9.0, 0.0]))
    torch.testing.assert_close(s._penalized(logits), torch.tensor([3.0 - 0.75, -2.0, 2.9 - 1.0, 0.0]))


def test_logprobs_are_the_models_own():
    s = Sampler(SamplingParams(temperature=0.5, logprobs=2, seed=0, repetition_penalty=1.3), prompt=[0])
    choice = s.choose(LOGITS)
    model = torch.log_softmax(LOGITS, dim=-1)
    assert choice.logprob == pytest.approx(model[choice.token].item())
    assert [t for t, _ in choice.top] == [0, 1] and choice.top[0][1] == pytest.approx(model[0].item())
    assert Sampler(SamplingParams(), []).choose(LOGITS).logprob is None


@pytest.mark.parametrize("field, value, said", [
    ("temperature", -0.1, "temperature: -0.1; expected a number >= 0"),
    ("temperature", float("nan"), "temperature: nan"),
    ("top_k", -1, "top_k: -1; expected an integer >= 0"),
    ("top_p", 0.0, "top_p: 0.0; expected a number in (0, 1]"),
    ("min_p", 1.5, "min_p: 1.5; expected a number in [0, 1]"),
    ("seed", -3, "seed: -3; expected an integer in [0, 2^63)"),
    ("presence_penalty", 3, "presence_penalty: 3; expected a number in [-2, 2]"),
    ("repetition_penalty", 0, "repetition_penalty: 0; expected a number > 0"),
    ("logprobs", 21, "logprobs: 21; expected an integer in [0, 20]"),
])  # fmt: skip
def test_a_parameter_out_of_range_is_an_error_naming_it(field, value, said):
    with pytest.raises(SamplingError, match=re.escape(said)):
        SamplingParams(**{field: value})


def stream(stops, deltas):
    s = StopText(stops)
    sent, stopped = [], False
    for d in deltas:
        text, stopped = s.feed(d)
        sent.append(text)
        if stopped:
            break
    if not stopped:
        sent.append(s.flush())
    return sent, stopped


def test_a_stop_string_across_three_tokens_never_reaches_the_stream():
    deltas = ["The answer is 42", " </", "ans", "wer> and more"]
    sent, stopped = stream(["</answer>"], deltas)
    assert stopped and "".join(sent) == "The answer is 42 " and not any("<" in t for t in sent), sent
    assert sent[:2] == ["The answer is 42", " "]  # held back only what could start the stop
    # The stream equals the whole text cut before the stop, as a response that is not streamed holds.
    whole = "".join(deltas)
    assert "".join(sent) == whole[: whole.find("</answer>")]


def test_held_text_that_turns_out_not_to_be_a_stop_is_sent_and_the_first_stop_wins():
    sent, stopped = stream(["</answer>", "STOP"], ["a </an", "x b S", "TO", "P c"])
    assert stopped and sent == ["a ", "</anx b ", "", ""] and "".join(sent) == "a </anx b "
    sent, stopped = stream(["</answer>"], ["ends with </ans"])
    assert not stopped and "".join(sent) == "ends with </ans"  # the end of the stream sends what was held
    sent, stopped = stream(["ab", "b"], ["xab"])
    assert sent == ["x"]
    with pytest.raises(StopError, match="stop: \\['ok', ''\\]; expected non-empty strings"):
        StopText(["ok", ""])


def test_greedy_is_torchs_argmax_ties_and_nans_included():
    """sampling.greedy (numpy's argmax on host float32 logits): the first of equal maxima,
    and the first NaN, as torch.argmax, row by row and for one row."""
    from aotc.runtime.sampling import greedy

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (64, 49152), generator=g).float()  # many ties at the maximum
    logits[5, 100] = logits[5, 7] = float("nan")
    logits[9] = float("-inf")
    for rows in (logits, logits[3], logits[[5, 9, 2]], logits.t().contiguous().t()):
        assert torch.equal(greedy(rows), rows.argmax(dim=-1)), rows.shape
    assert greedy(logits).dtype == torch.int64 and greedy(logits.bfloat16()).tolist() == logits.bfloat16().argmax(dim=-1).tolist()
