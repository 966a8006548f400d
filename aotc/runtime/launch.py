"""Starting and watching the local ranks of a parallel run (`aotc run` on a parallel bundle).

`launch(entry, arguments, world_size)` runs a Python function, named as
"module:function", with keyword arguments (JSON values), once per rank, each in a
process of its own (`python -m aotc.runtime.launch CALL`) with the environment
torchrun gives its workers (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). So a rank started here and one started by torchrun
take one path: the function opens its Session (aotc.Session), which joins the
launch. `aotc run` passes its own command (aotc.cli.run:run_rank); `aotc serve` its own
(aotc.cli.serve:serve_rank), with SIGTERM forwarded to rank 0, whose drain ends the
launch. Rank 0 writes to this terminal; the others' output is kept, and shown
when that rank fails.

Why not torch.distributed.elastic (torchrun's agent): its workers are not tied to
the agent's life, so a SIGKILLed launcher would leave them running; each rank
here dies with it (PR_SET_PDEATHSIG). It also restarts and re-rendezvouses
workers, which a fixed-shape inference run has no use for.

A rank that dies leaves the others blocked in a collective until the process
group's timeout (aotc.parallel.rank_timeout, AOTC_RANK_TIMEOUT). The launcher does
not wait for that: it polls its children, and when one exits with an error it ends
the rest and exits 1 naming that rank. A rank that stops or hangs fails the others'
next collective within that timeout; one that has not ended within it after another
rank ended well (stopped after its last token) is ended, named. Each child dies with
the launcher (PR_SET_PDEATHSIG), so a killed launcher leaves no rank behind either;
SIGTERM to the launcher ends the ranks and its log folder as Ctrl-C does.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..scratch import own_folder

POLL_S = 0.05
GRACE_S = 2.0  # SIGTERM, then SIGKILL after this


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own handlers still end the ranks
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(local_world: int) -> int:
    """The CPUs each local rank's kernels get: the machine's, shared out."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // local_world)


def launch(entry: str, arguments: dict, world_size: int, out=None, forward: bool = False) -> tuple[int, str | None]:
    """Run entry(**arguments) ("module:function"; JSON-serializable arguments) as ranks
    0..world_size-1 and watch them. A rank's exit status is the int the function returns
    (None: 0). Returns (exit status, what went wrong or None): rank 0's status when every
    rank ends by itself, else 1 with the rank that failed first. forward: SIGTERM and
    SIGINT sent to this process go to rank 0, which ends the launch its own way (a
    server's drain), instead of ending every rank."""
    from ..parallel import rank_timeout

    module, _, function = entry.partition(":")
    if not module or not function:
        raise ValueError(f"launch entry {entry!r}: expected 'module:function'")
    deadline = rank_timeout().total_seconds()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    logs = own_folder("ranks")  # 0700: the call file is ours alone; a killed launcher's is swept by the next
    call = Path(logs.name) / "call.json"
    call.write_text(json.dumps({"entry": entry, "arguments": arguments}))
    children: list[subprocess.Popen] = []
    before = {}
    if forward:
        for sig in (signal.SIGTERM, signal.SIGINT):
            before[sig] = signal.signal(sig, lambda sig, frame: children[0].send_signal(sig) if children else None)
    else:  # SIGTERM stops the launch as Ctrl-C does: the ranks ended, the log folder removed

        def interrupt(sig, frame):
            raise KeyboardInterrupt

        before[signal.SIGTERM] = signal.signal(signal.SIGTERM, interrupt)
    try:
        for rank in range(world_size):
            log = None if rank == 0 else open(Path(logs.name) / f"rank{rank}.log", "wb")
            children.append(subprocess.Popen(
                [sys.executable, "-m", __name__, str(call)], env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                stdout=out if rank == 0 else log, stderr=None if rank == 0 else log, preexec_fn=_die_with_parent,
            ))  # fmt: skip
        return _watch(children, logs.name, deadline)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        _end(children)
        logs.cleanup()


def _watch(children: list[subprocess.Popen], logs: str, deadline: float = float("inf")) -> tuple[int, str | None]:
    """Until every rank ends, or one fails (1, naming it), or one has not ended `deadline` s
    after another ended well (1, naming it: stopped, or waiting on a collective no other
    rank will join)."""
    first_end = None  # (when, rank) of the first rank to end well
    while True:
        codes = [c.poll() for c in children]
        # The others fail in turn when their collective loses its peer: a rank killed by a
        # signal is the cause where several are seen failed at once.
        failed = sorted((code > 0, r) for r, code in enumerate(codes) if code not in (None, 0))
        if failed and (any(code is None for code in codes) or failed[0][1] != 0):
            rank = failed[0][1]
            return 1, f"rank {rank} {_how(codes[rank])}" + _tail(Path(logs) / f"rank{rank}.log")
        if all(code is not None for code in codes):
            return codes[0], None
        if first_end is None and 0 in codes:
            first_end = (time.monotonic(), codes.index(0))
        if first_end is not None and time.monotonic() - first_end[0] > deadline:
            rank = codes.index(None)
            return 1, (
                f"rank {rank} had not ended {deadline:g} s after rank {first_end[1]} did (AOTC_RANK_TIMEOUT): it is stopped, or waits on a collective that no other rank will join"
            ) + _tail(Path(logs) / f"rank{rank}.log")
        time.sleep(POLL_S)


def _how(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _tail(log: Path, lines: int = 12) -> str:
    if not log.is_file():
        return ""
    text = log.read_text(errors="replace").strip().splitlines()[-lines:]
    return (":\n" + "\n".join(text)) if text else ""


def _end(children: list[subprocess.Popen]) -> None:
    """End every child still running: SIGTERM, then SIGKILL after a grace period."""
    for c in children:
        if c.poll() is None:
            c.terminate()
    deadline = time.monotonic() + GRACE_S
    for c in children:
        try:
            c.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()


def agree(gen) -> None:
    """Every rank of a parallel generation made the same tokens (the same buckets, the same
    gathered logits): an error naming the ranks that did not."""
    import hashlib

    import torch
    import torch.distributed as dist

    from ..parallel import settled

    # A digest of the tokens, as a tensor: all_gather_object's pickled tensors are not
    # ours to wait for (parallel.settled).
    digest = hashlib.sha256(json.dumps([s.new_ids for s in gen.sequences]).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    settled(mine, *every)
    differs = [r for r, theirs in enumerate(every) if not torch.equal(theirs, every[0])]
    if differs:
        from ..errors import AotcError

        raise AotcError(f"ranks {', '.join(map(str, differs))} generated other tokens than rank 0; the ranks must run the same graphs on the same inputs")


def _rank(call: str) -> int:
    """A rank's process: the launcher's call, read from the file it wrote for its ranks."""
    what = json.loads(Path(call).read_text())
    module, _, function = what["entry"].partition(":")
    status = getattr(importlib.import_module(module), function)(**what["arguments"])
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(_rank(sys.argv[1]))
