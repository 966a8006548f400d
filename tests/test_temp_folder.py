"""What a run leaves in the temp folder: nothing, killed or not (aotc.scratch,
Bundle.load). The checked copy of a bundle's artifacts goes once its programs are
loaded, where they no longer read their files (export, inductor on the CPU, unpacked by
aotc so that torch does not extract it into a folder of its own); a copy that a killed
process left (killed while loading, or on a backend that reads its files later) is
removed by the next aotc process that makes one of its kind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from aotc import scratch
from aotc.runtime.bundle import Bundle

HOLDING = """\
import sys
from aotc import Session

with Session.open(sys.argv[1]) as session:
    session.generate(["Hi"], max_new_tokens=2)
    print("generated", flush=True)
    sys.stdin.read()  # held until killed
"""


def assert_a_killed_run_leaves_nothing(bundle: Path, tmp_path: Path) -> None:
    """A program that opened `bundle` and generated, killed with SIGKILL: its temp folder
    (TMPDIR) holds nothing but torch's own compile cache folder, which importing
    torch.export's serializer makes there (torchinductor_USER, reused by every torch
    process of the user; a run that ends by itself leaves it too)."""
    import getpass

    temp = tmp_path / "tmp"
    temp.mkdir()
    # As a user's shell has it: torch sets TORCHINDUCTOR_CACHE_DIR in its own process, which a child inherits.
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}, "TMPDIR": str(temp)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDING, str(bundle)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    line = proc.stdout.readline()
    assert line == "generated\n", proc.stderr.read()[-2000:] if proc.wait(60) is not None else line
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    assert [p.name for p in temp.iterdir() if p.name != f"torchinductor_{getpass.getuser()}"] == []


def test_a_killed_run_of_an_export_bundle_leaves_nothing(tiny_bundle, tmp_path):
    assert_a_killed_run_leaves_nothing(tiny_bundle.out, tmp_path)


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_only_the_copies_of_this_users_ended_processes_are_swept(tiny_bundle, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = _dead_pid()
    gone = tmp_path / f"aotc-bundle-{dead}-abc"
    kept = [tmp_path / f"aotc-bundle-{os.getpid()}-abc", tmp_path / "aotc-bundle-abc", tmp_path / f"aotc-ranks-{dead}-abc", tmp_path / f"other-{dead}-abc"]
    for folder in [gone, *kept]:
        folder.mkdir()
        (folder / "model.pt2").write_bytes(b"x")
    linked = tmp_path / f"aotc-bundle-{dead}-link"  # a link named so is no folder of aotc's: left, and what it points at too
    linked.symlink_to(kept[0])
    b = Bundle.load(tiny_bundle.out)
    assert b.checked is None  # export: the copy went once loaded
    assert not gone.exists() and all((k / "model.pt2").exists() for k in kept) and linked.is_symlink()
    assert scratch.sweep("ranks") == [kept[2]]


def test_a_copy_is_kept_while_the_backend_reads_it_and_goes_with_the_bundle(tiny_bundle, tmp_path, monkeypatch):
    from aotc.backends.export import ExportBackend

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ExportBackend, "reads_files_loaded", True)
    b = Bundle.load(tiny_bundle.out)
    (copy,) = tmp_path.iterdir()
    assert copy.name.startswith(f"aotc-bundle-{os.getpid()}-") and (copy / "entries").is_dir()
    art = b.manifest.entries[0].artifacts[0]
    assert b.checked_dir(art) == copy / art.dir
    b.checked.cleanup()
    assert list(tmp_path.iterdir()) == []


def test_a_temp_folder_that_is_not_there_is_an_error_naming_it(tiny_bundle, tmp_path, monkeypatch):
    from aotc.errors import AotcError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t"))
    with pytest.raises(AotcError, match=r"/t \(the temp folder, \$TMPDIR\): No such file or directory; create it, or set TMPDIR to another folder"):
        Bundle.load(tiny_bundle.out)
