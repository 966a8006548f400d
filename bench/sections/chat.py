"""chat: time to first token at chat length: one 38-token chat prompt, and four,
SmolLM2-135M-Instruct (bench/smollm2.py; the tiny model under --quick) in float32 and
bfloat16, through a bundle of the default chunk and first-chunk buckets, against aotc's eager model and
transformers at the same precision. Each engine is ready as a server keeps it (loaded,
bound, its caches allocated); a request is its prompts' ids in, their first tokens out;
the median of the rounds, the engines taken in turn each round. With the chunks the
bundle ran, the rows they computed (padding included) and the decoder layers' GFLOP/s
(2 x their weights x tokens, by real tokens and by rows computed) beside a 2048^3
matmul's of the same precision in the same run. Issue 75's target: aotc's first tokens in
at most 0.9x transformers' time, at one prompt and at four."""

from __future__ import annotations

import statistics
import time

import torch
from common import Run, gemm_peak, print_misses, section, table
from smollm2 import smollm2

from aotc.builder.options import DEFAULT_CHUNK_BUCKETS, DEFAULT_FIRST_CHUNK_BUCKETS
from aotc.chat import render_user_turn
from aotc.models.loader import load_model
from aotc.runtime import Bundle, generate

# Each 38 tokens in SmolLM2's chat template (its system turn included).
PROMPTS = ("Write a haiku about the sea.", "What is the boiling point of water?", "How many legs does a spider have?", "Suggest a name for a pet dog.")
PROMPT_TOKENS = 38
TARGET = 0.9  # aotc/transformers, at one prompt and at four


@section("chat")
def chat(run: Run) -> dict:
    from transformers import AutoModelForCausalLM

    folders = {"tiny float32": run.model("tiny")} if run.quick else {f"SmolLM2-135M {d}": smollm2(d) for d in ("float32", "bfloat16")}
    rounds = 3 if run.quick else 9
    peaks = {}
    rows = []
    for label, folder in folders.items():
        requests = chat_requests(folder, run.quick)
        bundle = Bundle.load(run.bundle(folder, "chat", chunk_buckets=DEFAULT_CHUNK_BUCKETS, first_chunk_buckets=DEFAULT_FIRST_CHUNK_BUCKETS, max_seq=1024))
        # Two instances, so that no request binds or unbinds: one bound, one eager.
        model, eager = (load_model(folder, **bundle.model_args(eager=e)).model for e in (False, True))
        dtype = next(model.parameters()).dtype
        if label.split()[-1] != str(dtype).removeprefix("torch."):  # a row must run the precision it names
            raise SystemExit(f"chat: {label} loaded {dtype} weights")
        if dtype not in peaks:
            peaks[dtype] = gemm_peak(min_time=run.times(2.0), dtype=dtype)
        peak = peaks[dtype]
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        kw = dict(max_batch=4, max_seq=bundle.max_seq, slots=bundle.cache_slots)
        eager_caches = eager.allocate_caches(bundle.cache_slots, bundle.max_seq)
        bundle.bind(model)
        aotc_caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
        prefill = model.model.layers[0].prefill  # the dispatcher: the chunks it runs
        flops_per_token = 2 * sum(p.numel() for n, p in eager.named_parameters() if ".layers." in n)
        for prompts in (requests[:1], requests):
            engines = {
                "aotc": lambda: first_tokens(model, prompts, kw, aotc_caches),
                "eager": lambda: first_tokens(eager, prompts, kw, eager_caches),
                "transformers": lambda: _transformers_first(hf, prompts),
            }
            times, firsts = {e: [] for e in engines}, {}
            for _ in range(rounds):
                for engine, fn in engines.items():
                    t0 = time.perf_counter()
                    firsts[engine] = fn()
                    times[engine].append(time.perf_counter() - t0)
            if dtype == torch.float32 and firsts["aotc"] != firsts["eager"]:
                raise SystemExit(f"chat: {label}: the bundle's first tokens {firsts['aotc']} are not eager's {firsts['eager']}")
            ms = {e: statistics.median(t) * 1e3 for e, t in times.items()}
            tokens = sum(map(len, prompts))
            chunks = prefill.pieces(tokens, fresh=True)  # a request's prompts start at position 0
            computed = prefill.fresh.bucket_for[chunks[0]] + sum(prefill.bucket_for[m] for m in chunks[1:])
            rows.append({
                "model": label, "prompts": len(prompts), "tokens": tokens, "chunks": "+".join(map(str, chunks)), "rows computed": computed,
                "aotc ms": ms["aotc"], "eager ms": ms["eager"], "transformers ms": ms["transformers"],
                "aotc/eager": ms["aotc"] / ms["eager"], "aotc/transformers": ms["aotc"] / ms["transformers"],
                "first tokens as eager's": firsts["aotc"] == firsts["eager"], "first tokens as transformers'": firsts["aotc"] == firsts["transformers"],
                "aotc GFLOP/s": flops_per_token * tokens / ms["aotc"] / 1e6,
                "aotc GFLOP/s padding included": flops_per_token * computed / ms["aotc"] / 1e6,
                "eager GFLOP/s": flops_per_token * tokens / ms["eager"] / 1e6,
                "GEMM peak GFLOP/s": peak / 1e9,
                "aotc padding included / peak": flops_per_token * computed / ms["aotc"] / 1e6 / (peak / 1e9),
            })  # fmt: skip
        one, four = rows[-2], rows[-1]
        four["4 prompts / 1"] = four["aotc ms"] / one["aotc ms"]
        for r in (one, four):
            r["target met"] = r["aotc/transformers"] <= TARGET
    misses = [f"{r['model']}, {r['prompts']} prompt(s): aotc takes {r['aotc/transformers']:.2f}x transformers' time" for r in rows if not r["target met"]]
    table(
        f"time to first token (ms) at chat length, {PROMPT_TOKENS}-token prompts, chunk buckets {','.join(map(str, DEFAULT_CHUNK_BUCKETS))}, first chunks {','.join(map(str, DEFAULT_FIRST_CHUNK_BUCKETS))} "
        f"(target: aotc <= {TARGET}x transformers)",
        rows,
    )
    print_misses(misses)
    return {
        "prompts": list(PROMPTS), "chunk_buckets": list(DEFAULT_CHUNK_BUCKETS), "first_chunk_buckets": list(DEFAULT_FIRST_CHUNK_BUCKETS), "rounds": rounds, "gemm_peak_GFLOPs": {str(d).removeprefix("torch."): p / 1e9 for d, p in peaks.items()},
        "target": {"aotc/transformers": TARGET}, "misses": misses, "rows": rows,
    }  # fmt: skip


def chat_requests(folder, quick: bool) -> list[list[int]]:
    """The four prompts' ids: chat turns of the real model, or (tiny model, no chat
    template) that many tokens of its vocabulary."""
    if quick:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, 500, (PROMPT_TOKENS,), generator=g).tolist() for _ in PROMPTS]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = [tokenizer.encode(render_user_turn(folder, p), add_special_tokens=False).ids for p in PROMPTS]
    if {len(i) for i in ids} != {PROMPT_TOKENS}:
        raise SystemExit(f"chat: the prompts have {[len(i) for i in ids]} tokens, not {PROMPT_TOKENS} each")
    return ids


def first_tokens(model, prompts, kw, caches) -> list[int]:
    """The first token of each prompt, from aotc's generate (a bound model or eager)."""
    return [s.new_ids[0] for s in generate(model, prompts, 1, caches=caches, **kw).sequences]


@torch.no_grad()
def _transformers_first(hf, prompts) -> list[int]:
    """transformers' first token of each prompt, as its users ask for it (generate)."""
    ids = torch.tensor(prompts)  # prompts of one length: no padding
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)
    return out[:, -1].tolist()
