"""Writing a bundle's files: atomically, in turns with other writers, only over what aotc made."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import msgspec

from ..errors import BundleError
from .records import MANIFEST, Manifest


def encode(record) -> bytes:
    """A record as indented JSON (dataclass field order: `format_version` first)."""
    return msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n"


def write_manifest(folder: Path, manifest: Manifest) -> None:
    write_atomic(Path(folder) / MANIFEST, encode(manifest))


def umask() -> int:
    """This process's umask, read without setting it (os.umask sets it, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc (not Linux): read it by setting it, and put it back
    os.umask(mask)
    return mask


def temp_folder(prefix: str, parent: Path) -> Path:
    """tempfile.mkdtemp, with the mode a new folder gets (0777 less the umask): the folder
    is renamed into place as a bundle, a model or a cache entry, which other users (a
    service that runs what CI built) read where the umask lets them. mkdtemp makes 0700."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(tmp, 0o777 & ~umask())
    return tmp


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file so that readers see the old one or the new one, never half. Its mode is
    a new file's (0666 less the umask), not mkstemp's 0600."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:  # a failed write names no file: say which
            e.filename = str(path)
        raise


def check_replaceable(out: Path, option: str = "-o") -> None:
    """`out` may be written as a bundle: it does not exist, is an empty folder, or
    holds an aotc bundle (a manifest.json with a format_version). aotc replaces
    nothing else: not a file, not a folder of the user's."""
    out = Path(out)
    if out.is_symlink() and not out.exists():
        raise BundleError(f"{option} {out}: a broken symlink; remove it or choose another folder")
    if not out.exists():
        return
    if not out.is_dir():
        raise BundleError(f"{option} {out}: is a file, not a bundle folder; aotc replaces only bundle folders it wrote. Choose another path")
    if not any(out.iterdir()):
        return
    try:
        head = msgspec.json.decode((out / MANIFEST).read_bytes())
        ours = isinstance(head, dict) and "format_version" in head
    except (OSError, msgspec.DecodeError):
        ours = False
    if not ours:
        raise BundleError(
            f"{option} {out}: the folder holds files that are not an aotc bundle (no aotc {MANIFEST}); "
            "aotc replaces only bundle folders it wrote. Choose another folder, or empty this one"
        )


@contextlib.contextmanager
def writers_turn(out: Path, locks: Path | None) -> Iterator[None]:
    """This process's turn to write `out` (a bundle, a quantized model folder), under
    a temporary name beside it: what a killed writer left (`.NAME.tmp-*`, `.NAME.old-*`)
    is removed first. The lock file is in `locks` (the compile cache's locks/ folder),
    named after out's resolved path: filelock never deletes a lock file (deleting one
    after its release races), and one beside `out` would stay among the user's folders.
    Where `locks` cannot be made (a read-only cache), or is None, the lock is beside `out`."""
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / f".{out.name}.lock"
    if locks is not None:
        try:
            Path(locks).mkdir(parents=True, exist_ok=True)
            lock = Path(locks) / f"bundle-{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:32]}.lock"
        except OSError:
            pass
    with FileLock(str(lock)):
        for stale in [*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")]:
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
        yield


@contextlib.contextmanager
def bundle_writer(out: Path, locks: Path | None = None) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success it replaces `out`.

    The caller writes artifacts and the manifest into the yielded folder. If
    anything fails, the temporary folder is removed and `out` is untouched, so
    a bundle on disk is always complete. `out` must be replaceable
    (check_replaceable). Writers to one `out` take turns (writers_turn)."""
    out = Path(out)
    check_replaceable(out)
    with writers_turn(out, locks):
        tmp = temp_folder(f".{out.name}.tmp-", out.parent)
        try:
            yield tmp
            old = None
            if out.exists() or out.is_symlink():
                check_replaceable(out)  # again: it may have changed while we built
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.replace(out, old / "bundle")
            os.replace(tmp, out)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
