"""Real model shapes: an 8B-shaped build without weights, and a 0.5B-shaped run.

    python bench/real_shapes.py [--work DIR] [--json bench/results/real_shapes.json]

1. Llama-3.1-8B's config.json (128k vocabulary, 4096 wide, 32 layers). The
   safetensors file has the real header and is extended to its full 16 GB with
   truncate: sparse, so no disk is used and no weight is read (aotc builds from
   headers). `aotc build` on inductor, timed, with the peak RSS of the build's
   processes. --max-seq 131072 asks for caches this machine cannot hold: the
   build warns and goes on.
2. Qwen2.5-0.5B's config.json (151,936-token vocabulary, tied embeddings) with
   random bf16 weights drawn as transformers draws them (std 0.02, so near-ties
   occur), about 1 GB. Built on inductor, then `aotc run --check` at batch 1
   beside `aotc run --eager`: decode tokens/s of both, the logit difference
   against the bf16 tolerance, and tokens compared up to near-ties.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}  # fmt: skip
QWEN_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643,
    "use_sliding_window": False,
}  # fmt: skip


def llama_tensors(c: dict) -> dict[str, list[int]]:
    """Tensor names and shapes as Hugging Face saves a Llama checkpoint."""
    h, kv = c["hidden_size"], c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": [c["vocab_size"], h], "model.norm.weight": [h], "lm_head.weight": [c["vocab_size"], h]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h], p + "self_attn.v_proj.weight": [kv, h],
            p + "self_attn.o_proj.weight": [h, h], p + "mlp.gate_proj.weight": [c["intermediate_size"], h],
            p + "mlp.up_proj.weight": [c["intermediate_size"], h], p + "mlp.down_proj.weight": [h, c["intermediate_size"]],
            p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
        })  # fmt: skip
    return shapes


def sparse_safetensors(path: Path, shapes: dict[str, list[int]]) -> int:
    """The real header, then the file extended to its full size without writing data
    (a sparse file). safetensors cannot write a header without the data, so the header
    is written here, in its documented layout: an 8-byte length, then the JSON."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)  # bfloat16
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
    os.truncate(path, 8 + len(raw) + offset)
    return offset


def aotc(*args, env=None) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run the CLI; returns (process, seconds, peak RSS in GB of it and its workers)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "aotc.cli", *map(str, args)], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200", **(env or {})})
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far, in KiB
    if r.returncode != 0:
        raise SystemExit(f"aotc {' '.join(map(str, args))} failed:\n{r.stderr[-4000:]}")
    return r, seconds, (peak / 2**20 if peak > before else float("nan"))


def build_8b(work: Path) -> dict:
    from aotc.models.tiny import make_tokenizer

    model = work / "llama-8b-shaped"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    make_tokenizer().save(str(model / "tokenizer.json"))
    nbytes = sparse_safetensors(model / "model.safetensors", llama_tensors(LLAMA_8B))
    disk = os.stat(model / "model.safetensors").st_blocks * 512
    print(f"8B-shaped: {nbytes / 1e9:.1f} GB of bf16 weights in a sparse file using {disk / 1e6:.1f} MB of disk", flush=True)
    r, seconds, peak = aotc(
        "build", model, "--backend", "inductor", "--buckets", "1", "--prefill-chunk", "128", "--max-seq", "131072", "--no-cache", "-o", work / "llama-8b-bundle"
    )
    warned = [line for line in r.stderr.splitlines() + r.stdout.splitlines() if "warning" in line.lower()]
    return {"weights_gb": round(nbytes / 1e9, 2), "disk_mb": round(disk / 1e6, 1), "build_s": round(seconds, 1), "peak_rss_gb": round(peak, 2), "warnings": warned}


def run_05b(work: Path) -> dict:
    from aotc.models.tiny import make_tokenizer, write_model

    model = work / "qwen-0.5b-shaped"
    if not (model / "model.safetensors").is_file():
        t0 = time.perf_counter()
        write_model(model, QWEN_05B, make_tokenizer(), head_std=0.02)
        print(f"0.5B-shaped: random bf16 weights written in {time.perf_counter() - t0:.0f} s", flush=True)
    size = (model / "model.safetensors").stat().st_size
    bundle = work / "qwen-0.5b-bundle"
    _, build_s, build_peak = aotc("build", model, "--backend", "inductor", "--buckets", "1", "--prefill-chunk", "128", "--max-seq", "512", "--no-cache", "-o", bundle)
    prompt = ["--prompt", "The capital of France is", "--max-new-tokens", "32"]
    r, _, run_peak = aotc("run", bundle, "--check", "--json", "--max-batch", "1", *prompt)
    compiled = json.loads(r.stdout)
    r, _, _ = aotc("run", model, "--eager", "--json", *prompt)
    eager = json.loads(r.stdout)
    c = compiled["check"]
    return {
        "checkpoint_gb": round(size / 1e9, 2), "build_s": round(build_s, 1), "build_peak_rss_gb": round(build_peak, 2),
        "run_peak_rss_gb": round(run_peak, 2), "aotc_decode_tokens_per_s": compiled["timings"]["decode_tokens_per_s"],
        "eager_decode_tokens_per_s": eager["timings"]["decode_tokens_per_s"], "check_passed": c["passed"],
        "tokens_equal": c["tokens_equal"], "max_logit_diff": c["max_logit_diff"], "tolerance": c["tolerance"],
        "matching_tokens": c["per_prompt"][0]["matching_tokens"], "near_tie_gap": c["per_prompt"][0]["near_tie_gap"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="folder for the models and bundles (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "real_shapes.json")
    parser.add_argument("--only", choices=["8b", "0.5b"], help="run one part (its figures replace that part's in --json)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aotc-real-") as tmp:
        work = args.work or Path(tmp)
        results = {}
        if args.only in (None, "8b"):
            results["llama_8b_shaped_build"] = build_8b(work)
        if args.only in (None, "0.5b"):
            results["qwen_0_5b_shaped_run"] = run_05b(work)
    print(f"\n{'what':48} {'figure':>14}")
    for part, figures in results.items():
        for k, v in figures.items():
            if not isinstance(v, (list, dict)):
                print(f"{part + '.' + k:48} {v!s:>14}")
    q = results.get("qwen_0_5b_shaped_run")
    if q:
        print(f"{'aotc / eager decode tokens/s':48} {q['aotc_decode_tokens_per_s'] / q['eager_decode_tokens_per_s']:>14.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    if args.only and args.json.is_file():  # one part run again: the other part's figures stay
        results = {**json.loads(args.json.read_text()), **results}
    tmp_json = args.json.with_suffix(".tmp")
    tmp_json.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp_json, args.json)


if __name__ == "__main__":
    main()
