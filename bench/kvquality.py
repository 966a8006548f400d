"""fp8 KV caches against float32 caches on a real model: what each cache dtype keeps.

    python bench/kvquality.py [--out bench/results/kvquality.json]

SmolLM2-135M-Instruct (bench/smollm2.py), float32 weights, reads a fixed
public-domain passage (tests/data/declaration.txt, the Declaration of
Independence, 800 tokens) in one teacher-forced eager pass per cache dtype;
each position's logits are compared with float32 caches': the top-1 agreement
and the largest logit difference. Eager, because the cache format is what is
measured here; the fidelity rule (aotc.runtime.check) holds compiled bundles
to their eager twin's error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from common import HERE, table
from smollm2 import smollm2

PASSAGE = HERE.parent / "tests" / "data" / "declaration.txt"


def agreement(folder: Path, kv: str, ids: torch.Tensor, full: torch.Tensor) -> dict:
    from aotc.kvcache import kv_cache_record
    from aotc.models.loader import load_model

    model = load_model(folder, kv_cache=kv_cache_record(kv, "e4m3fn")).model
    with torch.no_grad():
        logits = model.prompt_logits(ids)
    bytes_per_token = model.cache_bytes(1, len(ids)) / len(ids)
    return {
        "kv cache": kv, "top-1 agreement": (logits.argmax(-1) == full.argmax(-1)).float().mean().item(),
        "max logit diff": (logits - full).abs().max().item(), "cache bytes per token": bytes_per_token,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "kvquality.json")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from aotc.models.loader import load_model

    folder = smollm2("float32")
    ids = torch.tensor(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PASSAGE.read_text()).ids)
    with torch.no_grad():
        full = load_model(folder).model.prompt_logits(ids)
    rows = [agreement(folder, kv, ids, full) for kv in ("auto", "fp8", "fp8-values")]
    table(f"SmolLM2-135M-Instruct, {len(ids)} tokens teacher-forced, against float32 caches", rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tokens": len(ids), "passage": PASSAGE.name, "rows": rows}, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
