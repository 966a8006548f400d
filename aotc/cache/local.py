"""The content-addressed compile cache: one folder per cache key.

    <root>/entries/<key[:2]>/<key>/   the artifact's files + record.json
    <root>/tmp/                         compiles in progress (never served)
    <root>/locks/<key>.lock             one lock per key (filelock)
    <root>/jax/<bundle digest>/         JAX's compilation cache for one xla bundle (private)
    <root>/CACHEDIR.TAG                 what makes the folder aotc's (below)

An entry is compiled in a temporary folder and renamed into place under the
key's lock, so a reader sees a whole entry or none, two builds compile a key
once, and a build killed mid-compile leaves only a temporary folder that
nothing serves. Every file's sha256 is checked each time an entry is served.

aotc writes, serves and deletes only in a cache folder it made: one that was
new or empty when aotc wrote its CACHEDIR.TAG there (the Cache Directory
Tagging Specification's file, which backup tools also read, with aotc's own
line). A `--cache-dir` that holds anything else (a home folder, a project) is
refused, so `aotc cache prune` can never delete what someone else made.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from ..errors import AotcError
from ..format import CompiledRecord, bad_file, decode, encode, temp_folder, write_atomic

ENV = "AOTC_CACHE_DIR"
RECORD = "record.json"  # an entry's CompiledRecord, written last
TAG = "CACHEDIR.TAG"
TAG_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by aotc: this folder is its compile cache.\n"
    "# For information about cache directory tags, see https://bford.info/cachedir/\n"
)


class CacheError(AotcError):
    """A cache entry is corrupt, or a required entry is missing."""


def read_record(data: bytes, source: str) -> CompiledRecord:
    """A validated cache record: its files are plain names inside the entry's folder."""
    record = decode(data, CompiledRecord, source, CacheError)
    for name in record.files:
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise CacheError(f"{source}: files: {name!r} is not a file name; delete the entry (aotc cache prune --max-size 0)")
    return record


def default_root() -> Path:
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "aotc"


@dataclass
class Entry:
    key: str
    dir: Path
    record: CompiledRecord

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in self.dir.iterdir() if f.is_file())


class LocalCache:
    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root else default_root()
        if self.root.exists() and not self.root.is_dir():
            raise CacheError(f"--cache-dir {self.root}: is a file, not a cache folder; pass a folder (or leave --cache-dir out)")

    def made_by_aotc(self) -> bool:
        """The folder holds aotc's cache tag, as a file of its own (not a link to one)."""
        tag = self.root / TAG
        try:
            return not tag.is_symlink() and tag.is_file() and tag.read_bytes() == TAG_TEXT.encode()
        except OSError:
            return False

    def _claimable(self) -> bool:
        """aotc's already, new, empty, or holding only what aotc puts there before its first
        entry: lock files (a lookup takes the key's lock)."""
        if self.made_by_aotc() or not self.root.is_dir():
            return True
        ours = lambda p: p.name == "locks" and p.is_dir() and not p.is_symlink() and all(f.suffix == ".lock" for f in p.iterdir())  # noqa: E731
        return all(ours(p) for p in self.root.iterdir())

    def _not_ours(self) -> str:
        return f"{self.root}: holds files, and is not a cache aotc made (no {TAG} of aotc's in it); aotc writes and deletes only in a cache folder of its own"

    def claim(self) -> None:
        """Make the folder aotc's cache if it is new or empty; refuse one that holds anything
        aotc did not put there."""
        if self.made_by_aotc():
            return
        if not self._claimable():
            raise CacheError(f"--cache-dir {self._not_ours()}. Pass a new or empty folder")
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.root / TAG, TAG_TEXT.encode())

    def writable(self) -> str | None:
        """None when builds can write here; else why not (a read-only folder, a full disk,
        a folder that is not aotc's)."""
        if not self._claimable():
            return self._not_ours()
        try:  # a probe that leaves nothing behind: the tag comes with the first entry
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root):
                pass
        except OSError as e:
            return f"{self.root}: {e.strerror or e}"
        return None

    def path(self, key: str) -> Path:
        return self.root / "entries" / key[:2] / key

    def private(self, kind: str, name: str) -> Path | None:
        """<root>/<kind>/<name>, made 0700, for a cache that another library fills and loads
        without checks of its own: JAX runs any executable it finds in its compilation
        cache, so that folder must be writable by this user alone. Each level below the
        root is checked: a folder of this user's, reached without a link, that no one else
        can open. None where the root is not aotc's, or a level cannot be made or fails the
        check: the caller then goes without the cache (slower, never less safe)."""
        try:
            self.claim()
        except (CacheError, OSError):
            return None
        folder = self.root
        for part in (kind, name):
            folder = folder / part
            try:
                folder.mkdir(mode=0o700, exist_ok=True)
                st = os.lstat(folder)
            except OSError:
                return None
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                return None
        return folder

    def lock(self, key: str) -> FileLock:
        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / "locks" / f"{key}.lock"))

    def has(self, key: str) -> bool:
        """Whether an entry is published for `key` (unverified: get() checks the files)."""
        return self.made_by_aotc() and (self.path(key) / RECORD).is_file()

    def get(self, key: str) -> Entry | None:
        """The verified entry for `key`, or None. A corrupt entry is an error naming the file."""
        path = self.path(key)
        record_file = path / RECORD
        if not self.made_by_aotc() or not record_file.is_file():
            return None
        record = read_record(record_file.read_bytes(), str(record_file))
        bad = bad_file(path, record.files)
        if bad:
            raise CacheError(f"{bad[0]}: {bad[1]}; delete {path} (or run `aotc cache prune --max-size 0`) and build again")
        os.utime(record_file)  # last use, for `aotc cache prune`
        return Entry(key, path, record)

    def put(self, key: str, make: Callable[[Path], CompiledRecord | None]) -> Entry | None:
        """Run make(tmp_dir) -> record and publish it as `key`.

        The caller holds the key's lock. Only a complete, verified folder is
        renamed into place; if make returns None, nothing is published.
        """
        self.claim()
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        # What a killed compile of this key left: the caller holds the key's lock, so no one else is writing it.
        self._remove_stale(key)
        tmp = temp_folder(f"{key[:16]}-", self.root / "tmp")
        try:
            record = make(tmp)
            if record is None:
                shutil.rmtree(tmp, ignore_errors=True)
                return None
            bad = bad_file(tmp, record.files)
            if bad:
                raise CacheError(f"{bad[0]}: {bad[1]} while being written to the cache")
            write_atomic(tmp / RECORD, encode(record))
            dest = self.path(key)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not self.owns(dest.parent):
                raise CacheError(f"{dest.parent}: a symlink inside the cache {self.root}; aotc writes only inside it. Remove the link")
            if dest.exists():  # a corrupt entry the caller decided to replace
                self.remove(dest)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return Entry(key, dest, record)

    def _remove_stale(self, key: str) -> None:
        for stale in (self.root / "tmp").glob(f"{key[:16]}-*"):
            self.remove(stale)

    def abandon(self, keys) -> None:
        """Remove what stopped compiles of `keys` left in tmp/, for each key whose lock no
        one holds now (a key another build is compiling is left to it)."""
        if not self.made_by_aotc():
            return
        for key in keys:
            try:
                with FileLock(str(self.root / "locks" / f"{key}.lock"), timeout=0):
                    self._remove_stale(key)
            except Timeout:
                continue

    def owns(self, path: Path) -> bool:
        """`path` is inside the cache root, reached without following a symlink
        (the root itself may be one: the user chose it)."""
        try:
            rel = Path(path).relative_to(self.root)
        except ValueError:
            return False
        here = self.root
        for part in rel.parts:
            here = here / part
            if part == ".." or here.is_symlink():
                return False
        return True

    def remove(self, path: Path) -> int:
        """Delete a folder the cache owns; returns the bytes freed. Anything reached
        through a symlink is left alone: prune never deletes outside the cache."""
        if not self.owns(path) or not path.is_dir():
            return 0
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(path, ignore_errors=True)  # rmtree does not follow links inside
        return size

    def entries(self) -> list[Entry]:
        out = []
        if not self.made_by_aotc():
            return out
        for record_file in sorted((self.root / "entries").glob("*/*/" + RECORD)):
            if not self.owns(record_file.parent):
                continue
            try:
                out.append(Entry(record_file.parent.name, record_file.parent, read_record(record_file.read_bytes(), str(record_file))))
            except (OSError, CacheError):
                continue
        return out

    def prune(self, max_size: int) -> tuple[int, int]:
        """Delete least recently used entries (and bundles' JAX caches, jax/) until the cache
        holds at most max_size bytes, and leftover temporary folders. Returns (entries removed, bytes freed).
        A folder aotc did not make is refused: nothing in it is aotc's to delete."""
        if not self.made_by_aotc():
            if not self.root.exists():
                return 0, 0
            raise CacheError(
                f"--cache-dir {self.root}: is not a cache aotc made (no {TAG} of aotc's in it); nothing was removed. "
                "Pass the folder aotc builds use (default: ~/.cache/aotc, or $AOTC_CACHE_DIR)"
            )
        removed = freed = 0
        tmp_root = self.root / "tmp"
        for tmp in tmp_root.glob("*") if self.owns(tmp_root) and tmp_root.is_dir() else []:
            with_age = time.time() - tmp.lstat().st_mtime
            if with_age > 3600:  # an hour: no compile takes that long; this one's build died
                freed += self.remove(tmp)
        # Compiled entries and the private caches (jax/<digest>), least recently used first:
        # an entry's record is touched when served; a private cache's newest file is its last write.
        items = [((e.dir / RECORD).stat().st_mtime, e.size, e) for e in self.entries()]
        for folder in self._private_folders():
            files = [f.lstat() for f in folder.rglob("*") if f.is_file() and not f.is_symlink()]
            items.append((max([f.st_mtime for f in files], default=folder.lstat().st_mtime), sum(f.st_size for f in files), folder))
        total = sum(size for _, size, _ in items)
        for _, size, item in sorted(items, key=lambda i: i[0]):
            if total <= max_size:
                break
            if isinstance(item, Entry):
                with self.lock(item.key):
                    size = item.size
                    self.remove(item.dir)
            else:
                self.remove(item)
            total -= size
            freed += size
            removed += 1
        return removed, freed

    def _private_folders(self) -> list[Path]:
        kind = self.root / "jax"
        if not self.owns(kind) or not kind.is_dir():
            return []
        return sorted(f for f in kind.iterdir() if f.is_dir() and not f.is_symlink())


def writer_locks(cache_dir: Path | str | None) -> Path | None:
    """Where the writers of one bundle or model folder take turns (format.writers_turn): the
    compile cache's locks/ folder, where it can be written (a folder aotc does not own, or
    cannot write, is left alone: None)."""
    try:
        cache = LocalCache(Path(cache_dir or default_root()))
    except AotcError:  # a file: the lock stays beside the folder written
        return None
    return None if cache.writable() else cache.root / "locks"


MAX_SIZE = 10**18  # bytes: more than any disk


def parse_size(text: str) -> int:
    """'500M', '2G', '1.5GB', '100k', '0' -> bytes, in decimal units (1G = 10^9 bytes), as
    sizes are printed; binary units are spelled out: '2GiB' = 2 * 2^30 bytes. Nothing else:
    no space inside, no 'Ki' without its B, at most MAX_SIZE."""
    from decimal import Decimal

    match = re.fullmatch(r"(\d+(?:\.\d+)?)(?:([KMGT])(IB|B)?|B)?", str(text).strip().upper())
    if not match:
        raise AotcError(f"--max-size {text!r}: expected a size such as 500M, 2G, 1.5GiB or 0 (decimal units, or KiB, MiB, GiB, TiB spelled out)")
    base = 1024 if match[3] == "IB" else 1000
    size = Decimal(match[1]) * base ** "_KMGT".index(match[2] or "_")
    if size > MAX_SIZE:
        shown = text if len(text) <= 24 else f"{text[:12]}...({len(text)} characters)"
        raise AotcError(f"--max-size {shown}: more than any disk holds; give at most 1000000T")
    return int(size)


def format_size(n: int) -> str:
    """Bytes in decimal units, as --max-size reads them."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)
