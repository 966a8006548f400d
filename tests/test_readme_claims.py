"""README and docs claims that no other test checks, each against what the code really does."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from aotc.builder import BuildOptions, build, build_keys
from aotc.cli import app
from aotc.cli.run import DEFAULT_PROMPTS

OPTIONS = dict(batch_buckets=(1, 2), chunk_buckets=(64,), max_seq=64, backend="export")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "300"})


def test_init_tiny_defaults_are_the_embedded_default_model(tmp_path):
    """README: llama, 4 layers, hidden 256, 4 heads, 2 kv heads, vocab 512."""
    r = invoke("init", "tiny", tmp_path / "m")
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 4, 256)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (4, 2, 512)


def test_run_without_prompts_uses_four_smoke_prompts_the_last_over_two_chunks(tiny_dir, tmp_path):
    from tokenizers import Tokenizer

    lengths = [len(Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).encode(p).ids) for p in DEFAULT_PROMPTS]
    assert len(lengths) == 4 and lengths[-1] > 2 * 128
    out = tmp_path / "b"
    build(BuildOptions(tiny_dir, out=out, batch_buckets=(1, 4), chunk_buckets=(128,), max_seq=512, backend="export", use_cache=False))
    r = invoke("run", out, "--max-new-tokens", 2, "--json")
    assert r.exit_code == 0, r.output
    assert [len(p["prompt_ids"]) for p in json.loads(r.output)["prompts"]] == lengths


def test_build_prints_its_table_and_the_fallback_message(tiny_dir, tmp_path, monkeypatch):
    """Without a C++ compiler the default backend is export, and the build says why."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ or c++
    r = invoke("build", tiny_dir, "--buckets", "1", "--prefill-chunk", "64", "--max-seq", 64, "--no-cache", "-o", tmp_path / "b")
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "using the export backend: inductor is unavailable: AOTInductor compiles C++ and no g++ or c++ is on PATH" in said
    for column in ("entry", "bucket", "context", "from", "seconds", "size"):
        assert column in said
    assert "LlamaDecoderLayer.decode │ 1 │ 64 │ uncached" in said and "traced 4 graphs for 4 entries serving" in said


def test_jobs_default_is_bounded_by_cores_memory_work_and_load(monkeypatch):
    from aotc.backends.export import ExportBackend
    from aotc.backends.inductor import InductorBackend
    from aotc.backends.neuron import NeuronBackend
    from aotc.builder.options import default_jobs

    pages = {"SC_PAGE_SIZE": 1 << 12, "SC_AVPHYS_PAGES": (20 << 30) >> 12}  # 20 GB free
    monkeypatch.setattr("os.sysconf", lambda name: pages[name])
    monkeypatch.setattr("aotc.runtime.threads.running_elsewhere", lambda: 0)  # a quiet machine
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert default_jobs(50, ExportBackend()) == 1  # a compile is a file write
    assert default_jobs(50, InductorBackend()) == 10  # 2 GB each
    assert default_jobs(50, NeuronBackend()) == 2  # 8 GB each
    assert default_jobs(3, InductorBackend()) == 3  # no more than the work
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert default_jobs(50, InductorBackend()) == 2  # no more than the cores
    monkeypatch.setattr("aotc.runtime.threads.running_elsewhere", lambda: 1)
    assert default_jobs(50, InductorBackend()) == 1  # no more than the cores other processes leave free
    monkeypatch.setattr("aotc.runtime.threads.running_elsewhere", lambda: 5)
    assert default_jobs(50, InductorBackend()) == 1  # and at least one


def test_cpu_target_is_in_the_cache_key(tiny_dir, monkeypatch):
    options = dict(OPTIONS, backend="inductor")
    here = {(e, b, c): k for e, b, c, k in build_keys(BuildOptions(tiny_dir, **options))}
    monkeypatch.setattr("aotc.backends.inductor.cpu_target", lambda config: "x86_64-haswell-isa.0-AVX2")
    other = {(e, b, c): k for e, b, c, k in build_keys(BuildOptions(tiny_dir, **options))}
    assert set(here.values()).isdisjoint(other.values())


def test_manifest_records_compile_time_and_the_cache_key(tiny_dir, tmp_path):
    result = build(BuildOptions(tiny_dir, out=tmp_path / "b", cache_dir=tmp_path / "c", **OPTIONS))
    keys = {(e, b, c): k for e, b, c, k in build_keys(BuildOptions(tiny_dir, **OPTIONS))}
    for e, a in result.manifest.artifacts():
        assert a.cache_key == keys[e.id, a.bucket, a.context] and a.compile_s > 0 and a.export_s > 0


def test_recipe_is_invalidated_when_a_source_changes(tiny_dir, tmp_path, monkeypatch):
    cache = tmp_path / "c"
    build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=cache, **OPTIONS))
    assert build(BuildOptions(tiny_dir, out=tmp_path / "b", cache_dir=cache, **OPTIONS)).graphs_traced == 0  # from the recipe
    import aotc.cache.keys as keys

    real = keys._source_digest.__wrapped__
    monkeypatch.setattr(keys, "_source_digest", lambda folder: real(folder) + "-edited")  # as if a file changed
    assert build(BuildOptions(tiny_dir, out=tmp_path / "c2", cache_dir=cache, **OPTIONS)).graphs_traced == 6


@pytest.mark.parametrize("tamper", ["file", "record"])
def test_remote_downloads_are_checked_before_they_enter_the_cache(tiny_dir, tmp_path, monkeypatch, tamper):
    moto_server = pytest.importorskip("moto.server", reason="moto[server] provides the local S3 server (test extra)")
    import boto3

    from aotc.builder.obtain import remote_client

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for k, v in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        s3 = boto3.client("s3")
        bucket = f"aotc-{tamper}"  # moto keeps buckets per process, across servers: one each
        s3.create_bucket(Bucket=bucket)
        remote_client.cache_clear()
        build(BuildOptions(tiny_dir, out=tmp_path / "a", cache_dir=tmp_path / "c1", remote_cache=f"s3://{bucket}/ci", **OPTIONS))
        for obj in s3.list_objects_v2(Bucket=bucket)["Contents"]:  # poison every entry on the remote
            if tamper == "file" and obj["Key"].endswith(".pt2"):
                s3.put_object(Bucket=bucket, Key=obj["Key"], Body=b"not the program")
            if tamper == "record" and obj["Key"].endswith("record.json"):
                record = json.loads(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
                record["files"] = {"../../escape.pt2": next(iter(record["files"].values()))}
                s3.put_object(Bucket=bucket, Key=obj["Key"], Body=json.dumps(record).encode())
        remote_client.cache_clear()
        second = build(BuildOptions(tiny_dir, out=tmp_path / "b", cache_dir=tmp_path / "c2", remote_cache=f"s3://{bucket}/ci", **OPTIONS))
        assert second.count("remote") == 0 and second.count("compiled") == 6  # refused, compiled locally instead
        assert second.remote_errors and not list(tmp_path.rglob("escape.pt2"))
    finally:
        remote_client.cache_clear()
        server.stop()


def _section_tables(title: str, page: str) -> list[list[list[str]]]:
    """The tables of a section of a docs page (or README.md): rows of cells, the header and rule left out."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / page).read_text()
    body = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    tables, rows = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            tables.append(rows[2:])
            rows = []
    return tables


def _types(cell: str) -> set[str]:
    import re

    return set(re.findall(r"`([a-z0-9_]+)`", cell))


def test_the_supported_models_tables_are_the_registry_and_the_tests():
    """docs/models.md "Supported models": aotc's own rows are the registry's model types, the
    generic row is the conformance matrix, every refused example is a refusal test; the
    README's glance names the same."""
    import transformers

    from aotc.models import hf
    from aotc.models.loader import architectures, resolve

    from .test_transformers_path import ARCHS, REFUSED

    supported, refused = _section_tables("Supported models", "docs/models.md")
    # aotc's own modules only: a test that loads the example plugin (tinygpt) leaves it registered for the worker
    own = {t for a in architectures().values() if a.name != hf.NAME and a.model_class.__module__.startswith("aotc.") for t in a.model_types}
    rows = [(row[1].split(" (")[0], _types(row[0])) for row in supported]
    assert set().union(*(types for through, types in rows if through == "aotc's own code")) == own
    (generic,) = [types for through, types in rows if through == "the generic path"]
    assert generic == set(ARCHS) - own
    (glance,) = _section_tables("At a glance", "README.md")
    assert _types(glance[0][1]) == own and _types(glance[1][1]) == generic
    for model_type in generic:
        config = getattr(transformers, ARCHS[model_type][0])().to_dict()
        assert resolve(config, "config.json").name == hf.NAME, model_type
    examples = set().union(*(_types(row[1].split(" with ")[0]) for row in refused))  # "gemma3_text with use_...": the type
    assert examples == set(REFUSED)
