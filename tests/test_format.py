"""The bundle format: one reader that validates every field and confines every path."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aotc.cli import app
from aotc.errors import BundleError
from aotc.format import FORMAT_VERSION, MANIFEST, Manifest, encode, read_manifest
from aotc.runtime import Bundle

# Values of every JSON type; a field gets each one whose type differs from its own.
JSON_VALUES = {"null": None, "boolean": True, "number": 7, "string": "x", "array": [], "object": {}}
# Free-form dicts (copied from config.json, backend flags, variant attributes): any value is valid.
FREE_FORM = {"config", "flags", "variant", "created_with"}
# Maps whose keys are names, not fields: deleting one is another valid manifest.
MAPS = {"caches"}
# Fields whose schema accepts more than one JSON type.
ALSO_VALID = {"path": {"null", "string"}, "pending": {"null", "string"}}


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def _fields(node, path=()):
    """(path, key) of every record field: records' keys, and the first and last element of lists."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, key
            if key not in FREE_FORM:
                yield from _fields(value, path + (key,))
    elif isinstance(node, list) and node:
        for i in sorted({0, len(node) - 1}):
            yield from _fields(node[i], path + (i,))


def _dotted(path, key) -> str:
    text, parent = "", None
    for p in (*path, key):
        if isinstance(p, int):
            text += f"[{p}]"
        elif parent in ("caches", "files", "dims"):  # a map's key, as the reader writes it
            text += f"[{p!r}]"
        else:
            text += f".{p}" if text else p
        parent = p
    return text


def _get(node, path):
    for p in path:
        node = node[p]
    return node


@pytest.fixture(scope="module")
def bundle_copy(tiny_bundle, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(tiny_bundle.out, root / "bundle")
    return root / "bundle", json.loads((tiny_bundle.out / MANIFEST).read_text())


@pytest.fixture
def opened():
    """Paths opened while the test runs (an audit hook: catches every read, by anyone)."""
    seen: list[str] = []
    active = [True]

    def hook(event, args):
        if active[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            seen.append(os.fsdecode(args[0]))

    _HOOKS.append(hook)
    yield seen
    active[0] = False
    _HOOKS.remove(hook)


_HOOKS: list = []
sys.addaudithook(lambda event, args: [h(event, args) for h in list(_HOOKS)])


def _write(bundle: Path, manifest) -> None:
    (bundle / MANIFEST).write_text(json.dumps(manifest))


def test_reader_round_trips_the_writer(tiny_bundle):
    m = read_manifest(tiny_bundle.out)
    assert isinstance(m, Manifest) and m.format_version == FORMAT_VERSION
    assert encode(m) == (tiny_bundle.out / MANIFEST).read_bytes()
    assert list(json.loads(encode(m)))[0] == "format_version"
    decode = next(e for e in m.entries if e.id == "LlamaDecoderLayer.decode")
    assert [a.dims for a in decode.artifacts] == [{"batch": 1, "context": 256}, {"batch": 2, "context": 256}, {"batch": 4, "context": 256}]
    assert decode.context_arg == "positions" and m.shapes.context == [256]
    assert {a.form for _, a in m.artifacts()} == {"static"}
    # Each artifact records the export pipeline's passes, by name and source hash, and what
    # each changed: the tiny llama's caches are written in place already, so nothing.
    from aotc.backends import get_backend_class
    from aotc.passes import pipeline_identity

    pipeline = [(p.name, p.uuid) for p in pipeline_identity(get_backend_class("export")())]
    assert pipeline and all([(p.name, p.uuid) for p in a.passes] == pipeline for _, a in m.artifacts())
    assert {p.changes for _, a in m.artifacts() for p in a.passes} == {0}


def test_every_field_deleted_or_mistyped_is_an_error_naming_it(bundle_copy):
    bundle, original = bundle_copy
    cases = 0
    for path, key in _fields(original):
        where = _dotted(path, key)
        mutations = [] if path and path[-1] in MAPS else [("deleted", None)]
        own = _json_type(_get(original, path)[key])
        valid = ALSO_VALID.get(key, set()) | {own}
        mutations += [(kind, value) for kind, value in JSON_VALUES.items() if kind not in valid]
        for what, value in mutations:
            manifest = copy.deepcopy(original)
            parent = _get(manifest, path)
            if what == "deleted":
                del parent[key]
            else:
                parent[key] = value
            _write(bundle, manifest)
            with pytest.raises(BundleError) as err:
                read_manifest(bundle)
            message = str(err.value)
            named = key in message if what == "deleted" else where in message
            assert named and MANIFEST in message, f"{where} {what}: {message}"
            cases += 1
    assert cases > 500  # every record type was reached
    _write(bundle, original)


@pytest.mark.parametrize("command", ["inspect", "run"])
def test_cli_exits_2_without_a_traceback(bundle_copy, command):
    bundle, original = bundle_copy
    for mutate, expect in [
        (lambda m: m["entries"][2]["artifacts"][0].__setitem__("bucket", "4"), "entries[2].artifacts[0].bucket: expected int, got str"),
        (lambda m: m.pop("shapes"), "missing required field shapes"),
        (lambda m: m["entries"][0].__setitem__("bucket_kind", "context"), "entries[0].bucket_kind"),
        (lambda m: m["entries"][0]["artifacts"][0].__setitem__("bucket", 3), "entries[0].artifacts[0].dims: expected {'batch': 3, 'context': 'C'}"),
        (lambda m: m["entries"][0]["artifacts"].pop(), "every bucket needs one artifact"),
        (lambda m: m["entries"].pop(), "the manifest has no compiled entry for head.forward" if command == "run" else None),
    ]:
        manifest = copy.deepcopy(original)
        mutate(manifest)
        _write(bundle, manifest)
        r = CliRunner().invoke(app, [command, str(bundle)], env={"COLUMNS": "300"})
        if expect is None:  # inspect shows what is there; only running needs every entry
            assert r.exit_code == 0, r.output
            continue
        assert r.exit_code == 2, r.output
        assert expect in " ".join(r.output.split()) and "Traceback" not in r.output
    for text in ("[1, 2]", "{", ""):
        (bundle / MANIFEST).write_text(text)
        r = CliRunner().invoke(app, [command, str(bundle)])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    _write(bundle, original)


def test_other_format_versions_say_to_rebuild(bundle_copy):
    bundle, original = bundle_copy
    for version in (FORMAT_VERSION - 1, FORMAT_VERSION + 1, "2"):
        _write(bundle, {**original, "format_version": version})
        with pytest.raises(BundleError, match=rf"format_version is {version!r}, this aotc reads format {FORMAT_VERSION} only; rebuild"):
            read_manifest(bundle)
    _write(bundle, original)


def test_paths_outside_the_bundle_are_refused_and_never_read(bundle_copy, tmp_path, opened):
    bundle, original = bundle_copy
    outside = tmp_path / "outside"
    shutil.copytree(bundle / "entries", outside)  # real artifact files: only the confinement can refuse them
    art = original["entries"][0]["artifacts"][0]
    name = next(iter(art["files"]))
    real = outside / Path(art["dir"]).relative_to("entries")  # a copy of the artifact's folder
    (bundle / "entries" / "link").symlink_to(real)
    file_link = bundle / art["dir"] / "linked.pt2"
    file_link.symlink_to(real / name)
    cases = {
        "absolute dir": ("dir", str(real)),
        "dotdot dir": ("dir", f"../{outside.name}/{real.relative_to(outside)}"),
        "symlinked dir": ("dir", "entries/link"),
        "absolute file": ("files", {str(real / name): art["files"][name]}),
        "dotdot file": ("files", {f"../../../{outside.name}/x": art["files"][name]}),
        "symlinked file": ("files", {"linked.pt2": art["files"][name]}),
    }
    try:
        for what, (field, value) in cases.items():
            manifest = copy.deepcopy(original)
            manifest["entries"][0]["artifacts"][0][field] = value
            _write(bundle, manifest)
            opened.clear()
            with pytest.raises(BundleError, match=r"entries\[0\]\.artifacts\[0\]\.(dir|files)"):
                Bundle.load(bundle)
            assert not [p for p in opened if str(outside) in str(Path(p).resolve())], what
    finally:
        (bundle / "entries" / "link").unlink()
        file_link.unlink()
        _write(bundle, original)


def test_the_bundle_folder_itself_may_be_a_symlink(tiny_bundle, tmp_path):
    (tmp_path / "latest").symlink_to(tiny_bundle.out)
    b = Bundle.load(tmp_path / "latest")
    assert len(b.programs) == sum(len(e.artifacts) for e in b.manifest.entries)


def _entry(m, eid="LlamaDecoderLayer.decode"):
    return next(e for e in m["entries"] if e["id"] == eid)


def _input(m, name, eid="LlamaDecoderLayer.decode"):
    return next(i for i in _entry(m, eid)["artifacts"][0]["inputs"] if i["name"] == name)


# What the types allow but no build writes: each refused by the field it names.
CROSS_CHECKS = {
    "batch buckets unsorted": (lambda m: m["shapes"].update(batch=[2, 1]), "shapes.batch: [2, 1] is not a strictly increasing list"),
    "context buckets duplicated": (lambda m: m["shapes"].update(context=[256, 256]), "shapes.context: [256, 256] is not a strictly increasing list"),
    "a context bucket above max_seq": (lambda m: m["shapes"].update(context=[300]), "shapes.context: [300] must end at max_seq (256)"),
    "a first chunk above the largest chunk": (
        lambda m: m["shapes"].update(first=[*m["shapes"]["chunk"], 4096]),
        "shapes.first: [16, 64, 4096]: expected every chunk bucket ([16, 64]) and finer ones, none above the largest",
    ),
    "a chunk bucket no first chunk": (lambda m: m["shapes"].update(first=[64]), "shapes.first: [64]: expected every chunk bucket ([16, 64])"),
    "cache_slots 0": (lambda m: m["shapes"].update(cache_slots=0), "shapes.cache_slots: 0, but the largest batch bucket is 4"),
    "fp8_max 0": (lambda m: m["model"]["kv_cache"].update(fp8_max=0), "model.kv_cache.fp8_max: 0"),
    "fp8_max negative": (lambda m: m["model"]["kv_cache"].update(fp8_max=-448.0), "model.kv_cache.fp8_max: -448.0"),
    "a cache of no dtype": (lambda m: m["caches"]["k"].update(dtype="float9"), "caches.k.dtype: 'float9' is not a torch dtype"),
    "cache regions overlapping": (
        lambda m: m["caches"]["k"].update(regions=[{"name": "values", "dtype": "uint8", "start": 0, "end": 40}, {"name": "scale", "dtype": "float32", "start": 36, "end": 44}]),
        "caches.k.regions: bytes 36:44 (float32) overlap",
    ),
    "a cache region past the row": (
        lambda m: m["caches"]["k"].update(regions=[{"name": "values", "dtype": "uint8", "start": 0, "end": 200}]),
        "caches.k.regions: bytes 0:200 run past the row's 64 bytes",
    ),
    "a cache region of no dtype": (
        lambda m: m["caches"]["k"].update(regions=[{"name": "values", "dtype": "float9", "start": 0, "end": 8}]),
        "region dtype 'float9' is not a torch dtype",
    ),
    "a duplicated entry": (lambda m: m["entries"].append(copy.deepcopy(m["entries"][0])), "'LlamaDecoderLayer.decode' names two entries"),
    "an entry cls of os.system": (lambda m: _entry(m).update(cls="os.system"), "is not the class's name, its method and a variant number"),
    "an entry id of ../../x": (lambda m: _entry(m).update(id="../../x"), "'../../x' is not the class's name"),
    "an instance outside the model": (lambda m: _entry(m).update(instances=["model.layers.0", "../x"]), "instances: '../x' is not a module path"),
    "a weight among an artifact's inputs": (lambda m: _input(m, "x").update(kind="weight"), "kind: 'weight': an artifact's inputs are caches and activations"),
    "an input of no dtype": (lambda m: _input(m, "positions").update(dtype="int65"), "dtype: 'int65' is not a torch dtype"),
    "a cache of other slots": (lambda m: _input(m, "k_cache").update(shape=[4, 2, 256, 64]), "dim 0 of a cache is cache_slots, 5"),
    "an output of other rows": (lambda m: _entry(m)["artifacts"][0]["outputs"][0].update(shape=[2, 256]), "dim 0 of an activation or output is the bucket, 1"),
    "an activation of other rows": (lambda m: _input(m, "x").update(shape=[3, 256]), "dim 0 of an activation or output is the bucket, 1"),
    "a region of an activation": (lambda m: _input(m, "x").update(region={"of": "x", "start": 0, "end": 1024}), "only a cache input is a region of a packed cache"),
    "a region of other width": (lambda m: _input(m, "k_cache").update(region={"of": "k_cache", "start": 0, "end": 8}), "bytes 0:8 hold 2 float32 values, but its shape"),
    "a slot copy of a backend that copies without one": (
        lambda m: m["copies"].append({"shape": [5, 2, 256, 64], "dtype": "float32", "dim": 2, "artifact": copy.deepcopy(_entry(m)["artifacts"][0])}),
        "copies: the export backend copies between cache slots without programs",
    ),
    "no activation": (lambda m: [i.update(kind="cache", shape=[5, *i["shape"][1:]]) for i in _entry(m)["artifacts"][0]["inputs"]], "no activation input"),
}


@pytest.mark.parametrize("case", list(CROSS_CHECKS))
def test_fields_are_checked_against_each_other(bundle_copy, case):
    bundle, original = bundle_copy
    edit, said = CROSS_CHECKS[case]
    manifest = copy.deepcopy(original)
    edit(manifest)
    _write(bundle, manifest)
    try:
        with pytest.raises(BundleError, match=re.escape(said)) as err:
            read_manifest(bundle)
        assert MANIFEST in str(err.value) and "Rebuild" in str(err.value)
    finally:
        _write(bundle, original)


def test_an_instance_of_another_class_is_refused_at_bind(tiny_bundle, tiny_dir, tmp_path):
    """An entry whose cls and id agree but name another class than the module at its path."""
    from aotc.models.loader import load_model
    from aotc.runtime import Bundle

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundle.out, bundle)
    manifest = json.loads((bundle / MANIFEST).read_text())
    head = _entry(manifest, "LMHead.forward")
    head["instances"] = ["model.layers.0"]  # a decoder layer: its forward would be replaced
    _write(bundle, manifest)
    with pytest.raises(BundleError, match=r"entry LMHead.forward runs LMHead.forward at model.layers.0, which is a LlamaDecoderLayer"):
        Bundle.load(bundle).bind(load_model(tiny_dir).model)
