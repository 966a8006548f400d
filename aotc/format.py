"""Bundle paths and format constants, and the atomic bundle writer.

Everything that knows where a file lives inside a bundle is here, so the
writer (build) and the reader (runtime) cannot drift apart.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ENTRIES_DIR = "entries"
DEFAULT_ARTIFACTS = Path("artifacts")


def artifact_dir(entry_id: str, bucket: int) -> str:
    """Folder of one (entry, bucket) artifact, relative to the bundle root."""
    return f"{ENTRIES_DIR}/{entry_id}/b{bucket}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write JSON so that readers see the old file or the new one, never half."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def manifest_json(manifest: dict) -> dict:
    """The manifest with `format_version` as its first key, as readers expect."""
    return {"format_version": FORMAT_VERSION, **{k: v for k, v in manifest.items() if k != "format_version"}}


@contextlib.contextmanager
def bundle_writer(out: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success it replaces `out`.

    The caller writes artifacts and the manifest into the yielded folder. If
    anything fails, the temporary folder is removed and `out` is untouched, so
    a bundle on disk is always complete.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "bundle")
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
