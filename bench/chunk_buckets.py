"""Which chunk buckets: time to first token per set of prefill chunk lengths.

    python bench/chunk_buckets.py [--dtype float32] [--sets 16,64 16,64,256 16,32,64,128] [--out bench/results/chunk_buckets.json]

SmolLM2-135M-Instruct (bench/smollm2.py, offline), inductor, max_seq 1024 (context
buckets 256 and 1024), one bundle per set of chunk buckets, each built with no aotc
cache and a fresh Inductor cache, so its build seconds are a cold build's. Per set:
the chunk context the build chose, the prefill graphs, the build time, and the time to
first token (median of the rounds, each engine loaded and bound as a server keeps it)
for one 38-token chat prompt, four of them (152 tokens, packed), and one 500-token
prompt (ids drawn from the vocabulary), with the chunks each ran.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import console, table  # noqa: E402
from sections.chat import chat_requests, first_tokens  # noqa: E402
from smollm2 import smollm2  # noqa: E402

from aotc.builder import BuildOptions, build  # noqa: E402
from aotc.format import encode, write_atomic  # noqa: E402
from aotc.models.loader import load_model  # noqa: E402
from aotc.runtime import Bundle  # noqa: E402

DEFAULT_SETS = ("16,64", "16,64,256", "16,32,64,128")
LONG = 500


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS), help="chunk bucket sets, each comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "chunk_buckets.json")
    args = ap.parse_args()
    folder = smollm2(args.dtype)
    chat = chat_requests(folder, quick=False)
    g = torch.Generator().manual_seed(0)
    workloads = {"1 x 38": chat[:1], "4 x 38": chat, f"1 x {LONG}": [torch.randint(3, 40000, (LONG,), generator=g).tolist()]}
    rows = []
    with tempfile.TemporaryDirectory(prefix="aotc-chunks-") as tmp:
        for text in args.sets:
            chunks = tuple(int(c) for c in text.split(","))
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / f"inductor-{text}")  # a cold build each
            t0 = time.perf_counter()
            result = build(BuildOptions(folder, out=Path(tmp) / text, backend="inductor", chunk_buckets=chunks, max_seq=1024, use_cache=False))
            seconds = time.perf_counter() - t0
            bundle = Bundle.load(result.out)
            model = load_model(folder, **bundle.model_args(eager=False)).model
            bundle.bind(model)
            caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
            kw = dict(max_batch=4, max_seq=bundle.max_seq, slots=bundle.cache_slots)
            prefill = model.model.layers[0].prefill
            row = {
                "chunk buckets": text, "chunk context": bundle.manifest.shapes.chunk_context,
                "prefill graphs": sum(len(e.artifacts) for e in bundle.manifest.entries if e.method == "prefill"),
                "graphs": result.graphs_traced, "build s": seconds,
            }  # fmt: skip
            for name, prompts in workloads.items():
                times = []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    first_tokens(model, prompts, kw, caches)
                    times.append(time.perf_counter() - t0)
                row[f"{name} chunks"] = "+".join(map(str, prefill.pieces(sum(map(len, prompts)))))
                row[f"{name} ms"] = statistics.median(times) * 1e3
            Bundle.unbind(model)
            rows.append(row)
            console.print(f"{text}: done", highlight=False)
    table(f"time to first token by chunk buckets, SmolLM2-135M {args.dtype}, inductor, max_seq 1024 (ms, median of {args.rounds})", rows)
    write_atomic(args.out, encode({"dtype": args.dtype, "rounds": args.rounds, "rows": rows}))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
