"""Full and read-only disks, for real: a small tmpfs mounted for each test, aotc run as
a separate process (torch's own file writer aborted the process on a full disk, which
no in-process test survives). Each case: the exit status, the message naming the path
and what to do, and nothing half-written left on the small disk."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SMALL = "64k"  # less than any model or artifact aotc writes; more than its tags and locks


def _mount(path, *options: str) -> None:
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join((f"size={SMALL}", *options)), "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode}): this test needs root and mount(8)")


@pytest.fixture()
def small(tmp_path):
    """A 64 KiB disk, mounted for the test."""
    path = tmp_path / "small"
    path.mkdir()
    _mount(path)
    yield path
    subprocess.run(["umount", str(path)], check=True)


@pytest.fixture()
def read_only(tmp_path):
    path = tmp_path / "ro"
    path.mkdir()
    _mount(path, "ro")
    yield path
    subprocess.run(["umount", str(path)], check=True)


def aotc(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aotc.cli", *map(str, args)], capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"})


def said(r) -> str:
    return " ".join((r.stdout + r.stderr).split())


BUILD = ("--backend", "export", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", "64")


def test_init_tiny_on_a_full_disk(small):
    r = aotc("init", "tiny", small / "m")
    assert r.returncode == 2, said(r)
    assert "No space left on device; the disk is full: free space there, or write elsewhere. Nothing was left half-written" in said(r)
    assert "Traceback" not in said(r) and list(small.iterdir()) == []


def test_a_build_onto_a_full_disk(small, tiny_dir):
    r = aotc("build", tiny_dir, *BUILD, "--no-cache", "-o", small / "bundle")
    assert r.returncode == 2, said(r)
    assert "No space left on device; the disk is full" in said(r) and "Traceback" not in said(r)
    assert [p.name for p in small.iterdir() if not p.name.endswith(".lock")] == []


def test_a_full_cache_disk_builds_without_the_cache(small, tiny_dir, tmp_path):
    """The README's promise for a cache that cannot be written: the build goes on without
    it, says so, and the bundle runs; the cache holds whole entries only (those that fit)
    and no half-written one."""
    out = tmp_path / "bundle"
    r = aotc("build", tiny_dir, *BUILD, "--cache-dir", small / "cache", "-o", out)
    assert r.returncode == 0, said(r)
    assert "the compile cache cannot be written" in said(r) and "No space left on device" in said(r)
    assert not list((small / "cache" / "tmp").iterdir())
    assert all((e / "record.json").is_file() for e in (small / "cache").glob("entries/*/*"))
    r = aotc("run", out, "--prompt", "hi", "--max-new-tokens", "2")
    assert r.returncode == 0, said(r)


@pytest.mark.parametrize("command", [pytest.param("init", marks=pytest.mark.slow), "build"])  # CI: the build
def test_writing_under_a_read_only_file_system(read_only, tiny_dir, command):
    args = ("init", "tiny", read_only / "m") if command == "init" else ("build", tiny_dir, *BUILD, "--no-cache", "-o", read_only / "bundle")
    r = aotc(*args)
    assert r.returncode == 2, said(r)
    assert "Read-only file system; the file system is read-only: write elsewhere" in said(r) and "Traceback" not in said(r)


def test_a_run_with_a_full_temp_folder(small, tiny_bundle):
    """Bundle.load's checked copy of the artifacts does not fit: exit 2 naming the temp
    folder and the fix, and nothing left in it."""
    r = subprocess.run([sys.executable, "-m", "aotc.cli", "run", str(tiny_bundle.out), "--prompt", "hi"], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "300", "TMPDIR": str(small)})  # fmt: skip
    assert r.returncode == 2, said(r)
    assert f"{small} (the temp folder, $TMPDIR): No space left on device; free space there, or set TMPDIR to another folder" in said(r) and "Traceback" not in said(r)
    assert list(small.iterdir()) == []
