"""prefill: a 715-token prompt, ~100M model (tiny under --quick), in bundles with chunk
buckets 128, 512, and both (one prefill call, as `aotc run` makes it: the runtime covers
the prompt's tail with the chunks that pad it least): aotc inductor (or --backend)
against eager and torch.compile of the gpt-fast style model on the same chunks; issue
20's target (aotc <= 0.8x eager)."""

from __future__ import annotations

import torch
from common import Run, gemm_peak, print_misses, section, table, timeit
from gptfast import from_aotc

from aotc.models.loader import load_model
from aotc.runtime import Bundle, tolerance_for

PREFILL_PROMPT, PREFILL_MAX_SEQ, PREFILL_TARGET = 715, 1024, 0.8
PREFILL_CHUNKS = ((128,), (512,), (128, 512))  # a bundle's chunk buckets (--prefill-chunk)


@section("prefill")
def prefill(run: Run) -> dict:
    """The runtime splits the prompt into chunks (whole largest ones, then the rest in the
    chunk buckets that pad it least) and pads the last one; eager and torch.compile run the
    same chunks (torch.compile compiles each chunk length once). The last token's logits
    of each way are checked against eager's before timing. Prefill is compute-bound: the
    linear layers' FLOPs (2 x weights but the embedding x tokens) per second are set
    beside a 2048^3 matmul's, measured here."""
    name = run.main
    model_dir = run.model(name)
    model = load_model(model_dir).model
    prompt = torch.randint(3, 500, (PREFILL_PROMPT,), generator=torch.Generator().manual_seed(0))
    caches = model.allocate_caches(2, PREFILL_MAX_SEQ)
    base = from_aotc(model)
    base.setup_caches(1, PREFILL_MAX_SEQ)
    tolerance = tolerance_for(run.backend)
    repeats = dict(min_time=run.times(3.0, 0.5), repeats=3)
    flops_per_token = 2 * sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.embed_tokens"))
    peak = gemm_peak(min_time=run.times(2.0))
    rows = []
    for chunks in PREFILL_CHUNKS:
        label = ",".join(map(str, chunks))
        bundle = Bundle.load(run.bundle(model_dir, f"prefill-{label}", batch_buckets=(1,), chunk_buckets=chunks, max_seq=PREFILL_MAX_SEQ))
        bundle.bind(model)
        layer = model.model.layers[0].prefill
        pieces = layer.pieces(PREFILL_PROMPT)
        computed = sum(layer.bucket_for[m] for m in pieces)  # padding rows included
        Bundle.unbind(model)
        spans = [(sum(pieces[:i]), m) for i, m in enumerate(pieces)]

        def ours():
            return model.prefill(prompt, 0, caches)

        def chunked():
            for start, m in spans:
                logits = model.prefill(prompt[start : start + m], 0, caches, start)
            return logits

        step = run.compile(base, fullgraph=True, dynamic=False)

        def theirs():
            with torch.no_grad():
                for start, m in spans:
                    logits = step(prompt[None, start : start + m], torch.arange(start, start + m))
            return logits[0, -1]

        expected = chunked()
        times = {"eager": timeit(chunked, **repeats)}
        bundle.bind(model)
        torch.testing.assert_close(ours(), expected, atol=tolerance, rtol=0)
        times[run.aotc] = timeit(ours, **repeats)
        Bundle.unbind(model)
        torch.testing.assert_close(theirs(), expected, atol=tolerance, rtol=0)
        times[run.baseline] = timeit(theirs, **repeats)
        torch._dynamo.reset()
        row = {"chunk buckets": label, "chunks": "+".join(map(str, pieces)), **{f"{k} ms": v * 1e3 for k, v in times.items()}}
        row["aotc tokens/s"] = PREFILL_PROMPT / times[run.aotc]
        row["aotc/eager"] = times[run.aotc] / times["eager"]
        row[f"aotc/{run.baseline}"] = times[run.aotc] / times[run.baseline]
        row["eager GFLOP/s"] = flops_per_token * PREFILL_PROMPT / times["eager"] / 1e9
        row["rows computed"] = computed
        row["aotc GFLOP/s, padding included"] = flops_per_token * computed / times[run.aotc] / 1e9
        row["target met"] = row["aotc/eager"] <= PREFILL_TARGET
        rows.append(row)
    misses = [
        f"chunks {r['chunks']}: aotc takes {r['aotc/eager']:.2f}x eager's time ({r['rows computed']} rows computed for {PREFILL_PROMPT}); "
        f"eager's linear layers already run at {r['eager GFLOP/s']:.0f} GFLOP/s, {r['eager GFLOP/s'] / (peak / 1e9):.2f} of the GEMM peak"
        for r in rows if not r["target met"]
    ]  # fmt: skip
    table(f"prefill of {PREFILL_PROMPT} tokens, {name} model, batch 1 (ms for the prompt; GEMM peak {peak / 1e9:.0f} GFLOP/s; target: aotc <= {PREFILL_TARGET}x eager)", rows)
    print_misses(misses)
    return {
        "model": name, "prompt_tokens": PREFILL_PROMPT, "max_seq": PREFILL_MAX_SEQ, "unit": "ms for the whole prompt", "gemm_peak_GFLOPs": peak / 1e9,
        "target": f"aotc <= {PREFILL_TARGET}x eager", "misses": misses, "rows": rows,
    }  # fmt: skip
