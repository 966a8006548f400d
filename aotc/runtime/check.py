"""`--check`, `aotc verify` and the tests: one fidelity rule (DESIGN.md, Fidelity).

An error is measured against a reference as max |x - ref| / (1 + |ref|) over the
values compared, so that `error <= tol` is `|x - ref| <= tol + tol x |ref|` (a
low-precision value's rounding grows with its magnitude).

  * A full-precision bundle (float32 weights and caches) is compared with eager
    float32, its own reference: error within the fp32 tolerance (1e-3, times the
    backend's factor), tokens equal.
  * A lower-precision bundle (bf16 weights, fp8 weights, fp8 caches) is not
    compared with eager code of the same precision: such a run is no oracle (it
    rounds differently, and flips near-ties the compiled run keeps). The bundle
    and its eager twin (the same precision, eager) are both measured against a
    float32 reference computed from the same stored weights, with float32 caches,
    along the bundle's own tokens (teacher forcing, so every step compares logits
    of one prefix). The bundle passes when its error is at most
    max(2 x the twin's error, the fp32 tolerance), and every token it chose is
    the reference's, or within that error of it (a near-tie, reported).

Tokens of a full-precision bundle are compared exactly, except where eager's top-2
logit gap at the first differing step is within the tolerance: such a near-tie is
reported with its gap, not counted as a failure (padding changes GEMM row counts,
and CPU matmul results with them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.registry import get_backend_class
from ..models.base import CausalLM
from ..models.loader import full_precision, reference_model
from .generate import Generation, generate

# fp32 logits differ by about 1e-4 between row counts; times the backend's own factor
# (Backend.tolerance_factor).
FP32_TOLERANCE = 1e-3
# A lower-precision bundle may be this many times as far from the fp32 reference as
# eager code of its precision is.
TWIN_FACTOR = 2.0


@dataclass
class PromptCheck:
    equal: bool
    matching_tokens: int  # tokens equal before the first difference
    tokens: int
    max_logit_diff: float  # max |logit - reference|, over the steps compared
    eager_new_ids: list[int]  # the reference's tokens (lower precision: its argmax at each of the bundle's steps)
    near_tie_gap: float | None = None  # the reference's gap where a token differs, when within the error allowed
    logits_close: bool = True  # error within the bound
    error: float = 0.0  # max |logit - reference| / (1 + |reference|)
    twin_error: float | None = None  # the eager twin's error (lower precision only)
    bound: float = 0.0  # the error allowed
    twin_new_ids: list[int] | None = None  # the eager twin's argmax at each of the bundle's steps (lower precision)

    @property
    def passed(self) -> bool:
        return (self.equal or self.near_tie_gap is not None) and self.logits_close


@dataclass
class CheckReport:
    tolerance: float  # the fp32 tolerance
    per_prompt: list[PromptCheck]
    reference: str = "eager"  # what the bundle is measured against
    twin: str | None = None  # the eager run of the bundle's precision, measured likewise

    @property
    def tokens_equal(self) -> bool:
        return all(p.equal for p in self.per_prompt)

    @property
    def max_logit_diff(self) -> float:
        return max((p.max_logit_diff for p in self.per_prompt), default=0.0)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.per_prompt)


def error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / (1 + |ref|): at most tol exactly where every |a - ref| <= tol + tol x |ref|."""
    if not a.numel():
        return 0.0
    a, ref = a.double(), ref.double()
    return ((a - ref).abs() / (1 + ref.abs())).max().item()


def near_tie(ref: torch.Tensor, chosen: int, allowed: float) -> float | None:
    """The reference logits' gap between their top and the one at `chosen`, where it is
    within the error `allowed` at that logit (a near-tie: either token may be chosen); else None."""
    top = ref.max()
    gap = (top - ref[chosen]).item()
    return gap if gap <= allowed * (1 + top.abs().item()) else None


def bound(twin_error: float, tolerance: float) -> float:
    """The error a lower-precision result may have: max(2 x its eager twin's, the fp32 tolerance)."""
    return max(TWIN_FACTOR * twin_error, tolerance)


def tolerance_for(backend: str) -> float:
    """The fp32 tolerance of a bundle built with the backend named so."""
    return FP32_TOLERANCE * get_backend_class(backend).tolerance_factor


def precision(model: CausalLM) -> str:
    """What a model computes in, for reports: 'float32', 'bfloat16, fp8 caches', ..."""
    kv_cache = getattr(model.config, "kv_cache", None)
    caches = f", {kv_cache.dtype} caches" if kv_cache is not None and kv_cache.dtype != "auto" else ""
    return str(model.config.dtype).removeprefix("torch.") + caches


@torch.no_grad()
def check_generation(model: CausalLM, gen: Generation, max_new_tokens: int, backend: str, **kwargs) -> CheckReport:
    """The bundle's generation `gen` (kept logits) under the rule above. model: the eager
    model the bundle was bound to, unbound; max_new_tokens and kwargs: generate's
    (max_batch, max_seq, slots, eos_ids), as the bundle ran."""
    tolerance = tolerance_for(backend)
    prompts = [s.prompt_ids for s in gen.sequences]
    kwargs = dict(kwargs, keep_logits=True, on_token=None)
    if full_precision(model):
        return compare(gen, generate(model, prompts, max_new_tokens, **kwargs), tolerance)
    forced = [s.new_ids for s in gen.sequences]
    twin = generate(model, prompts, 0, forced=forced, **kwargs)
    reference = reference_model(model)
    ref = generate(reference, prompts, 0, forced=forced, **kwargs)
    del reference
    return compare_to_reference(gen, twin, ref, tolerance, precision(model))


def compare(gen: Generation, ref: Generation, tolerance: float) -> CheckReport:
    """Compare each sequence of `gen` with eager's `ref` (both generated with keep_logits)."""
    rows = []
    for s, r in zip(gen.sequences, ref.sequences):
        same = next((i for i, (a, b) in enumerate(zip(s.new_ids, r.new_ids)) if a != b), min(len(s.new_ids), len(r.new_ids)))
        shared = list(zip(s.logits[: same + 1], r.logits[: same + 1]))
        diff = max(((a - b).abs().max().item() for a, b in shared), default=0.0)
        err = max((error(a, b) for a, b in shared), default=0.0)
        equal = s.new_ids == r.new_ids
        gap = None
        if not equal and same < len(r.logits):
            top2 = r.logits[same].float().topk(2).values
            if (top2[0] - top2[1]).item() <= tolerance:
                gap = (top2[0] - top2[1]).item()
        rows.append(PromptCheck(equal, same, len(r.new_ids), diff, r.new_ids, gap, err <= tolerance, err, None, tolerance))
    return CheckReport(tolerance, rows)


def compare_to_reference(gen: Generation, twin: Generation, ref: Generation, tolerance: float, twin_precision: str) -> CheckReport:
    """A lower-precision bundle's `gen`, and its eager `twin`, against the float32 `ref`,
    the last two forced along gen's tokens."""
    rows = []
    for s, t, r in zip(gen.sequences, twin.sequences, ref.sequences):
        assert t.new_ids == s.new_ids == r.new_ids, "the twin and the reference follow the bundle's tokens"
        err = max(error(a, b) for a, b in zip(s.logits, r.logits))
        twin_err = max(error(a, b) for a, b in zip(t.logits, r.logits))
        allowed = bound(twin_err, tolerance)
        chosen = [int(x.argmax()) for x in r.logits]
        differ = [i for i, (a, b) in enumerate(zip(s.new_ids, chosen)) if a != b]
        gap = None
        if differ:
            # A token the bundle chose over the reference's is a near-tie when the reference's
            # gap between the two is within the error allowed at that logit.
            gaps = [near_tie(r.logits[i], s.new_ids[i], allowed) for i in differ]
            if None not in gaps:
                gap = max(gaps)
        diff = max((a - b).abs().max().item() for a, b in zip(s.logits, r.logits))
        twin_ids = [int(x.argmax()) for x in t.logits]
        rows.append(PromptCheck(not differ, differ[0] if differ else len(chosen), len(chosen), diff, chosen, gap, err <= allowed, err, twin_err, allowed, twin_ids))
    return CheckReport(tolerance, rows, "float32 eager from the same stored weights", f"eager {twin_precision}")
