"""parallel: batch-1 decode of one bundle at --tensor-parallel 1 and 2, ~100M model (tiny
under --quick), each through `aotc run --check` in fresh processes (TP=2: two local gloo
ranks, each with half the cores), beside eager in one process; and the weight bytes each
rank holds, by kind. Then a DeepSeek V4 (the tiny one, 3 layers and 4 experts, under
--quick; else 6 layers of the v4 section's ~100M shapes, 16 experts) at --expert-parallel 1 and 2 the same way, with the
routed experts' bytes each rank holds, and the same V4 at --expert-parallel 2 with and without
--data-parallel-attention on 4 prompts. On a machine of 2 cores this shows correctness and
the collectives' overhead, not a speed-up: two ranks of one thread each do the work of one
process of two threads, plus their all-reduces per step."""

from __future__ import annotations

import json
import subprocess
import sys

from common import MAX_SEQ, Run, section, table

from aotc import parallel
from aotc.models.loader import load_model
from aotc.models.tiny import write_tiny
from aotc.runtime import Bundle

PROMPT = "Once upon a time there was a small model that learned to count: one, two, three,"


def _aotc_run(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "aotc", "run", *args, "--json", "--prompt", PROMPT], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"parallel: aotc run {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rank_bytes(bundle_dir, model_dir, degree: int) -> list[dict]:
    """The weight bytes each rank's graphs hold (what bind hands them), split into the
    tensors the plan at `degree` splits and those every rank holds whole; the embedding
    table, looked up on the host, is whole on every rank beside them."""
    bundle = Bundle.load(bundle_dir)
    layout = bundle.manifest.parallel
    rows = []
    for rank in range(layout.world_size):
        with parallel.tracing(layout, rank=rank):  # bind's check wants a rank of a group of that size
            model = load_model(model_dir, layout=layout, rank=rank).model
            bundle.bind(model, rank=rank, world_size=layout.world_size)
        plan = type(model).shard_specs(model.config, degree)
        shard = {p.data_ptr(): parallel.spec_of(plan, n) for n, p in model.named_parameters()}
        held = {t.data_ptr(): t for m in model.modules() for d in vars(m).values() if hasattr(d, "steps") for s in d.steps.values() for st in s.values() for t in st.weights}
        split = sum(t.nbytes for k, t in held.items() if shard.get(k) is not None)
        rows.append({
            "tensor parallel": layout.tensor_parallel, "rank": rank, "split MB": split / 1e6, "whole MB": (sum(t.nbytes for t in held.values()) - split) / 1e6,
            "embedding (host) MB": model.model.embed_tokens.weight.nbytes / 1e6,
        })  # fmt: skip
    return rows


def expert_bytes(bundle_dir, model_dir) -> list[dict]:
    """The routed experts' bytes each rank's graphs hold (their stacks), and the rest."""
    bundle = Bundle.load(bundle_dir)
    layout = bundle.manifest.parallel
    rows = []
    for rank in range(layout.world_size):
        with parallel.tracing(layout, rank=rank):
            model = load_model(model_dir, layout=layout, rank=rank).model
            bundle.bind(model, rank=rank, world_size=layout.world_size)
        stacks = {p.data_ptr() for n, p in model.named_parameters() if ".ffn.experts." in n}
        held = {t.data_ptr(): t for m in model.modules() for d in vars(m).values() if hasattr(d, "steps") for s in d.steps.values() for st in s.values() for t in st.weights}
        # A stack's sources are views of it: the stack is held where its first expert's tensor starts.
        routed = sum(t.nbytes for k, t in held.items() if k in stacks and t.dim() == 3)
        rows.append({"expert parallel": layout.expert_parallel, "rank": rank, "routed experts MB": routed / 1e6, "rest MB": (sum(t.nbytes for t in held.values()) - routed) / 1e6})
    return rows


def v4_experts(run: Run, new: str) -> tuple[list[dict], list[dict]]:
    from sections.v4 import V4_100M

    model_dir = write_tiny(run.root / "parallel-v4", arch="deepseek_v4", layers=3 if run.quick else 6, force=True, **({} if run.quick else V4_100M))
    rows, weights = [], []
    for n in (1, 2):
        out = run.bundle(model_dir, f"parallel-ep{n}", batch_buckets=(1,), chunk_buckets=(64,), expert_parallel=n)
        report = _aotc_run([str(out), "--check", "--max-new-tokens", new])
        t = report["timings"]
        rows.append({
            "what": f"DeepSeek V4, aotc {run.backend}, expert parallel {n}", "ranks": n, "decode tokens/s": t["decode_tokens_per_s"],
            "ttft ms": t["ttft_s"] * 1e3, "tokens equal eager": report["check"]["tokens_equal"], "max logit diff": report["check"]["max_logit_diff"],
        })  # fmt: skip
        weights += expert_bytes(out, model_dir)
    for r in rows:
        r["vs expert parallel 1"] = r["decode tokens/s"] / rows[0]["decode tokens/s"]
    for w in weights:
        w["routed / EP=1's"] = w["routed experts MB"] / weights[0]["routed experts MB"]
    return rows, weights


PROMPTS = [PROMPT, "Hello, world!", "The sea is", "a b c d e f g h i j k l m n o p"]


def v4_data_parallel(run: Run, new: str) -> list[dict]:
    """The same 4 prompts through V4 at --expert-parallel 2: part 1 (every rank runs every
    row: batch buckets up to 4, 5 cache slots on each rank) beside part 2 (data-parallel
    attention: each rank 2 of the rows, 3 cache slots); bytes each rank holds, collectives
    per step, and what the lockstep costs (the per-step all-gather of tokens, and the
    calls a rank ran with no row of its own)."""
    from aotc.format import read_manifest

    model_dir = run.root / "parallel-v4"
    model = load_model(model_dir).model
    layers = model.config.num_hidden_layers
    rows = []
    for dp, buckets in ((False, (1, 2, 4)), (True, (1, 2))):
        out = run.bundle(model_dir, f"parallel-ep2-dp{int(dp)}", batch_buckets=buckets, chunk_buckets=(64,), expert_parallel=2, data_parallel_attention=dp)
        args = [str(out), "--check", "--json", "--max-new-tokens", new, "--max-batch", str(max(buckets))]
        for p in PROMPTS:
            args += ["--prompt", p]
        done = subprocess.run([sys.executable, "-m", "aotc", "run", *args], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"parallel: aotc run {' '.join(args)} failed:\n{done.stderr[-2000:]}")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        m, t = read_manifest(out), report["timings"]
        held = expert_bytes(out, model_dir)[0]
        if dp:
            moe = "all-gather + fp32 reduce-scatter" if m.parallel.gather == "collectives" else "2 all-reduces (rows placed, fp32 sums)"
            per_step = f"{layers} x ({moe}) per call + 1 all-gather of tokens"
        else:
            per_step = f"{layers} x fp32 all-reduce per call"
        steps_s = t["prefill_s"] + t["decode_s"]
        rows.append({
            "what": "part 2: data-parallel attention" if dp else "part 1: attention on every rank", "sequences at once": max(buckets) * (2 if dp else 1),
            "cache slots per rank": m.shapes.cache_slots, "caches MB per rank": model.cache_bytes(m.shapes.cache_slots, m.shapes.max_seq) / 1e6,
            "weights MB per rank": held["routed experts MB"] + held["rest MB"], "collectives per step": per_step,
            "decode tokens/s": t["decode_tokens_per_s"], "ttft ms": t["ttft_s"] * 1e3,
            "lockstep all-gather share": t.get("exchange_s", 0.0) / steps_s if steps_s else 0.0, "idle calls (rank 0)": t.get("idle_calls", 0),
            "tokens equal eager": report["check"]["tokens_equal"],
        })  # fmt: skip
    for r in rows:
        r["caches / part 1's"] = r["caches MB per rank"] / rows[0]["caches MB per rank"]
    return rows


@section("parallel")
def parallel_section(run: Run) -> dict:
    name = run.main
    model_dir = run.model(name)
    new = "16" if run.quick else "64"
    bundles = {n: run.bundle(model_dir, f"parallel-tp{n}", batch_buckets=(1,), chunk_buckets=(64,), tensor_parallel=n) for n in (1, 2)}
    eager = _aotc_run([str(model_dir), "--eager", "--max-new-tokens", new])
    rows, weights = [], []
    for n, out in bundles.items():
        report = _aotc_run([str(out), "--check", "--max-new-tokens", new])
        t = report["timings"]
        rows.append({
            "what": f"aotc {run.backend}, tensor parallel {n}", "ranks": n, "decode tokens/s": t["decode_tokens_per_s"],
            "ttft ms": t["ttft_s"] * 1e3, "tokens equal eager": report["check"]["tokens_equal"] and report["prompts"][0]["new_ids"] == eager["prompts"][0]["new_ids"],
            "max logit diff": report["check"]["max_logit_diff"],
        })  # fmt: skip
        weights += rank_bytes(out, model_dir, max(bundles))
    rows.append({"what": "eager, one process", "ranks": 1, "decode tokens/s": eager["timings"]["decode_tokens_per_s"], "ttft ms": eager["timings"]["ttft_s"] * 1e3})
    one = rows[0]["decode tokens/s"]
    for r in rows:
        r["vs tensor parallel 1"] = r["decode tokens/s"] / one
    split1 = weights[0]["split MB"]
    for w in weights:
        w["split / TP=1's split"] = w["split MB"] / split1
    table(f"batch-1 decode, {name} model, {new} new tokens, max_seq {MAX_SEQ} (2 cores: correctness and overhead, not speed)", rows)
    table("weight bytes each rank's graphs hold", weights)
    v4_rows, v4_weights = v4_experts(run, new)
    table(f"batch-1 decode, DeepSeek V4, {new} new tokens (2 cores: correctness and overhead, not speed)", v4_rows)
    table("routed experts' bytes each rank's graphs hold", v4_weights)
    dp_rows = v4_data_parallel(run, new)
    table(f"DeepSeek V4 at expert parallel 2, 4 prompts, {new} new tokens: attention on every rank (part 1) or data-parallel (part 2)", dp_rows)
    return {"model": name, "new_tokens": int(new), "rows": rows, "weights": weights, "v4_rows": v4_rows, "v4_weights": v4_weights, "v4_data_parallel": dp_rows}
