"""The transformers releases the generic path runs on (aotc.models.hf.compat): the
private names it leans on are all there, the extras accept the releases tested, and
any other release is refused or warned about, naming the releases tested."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tomllib
import torch
import transformers
from typer.testing import CliRunner

from aotc.cli import app
from aotc.errors import ConfigError
from aotc.models.hf import compat as hf_compat

from .test_transformers_path import save

ROOT = Path(__file__).resolve().parents[1]


def GENERIC_PATH_SOURCE() -> str:
    """aotc/models/hf/'s code, its compatibility table (compat.py) aside."""
    return "\n".join(p.read_text() for p in sorted((ROOT / "aotc/models/hf").glob("*.py")) if p.name != "compat.py")


def test_every_private_name_aotc_uses_is_in_this_transformers():
    gone = hf_compat.missing()
    assert not gone, "transformers " + transformers.__version__ + " lacks: " + "; ".join(f"{p}, needed for {p.why}; can go when {p.until}" for p in gone)


def test_each_private_name_says_why_and_when_it_can_go_and_the_table_names_what_hf_uses():
    for p in hf_compat.PRIVATE:
        assert p.why and p.until, p
    source = GENERIC_PATH_SOURCE()
    for p in hf_compat.PRIVATE:
        assert re.search(rf"\b{re.escape(p.name)}\b", source), f"{p} is in hf_compat.PRIVATE, but aotc/models/hf/ does not use it"
    # Every private transformers attribute aotc/models/hf/ names (a leading underscore) is in the table.
    private = set(dir(transformers.PreTrainedModel)) - set(dir(torch.nn.Module))
    used = set(re.findall(r"\b(_[a-z][a-z_]+)\b", source)) & private
    assert used <= {p.name for p in hf_compat.PRIVATE}, used - {p.name for p in hf_compat.PRIVATE}


# Imported from a transformers submodule, not exported at its top level, and public all
# the same: documented in transformers' own docs, as AttentionInterface is.
DOCUMENTED = {"ExpertsInterface"}


def test_every_name_hf_imports_from_inside_transformers_is_in_the_table():
    """A name aotc/models/hf/ imports from a transformers submodule that transformers does
    not export at its top level is private: hf_compat.PRIVATE must list it."""
    tree = ast.parse(GENERIC_PATH_SOURCE())
    imported = {
        (node.module, a.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers.")
        for a in node.names
        if not hasattr(transformers, a.name) and a.name not in DOCUMENTED
    }  # fmt: skip
    listed = {(p.owner, p.name) for p in hf_compat.PRIVATE}
    assert imported and imported <= listed, sorted(imported - listed)


def test_the_extras_accept_exactly_the_releases_tested():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    major, first = hf_compat.TESTED[0].split(".")
    assert hf_compat.TESTED == tuple(f"{major}.{int(first) + i}" for i in range(len(hf_compat.TESTED)))  # consecutive minors
    spec = f"transformers>={hf_compat.TESTED[0]},<{major}.{int(first) + len(hf_compat.TESTED)}"
    assert hf_compat.INSTALL == f"pip install '{spec}'"
    assert spec in extras["hf"] and spec in extras["test"], (spec, extras["hf"], extras["test"])
    assert ".".join(transformers.__version__.split(".")[:2]) in hf_compat.TESTED


def test_an_older_release_is_refused_naming_the_releases_tested():
    with pytest.raises(ConfigError, match=r"transformers 5\.23\.1 is older .*tested with \(5\.24, 5\.25\); run: pip install 'transformers>=5\.24,<5\.26'"):
        hf_compat.check("5.23.1")


def test_a_newer_release_with_every_name_warns_naming_the_releases_tested():
    with pytest.warns(hf_compat.UntestedTransformersWarning, match=r"transformers 5\.26\.0\.dev0 is newer .*\(5\.24, 5\.25\); every private name"):
        hf_compat.check("5.26.0.dev0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_compat.check("5.25.9")  # a tested minor release: silent


def test_a_release_that_lacks_a_private_name_is_refused_naming_it(monkeypatch):
    gone = hf_compat.Private("transformers.modeling_utils.PreTrainedModel", "_no_such_name", "why it is needed", "when it can go")
    monkeypatch.setattr(hf_compat, "PRIVATE", (*hf_compat.PRIVATE, gone))
    with pytest.raises(
        ConfigError, match=r"transformers 5\.27\.0 lacks .*PreTrainedModel\._no_such_name \(needed for why it is needed\)\. aotc is tested with transformers 5\.24, 5\.25"
    ):
        hf_compat.check("5.27.0")


def test_aotc_build_refuses_an_older_transformers_before_tracing(tmp_path, monkeypatch):
    model_dir = save("olmo2", tmp_path / "model", layers=1)
    monkeypatch.setattr("transformers.__version__", "5.20.0")  # as imported now (sys.modules)
    hf_compat.check.cache_clear()
    try:
        result = CliRunner().invoke(app, ["build", str(model_dir), "--backend", "export", "--no-cache", "-o", str(tmp_path / "b")])
    finally:
        hf_compat.check.cache_clear()
    assert result.exit_code == 2, result.output
    assert "transformers 5.20.0 is older than the releases aotc's generic path is tested with (5.24, 5.25)" in result.output
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_conformance_on_the_other_tested_release(tmp_path):
    """The conformance matrix's CI part under the tested release CI does not install: a
    venv that sees this one's packages, with that transformers of its own in front."""
    mine = ".".join(transformers.__version__.split(".")[:2])
    other = next(v for v in hf_compat.TESTED if v != mine)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    ours = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
    (site / "aotc-parent.pth").write_text(ours + "\n")  # after the venv's own site-packages
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", f"transformers=={other}.*"], check=True)
    got = subprocess.run([str(python), "-c", "import transformers; print(transformers.__version__)"], capture_output=True, text=True, check=True).stdout
    assert got.startswith(other + "."), got
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_transformers_path.py", "tests/test_transformers_compat.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    print(f"transformers {got.strip()}: {run.stdout.strip().splitlines()[-1]}")
