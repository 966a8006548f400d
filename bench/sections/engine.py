"""engine: a mixed workload through the engine (continuous batching) against static
groups of the same requests, on the 100m model (tiny under --quick), batch buckets 1, 2,
4 and 8 (1, 2, 4 under --quick). 64 requests (16 under --quick), prompts of 1 to 300
tokens (to 100), 1 to 128 new tokens each (to 16), greedy, arriving as a Poisson process
at 1.5x the static groups' measured capacity, so that both are saturated. Static groups:
each group is what has arrived when the previous group ends (up to the largest batch
bucket), run by `generate` (a group's rows leave as they end; no request joins it).
Throughput is output tokens over the makespan; time to first token from each request's
arrival; inter-token latency between a request's tokens. Issue 67's targets: throughput
at least 1.5x static groups', time-to-first-token p99 at most half of theirs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from common import Run, print_misses, section, table

from aotc.models.loader import load_model
from aotc.runtime import Bundle, generate
from aotc.runtime.engine import Engine

RATE_OVER_CAPACITY = 1.5
THROUGHPUT_TARGET, TTFT_P99_TARGET = 1.5, 0.5  # engine / static groups: at least, at most


@dataclass
class Ask:
    arrival: float  # seconds after the start
    ids: list[int]
    max_tokens: int
    times: list[float] = field(default_factory=list)  # when each new token came
    new_ids: list[int] = field(default_factory=list)


@section("engine")
def engine(run: Run) -> dict:
    quick = run.quick
    n, longest, most_new = (16, 100, 16) if quick else (64, 300, 128)
    buckets = (1, 2, 4) if quick else (1, 2, 4, 8)
    folder = run.model(run.main)
    out = run.bundle(folder, "engine", batch_buckets=buckets, chunk_buckets=(16, 64, 128), max_seq=512)
    bundle = Bundle.load(out)
    model = load_model(folder, **bundle.model_args()).model
    bundle.bind(model)
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
    kw = dict(slots=bundle.cache_slots, max_seq=bundle.max_seq, max_batch=bundle.max_batch)
    vocab = min(model.config.vocab_size, 500)  # the tokenizer's ids
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, longest + 1, (n,), generator=g).tolist()
    news = torch.randint(1, most_new + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lengths]

    def asks(arrivals):
        return [Ask(a, p, m) for a, p, m in zip(arrivals, prompts, news)]

    _static(model, caches, kw, asks([0.0] * n))  # warm: every graph the workload reaches has run once
    capacity = n / _makespan(_static(model, caches, kw, asks([0.0] * n)))  # requests per second, all there at once
    rate = RATE_OVER_CAPACITY * capacity
    arrivals = np.cumsum(np.random.default_rng(0).exponential(1 / rate, n)).tolist()
    spent = {}  # seconds in prefill and decode calls, and decode steps, of each run
    runs = {"static groups": _static(model, caches, kw, asks(arrivals), spent), "engine": _engine(model, caches, kw, asks(arrivals), spent)}
    rows = []
    for what, done in runs.items():
        ttft = [a.times[0] - a.arrival for a in done]
        itl = [b - a for r in done for a, b in zip(r.times, r.times[1:])]
        tokens = sum(len(a.new_ids) for a in done)
        rows.append({
            "run": what, "bundle": run.aotc, "requests": n, "output tokens": tokens, "makespan s": _makespan(done),
            "tokens/s": tokens / _makespan(done), "TTFT p50 ms": _ms(ttft, 50), "TTFT p99 ms": _ms(ttft, 99),
            "ITL p50 ms": _ms(itl, 50), "ITL p99 ms": _ms(itl, 99),
            "in prefill s": spent[what][0], "in decode s": spent[what][1], "decode steps": spent[what][2],
            "tokens as static groups'": sum(a.new_ids == b.new_ids for a, b in zip(done, runs["static groups"])),
        })  # fmt: skip
    static, cont = rows
    cont["tokens/s vs static"] = cont["tokens/s"] / static["tokens/s"]
    cont["TTFT p99 vs static"] = cont["TTFT p99 ms"] / static["TTFT p99 ms"]
    misses = []
    if cont["tokens/s vs static"] < THROUGHPUT_TARGET:
        misses.append(f"throughput {cont['tokens/s vs static']:.2f}x static groups' (target {THROUGHPUT_TARGET}x)")
    if cont["TTFT p99 vs static"] > TTFT_P99_TARGET:
        misses.append(f"time to first token p99 {cont['TTFT p99 vs static']:.2f}x static groups' (target {TTFT_P99_TARGET}x)")
    table(
        f"a mixed workload, {n} requests arriving at {rate:.1f}/s ({RATE_OVER_CAPACITY}x static groups' capacity of {capacity:.1f}/s), "
        f"batch buckets {','.join(map(str, buckets))} (targets: tokens/s >= {THROUGHPUT_TARGET}x static, TTFT p99 <= {TTFT_P99_TARGET}x static)",
        rows,
    )
    print_misses(misses)
    return {
        "model": run.main, "requests": n, "prompt tokens": lengths, "max tokens": news, "arrivals s": arrivals,
        "capacity requests/s": capacity, "rate requests/s": rate, "batch buckets": list(buckets),
        "targets": {"tokens/s vs static": THROUGHPUT_TARGET, "TTFT p99 vs static": TTFT_P99_TARGET}, "misses": misses, "rows": rows,
    }  # fmt: skip


def _static(model, caches, kw, asks: list[Ask], spent: dict | None = None) -> list[Ask]:
    """Static groups: each group what has arrived when the last one ended, run to its end."""
    t0, queue, pending, totals = time.perf_counter(), [], list(asks), [0.0, 0.0, 0]
    while pending or queue:
        now = time.perf_counter() - t0
        while pending and pending[0].arrival <= now:
            queue.append(pending.pop(0))
        if not queue:
            time.sleep(pending[0].arrival - now)
            continue
        group, queue = queue[: kw["max_batch"]], queue[kw["max_batch"] :]

        def on_token(i, s, group=group):
            group[i].times.append(time.perf_counter() - t0)
            return len(s.new_ids) == group[i].max_tokens  # its own length ends it

        gen = generate(model, [a.ids for a in group], max(a.max_tokens for a in group), caches=caches, stop_at_eos=False, on_token=on_token, **kw)
        for a, s in zip(group, gen.sequences):
            a.new_ids = s.new_ids
        totals = [totals[0] + gen.prefill_s, totals[1] + gen.decode_s, totals[2] + gen.decode_steps]
    if spent is not None:
        spent["static groups"] = totals
    return asks


def _engine(model, caches, kw, asks: list[Ask], spent: dict) -> list[Ask]:
    """The engine: each request submitted when it arrives, one step at a time."""
    engine = Engine(model, caches, slots=kw["slots"], max_seq=kw["max_seq"], max_batch=kw["max_batch"], chunk=128)
    t0, pending = time.perf_counter(), list(asks)
    with torch.no_grad():
        while pending or not engine.idle:
            now = time.perf_counter() - t0
            while pending and pending[0].arrival <= now:
                a = pending.pop(0)
                request = engine.submit(a.ids, a.max_tokens, on_token=lambda r, a=a: a.times.append(time.perf_counter() - t0))
                request.new_ids = a.new_ids  # the same list, filled as it runs
            if engine.idle:
                time.sleep(pending[0].arrival - now)
                continue
            engine.step()
    spent["engine"] = [engine.stats.prefill_s, engine.stats.decode_s, engine.stats.decode_steps]
    return asks


def _makespan(done: list[Ask]) -> float:
    return max(a.times[-1] for a in done)


def _ms(values: list[float], q: int) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else 0.0
