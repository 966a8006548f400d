"""Nothing lost, nothing run that the user did not build: output folders, caches, plugins, digests."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from aotc.builder import BuildOptions, build
from aotc.cache import LocalCache
from aotc.cli import app
from aotc.errors import AotcError, BundleError, ConfigError
from aotc.models.tiny import write_tiny
from aotc.runtime import Bundle

from .conftest import cross_weights, rehash, swapped_copy

OPTIONS = dict(batch_buckets=(1,), chunk_buckets=(64,), max_seq=64, backend="export")


def tree_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "300"})


@pytest.fixture
def model(tiny_dir, tmp_path):
    """A private copy of the tiny model: tests here try to destroy it."""
    copy = tmp_path / "model"
    copy.mkdir()
    for f in tiny_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


@pytest.mark.parametrize("where", ["model", "inside", "around"])
def test_output_never_replaces_the_model_folder(model, where):
    before = tree_digest(model)
    out = {"model": model, "inside": model / "bundle", "around": model.parent}[where]
    r = invoke("build", model, "--backend", "export", "--no-cache", "--buckets", "1", "-o", out)
    assert r.exit_code == 2 and "would replace the model folder" in " ".join(r.output.split()), r.output
    assert tree_digest(model) == before


def test_output_never_replaces_files_that_are_not_a_bundle(model, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    file = tmp_path / "file.txt"
    file.write_text("keep me too")
    for out, said in [(notes, "holds files that are not an aotc bundle"), (file, "is a file, not a bundle folder")]:
        with pytest.raises(BundleError, match=said):
            build(BuildOptions(model, out=out, use_cache=False, **OPTIONS))
    assert (notes / "todo.txt").read_text() == "keep me" and file.read_text() == "keep me too"
    empty = tmp_path / "empty"
    empty.mkdir()
    build(BuildOptions(model, out=empty, use_cache=False, **OPTIONS))  # an empty folder is fine
    build(BuildOptions(model, out=empty, use_cache=False, **OPTIONS))  # and so is a bundle aotc wrote
    assert (empty / "manifest.json").is_file()


def test_stale_temporary_folders_are_removed_by_the_next_build(model, tmp_path):
    out = tmp_path / "bundle"
    stale = [tmp_path / ".bundle.tmp-dead1", tmp_path / ".bundle.old-dead2"]
    for s in stale:
        (s / "entries").mkdir(parents=True)
    other = tmp_path / ".other.tmp-keep"  # another bundle's: not ours to remove
    other.mkdir()
    build(BuildOptions(model, out=out, use_cache=False, **OPTIONS))
    assert not any(s.exists() for s in stale) and other.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".bundle")) == []  # the writers' lock is in the cache's locks/


def test_init_tiny_refuses_a_folder_with_files_unless_forced(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="not an empty folder.*--force"):
        write_tiny(folder, layers=1)
    r = invoke("init", "tiny", folder, "--layers", 1)
    assert r.exit_code == 2 and (folder / "thesis.tex").read_text() == "years of work"
    r = invoke("init", "tiny", folder, "--layers", 1, "--force")
    assert r.exit_code == 0 and (folder / "config.json").is_file() and not (folder / "thesis.tex").exists()


def test_prune_never_follows_a_symlink_out_of_the_cache(model, tmp_path):
    cache = tmp_path / "cache"
    build(BuildOptions(model, out=tmp_path / "b", cache_dir=cache, **OPTIONS))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    key = "ab" + "0" * 62
    (victim / key).mkdir()
    (victim / key / "record.json").write_text((next((cache / "entries").glob("*/*/record.json"))).read_text())
    (cache / "entries" / "ab").symlink_to(victim)  # entries/ab -> a user folder
    old = time.time() - 7200
    (tmp_path / "victim_tmp").mkdir()
    (tmp_path / "victim_tmp" / "x").mkdir()
    os.utime(tmp_path / "victim_tmp" / "x", (old, old))
    (cache / "tmp").mkdir(exist_ok=True)
    os.rename(cache / "tmp", tmp_path / "real_tmp")
    (cache / "tmp").symlink_to(tmp_path / "victim_tmp")  # cache/tmp -> a user folder
    before = tree_digest(victim), tree_digest(tmp_path / "victim_tmp")
    LocalCache(cache).prune(0)
    assert (tree_digest(victim), tree_digest(tmp_path / "victim_tmp")) == before
    assert (tmp_path / "victim_tmp" / "x").is_dir()
    assert not list((cache / "entries").glob("[!a]*/*/record.json"))  # the real entries went


def foreign_folder(root: Path) -> Path:
    """A folder someone else made that looks like a cache: a home or a project with a tmp/
    of hour-old work and an entries/ that holds a record.json."""
    old = time.time() - 7200
    (root / "tmp" / "draft").mkdir(parents=True)
    (root / "tmp" / "draft" / "chapter.tex").write_text("keep")
    (root / "entries" / "ab" / ("ab" + "0" * 62)).mkdir(parents=True)
    (root / "entries" / "ab" / ("ab" + "0" * 62) / "record.json").write_text("{}")
    (root / "notes.txt").write_text("keep")
    for p in root.rglob("*"):
        os.utime(p, (old, old))
    return root


def test_prune_refuses_a_folder_aotc_did_not_make_and_deletes_nothing(tmp_path):
    folder = foreign_folder(tmp_path / "home")
    before = tree_digest(folder)
    r = invoke("cache", "prune", "--max-size", "0", "--cache-dir", folder)
    assert r.exit_code == 2 and "is not a cache aotc made (no CACHEDIR.TAG of aotc's in it); nothing was removed" in " ".join(r.output.split()), r.output
    assert tree_digest(folder) == before
    # A tag that is not aotc's (another tool's, or a link to aotc's) does not make it aotc's.
    (folder / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n# another tool\n")
    assert invoke("cache", "prune", "--max-size", "0", "--cache-dir", folder).exit_code == 2 and tree_digest(folder) != before
    assert (folder / "tmp" / "draft" / "chapter.tex").is_file() and (folder / "entries" / "ab").is_dir()


def test_a_build_writes_nothing_into_a_cache_dir_aotc_did_not_make(model, tmp_path):
    folder = foreign_folder(tmp_path / "project")
    before = tree_digest(folder)
    result = build(BuildOptions(model, out=tmp_path / "b", cache_dir=folder, **OPTIONS))
    assert any("is not a cache aotc made" in n and "building without it" in n for n in result.notes), result.notes
    assert tree_digest(folder) == before and sorted(p.name for p in folder.iterdir()) == ["entries", "notes.txt", "tmp"]
    with pytest.raises(AotcError, match=r"--require-cache and --shard need it"):
        build(BuildOptions(model, out=tmp_path / "c", cache_dir=folder, require_cache=True, **OPTIONS))
    # A new folder becomes aotc's: tagged, and pruned as a cache.
    fresh = tmp_path / "fresh"
    build(BuildOptions(model, out=tmp_path / "d", cache_dir=fresh, **OPTIONS))
    assert (fresh / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55\n")
    assert LocalCache(fresh).prune(0)[0] == 4 and not list((fresh / "entries").glob("*/*/record.json"))


@pytest.mark.parametrize("where", ["model", "inside", "around"])
def test_cache_dir_in_or_around_the_model_folder_is_refused(model, tmp_path, where):
    cache = {"model": model, "inside": model / "cache", "around": model.parent}[where]
    before = tree_digest(model)
    r = invoke("build", model, "--backend", "export", "--buckets", "1", "--max-seq", "64", "--cache-dir", cache, "-o", tmp_path / "elsewhere" / "b")
    assert r.exit_code == 2 and "the compile cache would write into the model folder" in " ".join(r.output.split()), r.output
    assert tree_digest(model) == before and not (model / "cache").exists()


def test_plugins_named_by_a_bundle_are_not_imported(tiny_bundle, tmp_path):
    evil = tmp_path / "evil"
    shutil.copytree(tiny_bundle.out, evil)
    manifest = json.loads((evil / "manifest.json").read_text())
    (evil / "manifest.json").write_text(json.dumps({**manifest, "plugins": ["os_plugin_that_would_run"]}))
    with pytest.raises(BundleError, match="built with the plugin os_plugin_that_would_run; pass --plugin os_plugin_that_would_run"):
        Bundle.load(evil)
    r = invoke("run", evil, "--prompt", "Hi")
    assert r.exit_code == 2 and "aotc imports a module only when you name it" in " ".join(r.output.split())


def test_digest_is_printed_stable_and_pinnable(model, tmp_path):
    r = invoke("build", model, "--backend", "export", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", 64, "--cache-dir", tmp_path / "c", "-o", tmp_path / "a")
    assert r.exit_code == 0, r.output
    digest = " ".join(r.output.split()).split("bundle digest ")[1].split()[0]
    assert len(digest) == 64
    # A rebuild (served from the cache, another folder) has the same digest.
    r = invoke("build", model, "--backend", "export", "--buckets", "1", "--prefill-chunk", "16", "--max-seq", 64, "--cache-dir", tmp_path / "c", "-o", tmp_path / "b")
    assert f"bundle digest {digest}" in " ".join(r.output.split())
    assert invoke("run", tmp_path / "b", "--expect-digest", digest, "--prompt", "Hi", "--max-new-tokens", 2).exit_code == 0
    r = invoke("run", tmp_path / "b", "--expect-digest", "0" * 64, "--prompt", "Hi", "--max-new-tokens", 2)
    assert r.exit_code == 2 and "not the bundle you pinned" in " ".join(r.output.split())
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    manifest["entries"][0]["artifacts"][0]["files"]["program.pt2"] = "f" * 64  # any change to what runs
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    r = invoke("run", tmp_path / "b", "--expect-digest", digest, "--prompt", "Hi", "--max-new-tokens", 2)
    assert r.exit_code == 2 and "not the bundle you pinned" in " ".join(r.output.split())


def test_errors_are_aotc_errors():
    assert issubclass(BundleError, AotcError) and issubclass(ConfigError, AotcError)


def _rewrite_program(path: Path, edit) -> None:
    """Rewrite an export archive's members: edit(name, bytes) -> bytes."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members:
            z.writestr(name, edit(name, data))


def test_export_program_that_calls_python_or_unpickles_is_refused_and_never_runs(tiny_bundle, tmp_path, monkeypatch):
    import pickle

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Payload())  # made before os.system is replaced below
    calls = []
    monkeypatch.setattr(os, "system", lambda cmd: calls.append(cmd) or 0)
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: calls.append("pickle") or None)
    art = "entries/LMHead.forward/b1/program.pt2"

    def node_calls_system(name, data):
        if not name.endswith("models/model.json"):
            return data
        program = json.loads(data)
        program["graph_module"]["graph"]["nodes"][0]["target"] = "torch.os.system"
        return json.dumps(program).encode()

    def pickled_constant(name, data):
        if name.endswith("model_constants_config.json"):
            return json.dumps({"config": {"c0": {"path_name": "c0", "is_param": False}}}).encode()
        if name.endswith("sample_inputs/model.pt"):
            return payload
        return data

    for what, edit, said in [
        ("torch.os.system node", node_calls_system, "calls 'torch.os.system', which is not an aten or prims op"),
        ("pickled constant", pickled_constant, "pickled"),
    ]:
        bundle = tmp_path / what.replace(" ", "_")
        shutil.copytree(tiny_bundle.out, bundle)
        _rewrite_program(bundle / art, edit)
        rehash(bundle)
        with pytest.raises(BundleError, match=said):
            Bundle.load(bundle)
    assert calls == [] and not marker.exists()


def test_an_export_program_is_rebuilt_when_first_run_from_the_bytes_checked_at_load(tiny_bundle, tiny_dir, tmp_path, monkeypatch):
    """Bundle.load checks each archive's bytes and rebuilds no program (torch.export.load is
    most of a load); a program is rebuilt from the bytes that were checked when it first runs,
    whatever its file holds by then, and the programs a run never reaches are never rebuilt."""
    import collections

    from aotc.backends import export
    from aotc.models.loader import load_model
    from aotc.runtime import generate

    monkeypatch.setattr(export, "_ARCHIVES", collections.OrderedDict())  # no archive another test loaded
    rebuilt = []
    monkeypatch.setattr(export, "load_program", lambda data, load=export.load_program: rebuilt.append(data) or load(data))
    shutil.copytree(tiny_bundle.out, tmp_path / "b")
    bundle = Bundle.load(tmp_path / "b")
    assert rebuilt == []
    files = {(e.id, a.bucket, a.context): tmp_path / "b" / a.dir / "program.pt2" for e, a in bundle.manifest.artifacts()}
    checked = {key: path.read_bytes() for key, path in files.items()}
    for path in files.values():
        path.write_bytes(b"replaced after the load")
    model = load_model(tiny_dir).model
    bundle.bind(model)
    got = generate(model, [[1, 5, 9]], 3, max_batch=1, max_seq=bundle.max_seq, slots=bundle.cache_slots)
    Bundle.unbind(model)
    assert got.sequences[0].new_ids == generate(model, [[1, 5, 9]], 3, max_batch=1, max_seq=bundle.max_seq, slots=bundle.cache_slots).sequences[0].new_ids
    ran = [key for key in bundle.programs if checked[key] in rebuilt]
    # The prompt's chunk ran in the fresh form (from position 0), its decode at max_seq.
    assert len(rebuilt) == len(ran) and sorted(ran) == [("LMHead.forward", 1, None), ("LlamaDecoderLayer.decode", 1, 256), ("LlamaDecoderLayer.prefill_fresh", 16, None)], ran


def test_swapped_artifacts_are_refused_before_they_run(tiny_bundle, tmp_path):
    bundle = swapped_copy(tiny_bundle.out, tmp_path / "swapped")
    with pytest.raises(BundleError, match=r"is not LlamaDecoderLayer.decode bucket 1 context \d+ as the manifest says \(input \d+ is \(\[2,"):
        Bundle.load(bundle)


CROSSED = r"the artifact takes weight \d+ as 'mlp.gate_proj.weight', the entry lists 'mlp.up_proj.weight' there, so .*manifest.json would run it with other tensors"


def test_a_manifest_with_two_weights_crossed_is_refused(tiny_bundle, tmp_path):
    """gate_proj and up_proj (one shape) crossed in the manifest: each export program
    records which tensor each of its weight inputs is, so loading refuses it, naming it."""
    bundle = tmp_path / "crossed"
    shutil.copytree(tiny_bundle.out, bundle)
    cross_weights(bundle / "manifest.json")
    with pytest.raises(BundleError, match=r"entries/LlamaDecoderLayer\.\w+/b\d+\S*: " + CROSSED):
        Bundle.load(bundle)
    r = CliRunner().invoke(app, ["run", str(bundle), "--prompt", "hi"], env={"COLUMNS": "400"})
    assert r.exit_code == 2 and "the artifact takes weight" in r.output, r.output


@pytest.mark.parametrize("damage", ["truncated", "empty", "missing tensor", "config only"])
def test_warm_rebuild_still_checks_the_model_folder(model, tmp_path, damage):
    from safetensors.torch import load_file, save_file

    cache = tmp_path / "cache"
    build(BuildOptions(model, out=tmp_path / "a", cache_dir=cache, **OPTIONS))
    weights = model / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "empty":
        weights.write_bytes(b"")
    elif damage == "missing tensor":
        tensors = load_file(weights)
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, weights)
    else:
        weights.unlink()
    with pytest.raises(AotcError):
        build(BuildOptions(model, out=tmp_path / "b", cache_dir=cache, **OPTIONS))
    assert not (tmp_path / "b").exists()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tagged(tag: str) -> dict[int, tuple[str, str]]:
    """Live processes (pid: command name, command line) whose environment holds AOTC_TEST_RUN=tag: a
    build and everything it started, whoever their parent is now."""
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"AOTC_TEST_RUN={tag}".encode() in environ.read_bytes().split(b"\0") and _alive(int(environ.parent.name)):
                cmdline = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found[int(environ.parent.name)] = (environ.parent / "comm").read_text().strip(), cmdline
        except OSError:  # ended meanwhile
            continue
    return found


# A C++ compiler that takes 30 s per compile: the build is stopped while one runs, and a
# compiler left behind is still running a second after the build exits, whatever this
# machine's speed.
SLOW_CXX = '#!/bin/sh\ncase " $* " in *" -o "*) sleep 30 ;; esac\nexec g++ "$@"\n'


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
# Under slow, for CI's time (a minute each on a 2-core machine): SIGTERM, SIGINT (the CLI turns
# SIGTERM into KeyboardInterrupt: the same path) and SIGKILL (the workers' PDEATHSIG). CI stops
# a build mid-compile in test_cache.py (test_build_killed_mid_compile_leaves_nothing_served).
@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_stopped_parallel_build_leaves_no_process_compilers_included(model, tmp_path, how):
    """Stopped while its workers run the C++ compiler: one second after the build exits, nothing it
    started runs (each worker leads a process group with its compilers, and kills it when
    the build dies); no bundle; the next build to the same -o cleans what it left."""
    import signal
    import subprocess
    import sys
    import uuid

    from aotc.backends.inductor import InductorBackend

    if InductorBackend().can_compile() is not None:
        pytest.skip("needs a C++ compiler for AOTInductor")
    tag = uuid.uuid4().hex
    cxx = tmp_path / "slow-cxx"
    cxx.write_text(SLOW_CXX)
    cxx.chmod(0o755)
    args = [sys.executable, "-m", "aotc.cli", "build", str(model), "--backend", "inductor", "--jobs", "2", "--buckets", "1,2",
            "--prefill-chunk", "16", "--max-seq", "64", "--cache-dir", str(tmp_path / "cache"), "-o", str(tmp_path / "bundle")]  # fmt: skip
    # SIGINT as a terminal delivers it, even where pytest runs in the background (which hands
    # its children an ignored SIGINT, so Python would never raise KeyboardInterrupt).
    restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    system_tmp = tmp_path / "system-tmp"  # TMPDIR: what the build leaves outside its own folders
    system_tmp.mkdir()
    env = {**os.environ, "AOTC_TEST_RUN": tag, "CXX": str(cxx), "TMPDIR": str(system_tmp)}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, preexec_fn=restore)
    deadline, running = time.time() + 180, {}
    while time.time() < deadline and proc.poll() is None:  # both workers started, a compiler running
        running = _tagged(tag)
        workers = [p for p, (_, cmdline) in running.items() if "spawn_main" in cmdline]
        if len(workers) >= 2 and "slow-cxx" in {comm for comm, _ in running.values()}:
            break
        time.sleep(0.05)
    assert "slow-cxx" in {comm for comm, _ in running.values()}, f"the build never ran a compiler in a worker: {running}"
    proc.send_signal(getattr(signal, how))
    code = proc.wait(timeout=60)
    assert code == {"SIGKILL": -9}.get(how, 130)
    time.sleep(1)
    assert _tagged(tag) == {}, f"still running one second after the build exited: {_tagged(tag)}"
    assert not (tmp_path / "bundle").exists()
    assert [p.name for p in system_tmp.iterdir() if p.name.startswith("aotc")] == []  # its temp folders are in its staging
    build(BuildOptions(model, out=tmp_path / "bundle", cache_dir=tmp_path / "cache", **OPTIONS))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".bundle")) == []  # the writers' lock is in the cache's locks/
    leftover = [p.name for p in (tmp_path / "cache" / "tmp").glob("*")] if (tmp_path / "cache" / "tmp").is_dir() else []
    assert leftover == [] or how == "SIGKILL", leftover  # a stop cleans up at once; SIGKILL's are pruned later


def test_a_script_that_builds_at_its_top_level_fails_naming_the_fix_and_does_not_hang(model, tmp_path):
    """A script without `if __name__ == "__main__":` that calls build(): each compile worker
    (spawned) imports the script again, whose build() would wait forever on the writer's lock
    that the parent holds while the parent waits for the worker. That second call is refused:
    the build fails, naming the fix, and writes no bundle."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    options = f"{str(model)!r}, out={str(tmp_path / 'bundle')!r}, backend='export', batch_buckets=(1,), chunk_buckets=(16,), max_seq=64, jobs=2, use_cache=False"
    script.write_text(f"from aotc.builder import BuildOptions, build\n\nbuild(BuildOptions({options}))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and 'Put that call under `if __name__ == "__main__":`' in done.stderr, done.stderr[-2000:]
    assert "AotcError: a compile worker ended before its graph was compiled" in done.stderr.splitlines()[-1]
    assert not (tmp_path / "bundle").exists()


def test_cache_records_and_recipes_never_lead_outside(model, tmp_path):
    cache = tmp_path / "cache"
    build(BuildOptions(model, out=tmp_path / "a", cache_dir=cache, **OPTIONS))
    (recipe,) = (cache / "builds").glob("*.json")
    data = json.loads(recipe.read_text())
    data["entries"][0]["artifacts"][0]["dir"] = "entries/../../escaped/b1"
    recipe.write_text(json.dumps(data))
    result = build(BuildOptions(model, out=tmp_path / "b", cache_dir=cache, **OPTIONS))
    assert result.graphs_traced == 4  # the recipe was a miss: traced and served from the cache
    assert not (tmp_path / "escaped").exists() and not any(tmp_path.rglob("escaped"))
    record = next((cache / "entries").glob("*/*/record.json"))
    data = json.loads(record.read_text())
    data["files"] = {"../../../../outside.txt": next(iter(data["files"].values()))}
    record.write_text(json.dumps(data))
    # A record that leads outside is a corrupt entry: never followed, reported, compiled again.
    result = build(BuildOptions(model, out=tmp_path / "c", cache_dir=cache, use_cache=True, **OPTIONS))
    assert any("is not a file name" in note and "compiled again" in note for note in result.cache_notes), result.cache_notes
    assert not (tmp_path / "outside.txt").exists()
    assert Bundle.load(result.out)  # and the bundle is whole


def test_model_folder_may_be_a_symlink(model, tmp_path):
    (tmp_path / "snapshot").symlink_to(model)
    result = build(BuildOptions(tmp_path / "snapshot", out=tmp_path / "b", use_cache=False, **OPTIONS))
    assert Bundle.load(result.out).manifest.model.source == str((tmp_path / "snapshot").resolve())


def test_loading_reads_nothing_outside_the_bundle(tiny_bundle):
    """Nothing but the bundle's files, each read once (into the checked copy), and that copy."""
    Bundle.load(tiny_bundle.out)  # imports done: what remains to read is the bundle
    seen: list[str] = []
    hook_on[0] = seen
    try:
        bundle = Bundle.load(tiny_bundle.out)
    finally:
        hook_on[0] = None
    root, temp = tiny_bundle.out.resolve(), Path(tempfile.gettempdir()).resolve()

    def in_copy(p: Path) -> bool:  # this process's checked copy (removed once loaded: export)
        return p.is_relative_to(temp) and p.relative_to(temp).parts[0].startswith(f"aotc-bundle-{os.getpid()}-")

    # The copy's removal (rmtree) opens each of its folders by name, relative to its parent's descriptor.
    folders = {p.name for p in root.rglob("*") if p.is_dir()}
    seen = [p for p in seen if p not in folders]
    outside = [p for p in seen if not Path(p).resolve().is_relative_to(root) and not in_copy(Path(p).resolve())]
    assert seen and not outside, outside
    in_bundle = [Path(p).resolve().relative_to(root).as_posix() for p in seen if Path(p).resolve().is_relative_to(root)]
    files = [f"{a.dir}/{name}" for _, a in bundle.manifest.artifacts() for name in a.files]
    assert sorted(in_bundle) == sorted(["manifest.json", *files])  # each once: what is loaded is the copy checked


def test_an_artifact_swapped_after_its_check_is_never_loaded(tiny_bundle, tmp_path, monkeypatch):
    """A program replaced in the bundle folder right after aotc hashed it (as a watcher of
    the folder can): the program loaded is the one whose hash was checked."""
    from aotc.backends.export import ExportBackend
    from aotc.format import artifact_dir
    from aotc.models.loader import load_model

    bundle_dir = tmp_path / "b"
    shutil.copytree(tiny_bundle.out, bundle_dir)
    target = bundle_dir / artifact_dir("LMHead.forward", 1, None) / "program.pt2"

    def other_eps(name, data):  # the same graph with the final norm's eps at 0.5
        return data.replace(b'{"as_float": 1e-05}', b'{"as_float": 0.5}') if name.endswith("models/model.json") else data

    signature = ExportBackend.signature
    swapped = []

    def swap_then_sign(self, art_dir):
        if not swapped and Path(art_dir).as_posix().endswith("LMHead.forward/b1"):  # this one was just hashed
            _rewrite_program(target, other_eps)
            swapped.append(target.read_bytes())
        return signature(self, art_dir)

    monkeypatch.setattr(ExportBackend, "signature", swap_then_sign)
    bundle = Bundle.load(bundle_dir)
    assert swapped and b'"as_float": 0.5' in zipfile_member(target, "models/model.json")  # the folder holds the other program now
    loaded = load_model(tiny_bundle.manifest.model.source)
    h = torch.randn(1, 256)
    want = loaded.model.head(h)
    bundle.bind(loaded.model)
    torch.testing.assert_close(loaded.model.head(h), want)  # eps 1e-5, as hashed


def zipfile_member(path, suffix) -> bytes:
    import zipfile

    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(suffix)))


hook_on: list = [None]


def _audit(event, args):
    if event != "open" or hook_on[0] is None:
        return
    if isinstance(args[0], (str, bytes, os.PathLike)):
        hook_on[0].append(os.fsdecode(args[0]))


import sys  # noqa: E402

sys.addaudithook(_audit)
