"""What does the prefill entry's fresh form save on a real model, in one process?

    python bench/fresh_prefill.py [--dtype float32] [--rounds 15] [--out bench/results/fresh_prefill.json]

A call's first chunk whose first row is at position 0 runs LlamaDecoderLayer.prefill_fresh,
which attends to the chunk's own rows only, where the general form also reads the chunk's
context of cached positions (models/packing.py). Here SmolLM2-135M-Instruct (bench/smollm2.py)
through a bundle of the default chunk buckets (max_seq 1024, as the chat section), bound
once; its `prefill_batch` of one and of four 38-token chat prompts (the chat section's) with
the fresh form on and off (each layer's dispatcher told to run the general form), taken in
turn each round (this VM's speed drifts within minutes, more than this saves), the median of
the rounds after two warm ones. The two forms' logits are checked against each other.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import console, table  # noqa: E402
from sections.chat import chat_requests  # noqa: E402
from smollm2 import smollm2  # noqa: E402

from aotc.builder import BuildOptions, build  # noqa: E402
from aotc.builder.options import DEFAULT_CHUNK_BUCKETS  # noqa: E402
from aotc.format import encode, write_atomic  # noqa: E402
from aotc.models.loader import load_model  # noqa: E402
from aotc.runtime import Bundle  # noqa: E402


def measure(dtype: str, rounds: int, tmp: Path) -> list[dict]:
    folder = smollm2(dtype)
    bundle = Bundle.load(build(BuildOptions(folder, out=tmp / "bundle", backend="inductor", chunk_buckets=DEFAULT_CHUNK_BUCKETS, max_seq=1024)).out)
    model = load_model(folder, **bundle.model_args(eager=False)).model
    bundle.bind(model)
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
    prefills = [vars(layer)["prefill"] for layer in model.model.layers]
    fresh = [d.fresh for d in prefills]
    requests = [torch.tensor(r) for r in chat_requests(folder, quick=False)]
    rows = []
    for n in (1, 4):
        prompts = requests[:n]
        times, logits = {"fresh": [], "general": []}, {}
        for _ in range(rounds + 2):
            for form in times:
                for d, f in zip(prefills, fresh):
                    d.fresh = f if form == "fresh" else None
                t0 = time.perf_counter()
                logits[form] = model.prefill_batch(prompts, list(range(n)), caches)
                times[form].append(time.perf_counter() - t0)
        torch.testing.assert_close(logits["fresh"], logits["general"], atol=1e-4, rtol=1e-4)
        ms = {form: statistics.median(t[2:]) * 1e3 for form, t in times.items()}
        tokens = sum(len(p) for p in prompts)
        rows.append({"weights": dtype, "prompts": n, "tokens": tokens, "fresh ms": ms["fresh"], "general ms": ms["general"], "fresh / general": ms["fresh"] / ms["general"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fresh_prefill.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aotc-fresh-prefill-") as tmp:
        rows = measure(args.dtype, args.rounds, Path(tmp))
    table(f"SmolLM2-135M prefill_batch, the fresh form on and off in turn, ms, median of {args.rounds} rounds (torch {torch.__version__}, {torch.get_num_threads()} threads)", rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, encode({"torch": str(torch.__version__), "threads": torch.get_num_threads(), "rounds": args.rounds, "rows": rows}))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
