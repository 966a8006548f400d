"""The bundle format: typed records, one writer, one reader.

    BUNDLE/manifest.json                 a Manifest, `format_version` first
    BUNDLE/entries/<entry id>/b<bucket>[-c<context>]/
                                         one folder per artifact: the files that
                                         its ArtifactRecord lists, with their sha256
    BUNDLE/copies/<i>/                   a compiled copy between cache slots
                                         (CopyRecord; neuron bundles only)

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
    {"chunk": 128}, {"first": 40}, {"batch": 4, "context": 1024}); `bucket` is the value of
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

from .read import ENTRY_ID, MODULE_PATH, as_dict, bad_file, confined, convert, crossed_weights, decode, is_file_name, parse_manifest, read_manifest, sha256_file, unknown_field
from .records import (
    COPIES_DIR,
    DEFAULT_ARTIFACTS,
    ENTRIES_DIR,
    FORMAT_VERSION,
    MANIFEST,
    ArtifactRecord,
    BackendRecord,
    BucketKind,
    CacheRegion,
    CacheSpec,
    CompiledRecord,
    CopyRecord,
    EntryRecord,
    Form,
    Fp8Reading,
    GenerationRecord,
    GroupRecord,
    HubRecord,
    KvCacheRecord,
    Manifest,
    ModelRecord,
    ParallelRecord,
    PassIdentity,
    PassRecord,
    RegionSpec,
    Served,
    ShapesRecord,
    ShardSpec,
    StoredFormat,
    StoredPart,
    StoredSpec,
    TensorSpec,
    TransformName,
    WeightSpec,
    artifact_dir,
    artifact_label,
    copy_dir,
)
from .write import bundle_writer, check_replaceable, encode, temp_folder, umask, write_atomic, write_manifest, writers_turn

__all__ = [
    "ArtifactRecord",
    "BackendRecord",
    "BucketKind",
    "CacheRegion",
    "CacheSpec",
    "COPIES_DIR",
    "CompiledRecord",
    "CopyRecord",
    "DEFAULT_ARTIFACTS",
    "ENTRIES_DIR",
    "ENTRY_ID",
    "EntryRecord",
    "FORMAT_VERSION",
    "Form",
    "Fp8Reading",
    "GenerationRecord",
    "GroupRecord",
    "HubRecord",
    "KvCacheRecord",
    "MANIFEST",
    "MODULE_PATH",
    "Manifest",
    "ModelRecord",
    "ParallelRecord",
    "PassIdentity",
    "PassRecord",
    "RegionSpec",
    "Served",
    "ShapesRecord",
    "ShardSpec",
    "StoredFormat",
    "StoredPart",
    "StoredSpec",
    "TensorSpec",
    "TransformName",
    "WeightSpec",
    "artifact_dir",
    "artifact_label",
    "copy_dir",
    "as_dict",
    "bad_file",
    "bundle_writer",
    "check_replaceable",
    "confined",
    "convert",
    "crossed_weights",
    "decode",
    "encode",
    "is_file_name",
    "parse_manifest",
    "read_manifest",
    "sha256_file",
    "temp_folder",
    "umask",
    "unknown_field",
    "write_atomic",
    "write_manifest",
    "writers_turn",
]
