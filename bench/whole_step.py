"""A decode step as one compiled graph, on the tiny model: would it meet issue 75's host target?

    python bench/whole_step.py [--layers 2 8] [--batches 1 8] [--rounds 5] [--out bench/results/whole_step.json]

The bundle's step calls a graph per layer and one for the head, with the embedding, the
RoPE rows and the argmax on the host between them (`overhead` section: the host work is
0.6x the graphs' time at batch 1). The whole step here is one AOTInductor graph: the
embedding, the RoPE rows, every layer in a torch.while_loop over the layers' weights
stacked [layers, ...] (each iteration writes its layer of the root cache allocations at
the layer's index: bench/stacked_layers.py found writes through a layer's slice copied the
cache), the final norm, the head and the argmax. Its layer is llama's decode layer
(aotc.models.llama: the same rotate, visible and softmax_attend), weights as tensors.

For each layer count: the whole step's export and compile time (Inductor's caches in a
fresh folder each time, after one compile that warms the process), its logits against the eager model's
over 16 greedy steps (aotc's fp32 tolerance, runtime.check) with the same tokens, then
interleaved rounds of two decode loops at position 100: the bundle's (model.decode, the
argmax, the tokens to a list) and the whole step's (one call, the tokens to a list). Each
loop clocks its graph calls, so host work = step - graphs, from the same run; the quickest
round of each is kept (noise only adds).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import console, table  # noqa: E402

from aotc.builder import BuildOptions, build  # noqa: E402
from aotc.format import encode, write_atomic  # noqa: E402
from aotc.models.llama import rotate, softmax_attend, visible  # noqa: E402
from aotc.models.loader import load_model  # noqa: E402
from aotc.models.tiny import write_tiny  # noqa: E402
from aotc.runtime import Bundle  # noqa: E402
from aotc.runtime.check import tolerance_for  # noqa: E402
from aotc.runtime.sampling import greedy  # noqa: E402

MAX_SEQ, POSITION, CHECKED_STEPS = 256, 100, 16
STEPS = 200  # decode steps a timed loop runs


def rms_norm(x, weight, eps):
    """llama.RMSNorm's forward, its weight as a tensor."""
    dtype = x.dtype
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


class WholeStep(torch.nn.Module):
    """ids, positions, slots [B] -> logits [B, vocab] float32 and their argmax [B], writing
    every layer's keys and values into the root caches k, v [layers, slots, kv_heads,
    max_seq, head_dim]. `names`: a layer's parameter names, in the order of the stacked
    weights that end the arguments."""

    def __init__(self, model, names: list[str]):
        super().__init__()
        attention, config = model.model.layers[0].self_attn, model.config
        self.names, self.eps = names, config.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim, self.window, self.scale = attention.heads, attention.kv_heads, attention.head_dim, attention.window, attention.scale

    def forward(self, ids, positions, slots, k, v, cos_table, sin_table, embed, norm, head, *stacked):
        b, hd, rep = ids.shape[0], self.head_dim, self.heads // self.kv_heads
        x, cos, sin = F.embedding(ids, embed), cos_table[positions], sin_table[positions]
        mask = visible(positions, k.shape[3], self.window)[:, None, None, :]
        layers = stacked[0].shape[0]

        def more(i, x):
            return i < layers

        def body(i, x):
            j = i.item()
            torch._check(j >= 0)
            torch._check(j < layers)
            w = dict(zip(self.names, (s.select(0, j) for s in stacked)))
            a = rms_norm(x, w["input_layernorm.weight"], self.eps)
            q = rotate(F.linear(a, w["self_attn.q_proj.weight"]).view(b, self.heads, hd), cos, sin)
            keys = rotate(F.linear(a, w["self_attn.k_proj.weight"]).view(b, self.kv_heads, hd), cos, sin)
            k[i.expand(b), slots, :, positions] = keys  # the root allocation at the layer's index
            v[i.expand(b), slots, :, positions] = F.linear(a, w["self_attn.v_proj.weight"]).view(b, self.kv_heads, hd)
            out = softmax_attend(q.view(b, self.kv_heads, rep, hd), k.select(0, j)[:b], v.select(0, j)[:b], mask, self.scale)
            h = x + F.linear(out.reshape(b, self.heads * hd), w["self_attn.o_proj.weight"])
            m = rms_norm(h, w["post_attention_layernorm.weight"], self.eps)
            return i + 1, h + F.linear(F.silu(F.linear(m, w["mlp.gate_proj.weight"])) * F.linear(m, w["mlp.up_proj.weight"]), w["mlp.down_proj.weight"])

        x = torch.while_loop(more, body, (torch.zeros((), dtype=torch.long), x))[1]
        logits = F.linear(rms_norm(x, norm, self.eps), head).float()
        return logits, logits.argmax(-1)


def whole_step(model, batch: int, path: Path):
    """(the loaded package's boxed call, the arguments after ids and positions, seconds to
    export and compile): the whole step of `model` at `batch` rows, its weights stacked."""
    layers = model.model.layers
    if model.config.qkv_bias or model.config.o_bias or model.config.mlp_bias or not all(type(m) is type(layers[0]) for m in layers):
        raise SystemExit("whole_step: llama layers without biases only")
    names = [n for n, _ in layers[0].named_parameters()]
    stacked = [torch.stack([dict(layer.named_parameters())[n].detach() for layer in layers]) for n in names]
    caches = model.allocate_caches(batch + 1, MAX_SEQ)
    model.rope(torch.arange(MAX_SEQ))
    rest = [torch.arange(batch), caches["k"], caches["v"], *model.rope_tables]
    rest += [model.model.embed_tokens.weight.detach(), model.head.norm.weight.detach(), model.head.lm_head.weight.detach(), *stacked]
    ids, positions = torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long)
    # Inductor's caches in a fresh folder (read at each compile), so that no count reuses
    # what another compiled.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="aotc-whole-step-inductor-")
    t0 = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(WholeStep(model, names), (ids, positions, *rest))
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    compile_s = time.perf_counter() - t0
    return torch._inductor.aoti_load_package(package).loader.boxed_run, rest, compile_s


def check(model, run, rest, batch: int, tolerance: float) -> float:
    """The whole step's logits against eager decode over CHECKED_STEPS greedy steps from
    empty caches: the largest error (runtime.check's), tokens equal, else an exit."""
    caches = model.allocate_caches(batch + 1, MAX_SEQ)
    ids, worst = torch.arange(5, 5 + batch), 0.0
    for step in range(CHECKED_STEPS):
        positions = torch.full((batch,), step)
        expected = model.decode(ids, positions, caches)
        logits, chosen = run([ids, positions, *rest])
        worst = max(worst, float(((logits - expected).abs() / (1 + expected.abs())).max()))
        if chosen.tolist() != greedy(expected).tolist() or worst > tolerance:
            raise SystemExit(f"whole_step: step {step}: tokens {chosen.tolist()} against eager's {greedy(expected).tolist()}, error {worst:.2e} (allowed {tolerance:.0e})")
        ids = chosen
    return worst


def loop(step, graphs: list) -> tuple[float, float]:
    """(seconds per step, seconds in graphs per step) of STEPS calls of step(), whose
    graph calls append their seconds to `graphs`."""
    step()
    graphs.clear()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - t0) / STEPS, sum(graphs) / STEPS


def measure(root: Path, layers: int, batches: list[int], rounds: int) -> list[dict]:
    model_dir = write_tiny(root / f"tiny-{layers}", layers=layers)
    out = root / f"bundle-{layers}"
    build(BuildOptions(model_dir, out=out, backend="inductor", batch_buckets=tuple(batches), chunk_buckets=(128,), max_seq=MAX_SEQ))
    model = load_model(model_dir).model
    rows = []
    for batch in batches:
        run, rest, compile_s = whole_step(model, batch, root / f"whole-{layers}-{batch}.pt2")
        error = check(model, run, rest, batch, tolerance_for("inductor"))
        bundle, bound = Bundle.load(out), load_model(model_dir).model
        bundle.bind(bound)
        graphs: list[float] = []

        def clocked(fn, key):
            def call(args, call=0):
                t0 = time.perf_counter()
                outs = fn(args, call)
                graphs.append(time.perf_counter() - t0)
                return outs

            return call

        Bundle.wrap_steps(bound, clocked)
        caches = bound.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
        ids, positions = torch.arange(5, 5 + batch), torch.full((batch,), POSITION)

        def per_layer():
            return greedy(bound.decode(ids, positions, caches)).tolist()

        def whole():
            t0 = time.perf_counter()
            outs = run([ids, positions, *rest])
            graphs.append(time.perf_counter() - t0)
            return outs[1].tolist()

        best = {"bundle": (1.0, 0.0), "whole": (1.0, 0.0)}
        for _ in range(rounds):  # interleaved: the VM's speed drifts between minutes
            for name, fn in (("bundle", per_layer), ("whole", whole)):
                best[name] = min(best[name], loop(fn, graphs))
        (b_step, b_graphs), (w_step, w_graphs) = best["bundle"], best["whole"]
        rows.append({
            "layers": layers, "batch": batch, "compile s": compile_s, "error": error,
            "bundle step": b_step * 1e6, "its graphs": b_graphs * 1e6, "host/graphs": (b_step - b_graphs) / b_graphs,
            "whole step": w_step * 1e6, "its graph": w_graphs * 1e6, "host/graph": (w_step - w_graphs) / w_graphs,
            "whole/bundle": w_step / b_step,
        })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "whole_step.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aotc-whole-step-") as tmp:
        # The process's first compile also pays for what every later one reuses (imports, the compiler's setup).
        whole_step(load_model(write_tiny(Path(tmp) / "warm", layers=args.layers[0])).model, 1, Path(tmp) / "warm.pt2")
        rows = [row for n in args.layers for row in measure(Path(tmp), n, sorted(args.batches), args.rounds)]
    table(
        f"decode step: the bundle's graph per layer against one whole-step graph, tiny model, position {POSITION} (us; torch {torch.__version__}, {torch.get_num_threads()} threads)",
        rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, encode({"torch": str(torch.__version__), "threads": torch.get_num_threads(), "position": POSITION, "steps": STEPS, "rows": rows}))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
