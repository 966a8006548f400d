"""The bundle format: typed records, one writer, one reader.

    BUNDLE/manifest.json                 a Manifest, `format_version` first
    BUNDLE/entries/<entry id>/b<bucket>[-c<context>]/
                                         one folder per artifact: the files that
                                         its ArtifactRecord lists, with their sha256

Every other module reads the typed objects below; none indexes a manifest by
string. The reader validates every field's presence and type and names the
first bad one (`manifest.json: entries[2].artifacts[0].bucket: expected
int, got str`), and confines every path the manifest names to the bundle
folder (the folder itself may be a symlink, such as `artifacts/latest`).

Format-version policy: a bundle is read only by the aotc format it was
written with. An older or newer `format_version` is an error that says to
rebuild (exit 2); there is no migration, because a bundle is cheap to rebuild
from the compile cache and a half-understood bundle would run wrong code.

Records are designed for what comes next:
  * a bucket is `dims`, a record of named static dimensions ({"batch": 4},
    {"chunk": 128}, {"batch": 4, "context": 1024}); `bucket` is the value of
    the dimension that the runtime pads, the entry's `bucket_kind`; `context`
    is the cache positions a decode graph reads (a context bucket). An entry
    built per context bucket is one entry whose artifacts are keyed by both
    dims (entry ids never say the context), and names its positions argument
    (`context_arg`), from which the runtime picks the context bucket;
  * `form` says which graph an artifact holds: "static" (every shape fixed)
    or "unbacked" (data-dependent sizes kept, where a backend runs them);
  * a weight input may be derived from checkpoint tensors by a named
    transform (`transform`, `sources`; aotc.layout), applied at bind;
  * a weight the checkpoint stores in low precision is two inputs, its values
    and its scales (`stored`; aotc.lowp_weights), and says how the target reads fp8
    bytes (trn2: as IEEE e4m3, so bind rescales them; aotc.fp8);
  * a cache whose rows pack regions of different dtypes (an fp8 KV cache:
    values, scales, bf16 dims; aotc.kvcache) lists its regions' byte ranges;
    graphs take each region as a cache input of its own (`region`), each its
    own allocation (DESIGN.md, Caches);
  * a tensor-parallel bundle (`parallel`) is one SPMD graph per artifact that
    every rank runs, with the collectives in it (group names as strings, the
    groups in the record, created in that order); each weight says how a rank
    takes its part of the checkpoint tensor (`shard`), and shapes are per rank;
  * `digest()` identifies a whole bundle: the sha256 of its manifest, which
    holds every file's sha256.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import types
import typing
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Literal

import msgspec

from .errors import BundleError

FORMAT_VERSION = 16  # 16: int8 weight values reach the graphs as int8, not as uint8 bytes
MANIFEST = "manifest.json"
ENTRIES_DIR = "entries"
DEFAULT_ARTIFACTS = Path("artifacts")

BucketKind = Literal["batch", "chunk"]
# Load-time weight transforms (aotc.layout.TRANSFORMS): a bundle names one, never carries code.
TransformName = Literal["stack"]
StoredFormat = Literal["fp8", "fp4", "int8"]  # aotc.lowp_weights
StoredPart = Literal["values", "scale"]
Fp8Reading = Literal["e4m3fn", "e4m3"]  # how the target reads float8_e4m3fn bytes (aotc.fp8)
Form = Literal["static", "unbacked"]
Served = Literal["compiled", "cache", "remote", "uncached"]


def artifact_dir(entry_id: str, bucket: int, context: int | None = None) -> str:
    """Folder of one (entry, bucket, context bucket) artifact, relative to the bundle root."""
    return f"{ENTRIES_DIR}/{entry_id}/b{bucket}" + (f"-c{context}" if context is not None else "")


def artifact_label(entry_id: str, bucket: int, context: int | None = None) -> str:
    """How messages name one artifact: `LlamaDecoderLayer.decode bucket 4 context 256`."""
    return f"{entry_id} bucket {bucket}" + (f" context {context}" if context is not None else "")


# -- records ----------------------------------------------------------------------


@dataclass
class TensorSpec:
    """One graph input or output."""

    name: str
    kind: Literal["weight", "cache", "activation"]
    shape: list[int]
    dtype: str
    stride: list[int]
    path: str | None  # weights: parameter path inside the instance
    pad: int | float  # activations: the value padding rows get
    region: RegionSpec | None  # one region of a packed cache argument; None for any other input


@dataclass
class RegionSpec:
    """Which bytes of a packed cache row a graph input holds (aotc.passes.split_dtype_regions)."""

    of: str  # the entry's cache argument
    start: int  # byte range in the packed row
    end: int


@dataclass
class WeightSpec:
    path: str  # parameter or buffer path inside the instance; a derived weight's own name
    shape: list[int]
    dtype: str
    stride: list[int]
    # A derived weight (aotc.layout): the named transform the runtime applies at bind
    # to the sources, tensor paths inside the instance. None and [] for a plain one.
    transform: TransformName | None
    sources: list[str]
    stored: StoredSpec | None  # a part of a low-precision weight; None for any other
    shard: ShardSpec | None  # a rank's part of the checkpoint tensor; None: every rank holds it whole

    @property
    def key(self) -> str:
        """Unique among an entry's weights: a stored weight's two parts share its path."""
        return self.path if self.stored is None else f"{self.path}:{self.stored.part}"


@dataclass
class ShardSpec:
    """How each rank of a tensor-parallel bundle takes its part of a checkpoint tensor
    (aotc.parallel.piece). "split": along `dim`, each of the fused `blocks` (their sizes,
    summing to the tensor's) in `ways` equal parts of whole `unit`s (a head's rows), rank
    r taking part r * ways // world_size (ways below the world size: a part on several
    ranks, as KV heads are when the ranks outnumber them). "first": rank 0 holds it, the
    others zeros (a bias added before an all-reduce). "experts": a layer's routed experts,
    whole, `blocks` [E] of them in `ways` equal parts along `dim` of their stack; rank r
    holds experts [r*E/ways, (r+1)*E/ways), read from their own checkpoint tensors."""

    kind: Literal["split", "first", "experts"]
    dim: int
    blocks: list[int]
    ways: int
    unit: int


@dataclass
class StoredSpec:
    format: StoredFormat
    part: StoredPart
    dtype: str  # what the weight dequantizes to
    # "e4m3": the target reads fp8 bytes as IEEE e4m3 (trn2), so bind rewrites fp8
    # values as value/2 and doubles their scales, once (aotc.fp8).
    fp8_reading: Fp8Reading


@dataclass
class CacheRegion:
    name: str
    dtype: str
    start: int  # byte range in the packed row
    end: int


@dataclass
class CacheSpec:
    shape: list[int]  # the root allocation: layer-major (a packed cache: uint8, rows of bytes)
    dtype: str
    regions: list[CacheRegion]  # a packed cache's regions, each allocated apart when compiled; [] for others


@dataclass
class PassIdentity:
    name: str
    uuid: str  # a hash of the pass's source: which version of it runs


@dataclass
class PassRecord:
    name: str
    uuid: str
    changes: int  # sites the pass rewrote in this graph


@dataclass(kw_only=True)
class CompiledRecord:
    """What one compile produced: kept in the compile cache and in the manifest."""

    files: dict[str, str]  # file name in the artifact folder -> sha256
    inputs: list[TensorSpec]  # caches and activations (weights are the entry's)
    outputs: list[TensorSpec]
    form: Form
    export_s: float
    compile_s: float
    cache_key: str
    passes: list[PassRecord]
    extra: Any  # the backend's own record (its Backend.extra_type), typed by the reader


@dataclass(kw_only=True)
class ArtifactRecord(CompiledRecord):
    """One artifact of a bundle: an entry at one bucket (and context bucket)."""

    bucket: int  # rows: the value of the entry's bucket dimension
    dims: dict[str, int]  # the bucket's named static dimensions
    dir: str  # relative to the bundle folder
    served: Served

    @property
    def context(self) -> int | None:
        """The cache positions the graph reads (its context bucket); None: not a decode per context."""
        return self.dims.get("context")

    @property
    def pending(self) -> str | None:
        return getattr(self.extra, "pending", None)


@dataclass
class EntryRecord:
    id: str
    cls: str  # the module class's qualified name
    method: str
    bucket_kind: BucketKind
    split: bool  # rows beyond the largest bucket run as consecutive calls
    # The positions argument of an entry built per context bucket (its artifacts'
    # dims["context"], one artifact per bucket and context bucket); None: the graphs
    # read all of max_seq.
    context_arg: str | None
    variant: dict[str, Any]  # the attributes that set this variant apart
    instances: list[str]  # module paths that run this entry
    weights: list[WeightSpec]
    artifacts: list[ArtifactRecord]


@dataclass
class GenerationRecord:
    """What the model folder says about generating (aotc.models.generation)."""

    eos_token_ids: list[int]
    eos_from: str  # generation_config.json, config.json or none
    max_new_tokens: int
    max_new_tokens_from: str  # generation_config.json or aotc default


@dataclass
class HubRecord:
    """The Hugging Face Hub model the folder was resolved from (`aotc build ORG/NAME`)."""

    repo_id: str
    commit: str  # the snapshot's commit: `aotc run` resolves exactly this one


@dataclass
class KvCacheRecord:
    """What the KV caches store (`--kv-cache-dtype`; aotc.kvcache)."""

    dtype: Literal["auto", "fp8", "fp8-values"]  # auto: the model's dtype; fp8-values: keys in bf16
    fp8_max: float  # fp8 caches quantize to at most this: the target's (trn2: 224)
    scales: Literal["amax"]  # each group's scale: its largest magnitude / fp8_max (aotc.kvcache)


@dataclass
class ModelRecord:
    architecture: str
    model_class: str
    source: str  # the model folder it was built from (default for `aotc run`)
    config: dict[str, Any]
    generation: GenerationRecord
    hub: HubRecord | None  # null for a model folder given as a path
    kv_cache: KvCacheRecord


@dataclass
class GroupRecord:
    name: str  # the process group's name, as the graphs' collectives name it
    ranks: list[int]


@dataclass
class ParallelRecord:
    """How a bundle's graphs run across ranks (aotc.parallel). world_size 1: one device."""

    world_size: int
    tensor_parallel: int
    expert_parallel: int  # routed experts split across the ranks
    # replicated: every rank runs every row, with its own copy of every cache slot (tensor
    # parallel, or expert parallel alone); data-parallel: each rank runs its own sequences
    # in its own cache slots, and the MoE layers gather the rows of every rank
    # (--data-parallel-attention, with --expert-parallel)
    attention: Literal["replicated", "data-parallel"]
    # How the graphs gather rows from every rank and hand back each rank's sums: with
    # all-gathers and reduce-scatters, or as all-reduces of rows placed at their rank's
    # block (the backend's choice: Backend.gathers_with)
    gather: Literal["collectives", "all-reduce"]
    groups: list[GroupRecord]  # created in this order by every rank
    collectives: Literal["none", "in-graph"]  # in-graph: functional collectives inside the graphs


@dataclass
class BackendRecord:
    name: str
    version: str
    flags: dict[str, Any]


@dataclass
class ShapesRecord:
    batch: list[int]
    chunk: list[int]
    max_seq: int
    cache_slots: int  # the largest batch bucket plus one scratch slot
    context: list[int]  # the context buckets, max_seq last

    def buckets(self, kind: BucketKind) -> list[int]:
        return self.batch if kind == "batch" else self.chunk


@dataclass
class Manifest:
    format_version: int
    aotc_version: str
    created_with: dict[str, str]
    plugins: list[str]
    model: ModelRecord
    backend: BackendRecord
    shapes: ShapesRecord
    parallel: ParallelRecord
    caches: dict[str, CacheSpec]
    passes: list[PassIdentity]
    graphs_traced: int
    entries: list[EntryRecord]

    def artifacts(self) -> Iterator[tuple[EntryRecord, ArtifactRecord]]:
        for entry in self.entries:
            for art in entry.artifacts:
                yield entry, art

    def pending(self) -> list[tuple[EntryRecord, ArtifactRecord]]:
        return [(e, a) for e, a in self.artifacts() if a.pending]

    def entry(self, entry_id: str) -> EntryRecord:
        """The entry `entry_id`; an error (for --entry) names the bundle's entries."""
        entry = next((e for e in self.entries if e.id == entry_id), None)
        if entry is None:
            raise BundleError(f"--entry {entry_id}: the bundle has no such entry; it has {', '.join(e.id for e in self.entries)}")
        return entry

    def select(self, entry_id: str | None, bucket: int | None, context: int | None) -> list[tuple[EntryRecord, ArtifactRecord]]:
        """What --entry, --bucket and --context choose: every artifact (none given), an
        entry's (--entry), or one (--entry --bucket [--context])."""
        if entry_id is None:
            if bucket is not None or context is not None:
                raise BundleError(f"--{'bucket' if bucket is not None else 'context'} chooses among one entry's artifacts; pass --entry too")
            return list(self.artifacts())
        if bucket is None:
            if context is not None:
                raise BundleError("--context chooses among the artifacts of one bucket; pass --bucket too")
            entry = self.entry(entry_id)
            return [(entry, a) for a in entry.artifacts]
        return [self.find(entry_id, bucket, context)]

    def find(self, entry_id: str, bucket: int, context: int | None = None) -> tuple[EntryRecord, ArtifactRecord]:
        """The artifact of `entry_id` at `bucket` and context bucket `context` (None: the
        entry's smallest); an error (for --entry, --bucket, --context) names what the bundle has."""
        entry = self.entry(entry_id)
        contexts = sorted({a.context for a in entry.artifacts if a.context is not None})
        if context is not None and context not in contexts:
            has = f"context buckets {', '.join(map(str, contexts))}" if contexts else "no context buckets"
            raise BundleError(f"--context {context}: {entry_id} has {has}")
        context = context if context is not None else (contexts[0] if contexts else None)
        art = next((a for a in entry.artifacts if a.bucket == bucket and a.context == context), None)
        if art is None:
            raise BundleError(f"--bucket {bucket}: {entry_id} has buckets {', '.join(str(b) for b in sorted({a.bucket for a in entry.artifacts}))}")
        return entry, art

    def digest(self) -> str:
        """The bundle's identity, to pin it: the sha256 of the manifest's canonical JSON,
        which holds every file's sha256. What differs between two builds of the same
        bundle is left out: timings, where each artifact was served from, the model
        folder's path."""
        data = msgspec.to_builtins(self)
        data["model"].pop("source")
        for entry in data["entries"]:
            for art in entry["artifacts"]:
                for key in ("export_s", "compile_s", "served"):
                    art.pop(key)
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# -- writing ----------------------------------------------------------------------


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


# -- reading ----------------------------------------------------------------------


def decode(data: bytes | str, record_type: type, source: str, error: type[Exception] = BundleError):
    """Decode JSON into a record type; the error names `source` and the first bad field."""
    try:
        return msgspec.json.decode(data, type=record_type)
    except msgspec.ValidationError as e:
        raise error(f"{source}: {_field_message(e, msgspec.json.decode(data), record_type)}") from None
    except msgspec.DecodeError as e:
        raise error(f"{source}: not valid JSON ({e}); rebuild it (aotc build)") from None


def convert(obj, record_type: type, source: str, error: type[Exception] = BundleError):
    """`decode` for an already parsed JSON value."""
    try:
        return msgspec.convert(obj, record_type)
    except msgspec.ValidationError as e:
        raise error(f"{source}: {_field_message(e, obj, record_type)}") from None


def read_manifest(bundle: Path | str) -> Manifest:
    """The validated manifest of a bundle folder; every error names the file and field,
    and every path it names stays inside the bundle folder."""
    bundle = Path(bundle)
    file = bundle / MANIFEST
    if not file.is_file():
        raise BundleError(f"{bundle}: no {MANIFEST}; expected a bundle folder written by aotc build")
    manifest = parse_manifest(file.read_bytes(), str(file))
    root = bundle.resolve()
    for i, entry in enumerate(manifest.entries):
        for j, art in enumerate(entry.artifacts):
            where = f"{file}: entries[{i}].artifacts[{j}]"
            confined(root, art.dir, f"{where}.dir")
            for name in art.files:
                if not is_file_name(name):
                    raise BundleError(f"{where}.files: {name!r} must be a file name inside the artifact folder; rebuild the bundle")
                confined(root, f"{art.dir}/{name}", f"{where}.files[{name!r}]")
    return manifest


def unknown_field(obj, record_type, where: str = "") -> str | None:
    """Where JSON `obj` (already decoded as `record_type`) has a key that no record field
    names ("entries[0].weights[1].foo"), else None; the decoder itself skips such keys."""
    origin, args = typing.get_origin(record_type), typing.get_args(record_type)
    if dataclasses.is_dataclass(record_type) and isinstance(obj, dict):
        hints = typing.get_type_hints(record_type)
        names = {f.name for f in dataclasses.fields(record_type)}
        extra = next((k for k in obj if k not in names), None)
        if extra is not None:
            return f"{where}.{extra}".lstrip(".")
        return next((u for k, v in obj.items() if (u := unknown_field(v, hints[k], f"{where}.{k}"))), None)
    if origin in (list, tuple) and isinstance(obj, list) and args:
        return next((u for i, v in enumerate(obj) if (u := unknown_field(v, args[0], f"{where}[{i}]"))), None)
    if origin is dict and isinstance(obj, dict) and len(args) == 2:
        return next((u for k, v in obj.items() if (u := unknown_field(v, args[1], f"{where}[{k!r}]"))), None)
    kinds = [a for a in args if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(kinds) == 1:  # X | None
        return unknown_field(obj, kinds[0], where)
    return None


def parse_manifest(data: bytes, source: str, error: type[Exception] = BundleError) -> Manifest:
    """Decode and validate a manifest's JSON: format version, every field's type, backend records."""
    head = decode(data, Any, source, error)
    if not isinstance(head, dict):
        raise error(f"{source}: expected a JSON object, got {_json_type(head)}; rebuild the bundle (aotc build)")
    version = head.get("format_version")
    if version != FORMAT_VERSION:
        raise error(f"{source}: format_version is {version!r}, this aotc reads format {FORMAT_VERSION} only; rebuild the bundle with this aotc (aotc build)")
    manifest = decode(data, Manifest, source, error)
    kind = _artifact_kind(manifest, source, error)
    unknown = unknown_field(head, Manifest) or next(
        (u for i, e in enumerate(head["entries"]) for j, a in enumerate(e["artifacts"]) if (u := unknown_field(a["extra"], kind.extra_type, f"entries[{i}].artifacts[{j}].extra"))),
        None,
    )  # fmt: skip
    if unknown:
        raise error(
            f"{source}: {unknown}: no such field in format {FORMAT_VERSION}, which this aotc writes and reads; "
            "the manifest was altered or written by another tool. Rebuild the bundle (aotc build)"
        )
    bad = _refusal(source, error)
    _check_shapes(manifest, bad)
    _check_parallel(manifest, bad)
    for i, entry in enumerate(manifest.entries):
        for j, w in enumerate(entry.weights):
            if (w.transform is None) != (not w.sources):
                raise error(
                    f"{source}: entries[{i}].weights[{j}]: transform {w.transform!r} with {len(w.sources)} sources; "
                    "a derived weight has a transform and sources, a plain one neither. Rebuild the bundle"
                )
        for j, art in enumerate(entry.artifacts):
            where = f"{source}: entries[{i}].artifacts[{j}]"
            art.extra = convert(art.extra, kind.extra_type, f"{where}.extra", error)
            for name in kind.required_files(art.extra):
                if name not in art.files:
                    raise error(f"{where}.files: {name!r} is missing; every {manifest.backend.name} artifact has it. Rebuild the bundle")
            names = {entry.bucket_kind} | ({"context"} if entry.context_arg is not None else set())
            if set(art.dims) != names or art.dims[entry.bucket_kind] != art.bucket:
                expected = {entry.bucket_kind: art.bucket} | ({"context": "C"} if entry.context_arg is not None else {})
                raise error(f"{where}.dims: expected {expected} (entries[{i}].context_arg is {entry.context_arg!r}), got {art.dims}; rebuild the bundle")
        kinds = manifest.shapes.buckets(entry.bucket_kind)
        if entry.context_arg is None:  # the dims check above: no artifact of it has a context
            want, have, what = sorted(kinds), sorted(a.bucket for a in entry.artifacts), "buckets"
            shapes, per = f"shapes.{entry.bucket_kind} is {kinds}", ""
        else:
            want = sorted((b, c) for b in kinds for c in manifest.shapes.context)
            have, what = sorted((a.bucket, a.context) for a in entry.artifacts), "(bucket, context) pairs"
            shapes, per = f"shapes.{entry.bucket_kind} is {kinds} and shapes.context is {manifest.shapes.context}", " at each context bucket"
        if have != want:
            raise error(f"{source}: entries[{i}].artifacts: {what} {have}, but {shapes}: every bucket needs one artifact{per}. Rebuild the bundle")
    _check_entries(manifest, bad)
    return manifest


ENTRY_ID = re.compile(r"(?P<cls>[A-Za-z_]\w*)\.(?P<method>[A-Za-z_]\w*)(\.v\d+)?")
MODULE_PATH = re.compile(r"(\w+(\.\w+)*)?")  # "" is the model itself


def _refusal(source: str, error: type[Exception]):
    def bad(where: str, what: str):
        raise error(f"{source}: {where}: {what}; aotc never writes this. Rebuild the bundle (aotc build)")

    return bad


# Fields checked against each other (and against what the artifacts record of their
# inputs): what the types allow in a manifest or build recipe but no build writes.


def _check_shapes(m: Manifest, bad) -> None:
    s = m.shapes
    for name in ("batch", "chunk", "context"):
        values = getattr(s, name)
        if not values or values != sorted(set(values)) or values[0] < 1:
            bad(f"shapes.{name}", f"{values} is not a strictly increasing list of positive integers")
    if s.max_seq < 1 or s.context[-1] != s.max_seq:
        bad("shapes.context", f"{s.context} must end at max_seq ({s.max_seq}): the last context bucket reads the whole cache")
    if s.cache_slots != max(s.batch) + 1:
        bad("shapes.cache_slots", f"{s.cache_slots}, but the largest batch bucket is {max(s.batch)}: one slot per row plus the scratch slot is {max(s.batch) + 1}")
    kv = m.model.kv_cache
    if not (math.isfinite(kv.fp8_max) and kv.fp8_max > 0):
        bad("model.kv_cache.fp8_max", f"{kv.fp8_max} is not a positive number")
    for kind, cache in m.caches.items():
        where = f"caches.{kind}"
        if not _is_dtype(cache.dtype):
            bad(f"{where}.dtype", f"{cache.dtype!r} is not a torch dtype")
        if len(cache.shape) < 3 or cache.shape[1] != s.cache_slots or min(cache.shape) < 1:
            bad(f"{where}.shape", f"{cache.shape} is not [layers, cache_slots ({s.cache_slots}), ...]")
        _check_regions([(r.start, r.end, r.dtype) for r in cache.regions], cache.shape[-1] if cache.regions else None, f"{where}.regions", bad)


def _check_parallel(m: Manifest, bad) -> None:
    p = m.parallel
    world = p.world_size
    if world < 1 or sorted((p.tensor_parallel, p.expert_parallel)) != [1, world]:
        bad(
            "parallel",
            f"world_size {world}, tensor_parallel {p.tensor_parallel} and expert_parallel {p.expert_parallel}: a bundle's ranks are "
            "its tensor-parallel or its expert-parallel degree, the other 1",
        )
    if p.attention == "data-parallel" and p.expert_parallel < 2:
        bad("parallel.attention", f"data-parallel attention in a bundle of expert_parallel {p.expert_parallel}: it comes with expert parallelism only")
    if p.gather == "all-reduce" and p.attention != "data-parallel":
        bad("parallel.gather", "all-reduce gathers in a bundle without data-parallel attention, the only graphs that gather rows")
    want = [list(range(world))] if world > 1 else []
    if [g.ranks for g in p.groups] != want or p.collectives != ("in-graph" if world > 1 else "none"):
        bad("parallel.groups", f"{[g.ranks for g in p.groups]} with collectives {p.collectives!r}, for world_size {world}")
    for i, entry in enumerate(m.entries):
        for j, w in enumerate(entry.weights):
            spec, where = w.shard, f"entries[{i}].weights[{j}].shard"
            if spec is None:
                continue
            if world == 1:
                bad(where, "a shard in a bundle of one rank")
            if spec.kind == "first":
                continue
            # Across experts, a tensor is one expert's ("experts") or a stack of every expert's,
            # split along its experts ("split" on dim 0 in whole experts).
            stack = spec.kind == "split" and spec.dim == 0 and spec.unit == 1 and len(spec.blocks) == 1 and spec.ways == world
            if not ((spec.kind == "experts" or stack) if p.expert_parallel > 1 else spec.kind == "split"):
                bad(where, f"a shard of kind {spec.kind!r} in a bundle of tensor_parallel {p.tensor_parallel}, expert_parallel {p.expert_parallel}")
            if not 0 <= spec.dim < len(w.shape) or spec.ways < 1 or world % spec.ways or spec.unit < 1 or not spec.blocks:
                bad(where, f"dim {spec.dim}, ways {spec.ways}, unit {spec.unit}, blocks {spec.blocks} for shape {w.shape} at world_size {world}")
            if any(b < 1 or b % (spec.ways * spec.unit) for b in spec.blocks) or sum(b // spec.ways for b in spec.blocks) != w.shape[spec.dim]:
                bad(where, f"blocks {spec.blocks} in {spec.ways} parts of whole units of {spec.unit} are not the rank's shape {w.shape} along dim {spec.dim}")


def _check_entries(m: Manifest, bad) -> None:
    s = m.shapes
    ids = [e.id for e in m.entries]
    for i, entry in enumerate(m.entries):
        where = f"entries[{i}]"
        match = ENTRY_ID.fullmatch(entry.id)
        if ids.count(entry.id) > 1:
            bad(f"{where}.id", f"{entry.id!r} names two entries")
        if not match or match["method"] != entry.method or match["cls"] != entry.cls:
            bad(f"{where}.id", f"{entry.id!r} is not the class's name, its method and a variant number (<cls>.<method>[.vN]) of cls {entry.cls!r} and method {entry.method!r}")
        for path in entry.instances:
            if not MODULE_PATH.fullmatch(path):
                bad(f"{where}.instances", f"{path!r} is not a module path")
        for j, art in enumerate(entry.artifacts):
            at = f"{where}.artifacts[{j}]"
            if not any(spec.kind == "activation" for spec in art.inputs):
                bad(f"{at}.inputs", "no activation input: every entry method takes one")
            spans: dict[str, list[tuple[int, int, str]]] = {}
            for k, spec in enumerate([*art.inputs, *art.outputs]):
                part = f"{at}.inputs[{k}]" if k < len(art.inputs) else f"{at}.outputs[{k - len(art.inputs)}]"
                if not _is_dtype(spec.dtype):
                    bad(f"{part}.dtype", f"{spec.dtype!r} is not a torch dtype")
                if k >= len(art.inputs) or spec.kind == "activation":
                    if not spec.shape or spec.shape[0] != art.bucket:
                        bad(f"{part}.shape", f"{spec.shape}: dim 0 of an activation or output is the bucket, {art.bucket}")
                elif spec.kind == "cache":
                    if not spec.shape or spec.shape[0] != s.cache_slots:
                        bad(f"{part}.shape", f"{spec.shape}: dim 0 of a cache is cache_slots, {s.cache_slots}")
                else:
                    bad(f"{part}.kind", f"{spec.kind!r}: an artifact's inputs are caches and activations (weights are the entry's)")
                if spec.region is not None:
                    if spec.kind != "cache":
                        bad(f"{part}.region", "only a cache input is a region of a packed cache")
                    width = (spec.region.end - spec.region.start) // max(1, _itemsize(spec.dtype))
                    if spec.shape[-1] != width:
                        bad(f"{part}.region", f"bytes {spec.region.start}:{spec.region.end} hold {width} {spec.dtype} values, but its shape {spec.shape} ends in {spec.shape[-1]}")
                    spans.setdefault(spec.region.of, []).append((spec.region.start, spec.region.end, spec.dtype))
            for of, regions in spans.items():
                _check_regions(regions, None, f"{at}.inputs (the regions of {of!r})", bad)


def _check_regions(regions: list[tuple[int, int, str]], row: int | None, where: str, bad) -> None:
    """Byte ranges of one packed row: each a known dtype's whole values, none overlapping,
    within the row (`row` bytes, where known)."""
    end = 0
    for start, stop, dtype in sorted(regions):
        if not _is_dtype(dtype):
            bad(where, f"region dtype {dtype!r} is not a torch dtype")
        if start < end or stop <= start or (stop - start) % _itemsize(dtype):
            bad(where, f"bytes {start}:{stop} ({dtype}) overlap another region, are empty, or hold a part of a {dtype} value")
        if row is not None and stop > row:
            bad(where, f"bytes {start}:{stop} run past the row's {row} bytes")
        end = stop


def _is_dtype(name: str) -> bool:
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


def _itemsize(name: str) -> int:
    import torch

    return getattr(torch, name).itemsize


def _artifact_kind(manifest: Manifest, source: str, error: type[Exception]):
    """The backend that wrote the bundle, for its artifact kind (extra record, files)."""
    # Resolved here, not imported at the top: the format does not import the backends,
    # and a backend's own file (or a plugin's) declares its kind.
    from .backends.registry import backend_names, find_backend

    name = manifest.backend.name
    kind = find_backend(name)
    if kind is None:
        plugins = f"; it was built with the plugin {', '.join(manifest.plugins)}: pass --plugin for it" if manifest.plugins else ""
        raise error(f"{source}: backend.name: {name!r} is not a backend; known: {', '.join(backend_names())}{plugins}")
    return kind


def confined(root: Path, rel: str, where: str) -> Path:
    """root/rel, refusing absolute paths, `..` and symlinks that lead outside root."""
    if not _relative(rel):
        raise BundleError(f"{where}: {rel!r} must be a relative path inside the bundle, without '..'; rebuild the bundle")
    path = root / rel
    if not path.resolve().is_relative_to(root):
        raise BundleError(f"{where}: {rel!r} leads outside the bundle folder {root} (a symlink); rebuild the bundle")
    return path


def is_file_name(name: str) -> bool:
    """A plain name inside one folder: no separator, not `.` or `..`."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def _relative(rel: str) -> bool:
    p = PurePosixPath(rel)
    return bool(rel) and "\\" not in rel and not p.is_absolute() and ".." not in p.parts


def _field_message(e: msgspec.ValidationError, data, record_type: type) -> str:
    # msgspec: "Expected `int`, got `str` - at `$.entries[2].artifacts[0].bucket`"
    message, sep, at = str(e).rpartition(" - at ")
    if not sep:
        message, at = str(e), "$"
    path = _name_dict_keys(at.strip("`").removeprefix("$"), data, record_type).removeprefix(".")
    message = message.replace("`", "")
    message = message[:1].lower() + message[1:]
    return f"{path}: {message}" if path else message


def _name_dict_keys(path: str, data, record_type) -> str:
    """msgspec writes a dict value's place as `[...]`; find which key's value is wrong."""
    import re
    import typing

    out, node, typ = "", data, record_type
    for part in re.findall(r"\.\w+|\[\d+\]|\[\.\.\.\]", path):
        args = typing.get_args(typ)
        if part.startswith("."):
            hints = typing.get_type_hints(typ) if dataclasses.is_dataclass(typ) else {}
            typ, node = hints.get(part[1:], Any), node.get(part[1:]) if isinstance(node, dict) else None
        elif part == "[...]" and isinstance(node, dict):
            value_type = args[1] if len(args) == 2 else Any
            bad = next((k for k, v in node.items() if not _fits(v, value_type)), None)
            if bad is None:
                return out + path[len(out) :]
            part, node, typ = f"[{bad!r}]", node[bad], value_type
        else:
            index = int(part[1:-1]) if part != "[...]" else 0
            node = node[index] if isinstance(node, list) and index < len(node) else None
            typ = args[0] if args else Any
        out += part
    return out


def _fits(value, value_type) -> bool:
    try:
        msgspec.convert(value, value_type)
        return True
    except msgspec.ValidationError:
        return False


def _json_type(value) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


# -- file integrity ---------------------------------------------------------------


def crossed_weights(entry: EntryRecord, found: list[str] | None) -> str | None:
    """What differs between an artifact's own record of its weight inputs (each one's
    WeightSpec.key, in the order the graph takes them) and the entry's weights, which say
    which tensor of the instance goes where; None where they agree, or the artifact
    records none. Two weights of one shape crossed would otherwise run, wrong."""
    if found is None:
        return None
    expected = [w.key for w in entry.weights]
    if found == expected:
        return None
    i = next((i for i, (e, f) in enumerate(zip(expected, found)) if e != f), None)
    if i is None:
        return f"the artifact takes {len(found)} weights, the entry lists {len(expected)}"
    return f"the artifact takes weight {i} as {found[i]!r}, the entry lists {expected[i]!r} there"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def bad_file(folder: Path, files: dict[str, str]) -> tuple[Path, str] | None:
    """The first of `files` (name -> sha256) that is missing or changed in `folder`, and what is wrong."""
    for name, digest in files.items():
        path = Path(folder) / name
        if not path.is_file():
            return path, "missing"
        if sha256_file(path) != digest:
            return path, "sha256 differs from its record (changed or truncated)"
    return None


def as_dict(record) -> dict:
    """A record as plain JSON data (for --json output and tests)."""
    return msgspec.to_builtins(record)
