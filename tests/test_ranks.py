"""Ranks that cannot meet, stop or hang end the run within one deadline (AOTC_RANK_TIMEOUT),
naming what happened; the launch environment is checked as arguments are; SIGTERM to the
launcher ends the ranks and leaves nothing behind (aotc.parallel, aotc.runtime.launch)."""

from __future__ import annotations

import getpass
import os
import signal
import subprocess
import sys
import time

import pytest

from aotc import parallel
from aotc.errors import AotcError

from .test_parallel import aotc, parallel_port, tp_bundle  # noqa: F401 (the fixture)

DEADLINE = "2"  # s: AOTC_RANK_TIMEOUT in these tests


@pytest.mark.parametrize(
    "env, message",
    [
        ({"MASTER_ADDR": None}, r"MASTER_ADDR is not set: every rank of a launch meets rank 0's host"),
        ({"MASTER_ADDR": " "}, r"MASTER_ADDR is not set"),
        ({"MASTER_PORT": "abc"}, r"MASTER_PORT='abc': expected the port \(1 to 65535\)"),
        ({"MASTER_PORT": "0"}, r"MASTER_PORT='0': expected the port"),
        ({"MASTER_PORT": "70000"}, r"MASTER_PORT='70000': expected the port"),
        ({"MASTER_PORT": None}, r"MASTER_PORT='': expected the port"),
        ({"LOCAL_WORLD_SIZE": "0"}, r"LOCAL_WORLD_SIZE='0': expected the ranks on this host, 1 to WORLD_SIZE \(2\)"),
        ({"LOCAL_WORLD_SIZE": "abc"}, r"LOCAL_WORLD_SIZE='abc'"),
        ({"LOCAL_WORLD_SIZE": "3"}, r"LOCAL_WORLD_SIZE='3'"),
        ({"LOCAL_RANK": "2"}, r"LOCAL_RANK='2': expected this rank's index on its host, 0 to 1"),
        ({"AOTC_RANK_TIMEOUT": "abc"}, r"AOTC_RANK_TIMEOUT='abc': expected a positive number of seconds"),
        ({"AOTC_RANK_TIMEOUT": "0"}, r"AOTC_RANK_TIMEOUT='0'"),
        ({"AOTC_RANK_TIMEOUT": "inf"}, r"AOTC_RANK_TIMEOUT='inf'"),
    ],
)
def test_each_bad_launch_environment_value_is_refused_naming_it(monkeypatch, env, message):
    good = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    for k, v in {**good, **env}.items():
        monkeypatch.delenv(k, raising=False) if v is None else monkeypatch.setenv(k, v)
    with pytest.raises(AotcError, match=message):
        parallel.joined_rank()
    for k, v in good.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AOTC_RANK_TIMEOUT", raising=False)
    assert parallel.joined_rank() == (1, 2) and parallel.rank_timeout().total_seconds() == 60


def _rank_env(**more) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(parallel_port()), "AOTC_RANK_TIMEOUT": DEADLINE, **more}


def test_a_bad_environment_value_exits_2_before_any_group_is_joined(tp_bundle):  # noqa: F811
    t0 = time.monotonic()
    done = aotc("run", tp_bundle.out, "--prompt", "Hi", env=_rank_env(RANK="0", MASTER_PORT="abc"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "error: MASTER_PORT='abc': expected the port (1 to 65535) where rank 0 listens (torchrun sets them; unset RANK and WORLD_SIZE to let aotc run start the ranks itself)"
    ]
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("case", ["a lone rank 1", pytest.param("two ranks 0", marks=pytest.mark.slow), pytest.param("an unreachable MASTER_ADDR", marks=pytest.mark.slow)])
def test_ranks_that_cannot_meet_end_within_the_deadline_naming_it(tp_bundle, case):  # noqa: F811
    """Each rank exits 2 within the deadline (and start-up) with one error line: where it waited, for how long, and the fix."""
    env = _rank_env(RANK="1" if case == "a lone rank 1" else "0")
    if case == "an unreachable MASTER_ADDR":
        env = {**env, "RANK": "1", "MASTER_ADDR": "192.0.2.1"}  # TEST-NET-1: nothing answers there
    command = [sys.executable, "-m", "aotc", "run", str(tp_bundle.out), "--prompt", "Hi"]
    t0 = time.monotonic()
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2 if case == "two ranks 0" else 1)]
    results = [(p.wait(60), p.stderr.read()) for p in procs]
    assert time.monotonic() - t0 < float(DEADLINE) + 30
    for code, stderr in results:
        assert code == 2, stderr[-2000:]
        # One line: torch's C++ log of the store's retries (with its C++ stacks) is held and dropped.
        [line] = stderr.strip().splitlines()
        assert line.startswith("error: rank ") and "could not meet the other ranks at " in line and f"within {DEADLINE} s (AOTC_RANK_TIMEOUT)" in line, line


STOPPING = """\
import os, signal
from aotc import Session


def rank(bundle, when):
    with Session.open(bundle) as session:
        def on_token(event):
            if when == "mid-decode" and session.rank == 1 and event.index == 0 and event.token_id is not None:
                on_token.seen = getattr(on_token, "seen", 0) + 1
                if on_token.seen == 3:
                    os.kill(os.getpid(), signal.SIGSTOP)
        session.generate(["Hello, world!", "Once upon a time"], max_new_tokens=12, on_token=on_token)
        if when == "after the last token" and session.rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.mark.parametrize("when", ["mid-decode", pytest.param("after the last token", marks=pytest.mark.slow)])  # CI: one
def test_a_stopped_rank_ends_the_launch_within_the_deadline_naming_it(tp_bundle, tmp_path, monkeypatch, when):  # noqa: F811
    """Rank 1 stops itself (SIGSTOP) after 3 tokens, or after its last: the other rank's next
    collective fails within the deadline, or the launcher gives up on rank 1 that long after
    rank 0 ended; either way the launch ends with status 1, naming the rank, and the stopped
    rank is ended too."""
    from aotc.runtime.launch import launch

    (tmp_path / "stopping.py").write_text(STOPPING)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("AOTC_RANK_TIMEOUT", DEADLINE)
    t0 = time.monotonic()
    code, why = launch("stopping:rank", {"bundle": str(tp_bundle.out), "when": when}, 2)
    assert code == 1 and time.monotonic() - t0 < float(DEADLINE) + 40
    if when == "mid-decode":  # rank 0 waited on rank 1 in a collective for the deadline, then failed (its error on this terminal)
        assert why == "rank 0 exited with status 1", why
    else:
        assert why.startswith(f"rank 1 had not ended {DEADLINE} s after rank 0 did (AOTC_RANK_TIMEOUT): it is stopped"), why


def test_sigterm_ends_the_launcher_and_its_ranks_and_leaves_nothing_in_the_temp_folder(tp_bundle, tmp_path):  # noqa: F811
    temp = tmp_path / "tmp"
    temp.mkdir()
    # As a user's shell has it: torch sets TORCHINDUCTOR_CACHE_DIR in pytest's process (test_temp_folder.py).
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHINDUCTOR_CACHE_DIR")}, "TMPDIR": str(temp)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aotc", "run", str(tp_bundle.out), "--prompt", "Hi", "--max-new-tokens", "120"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # Rank 0 prints the prompt once both ranks have opened the bundle (they agree on it), then decodes for seconds.
    assert proc.stdout.readline().startswith("prompt 0 "), proc.stderr.read()[-2000:]
    assert any(temp.glob("aotc-ranks-*/rank1.log"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 130, proc.stderr.read()[-2000:]
    assert "interrupted: ended the ranks" in proc.stderr.read()
    end = time.monotonic() + 10
    torch_cache = f"torchinductor_{getpass.getuser()}"  # torch's own compile cache, left by a run that ends by itself too
    while [p for p in temp.iterdir() if p.name != torch_cache] and time.monotonic() < end:  # the ranks remove their bundle copies as they end
        time.sleep(0.05)
    assert [p.name for p in temp.iterdir() if p.name != torch_cache] == []


@pytest.mark.parametrize("how", ["a tampered world_size under --expect-digest", "an argument error", "a prompt longer than the cache", "a model folder that is gone"])
def test_the_launcher_checks_the_pin_and_the_arguments_before_any_rank_starts(tp_bundle, tmp_path, how):  # noqa: F811
    """Exit 2, the error printed once, and no rank started: no log folder of the launcher's
    and no rank's copy of the bundle in the temp folder."""
    import json
    import shutil

    bundle, args, expected = tp_bundle.out, ["--max-batch", "9"], "--max-batch 9: the bundle's largest batch bucket is 4"
    if how == "a prompt longer than the cache":  # found with the tokenizer, in the launching process too
        args, expected = ["--prompt", "hi " * 200], "prompt 1 has 600 tokens; with --max-new-tokens 32 that is 632 positions, more than the cache holds (max_seq 128)"
    if how == "a model folder that is gone":
        bundle = tmp_path / "b"
        shutil.copytree(tp_bundle.out, bundle)
        manifest = json.loads((bundle / "manifest.json").read_text())
        manifest["model"]["source"] = str(tmp_path / "gone")
        (bundle / "manifest.json").write_text(json.dumps(manifest))
        args, expected = [], f"{tmp_path / 'gone'}: no such folder (the folder the bundle {bundle} was built from, and it is gone)"
    if how.startswith("a tampered"):
        from aotc.format import read_manifest

        pin = read_manifest(bundle).digest()
        bundle = tmp_path / "b"
        shutil.copytree(tp_bundle.out, bundle)
        manifest = json.loads((bundle / "manifest.json").read_text())
        # A valid manifest of 4 ranks: only the pin can tell.
        manifest["parallel"].update(world_size=4, tensor_parallel=4, groups=[{"name": "0", "ranks": [0, 1, 2, 3]}])
        (bundle / "manifest.json").write_text(json.dumps(manifest))
        assert read_manifest(bundle).parallel.world_size == 4
        args, expected = ["--expect-digest", pin], f"expected {pin}"
    temp, started = tmp_path / "tmp", tmp_path / "started"
    temp.mkdir()
    started.mkdir()
    # Any Python process that starts as a rank leaves a file in `started`.
    (tmp_path / "sitecustomize.py").write_text(f"import os\nif 'RANK' in os.environ: open(os.path.join({str(started)!r}, os.environ['RANK']), 'w').close()\n")
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}, "TMPDIR": str(temp), "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "aotc", "run", str(bundle), "--prompt", "Hi", *args], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert expected in line, line
    assert not list(temp.iterdir()) and not list(started.iterdir())
