"""A decode step as one compiled graph against a graph per layer, the same model, the same run.

    python bench/whole_step.py [--models tiny-2 tiny-8 100m] [--batches 1 8] [--rounds 5] [--out bench/results/whole_step.json]

On the CPU, aotc builds a llama model's decode as one graph, the whole step
(LlamaForCausalLM.decode_step: every layer in a torch.while_loop over the layers' stacked
weights, with the RoPE rows, the embedding, the head and the argmax). Backends that run no
loops build a graph per layer and one for the head, with the embedding, the RoPE rows and the
argmax on the host between them. This script builds both kinds of inductor bundle of each
model: the whole step as `aotc build` makes it, and a graph per layer with the backend's
loops turned off in this process (as the xla and neuron backends build). It checks each
bundle's logits against the eager model's over 16 greedy steps (aotc's fp32 tolerance,
runtime.check, the same tokens), then times interleaved rounds of two decode loops at
position 100 (`model.decode_tokens`, the tokens to a list: what the engine's step does),
each clocking its graph calls, so that host work = step - graphs comes from the same run;
the quickest round of each is kept (noise only adds). Also each whole step's compile time
at 2 and 8 layers, from the build's own records.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from common import M100, POSITIONS, table, write_results  # noqa: E402

from aotc.backends.inductor import InductorBackend  # noqa: E402
from aotc.builder import BuildOptions, build  # noqa: E402
from aotc.models.loader import load_model  # noqa: E402
from aotc.models.tiny import write_tiny  # noqa: E402
from aotc.runtime import Bundle  # noqa: E402
from aotc.runtime.check import tolerance_for  # noqa: E402
from aotc.runtime.sampling import greedy  # noqa: E402

MAX_SEQ, POSITION, CHECKED_STEPS, STEPS = 256, 100, 16, 200
MODELS = {"tiny-2": dict(layers=2), "tiny-8": dict(layers=8), "100m": dict(layers=8, **M100, **POSITIONS)}
STEP = "LlamaForCausalLM.decode_step"


@contextlib.contextmanager
def no_loops():
    """The inductor backend as one without loops builds: a graph per layer."""
    init = InductorBackend.__init__

    def per_layer(self, *args, **kw):
        init(self, *args, **kw)
        self.loops = False

    InductorBackend.__init__ = per_layer
    try:
        yield
    finally:
        InductorBackend.__init__ = init


def check(model_dir: Path, out: Path, batch: int, tolerance: float) -> float:
    """The bundle's logits against eager's over CHECKED_STEPS greedy steps from empty caches:
    the largest error (runtime.check's), tokens equal, else an exit."""
    eager, bound = load_model(model_dir).model, load_model(model_dir).model
    bundle = Bundle.load(out)
    bundle.bind(bound)
    caches = {m: m.allocate_caches(bundle.cache_slots, bundle.max_seq, split=m is bound) for m in (eager, bound)}
    ids, worst = torch.arange(5, 5 + batch), 0.0
    for step in range(CHECKED_STEPS):
        positions = torch.full((batch,), step)
        expected = eager.decode(ids, positions, caches[eager])
        logits, chosen = bound.decode_tokens(ids, positions, caches[bound])
        chosen = greedy(logits) if chosen is None else chosen
        worst = max(worst, float(((logits - expected).abs() / (1 + expected.abs())).max()))
        if chosen.tolist() != greedy(expected).tolist() or worst > tolerance:
            raise SystemExit(
                f"whole_step: {out.name}, step {step}: tokens {chosen.tolist()} against eager's {greedy(expected).tolist()}, error {worst:.2e} (allowed {tolerance:.0e})"
            )
        ids = chosen
    return worst


def decode_loop(model_dir: Path, out: Path, batch: int):
    """A step function of the bound model at `batch` rows, and the list its graph calls
    append their seconds to."""
    bundle, model = Bundle.load(out), load_model(model_dir).model
    bundle.bind(model)
    graphs: list[float] = []

    def clocked(fn, key):
        def call(args, call=0):
            t0 = time.perf_counter()
            outs = fn(args, call)
            graphs.append(time.perf_counter() - t0)
            return outs

        return call

    Bundle.wrap_steps(model, clocked)
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
    ids, positions = torch.arange(5, 5 + batch), torch.full((batch,), POSITION)

    def step():
        logits, chosen = model.decode_tokens(ids, positions, caches)
        return (greedy(logits) if chosen is None else chosen).tolist()

    return step, graphs


def loop(step, graphs: list) -> tuple[float, float]:
    """(seconds per step, seconds in graphs per step) over STEPS calls."""
    step()
    graphs.clear()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - t0) / STEPS, sum(graphs) / STEPS


def measure(root: Path, name: str, batches: list[int], rounds: int) -> list[dict]:
    model_dir = write_tiny(root / name, **MODELS[name])
    kw = dict(backend="inductor", batch_buckets=tuple(batches), chunk_buckets=(16,), max_seq=MAX_SEQ)
    whole = build(BuildOptions(model_dir, out=root / f"{name}-whole", **kw))
    with no_loops():  # no compile cache: its build recipes do not know of the switch
        layers = build(BuildOptions(model_dir, out=root / f"{name}-layers", use_cache=False, **kw))
    if STEP not in [e.id for e in whole.manifest.entries] or STEP in [e.id for e in layers.manifest.entries]:
        raise SystemExit(f"whole_step: {name}: the bundles are not a whole step and a graph per layer")
    compile_s = {a.bucket: a.compile_s for a in whole.manifest.entry(STEP).artifacts}  # kept with a cached artifact too
    rows = []
    for batch in batches:
        errors = {kind: check(model_dir, r.out, batch, tolerance_for("inductor")) for kind, r in (("layers", layers), ("whole", whole))}
        loops = {kind: decode_loop(model_dir, r.out, batch) for kind, r in (("layers", layers), ("whole", whole))}
        best = {kind: (1.0, 0.0) for kind in loops}
        for _ in range(rounds):  # interleaved: this VM's speed drifts between minutes
            for kind, (step, graphs) in loops.items():
                best[kind] = min(best[kind], loop(step, graphs))
        (l_step, l_graphs), (w_step, w_graphs) = best["layers"], best["whole"]
        rows.append({
            "model": name, "batch": batch, "whole step compile s": compile_s.get(batch), "error": max(errors.values()),
            "per layer step us": l_step * 1e6, "its graphs us": l_graphs * 1e6, "per layer host/graphs": (l_step - l_graphs) / l_graphs,
            "whole step us": w_step * 1e6, "its graph us": w_graphs * 1e6, "whole host/graph": (w_step - w_graphs) / w_graphs,
            "whole / per layer": w_step / l_step,
        })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "whole_step.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aotc-whole-step-") as tmp:
        rows = [row for name in args.models for row in measure(Path(tmp), name, sorted(args.batches), args.rounds)]
    table(
        f"decode step, a graph per layer against the whole step, position {POSITION} (us; inductor, torch {torch.__version__}, {torch.get_num_threads()} threads)",
        rows,
    )
    write_results(args.out, {"position": POSITION, "steps": STEPS, "rows": rows})


if __name__ == "__main__":
    main()
