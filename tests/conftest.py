"""Shared fixtures: tiny model folders made here, never downloaded."""

from __future__ import annotations

import os

import pytest
import torch

from aotc.build import BuildOptions, build
from aotc.models.tiny import write_tiny


@pytest.fixture(scope="session", autouse=True)
def private_compile_cache(tmp_path_factory):
    """Builds in tests use a compile cache of their own, never the user's ~/.cache/aotc."""
    os.environ["AOTC_CACHE_DIR"] = str(tmp_path_factory.mktemp("aotc-cache"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The embedded default model, with 2 layers to keep tests fast."""
    return write_tiny(tmp_path_factory.mktemp("models") / "tiny", layers=2)


@pytest.fixture(scope="session")
def tiny_bundle(tiny_dir, tmp_path_factory):
    """An export-backend bundle of tiny_dir: batch buckets 1,2,4, prefill chunk 16 and 64."""
    out = tmp_path_factory.mktemp("bundles") / "tiny"
    return build(BuildOptions(tiny_dir, out=out, batch_buckets=(1, 2, 4), chunk_buckets=(16, 64), max_seq=256, backend="export"))


def hf_save(tmp_path, config_cls, model_cls, seed=0, **fields):
    """Save a tiny random transformers model with save_pretrained; returns (folder, model)."""
    torch.manual_seed(seed)
    config = config_cls(**fields)
    model = model_cls(config).eval()
    model.save_pretrained(tmp_path)
    return tmp_path, model


def rehash(bundle) -> None:
    """What an attacker does after tampering with a bundle: fix every sha256 in its manifest."""
    import hashlib
    import json

    manifest = json.loads((bundle / "manifest.json").read_text())
    for e in manifest["entries"]:
        for a in e["artifacts"]:
            for name in a["files"]:
                a["files"][name] = hashlib.sha256((bundle / a["dir"] / name).read_bytes()).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def swapped_copy(src, dst):
    """A copy of a bundle whose decode artifacts for buckets 1 and 2 trade places, hashes fixed."""
    import shutil

    shutil.copytree(src, dst)
    a, b = dst / "entries/LlamaDecoderLayer.decode/b1", dst / "entries/LlamaDecoderLayer.decode/b2"
    a.rename(dst / "swap")
    b.rename(a)
    (dst / "swap").rename(b)
    rehash(dst)
    return dst
