"""ThreadGovernor: torch's threads follow the CPUs that other processes leave free."""

from __future__ import annotations

import os
from pathlib import Path

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


def test_real_counters_count_seconds_not_ticks():
    """A third of a second of this process spinning: both counters grow by about that,
    where /proc/stat's ticks (100 a second) would grow by 30."""
    import time

    before, t0 = cpu_counters(), time.perf_counter()
    start = time.process_time()
    while time.process_time() - start < 0.3:  # spin: this process's own CPU time
        pass
    after, wall = cpu_counters(), time.perf_counter() - t0
    busy, own = after[0] - before[0], after[1] - before[1]
    assert own >= 0.25
    cpus = os.cpu_count()
    assert 0.5 * own <= busy <= cpus * wall + 0.05, (busy, own, wall)


@pytest.fixture
def fake_proc(tmp_path, monkeypatch):
    """/proc/loadavg and /proc/self/task/*/stat, as running_elsewhere reads them, made here."""
    root = tmp_path / "proc"
    monkeypatch.setattr(threads_mod, "Path", lambda p: Path(str(p).replace("/proc", str(root), 1)))

    def make(running: int, states: list[str]):
        (root / "self" / "task").mkdir(parents=True, exist_ok=True)
        (root / "loadavg").write_text(f"1.50 0.80 0.40 {running}/312 4242\n")
        for i, state in enumerate(states):
            (root / "self" / "task" / str(100 + i)).mkdir(exist_ok=True)
            # a thread name with a ") " in it: the state is the field after the last ")"
            (root / "self" / "task" / str(100 + i) / "stat").write_text(f"{100 + i} (pt main) S) {state} 1 100 100 0 -1\n")

    return make


def test_running_elsewhere_leaves_out_this_process_running_threads(fake_proc):
    fake_proc(running=5, states=["R", "R", "S", "D"])
    assert running_elsewhere() == 3  # 5 running, 2 of them ours
    fake_proc(running=1, states=["R", "R", "R", "R"])  # loadavg sampled a moment apart
    assert running_elsewhere() == 0


def test_running_elsewhere_is_none_without_proc_or_with_another_format(fake_proc, tmp_path):
    assert running_elsewhere() is None  # no loadavg made
    fake_proc(running=2, states=["R"])
    for text in ("1.50 0.80", "1.50 0.80 0.40 x/312 4242"):  # too few fields; not a count
        (tmp_path / "proc" / "loadavg").write_text(text)
        assert running_elsewhere() is None


def test_a_thread_that_ends_while_counted_is_skipped(fake_proc, tmp_path):
    fake_proc(running=4, states=["R", "R"])
    (tmp_path / "proc" / "self" / "task" / "999").mkdir()  # listed, but its stat is gone
    assert running_elsewhere() == 2


def test_counter_skew_never_gives_more_threads_than_cpus(cpus):
    """os.times can run ahead of /proc/stat: others never count below zero, even where
    torch was started with more threads than the machine has CPUs."""
    torch.set_num_threads(6)
    m = Machine()
    gov = ThreadGovernor(counters=m.counters, elsewhere=lambda: 0, clock=lambda: m.t)
    m.advance(0.3, others=0.0, own=2.0)
    m.own += 0.3  # this process's counter ahead of the machine's by one CPU
    assert gov.step() == 4


def test_a_step_within_the_same_instant_keeps_the_count(cpus):
    """With interval 0 and a clock that has not moved, no time has passed to measure: no
    other process is counted (with more torch threads than CPUs, still the CPUs)."""
    torch.set_num_threads(6)
    m = Machine()
    gov = ThreadGovernor(counters=m.counters, elsewhere=lambda: 0, clock=lambda: m.t, interval=0)
    assert gov.step() == 4 and gov.step() == 4


def test_an_unknown_cpu_count_is_one_cpu(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads_mod.os, "cpu_count", lambda: None)
    torch.set_num_threads(4)
    try:
        assert ThreadGovernor(counters=lambda: None, elsewhere=lambda: 0).threads == 1
    finally:
        torch.set_num_threads(before)


def test_cpu_counters_read_busy_ticks_as_seconds(monkeypatch):
    """/proc/stat's cpu line: user nice system idle iowait irq softirq steal (guest ...):
    busy is all but idle and iowait, in clock ticks; this process's time is os.times'."""
    import io

    line = "cpu  1000 200 300 40000 5000 60 70 80 900 1\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    monkeypatch.setattr(threads_mod, "open", lambda path: io.StringIO(line) if path == "/proc/stat" else None, raising=False)
    monkeypatch.setattr(threads_mod.os, "sysconf", lambda name: 100 if name == "SC_CLK_TCK" else os.sysconf(name))
    monkeypatch.setattr(threads_mod.os, "times", lambda: os.times_result((1.5, 0.25, 0, 0, 0)))
    assert cpu_counters() == (pytest.approx((1000 + 200 + 300 + 60 + 70 + 80) / 100), 1.75)


def test_cpu_counters_is_none_without_proc_stat(monkeypatch):
    def missing(*a, **k):
        raise FileNotFoundError("/proc/stat")

    monkeypatch.setattr("builtins.open", missing)
    assert cpu_counters() is None


def test_aotc_run_threads_reaches_the_governor(tiny_bundle, monkeypatch):
    import sys

    from typer.testing import CliRunner

    from aotc.cli import app

    generate_mod = sys.modules["aotc.runtime.generate"]
    asked = []

    class Recording(ThreadGovernor):
        def __init__(self, threads=None):
            asked.append(threads)
            super().__init__(threads, counters=lambda: None, elsewhere=lambda: None)

    monkeypatch.setattr(generate_mod, "ThreadGovernor", Recording)
    before = torch.get_num_threads()
    for args, want in [(["--threads", "1"], 1), ([], None)]:
        r = CliRunner().invoke(app, ["run", str(tiny_bundle.out), "--prompt", "hi", "--max-new-tokens", "2", "--json", *args])
        assert r.exit_code == 0, r.output
        assert asked[-1] == want
    assert torch.get_num_threads() == before


def test_generate_asks_the_governor_before_every_step_and_restores(tiny_dir, monkeypatch):
    import sys

    from aotc.models.loader import load_model

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
    assert made[0].fixed and made[0].steps == 1 + gen.decode_steps == 6  # the prompts' prefill, then 5 decode steps
    assert torch.get_num_threads() == before
