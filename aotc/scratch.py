"""Folders of a process's own in the temp folder, and the sweep of those whose process
was killed before it could remove them.

A folder is named `aotc-KIND-PID-RANDOM`: a later aotc process that finds one of its
user's whose process is gone removes it (SIGKILL runs no cleanup). aotc removes only
folders named so, owned by the user, and never one whose process still runs.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from .errors import AotcError


def own_folder(kind: str) -> tempfile.TemporaryDirectory:
    """A new folder (0700) for this process, removed with the returned object; stale ones
    of the same kind swept first. A temp folder that cannot take it is an AotcError."""
    sweep(kind)
    try:
        return tempfile.TemporaryDirectory(prefix=f"aotc-{kind}-{os.getpid()}-")
    except OSError as e:
        raise temp_error(e) from None


def temp_error(e: OSError) -> AotcError:
    """An OSError in the temp folder, as the user can act on it."""
    fix = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space there", errno.ENOENT: "create it"}.get(e.errno, "make it writable")
    return AotcError(f"{tempfile.gettempdir()} (the temp folder, $TMPDIR): {e.strerror or e}; {fix}, or set TMPDIR to another folder")


def sweep(kind: str) -> list[Path]:
    """Remove this user's `aotc-KIND-PID-*` folders whose process is gone; the removed."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"aotc-{kind}-*-*"):
        pid = folder.name.split("-")[2]
        try:
            st = folder.lstat()
        except OSError:
            continue
        if not pid.isdigit() or st.st_uid != os.getuid() or not folder.is_dir() or folder.is_symlink() or _alive(int(pid)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
