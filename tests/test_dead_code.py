"""Dead code is a failing test: a function, option or class that nothing reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_vulture_finds_nothing_unused():
    r = subprocess.run(
        [sys.executable, "-m", "vulture", "aotc", "tools/vulture_whitelist.py", "--min-confidence", "60"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, "unused code (delete it, wire it in, or whitelist it with a reason in tools/vulture_whitelist.py):\n" + r.stdout + r.stderr
