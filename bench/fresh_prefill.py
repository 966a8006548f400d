"""What do the prefill entry's fresh form and its first-chunk buckets save on a real model, in one process?

    python bench/fresh_prefill.py [--dtype float32] [--rounds 15] [--out bench/results/fresh_prefill.json]

A call's first chunk whose first row is at position 0 runs LlamaDecoderLayer.prefill_fresh,
which attends to the chunk's own rows only, where the general form also reads the chunk's
context of cached positions (models/packing.py), and pads to the next first-chunk bucket
(--first-chunk), not the next chunk bucket. Here SmolLM2-135M-Instruct (bench/smollm2.py)
through a bundle of the default chunk and first-chunk buckets (max_seq 1024, as the chat
section), bound once; its `prefill_batch` of one and of four 38-token chat prompts (the chat
section's) three ways: the fresh form at the first-chunk buckets (as aotc runs it), the fresh
form at the chunk buckets only (each fresh dispatcher's bucket choice narrowed to them), and
the general form (each layer's dispatcher told to run it); with transformers' forward of the
same prompts as one batch (logits_to_keep=1, what its generate runs for a first token).
Taken in turn each round (this VM's speed drifts within minutes, more than these save), the
median of the rounds after two warm ones. The forms' logits are checked against each other.
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

from common import table, write_results  # noqa: E402
from sections.chat import chat_requests  # noqa: E402
from smollm2 import smollm2  # noqa: E402

from aotc.builder import BuildOptions, build  # noqa: E402
from aotc.builder.options import DEFAULT_CHUNK_BUCKETS, DEFAULT_FIRST_CHUNK_BUCKETS  # noqa: E402
from aotc.models.loader import load_model  # noqa: E402
from aotc.runtime import Bundle  # noqa: E402


def measure(dtype: str, rounds: int, tmp: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM

    folder = smollm2(dtype)
    options = BuildOptions(folder, out=tmp / "bundle", backend="inductor", chunk_buckets=DEFAULT_CHUNK_BUCKETS, first_chunk_buckets=DEFAULT_FIRST_CHUNK_BUCKETS, max_seq=1024)
    bundle = Bundle.load(build(options).out)
    model = load_model(folder, **bundle.model_args(eager=False)).model
    bundle.bind(model)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
    prefills = [vars(layer)["prefill"] for layer in model.model.layers]
    fresh = [d.fresh for d in prefills]
    finer = fresh[0].bucket_for  # the fresh dispatchers' choice of bucket, by rows (one bucket set for all)
    chunk = [None] + [min(b for b in DEFAULT_CHUNK_BUCKETS if b >= r) for r in range(1, len(finer))]
    requests = chat_requests(folder, quick=False)
    forms = {"fresh, first chunks": (fresh, finer), "fresh, chunk buckets": (fresh, chunk), "general": ([None] * len(fresh), finer)}
    rows = []
    for n in (1, 4):
        prompts = [torch.tensor(r) for r in requests[:n]]
        batch = torch.tensor(requests[:n])  # prompts of one length: no padding
        times, logits = {form: [] for form in (*forms, "transformers")}, {}
        for _ in range(rounds + 2):
            for form in times:
                t0 = time.perf_counter()
                if form == "transformers":
                    with torch.no_grad():
                        hf(batch, logits_to_keep=1)
                else:
                    dispatchers, bucket_for = forms[form]
                    for d, f in zip(prefills, dispatchers):
                        d.fresh = f
                        if f is not None:
                            f.bucket_for = bucket_for
                    t0 = time.perf_counter()
                    logits[form] = model.prefill_batch(prompts, list(range(n)), caches)
                times[form].append(time.perf_counter() - t0)
        for form in forms:
            torch.testing.assert_close(logits[form], logits["general"], atol=1e-4, rtol=1e-4)
        ms = {form: statistics.median(t[2:]) * 1e3 for form, t in times.items()}
        for d, f in zip(prefills, fresh):  # as aotc runs them
            d.fresh, f.bucket_for = f, finer
        tokens = sum(len(p) for p in prompts)
        first = prefills[0].pieces(tokens, fresh=True)[0]
        row = {"weights": dtype, "prompts": n, "tokens": tokens, "first chunk rows": finer[first], "as a chunk bucket": chunk[first]}
        row |= {f"{form} ms": v for form, v in ms.items()}
        row |= {f"{form} / transformers": ms[form] / ms["transformers"] for form in forms}
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fresh_prefill.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aotc-fresh-prefill-") as tmp:
        rows = measure(args.dtype, args.rounds, Path(tmp))
    table(
        f"SmolLM2-135M prefill_batch: the fresh form at the first-chunk buckets, at the chunk buckets, and the general form, in turn with transformers, ms, median of {args.rounds} rounds (torch {torch.__version__}, {torch.get_num_threads()} threads)",
        rows,
    )
    write_results(args.out, {"rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
