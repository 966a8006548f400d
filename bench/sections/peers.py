"""peers: (with --peers) llama.cpp beside aotc at every precision users run, on the ~100M
model (tiny under --quick) and on SmolLM2-135M-Instruct (bench/smollm2.py; not under
--quick), in one run. llama.cpp is built once from llama-cpp-python's source distribution
into --peers-cache (bench/llamacpp.py).

Each model comes as an fp32 folder and a bf16 folder (the 100m model's: its fp32 weights
rounded to bf16). aotc runs the fp32 folder, the bf16 folder, an int8 checkpoint that
`aotc quantize --format int8` writes from the fp32 folder (its head in int8, as Q8_0's), and
three fp8 checkpoints: from the fp32 folder with the LM head kept, and in fp8 as Q8_0 has
it; and from the bf16 folder with an fp8 head (bf16 arithmetic). llama.cpp's own converter
makes F32 and F16 from the fp32 folder and BF16 and Q8_0 from the bf16 folder. Every engine
decodes the same prompt ids greedily at batch 1 with the same threads, once a round, best
of 3 rounds (tokens/s); a row gives the bytes of weights that one decode step reads (aotc:
what its graphs are handed at bind; llama.cpp: the GGUF's tensors, the embedding table
only where it is also the head) and how many greedy tokens equal aotc fp32's. The
quantized checkpoints' quality beside their speed, teacher-forced over the passage
tests/data/declaration.txt (aotc's eager logits, and llama.cpp's own for F32 and Q8_0):
the largest logit difference and the top-1 agreement against aotc fp32 and against the
source folder. Issue 19's target: aotc fp32 >= llama.cpp F32."""

from __future__ import annotations

import json
import shutil

import llamacpp
import torch
from common import HERE, Run, console, print_misses, section, table
from safetensors.torch import load_file, save_file
from smollm2 import smollm2

from aotc.chat import render_user_turn
from aotc.models.loader import load_model
from aotc.quantize_checkpoint import quantize_model
from aotc.runtime import Bundle, generate
from sections.lowp import read_by_graphs

PEER_PROMPT, PEER_NEW = 16, 128
PASSAGE = HERE.parent / "tests" / "data" / "declaration.txt"
PASSAGE_TOKENS = 800
CHAT_PROMPT = "Write a haiku about the sea."
# (engine, format): (the folder it is made from, what makes it)
AOTC = {"fp32": "fp32", "bf16": "bf16", "int8": "fp32", "fp8": "fp32", "fp8, fp8 head": "fp32", "fp8, fp8 head, bf16": "bf16"}
# aotc's quantized checkpoints: aotc quantize --format, --head. int8 is Q8_0's weight grid
# (a scale per 32 inputs) with its head in int8 as Q8_0's, activations in fp32.
QUANTIZED = {"int8": ("int8", "int8"), "fp8": ("fp8", "keep"), "fp8, fp8 head": ("fp8", "fp8"), "fp8, fp8 head, bf16": ("fp8", "fp8")}
LLAMA_CPP = {"F32": "fp32", "F16": "fp32", "BF16": "bf16", "Q8_0": "bf16"}
# Like against like: aotc's format, llama.cpp's
PAIRS = (("fp32", "F32"), ("bf16", "BF16"), ("bf16", "F16"), ("int8", "Q8_0"), ("fp8, fp8 head", "Q8_0"), ("fp8", "Q8_0"), ("fp8, fp8 head, bf16", "Q8_0"))
ROUNDS = 3  # every engine once a round, the rounds one after another: best of 3, interleaved


@section("peers", optional=True)
def peers(run: Run) -> dict:
    try:
        built = llamacpp.ensure_llama_cpp(run.peers_cache, say=lambda m: console.print(m, highlight=False))
    except llamacpp.Skipped as e:
        console.print(f"peers skipped: {e}", highlight=False)
        return {"skipped": str(e)}
    models = {run.main: _synthetic(run)}
    if not run.quick:
        models["SmolLM2-135M-Instruct"] = {"fp32": smollm2("float32"), "bf16": smollm2("bfloat16"), "chat": True}
    results = {
        "llama_cpp_python": llamacpp.LLAMA_CPP_PYTHON, "build": f"from the PyPI source distribution, CMAKE_ARGS={llamacpp.cmake_args()}",
        "new_tokens": PEER_NEW, "threads": torch.get_num_threads(), "batch": 1,
        "definitions": {
            "tokens/s": "greedy decode steps after the first token, per second, best of 3",
            "MB read per step": "the weights one decode step reads: aotc, what bind hands its graphs; llama.cpp, the GGUF's tensors but an embedding table that is not also the head",
        },
        "target": f"{run.aotc} fp32 tokens/s >= llama.cpp F32's, same model and run", "models": {},
    }  # fmt: skip
    misses = []
    for label, folders in models.items():
        results["models"][label] = found = _compare(run, built, label, folders)
        misses += found["misses"]
    results["misses"] = misses
    print_misses(misses)
    return results


def _synthetic(run: Run) -> dict:
    """The run's main model, and its weights rounded to bf16 in a folder of their own."""
    fp32 = run.model(run.main)
    bf16 = run.root / "models" / f"{run.main}-bf16"
    if not bf16.is_dir():
        bf16.mkdir(parents=True)
        shutil.copy(fp32 / "tokenizer.json", bf16)
        config = json.loads((fp32 / "config.json").read_text())
        (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2))
        weights = load_file(fp32 / "model.safetensors")
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}, str(bf16 / "model.safetensors"))
    return {"fp32": fp32, "bf16": bf16, "chat": False}


def _compare(run: Run, built, label: str, folders: dict) -> dict:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folders["fp32"] / "tokenizer.json"))
    if folders["chat"]:
        prompt = tokenizer.encode(render_user_turn(folders["fp32"], CHAT_PROMPT), add_special_tokens=False).ids
    else:
        prompt = torch.randint(3, 500, (PEER_PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    threads = torch.get_num_threads()
    where = run.root / "peers" / label.replace(" ", "-")
    where.mkdir(parents=True, exist_ok=True)
    checkpoints = {"fp32": folders["fp32"], "bf16": folders["bf16"]}
    made = {}
    for fmt, (form, head) in QUANTIZED.items():
        out = where / fmt.replace(", ", "-").replace(" ", "-")
        if not out.is_dir():
            made[fmt] = quantize_model(folders[AOTC[fmt]], out, form, head=head)
        checkpoints[fmt] = out

    jobs, nbytes, rows = {}, {}, []  # (engine, format): a decode, the bytes a step reads
    for fmt in AOTC:
        model_dir = checkpoints[fmt]
        bundle = Bundle.load(run.bundle(model_dir, f"peers-{label}", batch_buckets=(1,), chunk_buckets=(64,), max_seq=256))
        bound = load_model(model_dir, **bundle.model_args()).model
        bundle.bind(bound)
        jobs[run.aotc, fmt] = lambda model=bound: _ours(model, prompt)
        nbytes[run.aotc, fmt] = sum(read_by_graphs(bundle, bound)[0].values())
        if fmt == "fp32":
            jobs["eager PyTorch", "fp32"] = lambda model=load_model(model_dir).model: _ours(model, prompt)
            nbytes["eager PyTorch", "fp32"] = nbytes[run.aotc, fmt]
    ggufs = {}
    for fmt, source in LLAMA_CPP.items():
        ggufs[fmt] = gguf = llamacpp.convert(built, checkpoints[source], fmt, where)
        jobs["llama.cpp", fmt] = lambda gguf=gguf: llamacpp.decode(built, gguf, prompt, PEER_NEW, threads)
        nbytes["llama.cpp", fmt] = llamacpp.bytes_per_step(gguf)
    # Every engine once a round, so that a slow spell of the machine touches all alike.
    rounds = [{key: job() for key, job in jobs.items()} for _ in range(ROUNDS)]
    runs = {key: {**min((r[key] for r in rounds), key=lambda t: t["decode_s"]), "bytes": nbytes[key]} for key in jobs}
    reference = runs[run.aotc, "fp32"]
    for (engine, fmt), result in runs.items():
        rows.append({
            "engine": engine, "format": fmt, "made from": f"{AOTC.get(fmt) if engine != 'llama.cpp' else LLAMA_CPP[fmt]} folder",
            "tokens/s": result["tokens_per_s"], "MB read per step": result["bytes"] / 1e6,
            "GB/s of weights": result["bytes"] * result["tokens_per_s"] / 1e9,
            "greedy tokens equal to aotc fp32's": f"{llamacpp.agreement(result['tokens'], reference['tokens'])} of {PEER_NEW}",
        })  # fmt: skip
    stands = [
        {"aotc": ours, "llama.cpp": theirs, "aotc tokens/s": runs[run.aotc, ours]["tokens_per_s"], "llama.cpp tokens/s": runs["llama.cpp", theirs]["tokens_per_s"],
         "aotc / llama.cpp": runs[run.aotc, ours]["tokens_per_s"] / runs["llama.cpp", theirs]["tokens_per_s"],
         "aotc MB / llama.cpp MB per step": runs[run.aotc, ours]["bytes"] / runs["llama.cpp", theirs]["bytes"]}
        for ours, theirs in PAIRS
    ]  # fmt: skip
    quality = _quality(tokenizer, checkpoints, {fmt: ggufs[fmt] for fmt in ("F32", "Q8_0")}, built, threads, where)
    misses = []
    f32 = runs["llama.cpp", "F32"]
    if reference["tokens_per_s"] < f32["tokens_per_s"]:
        misses.append(f"{label}: {run.aotc} fp32 decodes {reference['tokens_per_s']:.0f} tokens/s at batch 1, llama.cpp F32 {f32['tokens_per_s']:.0f}")
    title = f"{label}: batch-1 greedy decode, a {len(prompt)}-token prompt, {PEER_NEW} new tokens, {threads} threads, best of {ROUNDS} interleaved rounds"
    table(title, rows)
    table(f"{label}: aotc against llama.cpp at each precision", stands)
    table(f"{label}: quality, eager, teacher-forced over {quality[0]['passage tokens']} tokens of {PASSAGE.name}", quality)
    return {
        "prompt_tokens": len(prompt), "prompt": CHAT_PROMPT if folders["chat"] else "random ids", "rows": rows, "stands": stands, "quality": quality,
        "quantized": {fmt: {"tensors": len(q.tensors), "MB before": q.bytes_in / 1e6, "MB after": q.bytes_out / 1e6, "head": q.head} for fmt, q in made.items()},
        "misses": misses,
    }  # fmt: skip


def _ours(model, prompt: list[int]) -> dict:
    g = generate(model, [prompt], PEER_NEW, max_batch=1, max_seq=256, slots=2, stop_at_eos=False)
    return {"tokens": g.sequences[0].new_ids, "decode_s": g.decode_s, "tokens_per_s": g.decode_tokens_per_s}


def _quality(tokenizer, checkpoints: dict, ggufs: dict, built, threads: int, work) -> list[dict]:
    """Each lower-precision checkpoint's logits over the passage against aotc fp32's and,
    made from the bf16 folder, its source's: aotc's eager (the reference of each: compiled
    bundles keep to it by the fidelity rule), llama.cpp's from llama-cpp-python's logits
    at every position (logits_all), the same passage ids."""
    ids = torch.tensor(tokenizer.encode(PASSAGE.read_text()).ids[:PASSAGE_TOKENS])
    logits, sources = {}, dict(AOTC)
    for fmt in AOTC:
        with torch.no_grad():
            logits[fmt] = load_model(checkpoints[fmt]).model.prompt_logits(ids).float()
    for fmt, gguf in ggufs.items():
        name = f"llama.cpp {fmt}"
        logits[name] = torch.from_numpy(llamacpp.passage_logits(built, gguf, ids.tolist(), threads, work))
        sources[name] = LLAMA_CPP[fmt]
    out = []
    for fmt, source in sources.items():
        if fmt == "fp32":
            continue
        row = {"checkpoint": fmt, "made from": f"{source} folder", "passage tokens": len(ids), "fp32 logit range": (logits["fp32"].max() - logits["fp32"].min()).item()}
        for against in dict.fromkeys(("fp32", source if fmt != source else "fp32")):
            a, b = logits[fmt], logits[against]
            row[f"max logit diff vs {against}"] = (a - b).abs().max().item()
            row[f"top-1 agreement vs {against}"] = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        out.append(row)
    return out
