"""Which chunk buckets: time to first token per set of prefill chunk lengths.

    python bench/chunk_buckets.py [--dtype float32] [--sets 16,64 16,64,128 16,32,64,128 16,64,256] [--out bench/results/chunk_buckets.json]

SmolLM2-135M-Instruct (bench/smollm2.py, offline), inductor, max_seq 1024 (context
buckets 256 and 1024), one bundle per set of chunk buckets, each built with no aotc
cache and a fresh Inductor cache (its build seconds are a cold build's), all built
before any is timed. Per set: the chunk contexts the build chose, the prefill graphs,
the build time, and the time to first token (median of the rounds, the sets taken in
turn each round, each engine loaded and bound as a server keeps it; and as a ratio to
the first set's) for one 38-token chat prompt, four of them (152 tokens, packed), and
one 500-token prompt (ids drawn from the vocabulary), with the chunks each ran.
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

from common import console, table, write_results  # noqa: E402
from sections.chat import chat_requests, first_tokens  # noqa: E402
from smollm2 import smollm2  # noqa: E402

from aotc.builder import BuildOptions, build  # noqa: E402
from aotc.models.loader import load_model  # noqa: E402
from aotc.runtime import Bundle  # noqa: E402

DEFAULT_SETS = ("16,64", "16,64,128", "16,32,64,128", "16,64,256")
LONG = 500


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--sets", nargs="+", default=list(DEFAULT_SETS), help="chunk bucket sets, each comma-separated; /C1,C2 after one sets its context buckets (default 256 and max_seq)"
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "chunk_buckets.json")
    args = ap.parse_args()
    folder = smollm2(args.dtype)
    chat = chat_requests(folder, quick=False)
    g = torch.Generator().manual_seed(0)
    workloads = {"1 x 38": chat[:1], "4 x 38": chat, f"1 x {LONG}": [torch.randint(3, 40000, (LONG,), generator=g).tolist()]}
    rows, engines = [], []
    with tempfile.TemporaryDirectory(prefix="aotc-chunks-") as tmp:
        for text in args.sets:  # every build first, one after another: no timing runs beside a build
            chunk_text, _, context_text = text.partition("/")  # CHUNKS[/CONTEXT BUCKETS]
            chunks = tuple(int(c) for c in chunk_text.split(","))
            contexts = tuple(int(c) for c in context_text.split(",")) if context_text else None
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / f"inductor-{text.replace('/', '-c')}")  # a cold build each
            t0 = time.perf_counter()
            out = Path(tmp) / text.replace("/", "-c")
            result = build(BuildOptions(folder, out=out, backend="inductor", chunk_buckets=chunks, context_buckets=contexts, max_seq=1024, use_cache=False))
            seconds = time.perf_counter() - t0
            bundle = Bundle.load(result.out)
            model = load_model(folder, **bundle.model_args(eager=False)).model
            bundle.bind(model)
            caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
            kw = dict(max_batch=4, max_seq=bundle.max_seq, slots=bundle.cache_slots)
            engines.append((model, kw, caches))
            rows.append({
                "chunk buckets": chunk_text, "context buckets": ",".join(map(str, bundle.manifest.shapes.context)), "chunk contexts": ",".join(map(str, bundle.manifest.shapes.chunk_contexts)) or "none",
                "prefill graphs": sum(len(e.artifacts) for e in bundle.manifest.entries if e.method == "prefill"),
                "graphs": result.graphs_traced, "build s": seconds,
            })  # fmt: skip
            console.print(f"{text}: built", highlight=False)
        # The sets taken in turn each round: this VM's speed drifts by 20% within minutes,
        # which a set timed after another would read as the sets' difference.
        for name, prompts in workloads.items():
            times = [[] for _ in engines]
            for _ in range(args.rounds):
                for (model, kw, caches), t in zip(engines, times):
                    t0 = time.perf_counter()
                    first_tokens(model, prompts, kw, caches)
                    t.append(time.perf_counter() - t0)
            for (model, _, _), t, row in zip(engines, times, rows):
                row[f"{name} chunks"] = "+".join(map(str, model.model.layers[0].prefill.pieces(sum(map(len, prompts)))))
                row[f"{name} ms"] = statistics.median(t) * 1e3
            base = rows[0][f"{name} ms"]
            for row in rows:
                row[f"{name} / first set"] = row[f"{name} ms"] / base
    table(f"time to first token by chunk buckets, SmolLM2-135M {args.dtype}, inductor, max_seq 1024 (ms, median of {args.rounds})", rows)
    write_results(args.out, {"dtype": args.dtype, "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
