"""The bundle format's typed records and constants (aotc.format says what a bundle is)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import msgspec

from ..errors import BundleError

FORMAT_VERSION = 20  # 20: shapes.first, the buckets of a prompt's first chunk (a fresh form's: entry.py)
MANIFEST = "manifest.json"
ENTRIES_DIR = "entries"
DEFAULT_ARTIFACTS = Path("artifacts")

BucketKind = Literal["batch", "chunk", "first"]
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


COPIES_DIR = "copies"


def copy_dir(i: int) -> str:
    """Folder of the manifest's i-th cache copy (CopyRecord), relative to the bundle root."""
    return f"{COPIES_DIR}/{i}"


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
class CopyRecord:
    """A compiled copy between the slots of one kind of cache allocation (a layer's slice of a
    cache kind, or of one region of it), for a backend whose device copies only through a
    program of its own (Backend.slot_copies): positions 0..n-1 along `dim` of slot src
    written into slot dst, in place. One per distinct (shape, dtype, dim)."""

    shape: list[int]  # one allocation: dim 0 the slot
    dtype: str
    dim: int  # the positions
    artifact: ArtifactRecord

    @property
    def label(self) -> str:
        return f"the cache copy of {self.dtype}{self.shape} along dim {self.dim}"


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

    @property
    def slot_dim(self) -> int:
        """The dim of its cache inputs that is the slot: 0 for a layer's cache; 1 for the
        model's own entry (a whole step), which takes every layer's allocation."""
        return 1 if self.instances == [""] else 0


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
    chunk_contexts: list[int]  # contexts only chunk entries have: chunk buckets below them, doublings between them (bucket_contexts)
    first: list[int]  # a call's first chunk from position 0 (fresh forms): the chunk buckets and finer ones

    def buckets(self, kind: BucketKind) -> list[int]:
        return {"batch": self.batch, "chunk": self.chunk, "first": self.first}[kind]

    def contexts(self, kind: BucketKind, bucket: int) -> list[int]:
        """The context buckets of a context-bucketed entry bucketed by `kind`, at `bucket`."""
        return bucket_contexts(kind, bucket, self.chunk_contexts, self.context)


def bucket_contexts(kind: BucketKind, bucket: int, chunk_contexts, contexts) -> list[int]:
    """The contexts an entry that reads positions is built at, at one bucket, in increasing
    order: every context bucket, and for a chunk bucket also each chunk context at least as
    long as the chunk. A chunk graph reads all of its context's positions, masked or not:
    a chunk of 64 continuing a prompt from position 20 reads 64 + 64 keys at context 64,
    256 + 64 at 256 (a chunk from position 0 runs the entry's fresh form: its own rows)."""
    return sorted([c for c in chunk_contexts if c >= bucket and kind == "chunk"] + list(contexts))


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
    copies: list[CopyRecord]  # [] unless the backend copies between cache slots by programs

    def artifacts(self) -> Iterator[tuple[EntryRecord, ArtifactRecord]]:
        for entry in self.entries:
            for art in entry.artifacts:
                yield entry, art

    def compiled(self) -> Iterator[tuple[str, ArtifactRecord]]:
        """Every compiled artifact, the entries' and the cache copies', with its label."""
        for e, a in self.artifacts():
            yield artifact_label(e.id, a.bucket, a.context), a
        for c in self.copies:
            yield c.label, c.artifact

    def pending(self) -> list[tuple[str, ArtifactRecord]]:
        """The artifacts not compiled yet (a neuron cross-build's), with their labels."""
        return [(label, a) for label, a in self.compiled() if a.pending]

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
