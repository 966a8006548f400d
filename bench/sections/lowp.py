"""lowp: batch-1 decode of the ~100M model (tiny under --quick) with fp8 and int8 weights
(stored as the checkpoint has them, decoded in the graph) against the same model in fp32
and in bf16, aotc inductor (or --backend): ms per step and GB/s of the bytes stored; resident
memory of `aotc run` after load against the checkpoint and against dequantizing at load;
eager fp8 against eager fp32 (max logit difference, greedy agreement over 200 tokens)."""

from __future__ import annotations

import subprocess
import sys

import torch
from common import M100, MAX_SEQ, POSITION, Run, section, table, timeit

from aotc.models.loader import load_model
from aotc.models.tiny import write_tiny
from aotc.runtime import Bundle
from aotc.runtime.bundle import bound_weights

LOWP_TOKENS = 200
# The checkpoint each row's label names: write_tiny's arguments.
FORMATS = {
    "fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"), "fp8": dict(dtype="float32", quantize="fp8"),
    "int8": dict(dtype="float32", quantize="int8"),  # int8 values (graphs take their bytes as uint8), a float32 scale per 32
}  # fmt: skip
# `aotc run`'s loading, in a fresh process: bundle, model as bind needs it, bind, a step; then RSS.
_LOAD_RSS = r"""
import sys, torch
from aotc.models.loader import load_model
from aotc.runtime import Bundle
bundle, model_dir, stored = sys.argv[1], sys.argv[2], sys.argv[3]
if bundle != "floor":
    if bundle == "-":  # eager, low-precision weights dequantized at load
        model = load_model(model_dir).model
    else:
        b = Bundle.load(bundle)
        args = b.model_args()
        model = load_model(model_dir, **(args if stored == "yes" else dict(args, stored=False))).model
        b.bind(model)
    # One decode step: safetensors maps the file, and its pages count once read.
    model.decode(torch.tensor([5]), torch.tensor([0]), model.allocate_caches(2, 256))
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
print(rss * 1024)
"""


def resident_after_load(*args: str) -> int:
    out = subprocess.run([sys.executable, "-c", _LOAD_RSS, *args], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


def read_by_graphs(bundle: Bundle, model) -> tuple[dict[str, int], set[str]]:
    """What the compiled entries read, as bind hands it to them: bytes by dtype (each
    tensor once), and the dtypes of the decoder layers' matrices (2-D weights of the
    entries that serve several layers; a stored weight's values, not its scales)."""
    specs = {e.id: e for e in bundle.manifest.entries}
    seen, layer_dtypes = {}, set()
    for (entry_id, _), weights in bound_weights(bundle.manifest, model, bundle.dir).items():
        entry = specs[entry_id]
        for i, spec in enumerate(entry.weights):
            t = weights.tensor(i)
            seen[(t.data_ptr(), t.nbytes)] = (str(t.dtype).removeprefix("torch."), t.nbytes)
            if len(entry.instances) > 1 and t.dim() == 2 and (spec.stored is None or spec.stored.part == "values"):
                layer_dtypes.add(str(t.dtype).removeprefix("torch."))
    by_dtype: dict[str, int] = {}
    for dtype, nbytes in seen.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return by_dtype, layer_dtypes


@section("lowp")
def lowp(run: Run) -> dict:
    shape = {} if run.quick else dict(layers=8, **M100)
    name = run.main
    # fp8: the fp32 model's weights (the same seed), quantized
    dirs = {kind: write_tiny(run.root / f"lowp-{name}-{kind}", **shape, **fmt) for kind, fmt in FORMATS.items()}
    ids = torch.randint(3, 500, (1,), generator=torch.Generator().manual_seed(1))
    positions = torch.full((1,), POSITION)
    rows, bundles = [], {}
    for kind, model_dir in dirs.items():
        bundles[kind] = bundle = Bundle.load(run.bundle(model_dir, batch_buckets=(1,), chunk_buckets=(128,)))
        model = load_model(model_dir, **bundle.model_args()).model
        bundle.bind(model)
        caches = model.allocate_caches(bundle.cache_slots, MAX_SEQ)
        seconds = timeit(lambda: model.decode(ids, positions, caches), min_time=run.times(2.0))
        by_dtype, layer_dtypes = read_by_graphs(bundle, model)
        stored = sum(by_dtype.values())
        rows.append({
            "weights": kind, "layer matrices": ",".join(sorted(layer_dtypes)), "step ms": seconds * 1e3, "stored MB read": stored / 1e6,
            "GB/s": stored / seconds / 1e9, "MB read by dtype": {d: b / 1e6 for d, b in sorted(by_dtype.items())},
        })  # fmt: skip
    for r in rows:
        r["fp32 ms / this"] = rows[0]["step ms"] / r["step ms"]
    results = {"model": name, "batch": 1, "position": POSITION, "target_fp32_over_fp8": 2.0, "rows": rows}
    table(f"batch-1 decode by weight format, {name} model, {run.aotc} (target: fp8 at least 2x faster than fp32)", rows)

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
    results["resident_after_load"] = memory
    table("resident memory after load (RSS)", memory)

    # Eager fp8 (dequantized at load) against eager fp32, the weights it was quantized from.
    fp32, fp8 = load_model(dirs["fp32"]).model, load_model(dirs["fp8"]).model
    prompt = [1, *range(5, 21)]
    tokens = 20 if run.quick else LOWP_TOKENS
    runs = {}
    for label, m in (("fp32", fp32), ("fp8", fp8)):
        caches = m.allocate_caches(2, m.round_max_seq(len(prompt) + tokens))
        logits = m.prefill(torch.tensor(prompt), 0, caches)
        out = []
        for i in range(tokens):
            out.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
            logits = m.decode(torch.tensor([out[-1]]), torch.tensor([len(prompt) + i]), caches)
        runs[label] = out
    first_diff = next((i for i, (a, b) in enumerate(zip(runs["fp32"], runs["fp8"])) if a != b), tokens)
    # Teacher-forced on fp32's sequence: each position's logits and argmax, both models.
    seq = torch.tensor(prompt + runs["fp32"])
    a, b = fp32.prompt_logits(seq)[len(prompt) - 1 : -1], fp8.prompt_logits(seq)[len(prompt) - 1 : -1]
    fidelity = {
        "tokens": tokens,
        "max_logit_diff": (a - b).abs().max().item(),
        "logit_range": (a.max() - a.min()).item(),
        "greedy_equal_before_first_difference": first_diff,
        "teacher_forced_top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }
    results["eager_fp8_vs_fp32"] = fidelity
    table(f"eager fp8 against eager fp32, {tokens} greedy tokens", [fidelity])
    return results
