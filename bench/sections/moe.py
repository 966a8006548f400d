"""moe: a Qwen3-MoE that transformers makes (~110M parameters, fp32, 64 experts at top-8;
3 tiny layers under --quick) through the generic path: decode at batch 1 and 4 at
position 128, aotc inductor (or --backend) against transformers' own eager model (its
default experts code and cache) and aotc's eager model; and each step's weight bytes:
what aotc's decode graphs read (each token's chosen experts, every other weight), the
chosen experts' bytes (each distinct expert once) and, per step time, versus copy
bandwidth."""

from __future__ import annotations

import math

import torch
from common import Run, console, copy_bandwidth, section, table, timeit, transformers_decode_step, transformers_model

from aotc.builder import BuildOptions
from aotc.builder.plan import make_plan
from aotc.models.loader import load_model
from aotc.runtime import Bundle, tolerance_for
from aotc.trace import trace

MOE_100M = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True, max_position_embeddings=1024,
)  # fmt: skip
MOE_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, max_position_embeddings=1024,
)  # fmt: skip
BATCHES = (1, 4)
POSITION = 128
MAX_SEQ = 256


def graph_weight_bytes(graph) -> int:
    """The weight bytes one call of a traced graph reads: a weight read only through
    indexing its first dim (the fused experts, by each token's choices) counts the rows
    indexed; any other, all of it."""
    aten = torch.ops.aten
    placeholders = [n for n in graph.graph_module.graph.nodes if n.op == "placeholder"]
    total = 0
    for node, spec in zip(placeholders, graph.inputs):
        if spec.kind != "weight":
            continue
        nbytes = math.prod(spec.shape) * getattr(torch, spec.dtype).itemsize
        users = list(node.users)
        if users and all(u.target is aten.index.Tensor and u.args[0] is node and len(u.args[1]) == 1 for u in users):
            rows = sum(u.args[1][0].meta["val"].numel() for u in users)
            nbytes = rows * nbytes // spec.shape[0]
        total += nbytes
    return total


@section("moe")
def moe(run: Run) -> dict:
    import transformers

    name = "qwen3_moe-tiny" if run.quick else "qwen3_moe-110m"
    fields = MOE_TINY if run.quick else MOE_100M
    model_dir = transformers_model(run.root / "models" / name, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", **fields)
    chunk = 16 if run.quick else 64
    bundle = Bundle.load(run.bundle(model_dir, batch_buckets=BATCHES, chunk_buckets=(chunk,), max_seq=MAX_SEQ))
    model = load_model(model_dir).model
    ran = {str(p.dtype) for p in model.parameters()}
    if ran != {"torch.float32"}:
        raise SystemExit(f"moe: {name} loaded {ran} weights, not float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    experts = {n: p for n, p in model.named_parameters() if ".mlp.experts." in n}
    per_expert = sum(p.nbytes for p in experts.values()) // (fields["num_hidden_layers"] * fields["num_experts"])
    k, e = fields["num_experts_per_tok"], fields["num_experts"]
    active = params - sum(p.numel() for p in experts.values()) * (1 - k / e)

    # What the decode graphs read, from the graphs themselves (traces of the bundle's
    # variants, with its backend's passes), times the layers each serves.
    plan = make_plan(BuildOptions(model_dir, out=run.root / "moe-plan", batch_buckets=BATCHES, chunk_buckets=(chunk,), max_seq=MAX_SEQ, backend=run.backend))
    graph_bytes = {}
    for b in BATCHES:
        graph_bytes[b] = sum(
            graph_weight_bytes(trace(v, b, plan.shapes, plan.backend)) * len(v.instances)
            for v in plan.variants
            if v.entry_id.split(".")[1] in ("decode", "project") and v.context in (None, MAX_SEQ)
        )
    # The weights the model's forward reads around the graphs, eagerly (the final norm; of
    # the embedding table, one row per token: left out).
    compiled = tuple(f"{path}." for v in plan.variants for path, _ in v.instances)
    around = sum(p.nbytes for n, p in model.named_parameters() if not n.startswith((*compiled, "model.embed_tokens.")))
    graph_bytes = {b: n + around for b, n in graph_bytes.items()}
    rest = sum(p.nbytes for n, p in model.named_parameters() if n not in experts and not n.startswith("model.embed_tokens."))
    if model.tied_parameters():
        rest += model.hf.get_output_embeddings().weight.nbytes

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, fields["vocab_size"], (max(BATCHES), POSITION), generator=g)
    step_ids = torch.randint(3, fields["vocab_size"], (max(BATCHES),), generator=g)
    caches = model.allocate_caches(bundle.cache_slots, MAX_SEQ)
    bundle.bind(model)
    for slot in range(max(BATCHES)):
        for start in range(0, POSITION, chunk):
            model.prefill(prompts[slot, start : start + chunk], slot, caches, start)
    Bundle.unbind(model)
    repeats = dict(min_time=run.times(2.0), repeats=3)
    tolerance = tolerance_for(run.backend)
    copy = copy_bandwidth(min_time=run.times(3.0))
    rows, chosen = [], {}
    for b in BATCHES:
        ids, positions = step_ids[:b], torch.full((b,), POSITION)

        # Each distinct expert the step's tokens choose, counted once per layer: the least
        # any experts code must read. Recorded from aotc's eager model (the same choices).
        picks: list[int] = []
        hooks = [m.register_forward_hook(lambda mod, args, out: picks.append(out[2].unique().numel())) for n, m in model.named_modules() if n.endswith("mlp.gate")]
        eager_logits = model.decode(ids, positions, caches)
        for h in hooks:
            h.remove()
        chosen[b] = sum(picks) * per_expert
        eager_s = timeit(lambda: model.decode(ids, positions, caches), **repeats)

        hf_step = transformers_decode_step(hf, prompts[:b], ids)
        hf_logits = hf_step()
        hf_s = timeit(hf_step, **repeats)

        bundle.bind(model)
        aotc_logits = model.decode(ids, positions, caches)
        aotc_s = timeit(lambda: model.decode(ids, positions, caches), **repeats)
        Bundle.unbind(model)
        for label, logits in (("transformers", hf_logits), ("aotc eager", eager_logits)):
            torch.testing.assert_close(aotc_logits, logits, atol=tolerance, rtol=tolerance, msg=f"moe batch {b}: {run.aotc} logits differ from {label}")
        read = graph_bytes[b]
        rows.append({
            "batch": b, f"{run.aotc} ms": aotc_s * 1e3, "transformers ms": hf_s * 1e3, "aotc eager ms": eager_s * 1e3,
            "vs transformers": hf_s / aotc_s, "vs aotc eager": eager_s / aotc_s,
            "MB read": read / 1e6, "chosen experts + rest MB": (chosen[b] + rest) / 1e6, "read / chosen": read / (chosen[b] + rest),
            "GB/s": read / aotc_s / 1e9, "of copy": read / aotc_s / copy,
        })  # fmt: skip
        console.print(f"  {name} batch {b}: {run.aotc} {aotc_s * 1e3:.2f} ms, transformers {hf_s * 1e3:.2f} ms, aotc eager {eager_s * 1e3:.2f} ms", highlight=False)
    table(
        f"{name} ({params / 1e6:.0f}M params, {active / 1e6:.0f}M active, {e} experts at top-{k}): decode at position {POSITION} (ms), "
        f"and the weight bytes a step reads: aotc's graphs, the distinct chosen experts' plus every other weight (copy {copy / 1e9:.1f} GB/s)",
        rows,
    )
    return {
        "model": name, "config": fields, "params": params, "active_params": int(active), "expert_bytes": per_expert, "other_bytes_read": rest,
        "position": POSITION, "max_seq": MAX_SEQ, "copy_GBps": copy / 1e9, "chosen_expert_bytes": chosen, "graph_bytes_read": graph_bytes, "unit": "ms", "rows": rows,
    }  # fmt: skip
