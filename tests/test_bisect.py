"""`aotc bisect` against the neuronx-cc test double, made to fail with a chosen NCC code
whenever the HLO it gets holds a chosen op."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aotc.backends import neuron
from aotc.bisect import bisect
from aotc.builder import BuildOptions, build
from aotc.cli import app
from aotc.errors import AotcError
from aotc.format import read_manifest

from .test_neuron import lowers

FAKES = Path(__file__).parent / "fakes"
pytestmark = lowers


@pytest.fixture(scope="module")
def neuron_bundle(tiny_dir, tmp_path_factory):
    """A neuron cross-build of the tiny model (no compiler on PATH: artifacts pending),
    decode at context buckets 32 and 64."""
    saved = os.environ["PATH"]
    os.environ["PATH"] = os.pathsep.join(p for p in saved.split(os.pathsep) if not (Path(p) / "neuronx-cc").exists())
    neuron.compiler_version.cache_clear()
    try:
        out = tmp_path_factory.mktemp("bisect") / "bundle"
        return build(BuildOptions(tiny_dir, out=out, backend="neuron", batch_buckets=(1, 2), chunk_buckets=(16,), max_seq=64, context_buckets=(32,), use_cache=False, jobs=1)).out
    finally:
        os.environ["PATH"] = saved
        neuron.compiler_version.cache_clear()


@pytest.fixture()
def failing_on(monkeypatch, tmp_path):
    """The test double on PATH, failing with NCC_IINL902 on HLO that holds `op`; returns a
    counter of its compile runs."""
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NEURONX_CC_CALLS", str(calls))
    monkeypatch.setenv("FAKE_NEURONX_CC_MODE", "pattern")
    monkeypatch.setenv("FAKE_NEURONX_CC_CODE", "NCC_IINL902")

    def arm(op: str):
        monkeypatch.setenv("FAKE_NEURONX_CC_PATTERN", op)
        return lambda: len(calls.read_text().splitlines()) if calls.exists() else 0

    return arm


def test_bisect_finds_the_node_and_its_source_line(neuron_bundle, failing_on, tmp_path):
    runs = failing_on("rsqrt")  # RMSNorm's rsqrt: the first one is in input_layernorm
    result = bisect(neuron_bundle, "LlamaDecoderLayer.decode", 1, work=tmp_path / "work")
    assert result.code == "NCC_IINL902"
    assert result.nodes == ["rsqrt = aten.rsqrt.default"]
    assert result.sources[0].endswith(", in forward") and "aotc/models/llama.py" in result.sources[0]
    line = int(result.sources[0].split("line ")[1].split(",")[0])
    source = Path(sys.modules["aotc.models.llama"].__file__).read_text().splitlines()[line - 1]
    assert "torch.rsqrt" in source
    assert runs() == result.runs <= 2 * math.log2(result.total_nodes) + 5
    assert b"rsqrt" in Path(result.hlo).read_bytes() and Path(result.log).is_file()
    assert result.command.startswith(f"cd {result.hlo.rsplit('/', 1)[0]} && neuronx-cc compile hlo.pb --framework XLA --target trn2")


def test_bisect_cli_json_and_another_compiler(neuron_bundle, failing_on, tmp_path):
    failing_on("dot")  # the first matmul: q_proj
    compiler = f"{sys.executable} {FAKES / 'neuronx-cc'}"  # any command taking neuronx-cc's argv
    r = CliRunner().invoke(
        app, ["bisect", str(neuron_bundle), "--entry", "LlamaDecoderLayer.prefill", "--bucket", "16", "--compiler", compiler, "--json", "--work", str(tmp_path / "w")]
    )
    assert r.exit_code == 0, r.output
    result = json.loads(r.output)
    assert (
        result["code"] == "NCC_IINL902"
        and len(result["nodes"]) == 1
        and "self.q_proj(x)" in Path(sys.modules["aotc.models.llama"].__file__).read_text().splitlines()[int(result["sources"][0].split("line ")[1].split(",")[0]) - 1]
    )
    assert result["command"].split(" && ")[1].startswith(compiler)
    assert (tmp_path / "w").is_dir()


def test_bisect_seeks_the_same_failure_not_any(neuron_bundle, failing_on, tmp_path):
    # The whole graph fails on its matmuls (NCC_IINL902); the input norm's rsqrt, earlier
    # in the graph, fails another way: a prefix ending there is not the failure sought.
    failing_on("dot=NCC_IINL902,rsqrt=NCC_IBCG902")
    result = bisect(neuron_bundle, "LlamaDecoderLayer.decode", 1, work=tmp_path / "work")
    assert result.code == "NCC_IINL902" and result.nodes == ["mm = aten.mm.default"]


def test_bisect_errors(neuron_bundle, failing_on, tiny_bundle, tmp_path):
    failing_on("no-such-op")
    with pytest.raises(AotcError, match="compiles; nothing to bisect"):
        bisect(neuron_bundle, "LMHead.forward", 1, work=tmp_path / "w")
    with pytest.raises(AotcError, match="has no such entry; it has LlamaDecoderLayer.decode"):
        bisect(neuron_bundle, "Nope.decode", 1)
    with pytest.raises(AotcError, match="--bucket 7: LMHead.forward has buckets 1, 2"):
        bisect(neuron_bundle, "LMHead.forward", 7)
    with pytest.raises(AotcError, match="is a export bundle; aotc bisect shrinks failures of compilers that take HLO"):
        bisect(tiny_bundle.out, "LMHead.forward", 1)


def test_bisect_takes_the_entry_id_and_a_context_bucket(neuron_bundle, failing_on, tmp_path):
    """The entry id has no context in it: --context picks the artifact (default: the
    smallest), and one the entry lacks is refused naming those it has."""
    failing_on("rsqrt")
    assert bisect(neuron_bundle, "LlamaDecoderLayer.decode", 1, work=tmp_path / "w32").context == 32
    result = bisect(neuron_bundle, "LlamaDecoderLayer.decode", 1, 64, work=tmp_path / "w64")
    assert (result.context, result.code) == (64, "NCC_IINL902")
    r = CliRunner().invoke(app, ["bisect", str(neuron_bundle), "--entry", "LlamaDecoderLayer.decode", "--bucket", "1", "--context", "48"])
    assert r.exit_code == 2 and "--context 48: LlamaDecoderLayer.decode has context buckets 32, 64" in " ".join(r.output.split())


def _table(text: str, title: str) -> list[list[str]]:
    """The body rows of the rich table printed after the line holding `title`, as cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if title in line)
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("│"):
            rows.append([c.strip() for c in line.strip("│").split("│")])
        elif line.startswith("└"):
            break
    return rows


@pytest.mark.slow  # three processes; CI runs bisect in process (test_bisect_seeks_the_same_failure_not_any)
def test_build_verify_and_bisect_piped_into_a_file_print_every_line_whole(neuron_bundle, failing_on, tiny_dir, tmp_path):
    """Output that is not a terminal is never wrapped or cut: in a file, the reproduce
    command is one line, each path is whole, and each table cell is whole."""
    failing_on("rsqrt")
    deep = tmp_path / ("a-folder-name-longer-than-a-terminal-is-wide-" * 2)  # every path below is over 80 columns
    out, work = deep / "bundle", deep / "work"
    script = (
        f"aotc build {tiny_dir} --backend export --buckets 1 --prefill-chunk 16 --max-seq 32 --no-cache -o {out} > {deep}/build.txt 2>&1 && "
        f"aotc verify {out} > {deep}/verify.txt 2>&1 && "
        f"aotc bisect {neuron_bundle} --entry LlamaDecoderLayer.decode --bucket 1 --work {work} > {deep}/bisect.txt 2>&1"
    )
    deep.mkdir()
    r = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env={**os.environ, "COLUMNS": "80", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    )
    texts = {name: (deep / f"{name}.txt").read_text() for name in ("build", "verify", "bisect") if (deep / f"{name}.txt").exists()}
    assert r.returncode == 0, texts
    for name, text in texts.items():
        assert "…" not in text, (name, text)

    built = read_manifest(out)
    expected = {(e.id, str(a.bucket), "" if a.context is None else str(a.context)) for e in built.entries for a in e.artifacts}
    assert any(f"{out}  (export, " in line for line in texts["build"].splitlines())
    assert {tuple(row[:3]) for row in _table(texts["build"], f"{out}  (export")} == expected
    assert any(f"{out}  (export, weights: " in line for line in texts["verify"].splitlines())
    rows = _table(texts["verify"], f"{out}  (export")
    assert {tuple(row[:3]) for row in rows} == expected
    for row in rows:
        float(row[4]), float(row[5]), float(row[6])  # max abs, max rel, tolerance: whole numbers
        assert row[-1] == "ok"

    lines = texts["bisect"].splitlines()
    reproduce = [line for line in lines if line.startswith("reproduce: ")]
    assert len(reproduce) == 1 and reproduce[0].startswith(f"reproduce: cd {work}/") and " && neuronx-cc compile hlo.pb --framework XLA --target trn2" in reproduce[0]
    assert [line for line in lines if line.startswith("minimal HLO: ")][0].endswith("hlo.pb")
    source = next(line for line in lines if "rsqrt = aten.rsqrt.default" in line)
    assert "aotc/models/llama.py" in source and source.endswith(", in forward")
