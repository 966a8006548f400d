"""serve: (with --peers) `aotc serve` against llama.cpp's own `llama-server` under the same
load from aiperf (NVIDIA's load client, in a venv of its own), and static groups of the
same requests, in one run. SmolLM2-135M-Instruct at fp32 (the tiny model under --quick):
aotc serves an inductor bundle of batch buckets 1, 2, 4 and 8 (8 slots); llama-server
(built once from the peers section's llama.cpp source, bench/llamacpp.py) serves the
F32 GGUF that llama.cpp's converter makes of the same folder, with as many slots (-np)
and continuous batching on, on the same threads. aiperf sends 96 streaming completions
(24 under --quick), 16 at a time, each within 10 ms of one ending (a closed loop), after 8
warm-up requests: synthetic prompts of 128 +- 32 tokens of the model's tokenizer (32 +-
8), 128 +- 32 new tokens each (16 +- 4), greedy, ignore_eos, the same seed, so the same
requests (checked: the two runs' inputs are equal). Static groups, in-process: the
same requests through `generate` under the same closed loop, a group being what waits
when the last one ends (up to 8), run to its end. aiperf's figures: output tokens per
second over the run, time to first token and inter-token latency, p50 and p99.
Issue 68's targets: aotc's throughput at least llama-server's, and at least 2x static
groups'.

Then the prefix cache (issue 80): a chat workload whose requests share a 500-token
system prompt (aiperf's --shared-system-prompt-length; 200 under --quick), against
`aotc serve` with its prefix cache and with --no-prefix-cache, and llama-server with its
prompt cache (cache_prompt, on by default: a slot keeps its last prompt, and a request
goes to the slot whose prompt it shares most with). A bundle of max_seq 1024 (the tiny
model: 512). Time to first token p50 and p99 and output tokens per second."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import llamacpp
import torch
from common import Run, console, print_misses, section, table
from filelock import FileLock
from smollm2 import smollm2

from aotc import Session
from aotc.format import read_manifest
from aotc.models.loader import load_model
from aotc.runtime import Bundle, generate
from sections.engine import Ask, _ms

AIPERF = "aiperf==0.13.0"
CONCURRENCY, WARMUP = 16, 8
# aiperf 0.13's closed loop (--concurrency alone) polls for a free slot without sleeping,
# and its timing_manager process spins a whole core for the run: half of this machine,
# taken from the server under test. A rate far above what a server here completes,
# capped at the same concurrency, makes it wait for its next tick (10 ms) instead.
PACE = 100  # requests per second
BUCKETS, MAX_SEQ = (1, 2, 4, 8), 512
THROUGHPUT_VS_PEER, THROUGHPUT_VS_STATIC = 1.0, 2.0  # aotc serve's tokens/s over llama-server's, over static groups': at least


@section("serve", optional=True)
def serve(run: Run) -> dict:
    say = lambda m: console.print(m, highlight=False)  # noqa: E731
    try:
        built = llamacpp.ensure_llama_server(run.peers_cache, say=say)
        aiperf = ensure_aiperf(run.peers_cache, say=say)
    except llamacpp.Skipped as e:
        say(f"serve skipped: {e}")
        return {"skipped": str(e)}
    label, folder = ("tiny", run.model("tiny")) if run.quick else ("SmolLM2-135M-Instruct", smollm2("float32"))
    n, isl, osl = (24, 32, 16) if run.quick else (96, 128, 128)
    load = {"requests": n, "prompt tokens": (isl, isl // 4), "new tokens": (osl, osl // 4)}
    bundle = run.bundle(folder, "serve", batch_buckets=BUCKETS, chunk_buckets=(32, 128), max_seq=MAX_SEQ)
    slots = read_manifest(bundle).shapes.cache_slots - 1  # one is the engine's scratch slot
    where = run.root / "serve"
    where.mkdir(parents=True, exist_ok=True)
    gguf = llamacpp.convert(built, folder, "F32", where)
    threads = torch.get_num_threads()
    servers = {
        run.aotc.replace("aotc", "aotc serve"): [sys.executable, "-m", "aotc.cli", "serve", str(bundle), "--served-model-name", label, "--max-queue", str(4 * CONCURRENCY), "--threads", str(threads)],
        "llama-server": [str(built / "bin" / "llama-server"), "-m", str(gguf), "--alias", label, "-np", str(slots), "-c", str(slots * MAX_SEQ), "-cb", "-t", str(threads), "-tb", str(threads)],
    }  # fmt: skip
    measured, inputs = {}, {}
    for name, command in servers.items():
        out = where / name.replace(" ", "-")
        with _serving(command, where / f"{name.replace(' ', '-')}.log") as url:
            measured[name], inputs[name] = _aiperf(aiperf, url, label, folder, out, load)
    ours, peer = servers
    if inputs[ours] != inputs[peer]:
        raise SystemExit(f"serve: aiperf sent different requests to {ours} and {peer} (the same --random-seed should make them equal)")
    measured["static groups"] = _static(bundle, folder, inputs[ours], slots)
    prefix = _prefix_cache(run, label, folder, built, aiperf, say)
    rows = [{"server": name, "model": label, "format": "fp32", "slots": slots, **row} for name, row in measured.items()]
    for row in rows:
        row[f"tokens/s vs {peer}"] = row["tokens/s"] / measured[peer]["tokens/s"]
        row["tokens/s vs static groups"] = row["tokens/s"] / measured["static groups"]["tokens/s"]
    misses = []
    if measured[ours]["tokens/s"] < THROUGHPUT_VS_PEER * measured[peer]["tokens/s"]:
        misses.append(f"{ours} {measured[ours]['tokens/s']:.0f} tokens/s, {peer} {measured[peer]['tokens/s']:.0f} (target: at least {peer}'s)")
    if measured[ours]["tokens/s"] < THROUGHPUT_VS_STATIC * measured["static groups"]["tokens/s"]:
        vs = measured[ours]["tokens/s"] / measured["static groups"]["tokens/s"]
        misses.append(f"{ours} {vs:.2f}x static groups' tokens/s (target {THROUGHPUT_VS_STATIC}x)")
    table(
        f"{label} fp32: {n} streaming completions, {CONCURRENCY} at a time (aiperf, closed loop), prompts {isl} +- {isl // 4} tokens, "
        f"{osl} +- {osl // 4} new tokens, {threads} threads (targets: {ours} tokens/s >= {peer}'s, >= {THROUGHPUT_VS_STATIC}x static groups')",
        rows,
    )
    print_misses(misses)
    return {
        "model": label, "format": "fp32", "load": {**load, "concurrency": CONCURRENCY, "warm-up requests": WARMUP, "temperature": 0, "ignore_eos": True, "pace requests/s": PACE},
        "client": AIPERF, "threads": threads, "slots": slots, "commands": {k: " ".join(v) for k, v in servers.items()},
        "llama_cpp_python": llamacpp.LLAMA_CPP_PYTHON, "build": f"cmake target llama-server, {llamacpp.cmake_args()} {' '.join(llamacpp.SERVER_CMAKE)}",
        "targets": {f"tokens/s vs {peer}": THROUGHPUT_VS_PEER, "tokens/s vs static groups": THROUGHPUT_VS_STATIC},
        "rows": rows, "misses": misses, "prefix cache": prefix,
    }  # fmt: skip


PREFIX_CONCURRENCY, PREFIX_MAX_SEQ = 8, 1024  # as many clients as slots: the first token waits for prefill, not for a slot


def _prefix_cache(run: Run, label: str, folder: Path, built: Path, aiperf: Path, say) -> dict:
    """The shared-system-prompt load against aotc serve with and without its prefix cache,
    and llama-server with its prompt cache (module docstring); every server gets the same
    requests (checked)."""
    system, n, isl, osl = (200, 24, 32, 16) if run.quick else (500, 48, 64, 64)
    max_seq = PREFIX_MAX_SEQ // 2 if run.quick else PREFIX_MAX_SEQ
    load = {"requests": n, "prompt tokens": (isl, isl // 4), "new tokens": (osl, osl // 4), "system prompt tokens": system,
            "endpoint": "chat", "concurrency": PREFIX_CONCURRENCY}  # fmt: skip
    bundle = run.bundle(folder, "serve-prefix", batch_buckets=BUCKETS, chunk_buckets=(32, 128), max_seq=max_seq)
    slots = read_manifest(bundle).shapes.cache_slots - 1
    where = run.root / "serve-prefix"
    where.mkdir(parents=True, exist_ok=True)
    gguf = llamacpp.convert(built, folder, "F32", where)
    threads = torch.get_num_threads()
    aotc = [sys.executable, "-m", "aotc.cli", "serve", str(bundle), "--served-model-name", label, "--max-queue", str(4 * PREFIX_CONCURRENCY), "--threads", str(threads)]
    servers = {
        "aotc serve, prefix cache": aotc,
        "aotc serve, --no-prefix-cache": [*aotc, "--no-prefix-cache"],
        "llama-server, prompt cache": [str(built / "bin" / "llama-server"), "-m", str(gguf), "--alias", label, "-np", str(slots), "-c", str(slots * max_seq), "-cb", "-t", str(threads), "-tb", str(threads)],
    }  # fmt: skip
    measured, inputs = {}, {}
    for name, command in servers.items():
        tag = name.replace(" ", "-").replace(",", "")
        with _serving(command, where / f"{tag}.log") as url:
            measured[name], inputs[name] = _aiperf(aiperf, url, label, folder, where / tag, load, ["--shared-system-prompt-length", str(system)])
            if name.startswith("aotc"):
                measured[name] |= _prefix_counts(url)
    first = next(iter(servers))
    if any(inputs[name] != inputs[first] for name in servers):
        raise SystemExit("serve: aiperf sent different shared-prefix requests to the servers (the same --random-seed should make them equal)")
    hits = measured[first]["prefix hit tokens"]
    if hits < 0.9 * system * (n - slots):  # what ran: each request after the first few found the system prompt
        raise SystemExit(f"serve: the prefix cache found {hits} tokens; {n} requests sharing {system} tokens should find at least {0.9 * system * (n - slots):.0f}")
    rows = [{"server": name, "model": label, **row} for name, row in measured.items()]
    for row in rows:
        row["TTFT p50 vs no prefix cache"] = row["TTFT p50 ms"] / measured["aotc serve, --no-prefix-cache"]["TTFT p50 ms"]
        row["tokens/s vs llama-server"] = row["tokens/s"] / measured["llama-server, prompt cache"]["tokens/s"]
    table(
        f"{label} fp32, the prefix cache: {n} streaming chat completions, {PREFIX_CONCURRENCY} at a time, a shared system prompt of {system} tokens, "
        f"user prompts {isl} +- {isl // 4} tokens, {osl} +- {osl // 4} new tokens, {threads} threads",
        rows,
    )
    return {"load": load, "slots": slots, "commands": {k: " ".join(v) for k, v in servers.items()}, "rows": rows}


def _prefix_counts(url: str) -> dict:
    """The prompt tokens a server looked up in its prefix cache and found (its /metrics)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    count = lambda name: sum(float(v) for v in re.findall(rf"^aotc:{name}_total{{[^}}]*}} (\S+)$", text, re.M))  # noqa: E731
    return {"prefix queried tokens": int(count("prefix_cache_queries")), "prefix hit tokens": int(count("prefix_cache_hits"))}


def ensure_aiperf(cache: Path, say=print) -> Path:
    """aiperf in a venv of its own under the peers cache (its pins are not aotc's), made
    once; `.complete` marks a finished one (a venv cannot be renamed into place)."""
    venv = cache / AIPERF.replace("==", "-")
    done = venv / ".complete"
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(venv) + ".lock"):
        if not done.is_file():
            say(f"installing {AIPERF} into {venv} (once)")
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            installed = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", AIPERF], capture_output=True, text=True)
            if installed.returncode:
                raise llamacpp.Skipped(f"pip install {AIPERF} failed: {installed.stderr.strip()[-500:]}")
            done.touch()
    return venv / "bin" / "aiperf"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serving(command: list[str], log: Path, bound: float = 600.0):
    """A server process on 127.0.0.1 (its output in `log`), once /health answers 200; its
    base URL. SIGTERM at the end."""
    port = _free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
    url, end = f"http://127.0.0.1:{port}", time.monotonic() + bound
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve: `{' '.join(command[:3])} ...` exited {proc.returncode} before it served; see {log}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise SystemExit(f"serve: `{' '.join(command[:3])} ...` did not answer /health within {bound:.0f} s; see {log}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _aiperf(aiperf: Path, url: str, model: str, tokenizer: Path, out: Path, load: dict, extra: list[str] = ()) -> tuple[dict, list[dict]]:
    """aiperf's figures for the load against the server at `url`, and the requests it sent.
    Token counts are the servers' own (usage). A request starts within 1/PACE s of a slot
    freeing. A connection per request: llama-server
    (cpp-httplib) closes a kept-alive connection after 5 s idle, and aiohttp, reusing one
    as it closes, failed 9 of 96 requests with ServerDisconnectedError."""
    (isl, isl_sd), (osl, osl_sd) = load["prompt tokens"], load["new tokens"]
    out.mkdir(parents=True, exist_ok=True)
    args = [
        str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", load.get("endpoint", "completions"), "--streaming",
        "--tokenizer", str(tokenizer), "--synthetic-input-tokens-mean", str(isl), "--synthetic-input-tokens-stddev", str(isl_sd),
        "--output-tokens-mean", str(osl), "--output-tokens-stddev", str(osl_sd), "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--request-count", str(load["requests"]), "--warmup-request-count", str(WARMUP), "--concurrency", str(load.get("concurrency", CONCURRENCY)),
        "--request-rate", str(PACE), "--arrival-pattern", "constant",
        "--random-seed", "0", "--use-server-token-count", "--connection-reuse-strategy", "never", "--workers-max", "1", "--record-processors", "1", "--ui-type", "none", "--artifact-dir", str(out),
        *extra,
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, cwd=out)
    if done.returncode:
        raise SystemExit(f"serve: aiperf failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    got = json.loads((out / "profile_export_aiperf.json").read_text())
    if got.get("error_summary"):
        raise SystemExit(f"serve: aiperf against {url} had errors: {got['error_summary']}")
    payloads = [r["payloads"][0] for r in json.loads((out / "inputs.json").read_text())["data"]]
    made, asked = int(got["total_output_tokens"]["avg"]), sum(p.get("max_tokens") or p["max_completion_tokens"] for p in payloads)
    if len(payloads) != load["requests"] or made != asked:  # what ran: every request, each to its max_tokens (ignore_eos)
        raise SystemExit(f"serve: {url} made {made} tokens for {len(payloads)} requests; aiperf asked {load['requests']} requests, {asked} tokens")
    return {
        "requests": int(got["request_count"]["avg"]), "output tokens": made,
        "tokens/s": got["output_token_throughput"]["avg"], "TTFT p50 ms": got["time_to_first_token"]["p50"],
        "TTFT p99 ms": got["time_to_first_token"]["p99"], "ITL p50 ms": got["inter_token_latency"]["p50"],
        "ITL p99 ms": got["inter_token_latency"]["p99"], "run s": got["benchmark_duration"]["avg"],
    }, payloads  # fmt: skip


def _static(bundle_dir: Path, folder: Path, payloads: list[dict], slots: int) -> dict:
    """Static groups of the aiperf run's requests under its closed loop: CONCURRENCY clients,
    each sending its next request when its last one ends; a group is what waits when the
    previous group ends (up to `slots`), run by `generate` to its longest row's end. The
    prompts are tokenized as aotc serve does (Session.encode)."""
    with Session.open(bundle_dir, model=folder) as session:
        prompts = [session.encode(p["prompt"]) for p in payloads]
    bundle = Bundle.load(bundle_dir)
    model = load_model(folder, **bundle.model_args()).model
    bundle.bind(model)
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
    kw = dict(slots=bundle.cache_slots, max_seq=bundle.max_seq, max_batch=slots, caches=caches, stop_at_eos=False)
    generate(model, prompts[:slots], 2, **kw)  # warm
    asks = [Ask(0.0, ids, p["max_tokens"]) for ids, p in zip(prompts, payloads)]
    queue, pending, t0 = asks[:CONCURRENCY], asks[CONCURRENCY:], time.perf_counter()
    while queue:
        group, queue = queue[:slots], queue[slots:]

        def on_token(i, s, group=group):
            a, now = group[i], time.perf_counter() - t0
            a.times.append(now)
            done = len(s.new_ids) == a.max_tokens
            if done and pending:  # its client sends the next request, which waits for a later group
                pending[0].arrival = now
                queue.append(pending.pop(0))
            return done

        generate(model, [a.ids for a in group], max(a.max_tokens for a in group), on_token=on_token, **kw)
    ttft = [a.times[0] - a.arrival for a in asks]
    itl = [b - a for r in asks for a, b in zip(r.times, r.times[1:])]
    tokens = sum(len(a.times) for a in asks)
    if tokens != sum(a.max_tokens for a in asks):
        raise SystemExit(f"serve: static groups made {tokens} tokens; the requests asked {sum(a.max_tokens for a in asks)}")
    span = max(a.times[-1] for a in asks)
    return {
        "requests": len(asks), "output tokens": tokens, "tokens/s": tokens / span, "TTFT p50 ms": _ms(ttft, 50),
        "TTFT p99 ms": _ms(ttft, 99), "ITL p50 ms": _ms(itl, 50), "ITL p99 ms": _ms(itl, 99), "run s": span,
    }  # fmt: skip
