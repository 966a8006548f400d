"""The compile cache: keys, hits and misses, faults, concurrency, CLI, remote, shards."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from aotc.backends.export import ExportBackend
from aotc.backends.inductor import InductorBackend
from aotc.builder import BuildOptions, build, build_keys
from aotc.cache import CacheError, LocalCache
from aotc.cli import app
from aotc.errors import AotcError
from aotc.format import CompiledRecord
from aotc.models.tiny import write_tiny

# A chunk as long as max_seq: no chunk context (builder.plan._chunk_contexts), one artifact per (entry, bucket).
OPTIONS = dict(batch_buckets=(1, 2), chunk_buckets=(64,), max_seq=64, backend="export")
ROOT = Path(__file__).resolve().parent.parent


def keys(model, **changes):
    """By (entry, bucket), at context max_seq (64, the one context bucket) or none: a chunk
    below it (chunk_buckets=(32, 64)) is also at the chunk context 32, left out here."""
    found = build_keys(BuildOptions(model, **{**OPTIONS, **changes}))
    assert {c for _, _, c, _ in found} <= {None, 64, 32}
    return {(e, b): k for e, b, c, k in found if c in (None, 64)}


@pytest.fixture(scope="module")
def base_keys(tiny_dir):
    return keys(tiny_dir)


def test_weights_and_paths_do_not_change_keys(tiny_dir, base_keys, tmp_path):
    retrained = write_tiny(tmp_path / "elsewhere" / "retrained", layers=2, seed=99)
    assert (retrained / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
    assert keys(retrained) == base_keys  # other weight values, other folder


def test_shapes_buckets_flags_and_versions_change_keys(tiny_dir, base_keys, tmp_path, monkeypatch):
    wider = write_tiny(tmp_path / "wider", layers=2, intermediate_size=704)
    changed = keys(wider)
    assert changed[("LlamaDecoderLayer.decode", 1)] != base_keys[("LlamaDecoderLayer.decode", 1)]
    assert changed[("LMHead.forward", 1)] == base_keys[("LMHead.forward", 1)]  # the head's shapes did not change

    rebucketed = keys(tiny_dir, chunk_buckets=(32, 64))
    assert rebucketed[("LlamaDecoderLayer.prefill", 64)] == base_keys[("LlamaDecoderLayer.prefill", 64)]
    assert rebucketed[("LlamaDecoderLayer.prefill", 32)] not in base_keys.values()
    # A larger batch bucket also grows the cache pool (slots), so every layer graph changes.
    assert keys(tiny_dir, batch_buckets=(1, 4))[("LlamaDecoderLayer.decode", 1)] != base_keys[("LlamaDecoderLayer.decode", 1)]

    plain = keys(tiny_dir, backend="inductor")
    flagged = keys(tiny_dir, backend="inductor", compiler_flags={"cpp.simdlen": 256})
    assert set(plain.values()).isdisjoint(flagged.values())

    monkeypatch.setattr(ExportBackend, "version", lambda self: "torch-0.0-other")
    assert set(keys(tiny_dir).values()).isdisjoint(base_keys.values())
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert set(keys(tiny_dir).values()).isdisjoint(base_keys.values())


def test_second_build_hits_and_output_folder_does_not_matter(tiny_dir, tmp_path):
    cache = tmp_path / "cache"
    first = build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=cache, **OPTIONS))
    assert (first.count("compiled"), first.count("cache")) == (6, 0)
    second = build(BuildOptions(tiny_dir, out=tmp_path / "b", cache_dir=cache, **OPTIONS))
    assert (second.count("compiled"), second.count("cache")) == (0, 6)
    assert second.graphs_traced == 0  # assembled from the recipe: nothing traced
    a = {e.id: [x.files for x in e.artifacts] for e in first.manifest.entries}
    b = {e.id: [x.files for x in e.artifacts] for e in second.manifest.entries}
    assert a == b
    # Without the recipe, the keys alone still hit.
    shutil.rmtree(cache / "builds")
    third = build(BuildOptions(tiny_dir, out=tmp_path / "c", cache_dir=cache, **OPTIONS))
    assert (third.count("compiled"), third.count("cache"), third.graphs_traced) == (0, 6, 6)


def test_corrupt_cache_entry_is_a_reported_miss_naming_the_file(tiny_dir, tmp_path):
    cache = tmp_path / "cache"
    build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=cache, **OPTIONS))
    victim = next((cache / "entries").rglob("program.pt2"))
    victim.write_bytes(victim.read_bytes()[:100])
    shutil.rmtree(cache / "builds")
    result = build(BuildOptions(tiny_dir, out=tmp_path / "b", cache_dir=cache, **OPTIONS))
    (note,) = result.cache_notes
    assert re.match(rf"{re.escape(str(victim))}: sha256 differs.*; compiled again$", note), note
    assert result.count("compiled") == 1 and LocalCache(cache).get(victim.parent.name) is not None  # replaced by a good one


def aotc(*args, env=None, check=True):
    return subprocess.run([sys.executable, "-m", "aotc.cli", *map(str, args)], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200", **(env or {})}, check=check)


def cpu_ticks(pid: int) -> int:
    """User plus system CPU time of a process, in clock ticks (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_until_all_idle(procs, timeout=240.0) -> None:
    """Until every process has done its start-up work and then sits idle for a second:
    a build idles only while it waits on a cache lock."""
    deadline = time.time() + timeout
    before = [cpu_ticks(p.pid) for p in procs]
    while time.time() < deadline:
        time.sleep(1.0)
        assert all(p.poll() is None for p in procs), "a build finished while every key's lock was held"
        now = [cpu_ticks(p.pid) for p in procs]
        if all(n - b <= 3 and n > 100 for n, b in zip(now, before)):
            return
        before = now
    raise AssertionError("the builds never all waited on the locks")


def test_two_concurrent_builds_compile_each_entry_once(tiny_dir, tmp_path):
    """The two builds provably overlap: the test holds every key's lock until both
    wait on it, then lets go. Each entry is then compiled by exactly one of them."""
    cache = tmp_path / "cache"
    options = dict(batch_buckets=(1, 2, 4, 8), chunk_buckets=(16, 32), max_seq=64, backend="export")
    args = ["build", tiny_dir, "--backend", "export", "--buckets", "1,2,4,8", "--prefill-chunk", "16,32", "--max-seq", "64", "--cache-dir", cache]
    held = [LocalCache(cache).lock(key) for key in sorted({k for *_, k in build_keys(BuildOptions(tiny_dir, **options))})]
    assert len(held) == 15  # 4 decode + 2 prefill at the context and 3 at the chunk contexts (16 at 16 and 32, 32 at 32) + 2 fresh + 4 head
    for lock in held:
        lock.acquire()
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "aotc.cli", *map(str, args), "-o", tmp_path / f"b{i}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "COLUMNS": "200"},
            )
            for i in range(2)
        ]
        wait_until_all_idle(procs)
    finally:
        for lock in held:
            lock.release()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    compiled = [int(re.search(r"(\d+) misses compiled", out).group(1)) for out, _ in outs]
    hits = [int(re.search(r"cache: (\d+) hits", out).group(1)) for out, _ in outs]
    assert sum(compiled) == 15 and [c + h for c, h in zip(compiled, hits)] == [15, 15], outs
    assert len(LocalCache(cache).entries()) == 15


@pytest.mark.skipif(InductorBackend().can_compile() is not None, reason="no C++ compiler for AOTInductor")
def test_build_killed_mid_compile_leaves_nothing_served(tiny_dir, tmp_path):
    cache = tmp_path / "cache"
    args = [
        "build",
        tiny_dir,
        "--backend",
        "inductor",
        "--jobs",
        "1",
        "--buckets",
        "1",
        "--prefill-chunk",
        "64",
        "--max-seq",
        "64",
        "--cache-dir",
        cache,
        "-o",
        tmp_path / "bundle",
    ]
    proc = subprocess.Popen([sys.executable, "-m", "aotc.cli", *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not any((cache / "tmp").glob("*")):  # a compile has started
        time.sleep(0.05)
    time.sleep(1.0)  # well inside the compile (seconds long)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert any((cache / "tmp").glob("*")), "the kill was supposed to land mid-compile"
    assert not (tmp_path / "bundle").exists()  # no half-written bundle either
    assert not any(tmp_path.glob(".bundle.tmp-*/manifest.json"))
    # Nothing the killed compile wrote is served: a cache-only build finds it missing.
    r = aotc(*args, "--require-cache", check=False)
    assert r.returncode == 2 and "are not in the cache" in r.stderr
    for entry in LocalCache(cache).entries():  # whatever was published is complete and verified
        assert LocalCache(cache).get(entry.key) is not None


def test_cache_cli_key_ls_prune_and_require_cache(tiny_dir, tmp_path):
    runner = CliRunner()
    cache = tmp_path / "cache"
    common = [str(tiny_dir), "--backend", "export", "--buckets", "1,2", "--prefill-chunk", "64", "--max-seq", "64"]
    key = runner.invoke(app, ["cache", "key", *common]).output.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert runner.invoke(app, ["cache", "key", *common]).output.strip() == key
    assert runner.invoke(app, ["cache", "key", *common[:-2], "--max-seq", "128"]).output.strip() != key

    r = runner.invoke(app, ["build", *common, "--cache-dir", str(cache), "--require-cache", "-o", str(tmp_path / "b")])
    assert r.exit_code == 2
    assert "--require-cache: 6 of 6 artifacts are not in the cache" in " ".join(r.output.split())
    assert "LlamaDecoderLayer.decode bucket 1" in r.output

    assert runner.invoke(app, ["build", *common, "--cache-dir", str(cache), "-o", str(tmp_path / "b")]).exit_code == 0
    r = runner.invoke(app, ["build", *common, "--cache-dir", str(cache), "--require-cache", "-o", str(tmp_path / "c")], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "6 hits, 0 misses" in r.output

    r = runner.invoke(app, ["cache", "ls", "--cache-dir", str(cache)], env={"COLUMNS": "200"})
    assert "6 entries" in r.output and "program.pt2" in r.output
    # Each entry says what it was compiled for (the finished build's recipe), and --filter picks.
    rows = [line for line in r.output.splitlines() if "program.pt2" in line]
    assert all(tiny_dir.name in row and "export" in row for row in rows) and sum("LlamaDecoderLayer.decode bucket" in row for row in rows) == 2, rows
    r = runner.invoke(app, ["cache", "ls", "--cache-dir", str(cache), "--filter", "LMHead.forward"], env={"COLUMNS": "200"})
    assert "2 entries" in r.output and "LlamaDecoderLayer" not in r.output, r.output
    r = runner.invoke(app, ["cache", "ls", "--cache-dir", str(cache), "--filter", "inductor"], env={"COLUMNS": "200"})
    assert "0 entries" in r.output
    r = runner.invoke(app, ["cache", "prune", "--max-size", "0", "--cache-dir", str(cache)])
    assert r.exit_code == 0 and "removed 6 entries" in r.output
    assert LocalCache(cache).entries() == []
    assert runner.invoke(app, ["cache", "prune", "--max-size", "lots", "--cache-dir", str(cache)]).exit_code == 2


def test_prune_keeps_the_most_recently_used(tiny_dir, tmp_path):
    cache = LocalCache(tmp_path / "cache")
    build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=cache.root, **OPTIONS))
    entries = sorted(cache.entries(), key=lambda e: e.size)
    now = time.time()
    for i, e in enumerate(entries):
        os.utime(e.dir / "record.json", (now - 1000 + i, now - 1000 + i))
    keep, dropped = entries[-1], sum(e.size for e in entries[:-1])
    removed, freed = cache.prune(keep.size)
    assert removed == len(entries) - 1 and [e.key for e in cache.entries()] == [keep.key]
    assert freed == dropped  # the bytes it reports are the bytes it deleted
    assert keep.dir == cache.root / "entries" / keep.key[:2] / keep.key  # the layout aotc/cache/local.py documents


def fake_record(files: dict[str, str], key: str) -> CompiledRecord:
    return CompiledRecord(files=files, inputs=[], outputs=[], form="static", export_s=0.0, compile_s=0.0, cache_key=key, passes=[], extra={})


def test_put_clears_what_a_killed_compile_of_the_key_left_and_checks_what_it_publishes(tmp_path):
    import hashlib

    cache, key = LocalCache(tmp_path / "cache"), "ab" * 32
    cache.claim()  # a cache aotc made, which a killed compile left things in
    stale, other = cache.root / "tmp" / f"{key[:16]}-dead", cache.root / "tmp" / ("cd" * 8 + "-alive")
    for folder in (stale, other):
        folder.mkdir(parents=True)
        (folder / "program.pt2").write_bytes(b"half")

    def make(tmp):
        (tmp / "program.pt2").write_bytes(b"whole")
        return fake_record({"program.pt2": hashlib.sha256(b"whole").hexdigest()}, key)

    entry = cache.put(key, make)
    assert not stale.exists() and other.exists()  # only this key's leftovers: another key's compile may be running
    assert cache.get(key).record.files == entry.record.files
    with pytest.raises(CacheError, match=r"/model.so: missing while being written to the cache"):
        cache.put("ef" * 32, lambda tmp: fake_record({"model.so": "0" * 64}, "ef" * 32))
    assert cache.get("ef" * 32) is None


def test_a_corrupt_record_is_left_out_of_the_listing(tiny_dir, tmp_path):
    cache = LocalCache(tmp_path / "cache")
    build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=cache.root, **OPTIONS))
    first, *rest = cache.entries()
    (first.dir / "record.json").write_text("{not json")
    assert [e.key for e in cache.entries()] == [e.key for e in rest]


# -- remote cache on a real S3-compatible server, on loopback ---------------------


@pytest.fixture()
def s3(monkeypatch):
    moto_server = pytest.importorskip("moto.server", reason="moto[server] provides the local S3 server (test extra)")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    boto3.client("s3").create_bucket(Bucket="aotc")
    yield env
    server.stop()


def test_remote_write_back_then_read_through(tiny_dir, tmp_path, s3):
    first = build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=tmp_path / "c1", remote_cache="s3://aotc/ci", **OPTIONS))
    assert first.count("compiled") == 6 and not first.remote_errors
    second = build(BuildOptions(tiny_dir, out=tmp_path / "b", cache_dir=tmp_path / "c2", remote_cache="s3://aotc/ci", **OPTIONS))
    assert second.count("remote") == 6 and second.count("compiled") == 0
    assert len(LocalCache(tmp_path / "c2").entries()) == 6  # verified copies in the local cache


def test_remote_that_is_down_never_fails_the_build(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    result = build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=tmp_path / "c", remote_cache="s3://aotc/ci", **OPTIONS))
    assert result.count("compiled") == 6 and result.remote_errors
    assert len(LocalCache(tmp_path / "c").entries()) == 6


@pytest.fixture(autouse=True)
def fresh_remote_clients():
    """A build keeps one remote client per URL for its process; tests must not share them."""
    from aotc.builder.obtain import remote_client

    remote_client.cache_clear()
    yield
    remote_client.cache_clear()


def test_remote_refusing_writes_is_reported_and_local_cache_is_intact(tiny_dir, tmp_path, s3, monkeypatch):
    """Reads answer (every key a miss); every upload is refused: the build compiles, says so, keeps its cache."""
    from botocore.exceptions import ClientError

    from aotc.cache.remote import RemoteCache

    def refuse(self, *args, **kwargs):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "writes refused"}}, "PutObject")

    refused = []
    real_store = RemoteCache.store

    def store(self, key, folder, record):
        monkeypatch.setattr(self.client, "upload_file", lambda *a, **k: refused.append(key) or refuse(self))
        return real_store(self, key, folder, record)

    monkeypatch.setattr(RemoteCache, "store", store)
    result = build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=tmp_path / "c", remote_cache="s3://aotc/x", **OPTIONS))
    assert result.count("compiled") == 6 and len(refused) == 1  # the first refusal marks the remote down
    assert any(e.startswith("put ") and "AccessDenied" in e for e in result.remote_errors), result.remote_errors
    cache = LocalCache(tmp_path / "c")
    assert len(cache.entries()) == 6 and all(cache.get(e.key) for e in cache.entries())


def test_remote_bucket_missing_is_reported_and_local_cache_is_intact(tiny_dir, tmp_path, s3):
    runner = CliRunner()
    r = runner.invoke(
        app,
        [
            "build",
            str(tiny_dir),
            "--backend",
            "export",
            "--buckets",
            "1,2",
            "--prefill-chunk",
            "64",
            "--max-seq",
            "64",
            "--cache-dir",
            str(tmp_path / "c"),
            "--remote-cache",
            "s3://no-such-bucket/x",
            "-o",
            str(tmp_path / "a"),
        ],
        env={"COLUMNS": "200", **s3},
    )
    assert r.exit_code == 0, r.output
    assert "remote cache unavailable, build went on without it" in r.output and "NoSuchBucket" in r.output
    cache = LocalCache(tmp_path / "c")
    assert len(cache.entries()) == 6 and all(cache.get(e.key) for e in cache.entries())


# -- sharded builds, and the CI workflow's commands ----------------------------------


def test_shards_then_assemble_from_hits_alone(tiny_dir, tmp_path):
    cache = tmp_path / "cache"
    shards = [build(BuildOptions(tiny_dir, out=tmp_path / "unused", cache_dir=cache, shard=(i, 2), **OPTIONS)) for i in (1, 2)]
    assert [s.out for s in shards] == [None, None] and not (tmp_path / "unused").exists()
    mine = [{(a.entry_id, a.bucket) for a in s.artifacts} for s in shards]
    assert mine[0].isdisjoint(mine[1]) and len(mine[0] | mine[1]) == 6
    assert abs(len(mine[0]) - len(mine[1])) <= 1
    final = build(BuildOptions(tiny_dir, out=tmp_path / "bundle", cache_dir=cache, require_cache=True, **OPTIONS))
    assert final.count("cache") == 6 and final.count("compiled") == 0


@pytest.mark.slow  # 35 s of subprocess builds; its steps run in CI one by one (test_shards_then_assemble_from_hits_alone)
def test_ci_workflow_commands_run_locally(tiny_dir, tmp_path):
    """docs/ci/github-actions.yml runs docs/ci/aotc-ci.sh; run it the same way: key, 2 shards, assemble."""
    script = ROOT / "docs" / "ci" / "aotc-ci.sh"
    workflow = (ROOT / "docs" / "ci" / "github-actions.yml").read_text()
    for step in ("docs/ci/aotc-ci.sh key", "docs/ci/aotc-ci.sh shard", "docs/ci/aotc-ci.sh assemble", "matrix", "actions/cache"):
        assert step in workflow
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "AOTC_BUILD_ARGS": "--backend export --buckets 1,2 --prefill-chunk 64 --max-seq 64", "COLUMNS": "200"}
    run = lambda *a, cache: subprocess.run(["bash", str(script), *map(str, a)], env={**env, "AOTC_CACHE_DIR": str(cache)}, capture_output=True, text=True, check=True)  # noqa: E731
    key = run("key", tiny_dir, cache=tmp_path / "none").stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    for i in (1, 2):  # two runners, two caches, as the matrix has
        run("shard", tiny_dir, i, 2, cache=tmp_path / f"cache{i}")
    merged = tmp_path / "merged"
    for i in (1, 2):  # what download-artifact with merge-multiple does with the uploaded paths
        shutil.copytree(tmp_path / f"cache{i}" / "entries", merged / "entries", dirs_exist_ok=True)
        shutil.copy(tmp_path / f"cache{i}" / "CACHEDIR.TAG", merged / "CACHEDIR.TAG")
    for path in ("- .aotc-cache/entries", "- .aotc-cache/CACHEDIR.TAG"):
        assert path.removeprefix("- ") in workflow
    out = run("assemble", tiny_dir, tmp_path / "bundle", cache=merged).stdout
    assert "5 hits, 0 misses" in out and "every token matches eager" in out
    assert json.loads((tmp_path / "bundle" / "manifest.json").read_text())["graphs_traced"] == 6


def test_require_cache_build_traces_and_keys_each_graph_once(tiny_dir, tmp_path, monkeypatch):
    """The key stage traces every (variant, bucket) once; nothing after it traces or keys again."""
    import aotc.builder.key as key_stage

    cache = tmp_path / "cache"
    first = build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=cache, **OPTIONS))
    shutil.rmtree(cache / "builds")  # no recipe: the deploy build below must trace
    exports, keys_made = [], []
    real_export, real_key = torch.export.export, key_stage.cache_key
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or real_export(*a, **k))
    monkeypatch.setattr(key_stage, "cache_key", lambda *a, **k: keys_made.append(1) or real_key(*a, **k))
    second = build(BuildOptions(tiny_dir, out=tmp_path / "b", cache_dir=cache, require_cache=True, **OPTIONS))
    assert second.count("cache") == len(second.artifacts) == first.graphs_traced == 6
    assert len(exports) == len(keys_made) == 6


def test_sizes_are_decimal_as_printed_and_binary_when_spelled_out():
    from aotc.cache import format_size, parse_size

    assert [parse_size(t) for t in ("0", "500M", "2G", "2GB", "1.5GiB", "100k")] == [0, 500 * 10**6, 2 * 10**9, 2 * 10**9, int(1.5 * 2**30), 100_000]
    for bad in ("5iB", "lots", "-1G"):
        with pytest.raises(AotcError, match="expected a size such as 500M"):
            parse_size(bad)
    assert format_size(2 * 10**9) == "2.0 GB" and parse_size(format_size(2 * 10**9).replace(" ", "")) == 2 * 10**9


def test_prune_removes_what_killed_builds_left_and_counts_its_bytes(tmp_path):
    cache = LocalCache(tmp_path / "cache")
    cache.claim()
    old, fresh = cache.root / "tmp" / "0123456789abcdef-old", cache.root / "tmp" / "0123456789abcdef-new"
    for folder in (old, fresh):
        folder.mkdir(parents=True)
        (folder / "model.so").write_bytes(b"x" * 1000)
    (old / "elsewhere").symlink_to(tmp_path)  # a link is neither followed nor counted
    hour_ago = time.time() - 3700
    os.utime(old, (hour_ago, hour_ago))
    assert cache.prune(10**9) == (0, 1000)  # no entry removed; the killed build's 1000 bytes freed
    assert not old.exists() and fresh.exists() and tmp_path.exists()  # a compile younger than an hour may be running


def test_a_private_folder_is_this_users_alone_and_prune_counts_it_with_the_entries(tmp_path):
    """jax/<digest> is where JAX's compilation cache goes (JAX runs what it finds there):
    made 0700; a level that others can open, or a link, is not used; prune drops it with
    the compiled entries, least recently written first."""
    cache = LocalCache(tmp_path / "cache")
    folder = cache.private("jax", "d1")
    assert folder == cache.root / "jax" / "d1" and cache.made_by_aotc()
    assert [oct(p.stat().st_mode & 0o777) for p in (folder.parent, folder)] == ["0o700", "0o700"]
    (folder / "exe").write_bytes(b"x" * 1000)
    old = cache.private("jax", "d0")
    (old / "exe").write_bytes(b"y" * 500)
    os.utime(old / "exe", (time.time() - 60, time.time() - 60))
    os.chmod(folder, 0o750)
    assert cache.private("jax", "d1") is None  # group can read it: not private
    os.chmod(folder, 0o700)
    (cache.root / "jax" / "linked").symlink_to(tmp_path)
    assert cache.private("jax", "linked") is None
    assert cache.prune(1000) == (1, 500)  # the least recently written goes first
    assert not old.exists() and folder.exists() and tmp_path.exists()
    assert cache.prune(0) == (1, 1000) and not folder.exists()
    other = LocalCache(tmp_path)  # holds files aotc did not make: never claimed
    assert other.private("jax", "d1") is None and not (tmp_path / "jax").exists()


def test_source_digest_follows_every_python_file_and_nothing_else(tmp_path):
    from aotc.cache.keys import _source_digest

    digest = _source_digest.__wrapped__  # the cached one holds per process; this reads the files
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 2\n")
    before = digest(tmp_path / "pkg")
    (tmp_path / "pkg" / "notes.txt").write_text("not code")
    assert digest(tmp_path / "pkg") == before
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 3\n")
    assert digest(tmp_path / "pkg") != before
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "pkg" / "sub" / "b.py").rename(tmp_path / "pkg" / "sub" / "c.py")
    assert digest(tmp_path / "pkg") != before  # a file's path is part of it too


def test_a_config_with_its_fields_in_another_order_is_the_same_recipe(tiny_dir):
    from aotc.cache.keys import recipe_key
    from aotc.models.loader import load_model

    options = BuildOptions(tiny_dir, **OPTIONS)
    config, model_class, backend = load_model(tiny_dir, weights=False).config_dict, LocalCache, ExportBackend()
    reordered = dict(reversed(list(config.items())))
    assert list(reordered) != list(config)
    assert recipe_key(options, reordered, model_class, backend) == recipe_key(options, config, model_class, backend)
    assert recipe_key(options, {**config, "rms_norm_eps": 1e-3}, model_class, backend) != recipe_key(options, config, model_class, backend)


def test_each_build_keeps_its_own_recipe(tiny_dir, tmp_path):
    cache = tmp_path / "cache"
    for buckets in ((1,), (1, 2)):
        build(BuildOptions(tiny_dir, out=tmp_path / f"b{len(buckets)}", cache_dir=cache, **{**OPTIONS, "batch_buckets": buckets}))
    assert len(list((cache / "builds").glob("*.json"))) == 2
    again = build(BuildOptions(tiny_dir, out=tmp_path / "again", cache_dir=cache, **{**OPTIONS, "batch_buckets": (1,)}))
    assert again.graphs_traced == 0  # the first build's recipe, still there after the second


@pytest.mark.parametrize("tamper", ["entry id", "folder", "file name", "entry record"])
def test_a_recipe_that_points_anywhere_aotc_would_not_write_is_a_miss(tiny_dir, tmp_path, tamper):
    from aotc.cache.recipes import load_recipe

    cache = LocalCache(tmp_path / "cache")
    build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=cache.root, **OPTIONS))
    (recipe_file,) = (cache.root / "builds").glob("*.json")
    recipe = recipe_file.stem
    assert load_recipe(cache, recipe) is not None
    manifest = json.loads(recipe_file.read_text())
    entry = manifest["entries"][0]
    art = entry["artifacts"][0]
    if tamper == "entry id":
        entry["id"] = "../escape"
    elif tamper == "folder":
        art["dir"] = "../../elsewhere"
    elif tamper == "file name":
        art["files"] = {"../model.so": next(iter(art["files"].values()))}
    else:  # the recipe is intact; an artifact's cache record is not
        (cache.path(art["cache_key"]) / "record.json").write_text("{not json")
    recipe_file.write_text(json.dumps(manifest))
    if tamper in ("file name", "entry id"):  # the manifest reader already refuses it: a reported miss in the build
        with pytest.raises(CacheError, match=r"files" if tamper == "file name" else r"entries\[0\]\.id: '\.\./escape'"):
            load_recipe(cache, recipe)
    else:
        assert load_recipe(cache, recipe) is None


def test_a_recipe_with_two_weights_crossed_is_a_reported_miss(tiny_dir, tmp_path):
    """A shared cache's recipe with gate_proj and up_proj crossed: each artifact's own
    record of its weights disagrees, so the build says so and traces; what it writes
    then (bundle and recipe) has the weights as compiled."""
    from aotc.runtime import Bundle

    from .conftest import cross_weights

    cache = tmp_path / "cache"
    first = build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=cache, **OPTIONS))
    (recipe,) = (cache / "builds").glob("*.json")
    cross_weights(recipe)
    again = build(BuildOptions(tiny_dir, out=tmp_path / "b", cache_dir=cache, **OPTIONS))
    assert again.graphs_traced > 0
    assert any(f"{recipe}: LlamaDecoderLayer." in n and "the artifact takes weight" in n and n.endswith("built the normal way") for n in again.notes), again.notes
    assert [e.weights for e in again.manifest.entries] == [e.weights for e in first.manifest.entries]
    Bundle.load(again.out)
    assert build(BuildOptions(tiny_dir, out=tmp_path / "c", cache_dir=cache, **OPTIONS)).graphs_traced == 0  # the recipe written again


@pytest.mark.parametrize("url", ["https://aotc/ci", "s3:///ci", "s3:ci"])
def test_remote_url_must_name_an_s3_bucket(url):
    from aotc.cache.remote import RemoteCache

    with pytest.raises(AotcError, match=r"expected s3://bucket/prefix"):
        RemoteCache(url)


def test_remote_without_boto3_says_what_to_install(monkeypatch):
    from aotc.cache.remote import RemoteCache

    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 now raises ImportError
    with pytest.raises(AotcError, match=r"needs boto3: pip install 'aotc\[s3\]'"):
        RemoteCache("s3://aotc/ci")


def test_remote_entry_with_a_file_missing_or_changed_is_a_reported_miss(tiny_dir, tmp_path, s3):
    import boto3

    from aotc.cache.remote import RemoteCache

    client = boto3.client("s3")
    client.create_bucket(Bucket="aotc-tampered")  # moto keeps buckets per process, across servers: one of its own
    build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=tmp_path / "c1", remote_cache="s3://aotc-tampered/ci", **OPTIONS))
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="aotc-tampered")["Contents"]]
    gone, changed = [k for k in keys if not k.endswith("record.json")][:2]
    client.delete_object(Bucket="aotc-tampered", Key=gone)
    client.put_object(Bucket="aotc-tampered", Key=changed, Body=b"not what the record says")
    for victim in (gone, changed):
        remote = RemoteCache("s3://aotc-tampered/ci")
        key = victim.split("/")[1]
        into = tmp_path / key
        into.mkdir()
        assert remote.fetch(key, into) is None
        (said,) = remote.errors
        assert said.startswith(f"get {key}: ")
        if victim == changed:
            assert said.endswith("sha256 differs from its record (changed or truncated); ignored") and not remote.down
        else:
            assert "ClientError" in said and remote.down  # a download that fails: the remote is not asked again


class _Loop(torch.nn.Module):
    """A loop whose body is a graph of its own (a whole step's shape, smaller)."""

    def forward(self, x, w):
        def more(i, x):
            return i < w.shape[0]

        def body(i, x):
            return i + 1, x @ w.select(0, i.item()) + 1

        with torch.no_grad():
            return torch.while_loop(more, body, (torch.zeros((), dtype=torch.long), x))[1]


def test_a_change_inside_a_loops_body_changes_the_key():
    """The graph's code names its loop's body without its code: a body that computes
    something else must not be served another's artifact."""
    from types import SimpleNamespace

    from aotc.cache.keys import cache_key
    from aotc.passes.base import loop_bodies

    gm = torch.export.export(_Loop(), (torch.randn(2, 4), torch.randn(3, 4, 4)), strict=False).graph_module
    graph = SimpleNamespace(graph_module=gm, inputs=[], outputs=[])
    before, code = cache_key(graph, ExportBackend()), gm.code
    body = loop_bodies(gm)[0]
    add = next(n for n in body.graph.nodes if n.target is torch.ops.aten.add.Tensor and 1 in n.args)
    add.target = torch.ops.aten.sub.Tensor
    body.recompile()
    assert gm.code == code and cache_key(graph, ExportBackend()) != before
