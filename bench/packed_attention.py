"""What does a packed prefill chunk's attention cost, against the attention its sequences need?

    python bench/packed_attention.py [--out bench/results/packed_attention.json]

Issue 75's four chat prompts (38 tokens each) run as one chunk of 160 rows
(models/packing.py): each KV head's query rows attend to the first sequence's cached
positions (the chunk's context, all masked when that sequence starts here) and to the
chunk's own 160 keys (masked outside each row's own sequence). transformers runs them as a
[4, 38] batch, each row attending to its own sequence's keys. Here, SmolLM2-135M's shapes
(9 query heads, 3 KV heads of 64), 30 layers, fp32:
- aotc's `softmax_attend` as its prefill graph computes it (compiled by torch.compile, as
  Inductor would), at one prompt (48 rows, context 48), at four (160 rows, context 160), and
  at four with a chunk graph of context 48 (a graph aotc does not build: a chunk bucket is
  built only at contexts at least as long as itself);
- the same in the prefill entry's fresh form (prefill_fresh), which a chunk from position 0
  runs: its own rows only, at one prompt and at four;
- `scaled_dot_product_attention` over the four sequences as a [4, 9, 38, 64] batch, causal.
The best of 5 runs (common.timeit) of 30 layer calls; each compiled result checked against
eager's on the same inputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import table, timeit, write_results  # noqa: E402

from aotc.models.llama import softmax_attend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
CASES = (
    ("one prompt", 48, 48),
    ("one prompt, fresh form", 48, 0),
    ("four prompts", 160, 160),
    ("four prompts, chunk graph at context 48", 160, 48),
    ("four prompts, fresh form", 160, 0),
)


def packed(rows: int, context: int) -> dict:
    g = torch.Generator().manual_seed(0)
    rep = HEADS // KV_HEADS
    q = torch.randn(KV_HEADS, rep * rows, HEAD_DIM, generator=g)
    keys, values = (torch.randn(KV_HEADS, context + rows, HEAD_DIM, generator=g) for _ in range(2))
    bias = torch.zeros(rep * rows, context + rows)
    compiled = torch.compile(softmax_attend)
    torch.testing.assert_close(compiled(q, keys, values, bias, HEAD_DIM**-0.5), softmax_attend(q, keys, values, bias, HEAD_DIM**-0.5), atol=1e-4, rtol=1e-4)
    ms = timeit(lambda: [compiled(q, keys, values, bias, HEAD_DIM**-0.5) for _ in range(LAYERS)], best=True) * 1e3
    return {"keys a row reads": context + rows, "ms": ms}


def per_sequence(sequences: int, length: int) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sequences, HEADS, length, HEAD_DIM, generator=g) for _ in range(3))
    return timeit(lambda: [F.scaled_dot_product_attention(q, k, v, is_causal=True) for _ in range(LAYERS)], best=True) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "packed_attention.json")
    args = ap.parse_args()
    rows = [{"what": what, "rows": r, "context": c, **packed(r, c)} for what, r, c in CASES]
    sdpa = per_sequence(4, 38)
    rows.append({"what": "four prompts, sdpa per sequence (transformers)", "rows": 152, "context": "", "keys a row reads": "38 or fewer", "ms": sdpa})
    for row in rows:
        row["/ sdpa per sequence"] = row["ms"] / sdpa
    table(f"{LAYERS} layers' prefill attention, fp32, SmolLM2-135M's heads, ms (torch {torch.__version__}, {torch.get_num_threads()} threads)", rows)
    write_results(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
