"""Reading a bundle's manifest: every field's presence and type checked, the first bad one named, every path confined to the bundle."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import types
import typing
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec

from ..errors import BundleError
from .records import FORMAT_VERSION, MANIFEST, EntryRecord, Manifest, copy_dir


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
    located = [(f"entries[{i}].artifacts[{j}]", art) for i, entry in enumerate(manifest.entries) for j, art in enumerate(entry.artifacts)]
    for at, art in located + [(f"copies[{i}].artifact", c.artifact) for i, c in enumerate(manifest.copies)]:
        where = f"{file}: {at}"
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
    extras = [(f"entries[{i}].artifacts[{j}].extra", a["extra"]) for i, e in enumerate(head["entries"]) for j, a in enumerate(e["artifacts"])]
    extras += [(f"copies[{i}].artifact.extra", c["artifact"]["extra"]) for i, c in enumerate(head["copies"])]
    unknown = unknown_field(head, Manifest) or next((u for where, extra in extras if (u := unknown_field(extra, kind.extra_type, where))), None)
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
            _typed_extra(art, kind, where, manifest.backend.name, error)
            names = {entry.bucket_kind} | ({"context"} if entry.context_arg is not None else set())
            if set(art.dims) != names or art.dims[entry.bucket_kind] != art.bucket:
                expected = {entry.bucket_kind: art.bucket} | ({"context": "C"} if entry.context_arg is not None else {})
                raise error(f"{where}.dims: expected {expected} (entries[{i}].context_arg is {entry.context_arg!r}), got {art.dims}; rebuild the bundle")
        kinds = manifest.shapes.buckets(entry.bucket_kind)
        if entry.context_arg is None:  # the dims check above: no artifact of it has a context
            want, have, what = sorted(kinds), sorted(a.bucket for a in entry.artifacts), "buckets"
            shapes, per = f"shapes.{entry.bucket_kind} is {kinds}", ""
        else:
            want = sorted((b, c) for b in kinds for c in manifest.shapes.contexts(entry.bucket_kind, b))
            have, what = sorted((a.bucket, a.context) for a in entry.artifacts), "(bucket, context) pairs"
            fields = "shapes.context" + (f" and shapes.chunk_contexts {manifest.shapes.chunk_contexts}" if entry.bucket_kind == "chunk" else "")
            shapes, per = f"shapes.{entry.bucket_kind} is {kinds} and its context buckets are {manifest.shapes.context} ({fields})", " at each context bucket it fits"
        if have != want:
            raise error(f"{source}: entries[{i}].artifacts: {what} {have}, but {shapes}: every bucket needs one artifact{per}. Rebuild the bundle")
    _check_entries(manifest, bad)
    _check_copies(manifest, kind, source, error, bad)
    return manifest


def _check_copies(m: Manifest, kind, source: str, error: type[Exception], bad) -> None:
    """Each cache copy (CopyRecord): a backend's that copies by programs, one per allocation
    kind, in its own folder, taking that allocation and three int64 scalars (src, dst, n)."""
    if m.copies and not kind.slot_copies:
        bad("copies", f"the {m.backend.name} backend copies between cache slots without programs")
    seen = set()
    for i, c in enumerate(m.copies):
        where, art = f"copies[{i}]", c.artifact
        if not _is_dtype(c.dtype) or len(c.shape) < 2 or c.shape[0] != m.shapes.cache_slots or not 0 < c.dim < len(c.shape) or min(c.shape) < 1:
            bad(where, f"{c.dtype}{c.shape} along dim {c.dim} is not a cache allocation ([cache_slots ({m.shapes.cache_slots}), ...]) and one of its dims")
        if (tuple(c.shape), c.dtype, c.dim) in seen:
            bad(where, f"a second copy of {c.dtype}{c.shape} along dim {c.dim}")
        seen.add((tuple(c.shape), c.dtype, c.dim))
        if art.dir != copy_dir(i):
            bad(f"{where}.artifact.dir", f"{art.dir!r}, not {copy_dir(i)!r}")
        want = [("cache", c.shape, c.dtype)] + [("activation", [1], "int64")] * 3
        if [(t.kind, t.shape, t.dtype) for t in art.inputs] != want or art.outputs:
            bad(f"{where}.artifact.inputs", f"{[(t.kind, t.shape, t.dtype) for t in art.inputs]}, not the allocation, src, dst and n, with no outputs")
        _typed_extra(art, kind, f"{source}: {where}.artifact", m.backend.name, error)


def _typed_extra(art, kind, where: str, backend: str, error: type[Exception]) -> None:
    """The artifact's `extra` as its backend's record, and every file that record requires listed."""
    art.extra = convert(art.extra, kind.extra_type, f"{where}.extra", error)
    for name in kind.required_files(art.extra):
        if name not in art.files:
            raise error(f"{where}.files: {name!r} is missing; every {backend} artifact has it. Rebuild the bundle")


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
    for name in ("batch", "chunk", "context", "first"):
        values = getattr(s, name)
        if not values or values != sorted(set(values)) or values[0] < 1:
            bad(f"shapes.{name}", f"{values} is not a strictly increasing list of positive integers")
    if not set(s.chunk) <= set(s.first) or s.first[-1] != s.chunk[-1]:
        bad("shapes.first", f"{s.first}: expected every chunk bucket ({s.chunk}) and finer ones, none above the largest")
    if s.max_seq < 1 or s.context[-1] != s.max_seq:
        bad("shapes.context", f"{s.context} must end at max_seq ({s.max_seq}): the last context bucket reads the whole cache")
    c = s.chunk_contexts
    if c != sorted(set(c)) or set(c) & set(s.context) or any(x < 1 or x > s.max_seq or (x < s.context[0] and x not in s.chunk) for x in c):
        bad(
            "shapes.chunk_contexts",
            f"{c}: expected increasing cache lengths up to max_seq ({s.max_seq}), none a context bucket ({s.context}), each below the smallest context bucket a chunk bucket ({s.chunk})",
        )
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
                    slots_dim = entry.slot_dim
                    if len(spec.shape) <= slots_dim or spec.shape[slots_dim] != s.cache_slots:
                        what = "dim 1 of the model's own entry's cache (every layer's)" if slots_dim else "dim 0 of a cache"
                        bad(f"{part}.shape", f"{spec.shape}: {what} is cache_slots, {s.cache_slots}")
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
    from ..backends.registry import backend_names, find_backend

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
