"""aotc against what a user would pick instead, side by side in one run.

    python bench/perf.py [--quick] [--peers] [--out bench/results/perf.json]

Sections (each a table, all in one JSON file):
  decode     decode step latency per batch bucket: eager, aotc export, aotc
             inductor, torch.compile of a gpt-fast style static-cache model
  ttft       time to first token in a fresh process: aotc run from a built
             bundle, the torch.compile baseline (cold and warm inductor cache), eager
  build      build time at 2, 8, 32 layers of one layer shape: aotc versus
             whole-model torch.compile and whole-model AOTInductor, and sizes
  bandwidth  decode of the ~100M model at every batch bucket against the
             roofline, max(weight bytes / copy bandwidth, FLOPs / GEMM peak):
             copy bandwidth is bytes read per second by a streaming sum over
             1 GiB, GEMM peak a 2048^3 fp32 matmul, both measured in the same
             run; issue 19's targets (>= 0.7 of the roofline, <= 0.4x eager)
  memory     peak RSS of a weight-free build of a 32-layer hidden-1024 model
             versus loading its weights
  lowp       batch-1 decode of the ~100M model with fp8 weights (stored as the
             checkpoint has them, decoded in the graph) against the same model
             in fp32 and in bf16, aotc inductor: ms per step and GB/s of the
             bytes stored; resident memory of `aotc run` after load against the
             checkpoint and against dequantizing at load; eager fp8 against
             eager fp32 (max logit difference, greedy agreement over 200 tokens)
  v4         DeepSeek V4 of ~100M parameters: decode at batch 1 and 4, prefill
             of a 715-token prompt in chunks of 128, aotc inductor versus eager
             and torch.compile of the eager model; batch-1 decode's bytes of
             the weights it uses (the chosen experts and the rest) versus copy
             bandwidth
  kvcache    fp8 KV caches against full precision, ~100M model in a
             max_seq-4096 bundle: cache bytes per token, batch-1 decode at
             position 4000 (aotc inductor and eager, each cache dtype), and
             eager fp8 cache against eager full precision (max logit
             difference, greedy agreement over 200 tokens)

  prefill    prefill of a 715-token prompt, ~100M model, in bundles with
             chunk buckets 128, 512, and both (one prefill call, as `aotc
             run` makes it: the runtime covers the prompt's tail with the
             chunks that pad it least): aotc inductor against eager and
             torch.compile of the gpt-fast style model on the same chunks;
             issue 20's target (aotc <= 0.8x eager)
  contention batch-1 decode tokens/s of `generate` through an inductor bundle
             (tiny and ~100M), alone and next to a CPU-bound busy loop, with
             torch's threads fixed at the CPU count and with aotc's default
             (runtime/threads.py: the CPUs other processes leave free);
             issue 20's target (busy >= 1/3 of quiet)
  context    batch-1 decode step at positions 128 and 4000, ~100M model, in a
             max_seq-4096 bundle (default context buckets 256, 1024, 4096)
             against a max_seq-256 bundle, eager and torch.compile (4096
             caches); issue 20's targets (<= 1.2x the 256 bundle at 128,
             <= 1.1x eager at 4000)
  resident   xla decode at position 128 (context bucket 256), ~100M model, in a
             max_seq-4096 bundle against a max_seq-256 bundle: step times, and
             the bytes a step copies: cache buffers that moved over 32 steps
             (each buffer's unsafe_buffer_pointer before and after) and the
             host<->device transfers the device counts; eager beside them.
             Issue 31's target: no cache byte copied
  overhead   tiny model (2 and 8 layers), batch 1 and 8: `generate`'s decode
             step against the time inside its compiled graphs, and the tensors
             the runtime allocates per step outside them; issue 20's target
             (overhead <= 10% of the graph time at batch 1)
  peers      (with --peers) llama.cpp, built once from llama-cpp-python's
             source distribution into --peers-cache: the ~100M model as GGUF
             F32, F16 and Q8_0 against aotc inductor and eager, batch-1 greedy
             decode tokens/s with the same prompt ids and threads; greedy
             agreement at F32; issue 19's target (aotc >= llama.cpp F32)

--quick runs the tiny models only, with fewer repeats and layer counts 2, 8.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peers  # noqa: E402
from gptfast import from_aotc  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from aotc.backends.base import Step  # noqa: E402
from aotc.build import BuildOptions, build  # noqa: E402
from aotc import kvcache  # noqa: E402
from aotc.format import encode, write_atomic  # noqa: E402
from aotc.models.base import load_model  # noqa: E402
from aotc.models.tiny import write_tiny  # noqa: E402
from aotc.runtime import Bundle, Dispatcher, generate, tolerance_for  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

console = Console()
BUCKETS = (1, 2, 4, 8)
MAX_SEQ = 256
POSITION = 128  # decode steps are timed at this context position
# ~100M parameters, fp32: 8 layers of hidden 1024, GQA 16/4, vocab 8192
M100 = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=8192)
# ~100M-parameter DeepSeek V4, fp32: 93M in total, 27M active per token. 6 layers (each
# attention kind twice), hidden 512, 16 routed experts of 512 at top-2 and a shared one.
V4_100M = dict(
    hidden_size=512, moe_intermediate_size=512, n_routed_experts=16, num_experts_per_tok=2, num_attention_heads=8, head_dim=64,
    q_lora_rank=256, o_lora_rank=128, o_groups=4, index_n_heads=8, index_head_dim=64, index_topk=16, vocab_size=8192, sliding_window=128,
)  # fmt: skip
V4_BUCKETS = (1, 4)
V4_PROMPT, V4_CHUNK, V4_MAX_SEQ = 715, 128, 1024
# The targets: aotc / eager for decode and prefill, and batch-1 decode's share of copy bandwidth
V4_TARGETS = {"decode": 0.5, "prefill": 0.5, "bandwidth": 0.6}


def timeit(fn, *, min_time=0.5, repeats=5, best=False) -> float:
    """Median (or best) seconds per call over `repeats` runs of about min_time/repeats each."""
    fn()
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    n = max(1, int(min_time / repeats / once))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return min(samples) if best else statistics.median(samples)


def make_models(root: Path, quick: bool) -> dict[str, Path]:
    models = {"tiny": write_tiny(root / "tiny")}
    if not quick:
        # The tokenizer has 512 tokens; the other vocab rows are unused ids, as in real models.
        models["100m"] = write_tiny(root / "100m", layers=8, **M100)
    return models


def bundle_for(model_dir: Path, root: Path, backend: str, **kw) -> Path:
    out = root / f"{model_dir.name}-{backend}"
    kw.setdefault("max_seq", MAX_SEQ)
    build(BuildOptions(model_dir, out=out, backend=backend, **kw))
    return out


# -- decode --------------------------------------------------------------------


def bench_decode(models: dict[str, Path], root: Path, results: dict, quick: bool) -> None:
    rows = []
    for name, model_dir in models.items():
        bundles = {b: Bundle.load(bundle_for(model_dir, root, b, batch_buckets=BUCKETS, chunk_buckets=(128,))) for b in ("export", "inductor")}
        loaded = load_model(model_dir)
        model = loaded.model
        base = from_aotc(model)
        for batch in BUCKETS:
            ids = torch.randint(3, 500, (batch,), generator=torch.Generator().manual_seed(batch))
            positions = torch.full((batch,), POSITION)
            caches = model.allocate_caches(max(BUCKETS) + 1, MAX_SEQ)
            times = {"eager": timeit(lambda: model.decode(ids, positions, caches), min_time=0.3 if quick else 1.0)}
            expected = model.decode(ids, positions, caches)
            for backend, bundle in bundles.items():
                bundle.bind(model)
                torch.testing.assert_close(model.decode(ids, positions, caches), expected, atol=1e-3, rtol=1e-3)
                times[f"aotc {backend}"] = timeit(lambda: model.decode(ids, positions, caches), min_time=0.3 if quick else 1.0)
                Bundle.unbind(model)
            base.setup_caches(batch, MAX_SEQ)
            step = torch.compile(base, fullgraph=True, dynamic=False)
            pos = torch.tensor([POSITION])
            with torch.no_grad():
                torch.testing.assert_close(step(ids[:, None], pos)[:, 0], expected, atol=1e-3, rtol=1e-3)
                times["torch.compile"] = timeit(lambda: step(ids[:, None], pos), min_time=0.3 if quick else 1.0)
            torch._dynamo.reset()
            row = {"model": name, "batch": batch, **{k: v * 1e3 for k, v in times.items()}}
            row["inductor/eager"] = times["aotc inductor"] / times["eager"]
            row["inductor/torch.compile"] = times["aotc inductor"] / times["torch.compile"]
            rows.append(row)
    results["decode"] = {"unit": "ms per decode step", "max_seq": MAX_SEQ, "position": POSITION, "rows": rows}
    table("decode step (ms), max_seq %d, position %d" % (MAX_SEQ, POSITION), rows)


# -- time to first token -----------------------------------------------------------


def bench_ttft(models: dict[str, Path], root: Path, results: dict, quick: bool) -> None:
    model_dir = models["tiny"]
    bundle = root / "tiny-inductor"
    n = 100
    probe = [sys.executable, str(HERE / "ttft.py")]
    cache = root / "inductor-cache-ttft"
    runs = {
        "aotc run (bundle)": probe + ["aotc", str(bundle), str(model_dir), str(n)],
        "torch.compile, cold cache": probe + ["compile", str(model_dir), str(n)],
        "torch.compile, warm cache": probe + ["compile", str(model_dir), str(n)],
        "eager": probe + ["eager", str(model_dir), str(n)],
    }
    rows, tokens = [], set()
    for label, cmd in runs.items():
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        wall = time.perf_counter() - t0
        report = json.loads(out.stdout.strip().splitlines()[-1])
        tokens.add(report["token"])
        rows.append({"what": label, "process_s": wall, "in_script_s": report["seconds"]})
    if len(tokens) != 1:
        raise SystemExit(f"ttft: the runs disagree on the first token: {tokens}")
    base = next(r["process_s"] for r in rows if r["what"] == "torch.compile, cold cache")
    for r in rows:
        r["vs torch.compile cold"] = r["process_s"] / base
    results["ttft"] = {"prompt_tokens": n, "rows": rows}
    table(f"time to first token in a fresh process (s), tiny model, {n}-token prompt", rows)


# -- build time and size ---------------------------------------------------------


_WHOLE = r"""
import sys, time, json, torch
sys.path.insert(0, sys.argv[1])
from gptfast import from_aotc
from aotc.models.base import load_model
mode, model_dir, out = sys.argv[2], sys.argv[3], sys.argv[4]
t0 = time.perf_counter()
model = from_aotc(load_model(model_dir).model)
model.setup_caches(1, %(max_seq)d)
decode = (torch.randint(3, 500, (1, 1)), torch.tensor([0]))
prefill = (torch.randint(3, 500, (1, 128)), torch.arange(128))
size = 0
with torch.no_grad():
    if mode == "compile":
        step = torch.compile(model, fullgraph=True, dynamic=False)
        step(*decode); step(*prefill)
    else:
        import os
        for name, args in (("decode", decode), ("prefill", prefill)):
            ep = torch.export.export(model, args, strict=False)
            path = torch._inductor.aoti_compile_and_package(ep, package_path=f"{out}-{name}.pt2")
            size += os.path.getsize(path)
print(json.dumps({"seconds": time.perf_counter() - t0, "size": size}))
""" % {"max_seq": MAX_SEQ}


def bench_build(root: Path, results: dict, quick: bool) -> None:
    rows = []
    for layers in (2, 8) if quick else (2, 8, 32):
        model_dir = write_tiny(root / f"build-{layers}", layers=layers)
        row = {"layers": layers}
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(root / f"inductor-cache-build-{layers}"))
        t0 = time.perf_counter()
        out = root / f"build-{layers}-bundle"
        subprocess.run(
            [sys.executable, "-m", "aotc.cli", "build", str(model_dir), "--backend", "inductor", "--no-cache", "--buckets", "1", "--prefill-chunk", "128", "--max-seq", str(MAX_SEQ), "-o", str(out)],
            env=env, check=True, capture_output=True,
        )
        row["aotc s"] = time.perf_counter() - t0
        row["aotc bundle MB"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
        for mode, label in (("compile", "torch.compile"), ("aoti", "whole-model AOTI")):
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(root / f"inductor-cache-{mode}-{layers}"))
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", _WHOLE, str(HERE), mode, str(model_dir), str(root / f"whole-{layers}")], env=env, check=True, capture_output=True, text=True)
            row[f"{label} s"] = time.perf_counter() - t0
            if mode == "aoti":
                row["whole-model AOTI MB"] = json.loads(proc.stdout.strip().splitlines()[-1])["size"] / 1e6
        rows.append(row)
        console.print(f"  build, {layers} layers: {row}", highlight=False)
    first = rows[0]
    for r in rows:
        r["aotc vs 2 layers"] = r["aotc s"] / first["aotc s"]
    results["build"] = {"graphs": "decode b1 + prefill 128 (+ head b1 for aotc)", "cold inductor cache each": True, "rows": rows}
    table("build time (s, fresh process, cold inductor cache) and size (MB)", rows)


# -- bandwidth -------------------------------------------------------------------


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Copy bandwidth, as issue 19 defines it: bytes read per second by a streaming
    reduction (a sum) over a buffer of 1 GiB, far larger than any cache; best of 10."""
    buf = torch.ones(nbytes // 4)
    return nbytes / timeit(lambda: buf.sum(), min_time=3.0, repeats=10, best=True)


def gemm_peak(n: int = 2048) -> float:
    """fp32 FLOP/s of a large matmul (n x n x n), best of 5: the compute side of the roofline."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / timeit(lambda: a @ b, min_time=2.0, repeats=5, best=True)


# Issue 19's targets, per batch bucket 1-8: aotc decode within 0.4x eager's step time, and at
# least 70% of the roofline.
DECODE_TARGETS = {"of_eager": 0.4, "of_roofline": 0.7}
# How the CPU decode path reads each weight, at every batch bucket (rewrite_skinny_linears).
SKINNY_PATH = "a mul + sum per row, fused by Inductor into one pass over each weight"


def bench_bandwidth(models: dict[str, Path], results: dict) -> None:
    """Decode steps of this run's decode section against the roofline:
    max(weight bytes / copy bandwidth, FLOPs / GEMM peak), both measured here. Weight
    bytes: every weight but the embedding table; FLOPs: 2 x those weights x rows (the
    linear layers; attention at position 128 adds under 1%)."""
    name = "100m" if "100m" in models else "tiny"
    model = load_model(models[name]).model
    weights = [p for n, p in model.named_parameters() if not n.startswith("model.embed_tokens")]
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    copy, peak = copy_bandwidth(), gemm_peak()
    rows = []
    for step in (r for r in results["decode"]["rows"] if r["model"] == name):
        batch = step["batch"]
        flops = 2 * sum(p.numel() for p in weights) * batch
        roofline_ms = max(weight_bytes / copy, flops / peak) * 1e3
        row = {
            "batch": batch, "roofline ms": roofline_ms, "bound by": "memory" if weight_bytes / copy >= flops / peak else "compute",
            "aotc inductor ms": step["aotc inductor"], "of roofline": roofline_ms / step["aotc inductor"],
            "eager ms": step["eager"], "aotc / eager": step["aotc inductor"] / step["eager"],
            "weight GB/s": weight_bytes / (step["aotc inductor"] / 1e3) / 1e9,
        }  # fmt: skip
        row["targets met"] = row["of roofline"] >= DECODE_TARGETS["of_roofline"] and row["aotc / eager"] <= DECODE_TARGETS["of_eager"]
        rows.append(row)
    misses = [
        f"batch {r['batch']}: {r['of roofline']:.2f} of the roofline ({r['bound by']}-bound; weights read at {r['weight GB/s']:.1f} GB/s, "
        f"copy {copy / 1e9:.1f}), {r['aotc / eager']:.2f}x eager"
        for r in rows if not r["targets met"]
    ]  # fmt: skip
    results["bandwidth"] = {
        "model": name, "weight_bytes": weight_bytes, "copy_GBps": copy / 1e9, "gemm_peak_GFLOPs": peak / 1e9,
        "definitions": {
            "copy bandwidth": "bytes read per second by a streaming sum over a 1 GiB fp32 buffer, best of 10, this run",
            "roofline": "max(weight bytes / copy bandwidth, FLOPs / GEMM peak); GEMM peak: a 2048^3 fp32 matmul, this run",
        },
        "decode path": SKINNY_PATH, "targets": DECODE_TARGETS, "misses": misses, "rows": rows,
    }  # fmt: skip
    table(
        f"decode against the roofline, {name} model ({weight_bytes / 1e6:.0f} MB of weights; copy {copy / 1e9:.1f} GB/s read, "
        f"GEMM {peak / 1e9:.0f} GFLOP/s; targets: >= 0.7 of the roofline, <= 0.4x eager)",
        rows,
    )
    print_misses(misses)


# -- memory ----------------------------------------------------------------------

_RSS = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"


def bench_memory(root: Path, results: dict) -> None:
    model_dir = write_tiny(root / "mem-32x1024", layers=32, **M100)
    weights = (model_dir / "model.safetensors").stat().st_size
    rows = []
    cmds = {
        "aotc build (weight-free)": [sys.executable, "-m", "aotc.cli", "build", str(model_dir), "--backend", "export", "--no-cache", "--buckets", "1", "--prefill-chunk", "128", "--max-seq", str(MAX_SEQ), "-o", str(root / "mem-bundle")],
        "floor: python + import torch, aotc": [sys.executable, "-c", "import torch, aotc.build"],
        "eager model, weights in memory": [sys.executable, "-c", f"from aotc.models.base import load_model; m = load_model({str(model_dir)!r}).model; [p.sum() for p in m.parameters()]"],
    }
    for label, cmd in cmds.items():
        out = subprocess.run([sys.executable, "-c", _RSS, *cmd], check=True, capture_output=True, text=True)
        rss = int(out.stdout.strip()) * 1024
        rows.append({"what": label, "peak RSS MB": rss / 1e6, "of weight bytes": rss / weights})
    results["memory"] = {"layers": 32, "hidden": 1024, "weight_MB": weights / 1e6, "rows": rows}
    table(f"peak RSS, 32 layers x hidden 1024 ({weights / 1e6:.0f} MB of weights)", rows)


# -- DeepSeek V4 -------------------------------------------------------------------


def v4_weight_bytes(model) -> dict[str, int]:
    """Parameter counts, and the weight bytes a batch-1 decode step reads: every weight
    but the embedding table (one row is read) and the routed experts, of which each MoE
    layer reads the k chosen."""
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    routed = {n: p for n, p in model.named_parameters() if ".ffn.experts." in n}
    per_expert = sum(p.numel() * p.element_size() for p in routed.values()) // (c.num_hidden_layers * c.n_routed_experts)
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in routed and not n.startswith("model.embed_tokens"))
    active = total - sum(p.numel() for p in routed.values()) * (1 - c.num_experts_per_tok / c.n_routed_experts)
    return {
        "params": total, "active_params": int(active), "expert_bytes_read": c.num_hidden_layers * c.num_experts_per_tok * per_expert,
        "other_bytes_read": rest,
    }  # fmt: skip


def bench_v4(root: Path, results: dict, quick: bool) -> None:
    name = "v4-tiny" if quick else "v4-100m"
    model_dir = write_tiny(root / name, arch="deepseek_v4", layers=3 if quick else 6, **({} if quick else V4_100M))
    t0 = time.perf_counter()
    # A cold build (no compile cache), to set beside torch.compile's compiling first calls
    bundle = Bundle.load(bundle_for(model_dir, root, "inductor", batch_buckets=V4_BUCKETS, chunk_buckets=(V4_CHUNK,), max_seq=V4_MAX_SEQ, use_cache=False))
    build_s = time.perf_counter() - t0
    model = load_model(model_dir).model
    sizes = v4_weight_bytes(model)
    tolerance = tolerance_for(torch.float32, "inductor")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 500, (V4_PROMPT,), generator=g)
    caches = model.allocate_caches(max(V4_BUCKETS) + 1, V4_MAX_SEQ)
    decode_ids = {b: torch.randint(3, 500, (b,), generator=g) for b in V4_BUCKETS}
    position = {b: torch.full((b,), V4_PROMPT) for b in V4_BUCKETS}
    repeats = dict(min_time=0.3 if quick else 2.0, repeats=3)

    def prefill(run, slot=0):
        for start in range(0, V4_PROMPT, V4_CHUNK):
            logits = run(prompt[start : start + V4_CHUNK], slot, caches, start)
        return logits

    def timed(label: str, prefill_fn, decode_fn) -> dict:
        """Time one way of running the model; its outputs against eager's (the first run)."""
        t0 = time.perf_counter()  # the first calls: torch.compile compiles in them
        prefill(prefill_fn)
        for b in V4_BUCKETS:
            decode_fn(decode_ids[b], position[b], caches)
        first_calls[label] = time.perf_counter() - t0
        out = {"prefill": timeit(lambda: prefill(prefill_fn), **repeats)}
        got = {"prefill": prefill(prefill_fn)}
        for b in V4_BUCKETS:
            out[f"decode b{b}"] = timeit(lambda: decode_fn(decode_ids[b], position[b], caches), **repeats)
            got[f"decode b{b}"] = decode_fn(decode_ids[b], position[b], caches)
        if reference:
            for k, v in got.items():
                torch.testing.assert_close(v, reference[k], atol=tolerance, rtol=0, msg=f"{label}, {k}: logits differ from eager")
        else:
            reference.update(got)
        console.print(f"  {name} {label}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in out.items()), highlight=False)
        return out

    copy_first = copy_bandwidth()
    reference: dict = {}
    first_calls: dict = {}
    for slot in range(1, max(V4_BUCKETS)):  # the other rows of batch 4 attend to the prompt too; every run reads these
        prefill(model.prefill, slot)
    times = {"eager": timed("eager", model.prefill, model.decode)}
    bundle.bind(model)
    times["aotc inductor"] = timed("aotc inductor", model.prefill, model.decode)
    Bundle.unbind(model)
    # The MoE's nonzero captured (unbacked), as aotc does: by default each expert's row
    # count would be a graph break and a recompile per count, until dynamo gives up.
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        compiled = torch.compile(model.prefill, dynamic=False), torch.compile(model.decode, dynamic=False)
        times["torch.compile"] = timed("torch.compile", *compiled)
    torch._dynamo.reset()
    rows = []
    for what in times["eager"]:
        row = {"what": what, **{f"{k} ms": v[what] * 1e3 for k, v in times.items()}}
        row["aotc/eager"] = times["aotc inductor"][what] / times["eager"][what]
        row["aotc/torch.compile"] = times["aotc inductor"][what] / times["torch.compile"][what]
        row["target aotc/eager"] = V4_TARGETS["prefill" if what == "prefill" else "decode"]
        rows.append(row)
    copy = max(copy_first, copy_bandwidth())  # the better of two: the share is not flattered by a slow copy
    used = sizes["expert_bytes_read"] + sizes["other_bytes_read"]
    step = times["aotc inductor"]["decode b1"]
    bandwidth = {"bytes_read": used, "GBps": used / step / 1e9, "copy_GBps": copy / 1e9, "of_copy": used / step / copy, "target": V4_TARGETS["bandwidth"]}
    results["v4"] = {
        "model": name, "config": V4_100M if not quick else "tiny", **sizes, "prompt_tokens": V4_PROMPT, "chunk": V4_CHUNK,
        "max_seq": V4_MAX_SEQ, "decode_position": V4_PROMPT, "build_s": build_s, "first_calls_s": first_calls, "unit": "ms", "rows": rows, "bandwidth": bandwidth,
    }  # fmt: skip
    table(
        f"DeepSeek V4 {name} ({sizes['params'] / 1e6:.0f}M params, {sizes['active_params'] / 1e6:.0f}M active): "
        f"prefill of {V4_PROMPT} tokens in chunks of {V4_CHUNK}, decode at position {V4_PROMPT} (ms)",
        rows,
    )
    table(
        f"DeepSeek V4 {name} batch-1 decode: bytes of the weights it uses (the {model.config.num_experts_per_tok} chosen experts "
        "per layer and the rest) per step time, versus copy bandwidth",
        [{"what": "aotc inductor decode b1", "MB read": used / 1e6, "GB/s": bandwidth["GBps"], "of copy bandwidth": bandwidth["of_copy"], "target": bandwidth["target"]},
         {"what": "memory copy", "GB/s": copy / 1e9, "of copy bandwidth": 1.0}],
    )  # fmt: skip
    console.print(
        f"aotc build (cold, {len(V4_BUCKETS)} decode buckets + prefill {V4_CHUNK}): {build_s:.0f} s; first calls (prefill + each decode bucket): "
        + ", ".join(f"{k} {v:.1f} s" for k, v in first_calls.items()),
        highlight=False,
    )


# -- low precision ---------------------------------------------------------------

LOWP_TOKENS = 200
# `aotc run`'s loading, in a fresh process: bundle, model as bind needs it, bind, a step; then RSS.
_LOAD_RSS = r"""
import sys, torch
from aotc.models.base import load_model
from aotc.runtime import Bundle
bundle, model_dir, stored = sys.argv[1], sys.argv[2], sys.argv[3]
if bundle != "floor":
    if bundle == "-":  # eager, low-precision weights dequantized at load
        model = load_model(model_dir).model
    else:
        b = Bundle.load(bundle)
        model = load_model(model_dir, stored=b.stored_params() if stored == "yes" else False).model
        b.bind(model)
    # One decode step: safetensors maps the file, and its pages count once read.
    model.decode(torch.tensor([5]), torch.tensor([0]), model.allocate_caches(2, 256))
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
print(rss * 1024)
"""


def resident_after_load(*args: str) -> int:
    out = subprocess.run([sys.executable, "-c", _LOAD_RSS, *args], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


def bound_bytes(bundle: Bundle, model) -> int:
    """The bytes of the weights the compiled entries read, each tensor once."""
    from aotc.runtime.bundle import bound_weights

    seen = {}
    for weights in bound_weights(bundle.manifest, model, bundle.dir).values():
        for t in weights.tensors():
            seen[(t.data_ptr(), t.nbytes)] = t.nbytes
    return sum(seen.values())


def bench_lowp(root: Path, results: dict, quick: bool) -> None:
    shape = {} if quick else dict(layers=8, **M100)
    name = "tiny" if quick else "100m"
    dirs = {
        "fp32": write_tiny(root / f"lowp-{name}-fp32", **shape),
        "bf16": write_tiny(root / f"lowp-{name}-bf16", torch_dtype="bfloat16", **shape),
        "fp8": write_tiny(root / f"lowp-{name}-fp8", quantize="fp8", **shape),  # the fp32 model's weights, quantized
    }
    ids = torch.randint(3, 500, (1,), generator=torch.Generator().manual_seed(1))
    positions = torch.full((1,), POSITION)
    rows, bundles = [], {}
    for kind, model_dir in dirs.items():
        bundles[kind] = bundle = Bundle.load(bundle_for(model_dir, root, "inductor", batch_buckets=(1,), chunk_buckets=(128,)))
        model = load_model(model_dir, stored=bundle.stored_params()).model
        bundle.bind(model)
        caches = model.allocate_caches(bundle.cache_slots, MAX_SEQ)
        seconds = timeit(lambda: model.decode(ids, positions, caches), min_time=0.3 if quick else 2.0)
        stored = bound_bytes(bundle, model)
        rows.append({"weights": kind, "step ms": seconds * 1e3, "stored MB read": stored / 1e6, "GB/s": stored / seconds / 1e9})
    for r in rows:
        r["fp32 ms / this"] = rows[0]["step ms"] / r["step ms"]
    results["lowp"] = {"model": name, "batch": 1, "position": POSITION, "target_fp32_over_fp8": 2.0, "rows": rows}
    table(f"batch-1 decode by weight format, {name} model, aotc inductor (target: fp8 at least 2x faster than fp32)", rows)

    checkpoint = (dirs["fp8"] / "model.safetensors").stat().st_size
    memory = [
        {"what": "checkpoint file (fp8)", "MB": checkpoint / 1e6},
        {"what": "aotc run, fp8 kept as stored", "MB": resident_after_load(str(bundles["fp8"].dir), str(dirs["fp8"]), "yes") / 1e6},
        {"what": "eager, fp8 dequantized at load", "MB": resident_after_load("-", str(dirs["fp8"]), "no") / 1e6},
        {"what": "aotc run, fp32 model", "MB": resident_after_load(str(bundles["fp32"].dir), str(dirs["fp32"]), "no") / 1e6},
        {"what": "floor: python, torch, aotc imported", "MB": resident_after_load("floor", "-", "no") / 1e6},
    ]
    for m in memory:
        m["of checkpoint"] = m["MB"] * 1e6 / checkpoint
    results["lowp"]["resident_after_load"] = memory
    table("resident memory after load (RSS)", memory)

    # Eager fp8 (dequantized at load) against eager fp32, the weights it was quantized from.
    fp32, fp8 = load_model(dirs["fp32"]).model, load_model(dirs["fp8"]).model
    prompt = [1, *range(5, 21)]
    runs = {}
    for label, m in (("fp32", fp32), ("fp8", fp8)):
        caches = m.allocate_caches(2, m.round_max_seq(len(prompt) + LOWP_TOKENS))
        logits = m.prefill(torch.tensor(prompt), 0, caches)
        out = []
        for i in range(LOWP_TOKENS):
            out.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
            logits = m.decode(torch.tensor([out[-1]]), torch.tensor([len(prompt) + i]), caches)
        runs[label] = out
    first_diff = next((i for i, (a, b) in enumerate(zip(runs["fp32"], runs["fp8"])) if a != b), LOWP_TOKENS)
    # Teacher-forced on fp32's sequence: each position's logits and argmax, both models.
    seq = torch.tensor(prompt + runs["fp32"])
    a, b = fp32.prompt_logits(seq)[len(prompt) - 1 : -1], fp8.prompt_logits(seq)[len(prompt) - 1 : -1]
    fidelity = {
        "tokens": LOWP_TOKENS,
        "max_logit_diff": (a - b).abs().max().item(),
        "logit_range": (a.max() - a.min()).item(),
        "greedy_equal_before_first_difference": first_diff,
        "teacher_forced_top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }
    results["lowp"]["eager_fp8_vs_fp32"] = fidelity
    table(f"eager fp8 against eager fp32, {LOWP_TOKENS} greedy tokens", [fidelity])


# -- fp8 KV caches -------------------------------------------------------------------

KV_MAX_SEQ, KV_POSITION, KV_TOKENS = 4096, 4000, 200


def bench_kvcache(models: dict[str, Path], root: Path, results: dict, quick: bool) -> None:
    name = "100m" if "100m" in models else "tiny"
    model_dir = models[name]
    ids, positions = torch.tensor([7]), torch.tensor([KV_POSITION])
    rows, eager = [], {}
    for dtype in ("auto", "fp8"):
        out = root / f"kv-{name}-{dtype}"
        build(BuildOptions(model_dir, out=out, backend="inductor", batch_buckets=(1,), chunk_buckets=(128,), max_seq=KV_MAX_SEQ, kv_cache_dtype=dtype))
        bundle = Bundle.load(out)
        model = load_model(model_dir, kv_cache=bundle.manifest.model.kv_cache).model
        eager[dtype] = model
        caches = model.allocate_caches(bundle.cache_slots, KV_MAX_SEQ)
        for kind, t in caches.items():  # a filled context: random keys and values (fp8: quantized as the model writes them)
            full = torch.randn(*t.shape[:-1], model.config.head_dim, generator=torch.Generator().manual_seed(0))
            kvcache.store(model.model.layers[0].self_attn.kv_rows, t, (), full)
        times = {"eager": timeit(lambda: model.decode(ids, positions, caches), min_time=0.3 if quick else 2.0)}
        expected = model.decode(ids, positions, caches)
        bundle.bind(model)
        layouts = model.cache_layouts()  # the same bytes, as the graphs take them
        regions = {kind: layouts[kind].unpack(t) if kind in layouts else t for kind, t in caches.items()}
        torch.testing.assert_close(model.decode(ids, positions, regions), expected, atol=1e-3, rtol=1e-3)
        times["aotc inductor"] = timeit(lambda: model.decode(ids, positions, regions), min_time=0.3 if quick else 2.0)
        Bundle.unbind(model)
        per_token = model.cache_bytes(1, KV_MAX_SEQ) / KV_MAX_SEQ
        rows.append({"cache": "full precision (fp32)" if dtype == "auto" else "fp8", "bytes per token": per_token, **{f"{k} ms": v * 1e3 for k, v in times.items()}})
    for r in rows:
        r["full / this, bytes"] = rows[0]["bytes per token"] / r["bytes per token"]
        r["full / this, aotc ms"] = rows[0]["aotc inductor ms"] / r["aotc inductor ms"]
    results["kvcache"] = {"model": name, "batch": 1, "max_seq": KV_MAX_SEQ, "position": KV_POSITION, "rows": rows}
    table(f"KV cache dtype, {name} model, batch-1 decode at position {KV_POSITION} of max_seq {KV_MAX_SEQ}", rows)

    # Eager fp8 cache against eager full precision: greedy from one prompt, then teacher-forced.
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = {k: generate(m, [prompt], KV_TOKENS, max_batch=1, max_seq=len(prompt) + KV_TOKENS, stop_at_eos=False).sequences[0].new_ids for k, m in eager.items()}
    first_diff = next((i for i, (a, b) in enumerate(zip(runs["auto"], runs["fp8"])) if a != b), KV_TOKENS)
    seq = torch.tensor(prompt + runs["auto"])
    a = eager["auto"].prompt_logits(seq)[len(prompt) - 1 : -1]
    b = eager["fp8"].prompt_logits(seq)[len(prompt) - 1 : -1]
    fidelity = {
        "tokens": KV_TOKENS, "max_logit_diff": (a - b).abs().max().item(), "logit_range": (a.max() - a.min()).item(),
        "greedy_equal_before_first_difference": first_diff, "teacher_forced_top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }  # fmt: skip
    results["kvcache"]["eager_fp8_vs_full"] = fidelity
    table(f"eager fp8 cache against eager full precision, {KV_TOKENS} greedy tokens", [fidelity])


# -- output ----------------------------------------------------------------------


# -- prefill -----------------------------------------------------------------------

PREFILL_PROMPT, PREFILL_MAX_SEQ, PREFILL_TARGET = 715, 1024, 0.8
PREFILL_CHUNKS = ((128,), (512,), (128, 512))  # a bundle's chunk buckets (--prefill-chunk)


def bench_prefill(models: dict[str, Path], root: Path, results: dict, quick: bool) -> None:
    """A 715-token prompt, one `prefill` call as `aotc run` makes it: the runtime splits
    it into chunks (whole largest ones, then the rest in the chunk buckets that pad it
    least) and pads the last one; eager and torch.compile run the same chunks (torch.compile
    compiles each chunk length once). The last token's logits of each way are checked
    against eager's before timing. Prefill is compute-bound: the linear layers' FLOPs
    (2 x weights but the embedding x tokens) per second are set beside a 2048^3 matmul's,
    measured here."""
    name = "100m" if "100m" in models else "tiny"
    model_dir = models[name]
    model = load_model(model_dir).model
    prompt = torch.randint(3, 500, (PREFILL_PROMPT,), generator=torch.Generator().manual_seed(0))
    caches = model.allocate_caches(2, PREFILL_MAX_SEQ)
    base = from_aotc(model)
    base.setup_caches(1, PREFILL_MAX_SEQ)
    tolerance = tolerance_for(torch.float32, "inductor")
    repeats = dict(min_time=0.5 if quick else 3.0, repeats=3)
    flops_per_token = 2 * sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.embed_tokens"))
    peak = gemm_peak()
    rows = []
    for chunks in PREFILL_CHUNKS:
        label = ",".join(map(str, chunks))
        bundle = Bundle.load(bundle_for(model_dir, root / f"prefill-{label}", "inductor", batch_buckets=(1,), chunk_buckets=chunks, max_seq=PREFILL_MAX_SEQ))
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

        step = torch.compile(base, fullgraph=True, dynamic=False)

        def theirs():
            with torch.no_grad():
                for start, m in spans:
                    logits = step(prompt[None, start : start + m], torch.arange(start, start + m))
            return logits[0, -1]

        expected = chunked()
        times = {"eager": timeit(chunked, **repeats)}
        bundle.bind(model)
        torch.testing.assert_close(ours(), expected, atol=tolerance, rtol=0)
        times["aotc inductor"] = timeit(ours, **repeats)
        Bundle.unbind(model)
        torch.testing.assert_close(theirs(), expected, atol=tolerance, rtol=0)
        times["torch.compile"] = timeit(theirs, **repeats)
        torch._dynamo.reset()
        row = {"chunk buckets": label, "chunks": "+".join(map(str, pieces)), **{f"{k} ms": v * 1e3 for k, v in times.items()}}
        row["aotc tokens/s"] = PREFILL_PROMPT / times["aotc inductor"]
        row["aotc/eager"] = times["aotc inductor"] / times["eager"]
        row["aotc/torch.compile"] = times["aotc inductor"] / times["torch.compile"]
        row["eager GFLOP/s"] = flops_per_token * PREFILL_PROMPT / times["eager"] / 1e9
        row["rows computed"] = computed
        row["aotc GFLOP/s, padding included"] = flops_per_token * computed / times["aotc inductor"] / 1e9
        row["target met"] = row["aotc/eager"] <= PREFILL_TARGET
        rows.append(row)
    misses = [
        f"chunks {r['chunks']}: aotc takes {r['aotc/eager']:.2f}x eager's time ({r['rows computed']} rows computed for {PREFILL_PROMPT}); "
        f"eager's linear layers already run at {r['eager GFLOP/s']:.0f} GFLOP/s, {r['eager GFLOP/s'] / (peak / 1e9):.2f} of the GEMM peak"
        for r in rows if not r["target met"]
    ]  # fmt: skip
    results["prefill"] = {
        "model": name, "prompt_tokens": PREFILL_PROMPT, "max_seq": PREFILL_MAX_SEQ, "unit": "ms for the whole prompt", "gemm_peak_GFLOPs": peak / 1e9,
        "target": f"aotc <= {PREFILL_TARGET}x eager", "misses": misses, "rows": rows,
    }  # fmt: skip
    table(f"prefill of {PREFILL_PROMPT} tokens, {name} model, batch 1 (ms for the prompt; GEMM peak {peak / 1e9:.0f} GFLOP/s; target: aotc <= {PREFILL_TARGET}x eager)", rows)
    print_misses(misses)


# -- context buckets ---------------------------------------------------------------

CONTEXT_MAX_SEQ, CONTEXT_POSITIONS = 4096, (128, 4000)
CONTEXT_TARGETS = {"long/short bundle at 128": 1.2, "aotc/eager at 4000": 1.1}


def bench_context(models: dict[str, Path], root: Path, results: dict, quick: bool) -> None:
    """Batch-1 decode steps at positions 128 and 4000 in a max_seq-4096 bundle (the
    default context buckets 256, 1024, 4096), beside a max_seq-256 bundle at 128, eager
    and torch.compile of the gpt-fast style model with 4096-position caches. Each way's
    logits are checked against eager's on the same caches before timing."""
    name = "100m" if "100m" in models else "tiny"
    model_dir = models[name]
    model = load_model(model_dir).model
    bundles = {n: bundle_for(model_dir, root / f"context-{n}", "inductor", batch_buckets=(1,), chunk_buckets=(128,), max_seq=n) for n in (CONTEXT_MAX_SEQ, MAX_SEQ)}
    g = torch.Generator().manual_seed(0)
    caches = {n: {k: torch.randn(v.shape, generator=g) for k, v in model.allocate_caches(2, n).items()} for n in bundles}
    base = from_aotc(model)
    base.setup_caches(1, CONTEXT_MAX_SEQ)
    step = torch.compile(base, fullgraph=True, dynamic=False)
    ids, tolerance = torch.tensor([7]), tolerance_for(torch.float32, "inductor")
    repeats = dict(min_time=0.3 if quick else 1.0)
    rows = []
    for position in CONTEXT_POSITIONS:
        pos = torch.tensor([position])
        row = {"position": position}
        expected = {n: model.decode(ids, pos, caches[n]) for n in bundles if position < n}
        row["eager ms"] = timeit(lambda: model.decode(ids, pos, caches[CONTEXT_MAX_SEQ]), **repeats) * 1e3
        with torch.no_grad():
            step(ids[:, None], pos)  # compile outside the timing; its caches are its own (zeros)
            row["torch.compile ms"] = timeit(lambda: step(ids[:, None], pos), **repeats) * 1e3
        for n, out in bundles.items():
            if position >= n:
                continue
            bundle = Bundle.load(out)
            bundle.bind(model)
            torch.testing.assert_close(model.decode(ids, pos, caches[n]), expected[n], atol=tolerance, rtol=0)
            row[f"aotc max_seq {n} ms"] = timeit(lambda: model.decode(ids, pos, caches[n]), **repeats) * 1e3
            Bundle.unbind(model)
        read = next(c for c in Bundle.load(bundles[CONTEXT_MAX_SEQ]).manifest.shapes.context if c > position)
        row["positions read (4096 bundle)"] = read
        row["aotc/eager"] = row[f"aotc max_seq {CONTEXT_MAX_SEQ} ms"] / row["eager ms"]
        row["aotc/torch.compile"] = row[f"aotc max_seq {CONTEXT_MAX_SEQ} ms"] / row["torch.compile ms"]
        if f"aotc max_seq {MAX_SEQ} ms" in row:
            row["4096 bundle / 256 bundle"] = row[f"aotc max_seq {CONTEXT_MAX_SEQ} ms"] / row[f"aotc max_seq {MAX_SEQ} ms"]
        rows.append(row)
    torch._dynamo.reset()
    short, long = rows
    checks = {
        "long/short bundle at 128": (short["4096 bundle / 256 bundle"], "the max_seq-4096 bundle's step at 128 against the max_seq-256 bundle's"),
        "aotc/eager at 4000": (long["aotc/eager"], "the max_seq-4096 bundle's step at 4000 against eager's"),
    }
    misses = [f"{what}: {value:.2f}x (target <= {CONTEXT_TARGETS[key]}x)" for key, (value, what) in checks.items() if value > CONTEXT_TARGETS[key]]
    results["context"] = {
        "model": name, "unit": "ms per batch-1 decode step", "max_seq": CONTEXT_MAX_SEQ, "targets": CONTEXT_TARGETS,
        "figures": {key: value for key, (value, _) in checks.items()}, "misses": misses, "rows": rows,
    }  # fmt: skip
    table(f"batch-1 decode step by position, {name} model (ms); targets: 4096 bundle <= 1.2x the 256 bundle at 128, <= 1.1x eager at 4000", rows)
    print_misses(misses)


# -- resident caches (xla) -----------------------------------------------------------

RESIDENT_MAX_SEQ, RESIDENT_STEPS = 4096, 32


def bench_resident(models: dict[str, Path], root: Path, results: dict, quick: bool) -> None:
    """Batch-1 xla decode at position 128 in a max_seq-4096 bundle (context buckets 256,
    1024, 4096: the step reads 256) and in a max_seq-256 bundle. Caches are the device's
    arrays, donated to each call: over 32 steps each cache buffer's pointer is read
    before and after (a buffer that moved was copied), and the device counts the bytes
    it sends and reads back. Logits are checked against eager's before timing."""
    from aotc.runtime.resident import buffers

    name = "100m" if "100m" in models else "tiny"
    model_dir = models[name]
    model = load_model(model_dir).model
    prompt = torch.randint(3, 512, (POSITION,), generator=torch.Generator().manual_seed(0))
    ids, pos = torch.tensor([7]), torch.tensor([POSITION])
    repeats = dict(min_time=0.3 if quick else 1.0)
    eager = model.allocate_caches(2, RESIDENT_MAX_SEQ)
    model.prefill(prompt, 0, eager)
    expected = model.decode(ids, pos, eager)
    rows = [{"run": "eager", "max_seq": RESIDENT_MAX_SEQ, "step ms": timeit(lambda: model.decode(ids, pos, eager).argmax(-1), **repeats) * 1e3}]
    tolerance = tolerance_for(torch.float32, "xla")
    for n in (RESIDENT_MAX_SEQ, MAX_SEQ):
        out = bundle_for(model_dir, root / f"resident-{n}", "xla", batch_buckets=(1,), chunk_buckets=(128,), max_seq=n)
        bundle = Bundle.load(out)
        bundle.bind(model)
        device = bundle.backend.device_for()
        caches = model.allocate_caches(bundle.cache_slots, n)
        model.prefill(prompt, 0, caches)
        torch.testing.assert_close(model.decode(ids, pos, caches), expected, atol=tolerance, rtol=tolerance)
        held = [(b, b.value.unsafe_buffer_pointer()) for b in buffers(caches)]
        sent, received = device.sent, device.received
        step = lambda: model.decode(ids, pos, caches).argmax(-1)  # noqa: E731  (a step reads its logits, as generate does)
        for _ in range(RESIDENT_STEPS):
            step()
        moved = sum(math.prod(b.shape) * b.dtype.itemsize for b, p in held if b.value.unsafe_buffer_pointer() != p)
        row = {
            "run": "aotc xla", "max_seq": n, "positions read": next(c for c in bundle.manifest.shapes.context if c > POSITION),
            "cache bytes copied / step": moved / RESIDENT_STEPS, "cache bytes": sum(math.prod(b.shape) * b.dtype.itemsize for b, _ in held),
            "host->device B / step": (device.sent - sent) / RESIDENT_STEPS, "device->host B / step": (device.received - received) / RESIDENT_STEPS,
            "weights placed B": device.placed,
        }  # fmt: skip
        row["step ms"] = timeit(step, **repeats) * 1e3
        rows.append(row)
        Bundle.unbind(model)
    long, short = rows[1], rows[2]
    long["4096 bundle / 256 bundle"] = long["step ms"] / short["step ms"]
    for row in rows[1:]:
        row["aotc/eager"] = row["step ms"] / rows[0]["step ms"]
    misses = [f"max_seq {r['max_seq']}: {r['cache bytes copied / step']:.0f} cache bytes copied a step (target 0)" for r in rows[1:] if r["cache bytes copied / step"]]
    results["resident"] = {
        "model": name, "unit": "ms per batch-1 decode step at position 128", "steps counted": RESIDENT_STEPS, "target": "no cache byte copied",
        "misses": misses, "rows": rows,
    }  # fmt: skip
    table(f"xla decode at position {POSITION}, {name} model: caches on the device, donated (bytes a step copies)", rows)
    print_misses(misses)


# -- runtime overhead --------------------------------------------------------------

OVERHEAD_BATCHES, OVERHEAD_TOKENS, OVERHEAD_TARGET = (1, 8), 64, 0.10


class AllocationCounter(TorchDispatchMode):
    """Counts the tensors that aten ops create outside compiled graphs while `on` is true:
    outputs whose storage no input has (views and in-place results are not allocations)."""

    def __init__(self):
        super().__init__()
        self.count, self.on = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on:
            given = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            self.count += sum(t.untyped_storage().data_ptr() not in given for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def wrap_graphs(model, wrap) -> None:
    """Replace every bound graph's step of the model with one whose run is wrap(run)."""
    for m in model.modules():
        for d in vars(m).values():
            if isinstance(d, Dispatcher):
                d.steps = {c: {b: Step(s.device, (lambda s: lambda args, call=0: wrap(lambda a: s.run(a, call))(args))(s)) for b, s in steps.items()} for c, steps in d.steps.items()}


def bench_overhead(models: dict[str, Path], root: Path, results: dict, quick: bool) -> None:
    """`generate`'s decode step against the time inside its compiled graphs, at batch 1
    and 8, tiny model at 2 and 8 layers; and the tensors the runtime allocates per step
    outside the graphs, which should not grow with the layer count. Three runs of each:
    the step as users get it (nothing wrapped), the graphs timed (a clock around each
    call), the allocations counted (a dispatch mode, off inside the graphs)."""
    from torch.utils._python_dispatch import _disable_current_modes

    rows = []
    runs = 3 if quick else 9
    for layers in (2, 8):
        model_dir = write_tiny(root / "overhead" / f"tiny-{layers}", layers=layers)
        out = bundle_for(model_dir, root / "overhead", "inductor", batch_buckets=OVERHEAD_BATCHES, chunk_buckets=(128,))
        for batch in OVERHEAD_BATCHES:
            prompts = [[5 + i, 6, 7, 8] for i in range(batch)]
            figures = {}
            for what in ("step", "graphs", "allocations"):
                bundle, model = Bundle.load(out), load_model(model_dir).model
                bundle.bind(model)
                decoding, clock, counter = [False], [0.0], AllocationCounter()

                def timed(run):
                    def call(args):
                        t0 = time.perf_counter()
                        outs = run(args)
                        clock[0] += (time.perf_counter() - t0) if decoding[0] else 0.0
                        return outs

                    return call

                def uncounted(run):
                    def call(args):
                        with _disable_current_modes():
                            return run(args)

                    return call

                if what != "step":
                    wrap_graphs(model, timed if what == "graphs" else uncounted)

                def started(i, s):  # the first token comes from prefill: decode starts after it
                    decoding[0] = counter.on = True

                kw = dict(max_batch=batch, max_seq=bundle.max_seq, slots=bundle.cache_slots, stop_at_eos=False, threads=torch.get_num_threads(), on_token=started)
                samples = []
                for _ in range(1 if what == "allocations" else runs):
                    decoding[0], clock[0] = False, 0.0
                    with counter if what == "allocations" else contextlib.nullcontext():
                        g = generate(model, prompts, OVERHEAD_TOKENS, **kw)
                    samples.append({"step": g.decode_s, "graphs": clock[0], "allocations": counter.count}[what] / g.decode_steps)
                figures[what] = min(samples)  # the quietest run: noise only adds
            overhead = (figures["step"] - figures["graphs"]) / figures["graphs"]
            rows.append({
                "layers": layers, "batch": batch, "step ms": figures["step"] * 1e3, "in graphs ms": figures["graphs"] * 1e3,
                "host us per step": (figures["step"] - figures["graphs"]) * 1e6, "overhead / graphs": overhead,
                "allocations per step": figures["allocations"], "target met": layers != 2 or batch != 1 or overhead <= OVERHEAD_TARGET,
            })  # fmt: skip
    misses = [f"tiny (2 layers), batch 1: host work {r['host us per step']:.0f} us a step, {r['overhead / graphs']:.0%} of the {r['in graphs ms'] * 1e3:.0f} us in graphs" for r in rows if not r["target met"]]
    results["overhead"] = {
        "model": "tiny", "unit": "ms per decode step of generate, and in its compiled graphs", "tokens": OVERHEAD_TOKENS,
        "target": f"overhead <= {OVERHEAD_TARGET:.0%} of the graph time at batch 1 (2 layers)", "misses": misses, "rows": rows,
    }  # fmt: skip
    table(f"decode step of generate against its compiled graphs, tiny model (ms); target: overhead <= {OVERHEAD_TARGET:.0%} at batch 1", rows)
    print_misses(misses)


# -- contention ------------------------------------------------------------------

CONTENTION_TOKENS, CONTENTION_TARGET = 200, 1 / 3
# A fresh process per measurement: its thread count and OpenMP pool start clean.
_CONTENTION_PROBE = """
import json, statistics, sys, torch
from aotc.models.base import load_model
from aotc.runtime import Bundle, generate
bundle, model_dir, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
b = Bundle.load(bundle)
model = load_model(model_dir).model
b.bind(model)
runs = [generate(model, [[5, 6, 7, 8]], new, max_batch=1, max_seq=b.max_seq, slots=b.cache_slots, stop_at_eos=False,
                 threads=None if threads == "auto" else int(threads)).decode_tokens_per_s for _ in range(3)]
print(json.dumps(statistics.median(runs)))
"""


def bench_contention(models: dict[str, Path], root: Path, results: dict) -> None:
    cpus = os.cpu_count() or 1
    rows = []
    for name, model_dir in models.items():
        bundle = bundle_for(model_dir, root, "inductor", batch_buckets=BUCKETS, chunk_buckets=(128,))
        new = CONTENTION_TOKENS if name == "tiny" else CONTENTION_TOKENS // 4
        for policy in (str(cpus), "auto"):
            row = {"model": name, "threads": f"{policy} (fixed)" if policy != "auto" else "aotc default (free CPUs)"}
            for busy in (0, 1):
                loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
                try:
                    time.sleep(0.5)
                    out = subprocess.run([sys.executable, "-c", _CONTENTION_PROBE, str(bundle), str(model_dir), str(new), policy], capture_output=True, text=True, check=True)
                finally:
                    for loop in loops:
                        loop.kill()
                        loop.wait()
                row["busy loop" if busy else "alone"] = json.loads(out.stdout.strip().splitlines()[-1])
            row["with / alone"] = row["busy loop"] / row["alone"]
            row["target met"] = row["with / alone"] >= CONTENTION_TARGET
            rows.append(row)
    misses = [f"{r['model']}, threads {r['threads']}: {r['with / alone']:.2f} of its quiet speed" for r in rows if not r["target met"]]
    results["contention"] = {
        "unit": "decode tokens/s, batch 1", "cpus": cpus, "busy": "one `while True: pass` process",
        "target": "tokens/s next to the busy loop >= 1/3 of alone", "misses": misses, "rows": rows,
    }  # fmt: skip
    table(f"batch-1 decode tokens/s, alone and next to one busy loop ({cpus} CPUs); target >= 1/3 of alone", rows)
    print_misses(misses)


# -- peers -------------------------------------------------------------------------

PEER_PROMPT, PEER_NEW = 16, 128


def bench_peers(models: dict[str, Path], root: Path, results: dict, cache: Path) -> None:
    name = "100m" if "100m" in models else "tiny"
    model_dir = models[name]
    try:
        built = peers.ensure_llama_cpp(cache, say=lambda m: console.print(m, highlight=False))
    except peers.Skipped as e:
        results["peers"] = {"skipped": str(e)}
        console.print(f"peers skipped: {e}", highlight=False)
        return
    model = load_model(model_dir).model
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.embed_tokens"))
    prompt = torch.randint(3, 500, (PEER_PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    threads = torch.get_num_threads()
    bundle = Bundle.load(bundle_for(model_dir, root, "inductor", batch_buckets=BUCKETS, chunk_buckets=(128,)))

    def ours(bound: bool) -> dict:
        if bound:
            bundle.bind(model)
        try:
            g = generate(model, [prompt], PEER_NEW, max_batch=1, max_seq=MAX_SEQ, slots=max(BUCKETS) + 1, stop_at_eos=False)
        finally:
            Bundle.unbind(model)
        return {"tokens": g.sequences[0].new_ids, "decode_s": g.decode_s, "tokens_per_s": g.decode_tokens_per_s}

    runs = {("aotc inductor", "fp32"): peers.timed(lambda: ours(True)), ("eager PyTorch", "fp32"): peers.timed(lambda: ours(False))}
    for fmt in peers.FORMATS:
        gguf = peers.convert(built, model_dir, fmt, root)
        runs["llama.cpp", fmt] = peers.timed(lambda: peers.decode(built, gguf, prompt, PEER_NEW, threads))
    reference = runs["aotc inductor", "fp32"]
    rows = []
    for (engine, fmt), run in runs.items():
        per_weight = 4.0 if fmt == "fp32" else peers.FORMATS[fmt][1]
        rows.append({
            "engine": engine, "format": fmt, "tokens/s": run["tokens_per_s"],
            "GB/s of weights": non_embedding * per_weight * run["tokens_per_s"] / 1e9,
            "aotc / this, tokens/s": reference["tokens_per_s"] / run["tokens_per_s"],
            "greedy tokens equal to aotc's": f"{peers.agreement(run['tokens'], reference['tokens'])} of {PEER_NEW}",
        })  # fmt: skip
    f32 = runs["llama.cpp", "F32"]
    misses = []
    if reference["tokens_per_s"] < f32["tokens_per_s"]:
        misses.append(f"aotc inductor decodes {reference['tokens_per_s']:.0f} tokens/s at batch 1, llama.cpp F32 {f32['tokens_per_s']:.0f}")
    if peers.agreement(f32["tokens"], reference["tokens"]) < PEER_NEW:
        misses.append(f"llama.cpp F32's greedy tokens differ from aotc's after {peers.agreement(f32['tokens'], reference['tokens'])}")
    results["peers"] = {
        "model": name, "llama_cpp_python": peers.LLAMA_CPP_PYTHON, "build": "GGML_NATIVE=ON, from the PyPI source distribution",
        "prompt_tokens": PEER_PROMPT, "new_tokens": PEER_NEW, "threads": threads, "batch": 1,
        "definitions": {"tokens/s": "greedy decode steps after the first token, per second, best of 3",
                        "GB/s of weights": "every weight but the embedding table, at the format's bytes per weight, per token"},
        "target": "aotc inductor tokens/s >= llama.cpp F32's, same model and run", "misses": misses, "rows": rows,
    }  # fmt: skip
    table(f"batch-1 greedy decode, {name} model, {PEER_PROMPT}-token prompt, {PEER_NEW} new tokens, {threads} threads", rows)
    print_misses(misses)


def print_misses(misses: list[str]) -> None:
    for miss in misses:
        console.print(f"  target missed: {miss}", highlight=False)


def table(title: str, rows: list[dict]) -> None:
    t = Table(title=title)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    for c in cols:
        t.add_column(c, justify="left" if c in ("model", "what") else "right")
    for r in rows:
        t.add_row(*[_fmt(r.get(c, "")) for c in cols])
    console.print(t)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model only, fewer repeats and layer counts")
    ap.add_argument("--sections", default="decode,ttft,build,bandwidth,memory,lowp,v4,kvcache,prefill,contention,context,resident,overhead")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "perf.json")
    ap.add_argument("--peers", action="store_true", help="also run the peers section: llama.cpp, built once into --peers-cache")
    ap.add_argument("--peers-cache", type=Path, default=peers.DEFAULT_CACHE, help=f"where llama.cpp is built, once per version and CPU (default {peers.DEFAULT_CACHE})")
    args = ap.parse_args()
    sections = args.sections.split(",") + (["peers"] if args.peers else [])
    # Sections run now replace theirs in an existing results file; the others are kept.
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results.update(
        machine={"cpus": os.cpu_count(), "torch": str(torch.__version__), "threads": torch.get_num_threads(), "cpu": torch.backends.cpu.get_cpu_capability()},
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    with tempfile.TemporaryDirectory(prefix="aotc-bench-") as tmp:
        root = Path(tmp)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor-cache"))
        models = make_models(root, args.quick)
        if "decode" in sections:
            bench_decode(models, root, results, args.quick)
        if "ttft" in sections:
            bench_ttft(models, root, results, args.quick)
        if "build" in sections:
            bench_build(root, results, args.quick)
        if "bandwidth" in sections and "decode" in results:
            bench_bandwidth(models, results)
        if "memory" in sections and not args.quick:
            bench_memory(root, results)
        if "lowp" in sections:
            bench_lowp(root, results, args.quick)
        if "v4" in sections:
            bench_v4(root, results, args.quick)
        if "kvcache" in sections:
            bench_kvcache(models, root, results, args.quick)
        if "prefill" in sections:
            bench_prefill(models, root, results, args.quick)
        if "contention" in sections:
            bench_contention(models, root, results)
        if "context" in sections:
            bench_context(models, root, results, args.quick)
        if "resident" in sections:
            bench_resident(models, root, results, args.quick)
        if "overhead" in sections:
            bench_overhead(models, root, results, args.quick)
        if "peers" in sections:
            bench_peers(models, root, results, args.peers_cache)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, encode(results))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
