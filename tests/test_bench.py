"""The benchmark scripts import and parse their options (their runs are long: run them by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py") if p.name not in ("gptfast.py", "ttft.py", "peers.py")))
def test_each_benchmark_script_starts(script):
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


def test_peers_section_is_skipped_with_the_reason_without_cmake(tmp_path, monkeypatch):
    """--peers builds llama.cpp from source: without cmake it says so, records the
    reason in the results, and writes nothing into the cache folder."""
    sys.path.insert(0, str(BENCH))
    try:
        import peers
        import perf
    finally:
        sys.path.remove(str(BENCH))
    which = peers.shutil.which
    monkeypatch.setattr(peers.shutil, "which", lambda tool: None if tool == "cmake" else which(tool))
    cache, results = tmp_path / "cache", {}
    perf.bench_peers({"tiny": tmp_path / "unused"}, tmp_path, results, cache)
    assert results == {"peers": {"skipped": "cmake is not on PATH; llama.cpp is built from source"}}
    assert not cache.exists()
