"""ThreadGovernor: torch's threads follow the CPUs that other processes leave free."""

from __future__ import annotations

import os

import pytest
import torch

from aotc.runtime import threads as threads_mod
from aotc.runtime.threads import ThreadGovernor, cpu_counters, running_elsewhere


class Machine:
    """A fake clock and /proc/stat: others use `others` CPUs, this process `own`."""

    def __init__(self):
        self.t, self.busy, self.own = 0.0, 0.0, 0.0

    def advance(self, seconds, others, own):
        self.t += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds

    def counters(self):
        return self.busy, self.own


@pytest.fixture
def cpus(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads_mod.os, "cpu_count", lambda: 4)
    torch.set_num_threads(4)
    yield 4
    torch.set_num_threads(before)


def test_threads_yield_the_cpus_others_use_and_come_back(cpus):
    m = Machine()
    gov = ThreadGovernor(counters=m.counters, elsewhere=lambda: 0, clock=lambda: m.t)
    assert gov.step() == 4
    m.advance(0.3, others=0.0, own=4.0)  # our own (spinning) threads do not count
    assert gov.step() == 4 and torch.get_num_threads() == 4
    m.advance(0.3, others=1.0, own=3.0)
    assert gov.step() == 3 and torch.get_num_threads() == 3
    m.advance(0.1, others=4.0, own=0.0)  # within the interval: no change yet
    assert gov.step() == 3
    m.advance(0.3, others=4.0, own=0.5)  # every CPU taken: still one thread
    assert gov.step() == 1
    m.advance(0.3, others=0.2, own=1.0)
    assert gov.step() == 4
    gov.restore()
    assert torch.get_num_threads() == 4


def test_fixed_threads_are_kept_and_restored(cpus):
    m = Machine()
    gov = ThreadGovernor(2, counters=m.counters, elsewhere=lambda: 4, clock=lambda: m.t)
    m.advance(1.0, others=4.0, own=0.0)
    assert gov.step() == 2 and torch.get_num_threads() == 2
    gov.restore()
    assert torch.get_num_threads() == 4


def test_without_proc_stat_nothing_changes(cpus):
    gov = ThreadGovernor(counters=lambda: None, elsewhere=lambda: None)
    assert gov.step() == 4


def test_the_first_count_leaves_out_the_processes_running_now(cpus):
    """Before an interval has passed: other processes' running threads at that moment."""
    m = Machine()
    gov = ThreadGovernor(counters=m.counters, elsewhere=lambda: 1, clock=lambda: m.t)
    assert gov.step() == 3 and torch.get_num_threads() == 3
    m.advance(0.2, others=0.0, own=3.0)  # it ended: back to every CPU
    assert gov.step() == 4


def test_real_counters_are_seconds():
    assert running_elsewhere() >= 0
    busy, own = cpu_counters()
    assert busy > 0 and 0 < own <= busy + 1  # /proc/stat ticks and os.times, both in seconds
    assert os.path.exists("/proc/stat")


def test_generate_asks_the_governor_before_every_step_and_restores(tiny_dir, monkeypatch):
    import sys

    from aotc.models.base import load_model

    generate_mod = sys.modules["aotc.runtime.generate"]  # the module; aotc.runtime.generate is the function

    made = []

    class Recording(ThreadGovernor):
        def __init__(self, threads=None):
            super().__init__(threads, counters=lambda: None, elsewhere=lambda: None)
            self.steps = 0
            made.append(self)

        def step(self):
            self.steps += 1
            return super().step()

    monkeypatch.setattr(generate_mod, "ThreadGovernor", Recording)
    before = torch.get_num_threads()
    model = load_model(tiny_dir).model
    gen = generate_mod.generate(model, [[5, 6, 7], [8, 9]], 6, max_batch=2, max_seq=64, stop_at_eos=False, threads=1)
    assert made[0].fixed and made[0].steps == 1 + gen.decode_steps == 6  # the group's prefill, then 5 decode steps
    assert torch.get_num_threads() == before
