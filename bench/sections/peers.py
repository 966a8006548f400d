"""peers: (with --peers) llama.cpp, built once from llama-cpp-python's source
distribution into --peers-cache: the ~100M model (tiny under --quick) as GGUF F32, F16
and Q8_0 against aotc inductor (or --backend) and eager, batch-1 greedy decode tokens/s
with the same prompt ids and threads; greedy agreement at F32; issue 19's target (aotc
>= llama.cpp F32)."""

from __future__ import annotations

import torch

import llamacpp
from aotc.models.base import load_model
from aotc.runtime import Bundle, generate
from common import BUCKETS, MAX_SEQ, Run, console, print_misses, section, table

PEER_PROMPT, PEER_NEW = 16, 128


@section("peers", optional=True)
def peers(run: Run) -> dict:
    name = run.main
    model_dir = run.model(name)
    try:
        built = llamacpp.ensure_llama_cpp(run.peers_cache, say=lambda m: console.print(m, highlight=False))
    except llamacpp.Skipped as e:
        console.print(f"peers skipped: {e}", highlight=False)
        return {"skipped": str(e)}
    model = load_model(model_dir).model
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.embed_tokens"))
    prompt = torch.randint(3, 500, (PEER_PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    threads = torch.get_num_threads()
    bundle = Bundle.load(run.bundle(model_dir, batch_buckets=BUCKETS, chunk_buckets=(128,)))

    def ours(bound: bool) -> dict:
        if bound:
            bundle.bind(model)
        try:
            g = generate(model, [prompt], PEER_NEW, max_batch=1, max_seq=MAX_SEQ, slots=max(BUCKETS) + 1, stop_at_eos=False)
        finally:
            Bundle.unbind(model)
        return {"tokens": g.sequences[0].new_ids, "decode_s": g.decode_s, "tokens_per_s": g.decode_tokens_per_s}

    runs = {(run.aotc, "fp32"): llamacpp.timed(lambda: ours(True)), ("eager PyTorch", "fp32"): llamacpp.timed(lambda: ours(False))}
    for fmt in llamacpp.FORMATS:
        gguf = llamacpp.convert(built, model_dir, fmt, run.root)
        runs["llama.cpp", fmt] = llamacpp.timed(lambda: llamacpp.decode(built, gguf, prompt, PEER_NEW, threads))
    reference = runs[run.aotc, "fp32"]
    rows = []
    for (engine, fmt), result in runs.items():
        per_weight = 4.0 if fmt == "fp32" else llamacpp.FORMATS[fmt][1]
        rows.append({
            "engine": engine, "format": fmt, "tokens/s": result["tokens_per_s"],
            "GB/s of weights": non_embedding * per_weight * result["tokens_per_s"] / 1e9,
            "aotc / this, tokens/s": reference["tokens_per_s"] / result["tokens_per_s"],
            "greedy tokens equal to aotc's": f"{llamacpp.agreement(result['tokens'], reference['tokens'])} of {PEER_NEW}",
        })  # fmt: skip
    f32 = runs["llama.cpp", "F32"]
    misses = []
    if reference["tokens_per_s"] < f32["tokens_per_s"]:
        misses.append(f"{run.aotc} decodes {reference['tokens_per_s']:.0f} tokens/s at batch 1, llama.cpp F32 {f32['tokens_per_s']:.0f}")
    if llamacpp.agreement(f32["tokens"], reference["tokens"]) < PEER_NEW:
        misses.append(f"llama.cpp F32's greedy tokens differ from aotc's after {llamacpp.agreement(f32['tokens'], reference['tokens'])}")
    table(f"batch-1 greedy decode, {name} model, {PEER_PROMPT}-token prompt, {PEER_NEW} new tokens, {threads} threads", rows)
    print_misses(misses)
    return {
        "model": name, "llama_cpp_python": llamacpp.LLAMA_CPP_PYTHON, "build": "GGML_NATIVE=ON, from the PyPI source distribution",
        "prompt_tokens": PEER_PROMPT, "new_tokens": PEER_NEW, "threads": threads, "batch": 1,
        "definitions": {"tokens/s": "greedy decode steps after the first token, per second, best of 3",
                        "GB/s of weights": "every weight but the embedding table, at the format's bytes per weight, per token"},
        "target": f"{run.aotc} tokens/s >= llama.cpp F32's, same model and run", "misses": misses, "rows": rows,
    }  # fmt: skip
