"""`--check`: a bundle's generation against the eager model's (DESIGN.md, Fidelity).

Logits are compared at a tolerance per dtype, tol + tol x |eager logit| (the
rounding of a low-precision dtype grows with the value: a bf16 logit near 10
moves in steps of 0.06); tokens are compared exactly,
except where eager's top-2 logit gap at the first differing step is within
that tolerance: such a near-tie is reported with its gap, not counted as a
failure (padding changes GEMM row counts, and CPU matmul results with them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.base import get_backend_class
from .generate import Generation

# Absolute logit tolerance per dtype: fp32 differs by about 1e-4 between row counts;
# times the backend's own factor (Backend.tolerance_factor).
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-1, torch.float16: 2e-2}


@dataclass
class PromptCheck:
    equal: bool
    matching_tokens: int  # tokens equal before the first difference
    tokens: int
    max_logit_diff: float  # over the steps both runs share, the first differing one included
    eager_new_ids: list[int]
    near_tie_gap: float | None = None  # eager's top-2 gap at the first differing step, when within tolerance
    logits_close: bool = True  # every compared logit within tol + tol x |eager|

    @property
    def passed(self) -> bool:
        return (self.equal or self.near_tie_gap is not None) and self.logits_close


@dataclass
class CheckReport:
    tolerance: float
    per_prompt: list[PromptCheck]

    @property
    def tokens_equal(self) -> bool:
        return all(p.equal for p in self.per_prompt)

    @property
    def max_logit_diff(self) -> float:
        return max((p.max_logit_diff for p in self.per_prompt), default=0.0)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.per_prompt)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Every element of a within tol + tol x |b| of b (b: the eager reference)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= tol + tol * b.abs()).all())


def tolerance_for(dtype: torch.dtype, backend: str) -> float:
    """The logit tolerance of a bundle of this dtype built with the backend named so."""
    return TOLERANCE.get(dtype, 1e-1) * get_backend_class(backend).tolerance_factor


def compare(gen: Generation, ref: Generation, tolerance: float) -> CheckReport:
    """Compare each sequence of `gen` with eager's `ref` (both generated with keep_logits)."""
    rows = []
    for s, r in zip(gen.sequences, ref.sequences):
        same = next((i for i, (a, b) in enumerate(zip(s.new_ids, r.new_ids)) if a != b), min(len(s.new_ids), len(r.new_ids)))
        shared = list(zip(s.logits[: same + 1], r.logits[: same + 1]))
        diff = max(((a - b).abs().max().item() for a, b in shared), default=0.0)
        logits_close = all(close(a, b, tolerance) for a, b in shared)
        equal = s.new_ids == r.new_ids
        gap = None
        if not equal and same < len(r.logits):
            top2 = r.logits[same].float().topk(2).values
            if (top2[0] - top2[1]).item() <= tolerance:
                gap = (top2[0] - top2[1]).item()
        rows.append(PromptCheck(equal, same, len(r.new_ids), diff, r.new_ids, gap, logits_close))
    return CheckReport(tolerance, rows)
