"""The fidelity rule (aotc.runtime.check) at every precision: a correct bundle passes
`aotc run --check` and `aotc verify`, and one whose decode graph is another model's
(rms_norm_eps 0.5: same signature, hashes fixed) fails both."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from aotc.builder import BuildOptions, build
from aotc.cli import app
from aotc.format import artifact_dir
from aotc.models.tiny import write_tiny
from aotc.runtime.check import bound, compare_to_reference, error
from aotc.runtime.generate import Generation, Sequence
from aotc.runtime.verify import Writes, verify

from .conftest import rehash

# precision: (write_tiny's arguments, the build's kv cache dtype, measured against a
# float32 twin). fp8 weights in a float32 model: eager dequantizes them to float32, the
# values the twin would hold, so eager is the reference.
PRECISIONS = {
    "float32": ({}, "auto", False),
    "bfloat16": ({"dtype": "bfloat16"}, "auto", True),
    "fp8 weights": ({"quantize": "fp8"}, "auto", False),
    "fp8 weights, bfloat16": ({"quantize": "fp8", "dtype": "bfloat16"}, "auto", True),
    "fp8 caches": ({}, "fp8", True),
    "fp8 values, bf16 keys": ({}, "fp8-values", True),
}
DECODE = artifact_dir("LlamaDecoderLayer.decode", 1, 64)


@pytest.fixture(scope="module", params=list(PRECISIONS))
def bundles(request, tmp_path_factory):
    """(its bundle, the bundle with the other model's decode graph, whether a float32 twin
    is the reference)."""
    fields, kv, twin = PRECISIONS[request.param]
    root = tmp_path_factory.mktemp("fidelity")
    made = {}
    for name, eps in (("model", {}), ("other", {"rms_norm_eps": 0.5})):
        folder = write_tiny(root / name, layers=2, **fields, **eps)
        made[name] = build(BuildOptions(folder, out=root / f"{name}-bundle", batch_buckets=(1,), chunk_buckets=(16,), max_seq=64, backend="export", kv_cache_dtype=kv)).out
    broken = root / "broken"
    shutil.copytree(made["model"], broken)
    shutil.copy(made["other"] / DECODE / "program.pt2", broken / DECODE / "program.pt2")
    rehash(broken)
    return made["model"], broken, twin


def _check(bundle) -> tuple[int, dict]:
    r = CliRunner().invoke(app, ["run", str(bundle), "--check", "--json", "--max-new-tokens", "6", "--prompt", "Hello there", "--prompt", "The capital of France is"])
    return r.exit_code, json.loads(r.output.strip().splitlines()[-1]) if r.output.strip().startswith("{") else r.output


def test_a_correct_bundle_passes_check_and_verify(bundles):
    bundle, _, twin = bundles
    code, report = _check(bundle)
    assert code == 0 and report["check"]["passed"], report
    assert (report["check"]["twin"] is not None) == twin, report["check"]
    checked = verify(bundle)
    assert checked.passed, [(a.entry, a.problems) for a in checked.artifacts]


def test_a_bundle_with_one_graph_of_another_model_fails_check_and_verify(bundles):
    _, broken, _ = bundles
    code, report = _check(broken)
    assert code == 1 and not report["check"]["passed"], report
    assert not all(p["logits_close"] for p in report["check"]["per_prompt"]), report["check"]
    checked = verify(broken)
    failed = {a.entry for a in checked.artifacts if not a.passed}
    assert failed == {"LlamaDecoderLayer.decode"}, [(a.entry, a.problems) for a in checked.artifacts]


def test_the_rule_allows_twice_the_twins_error_or_the_fp32_tolerance():
    ref = torch.tensor([0.0, 10.0])
    assert error(torch.tensor([0.1, 10.0]), ref) == pytest.approx(0.1)
    assert error(torch.tensor([0.0, 11.1]), ref) == pytest.approx(0.1)  # 1.1 / (1 + 10)
    assert bound(0.02, 1e-3) == 0.04 and bound(1e-4, 1e-3) == 1e-3


def test_writes_are_found_where_eager_wrote_an_equal_value():
    """Where eager writes the value already there (a bf16 value equal to the random one),
    it wrote all the same; an fp8 row's scale view over the packed bytes counts too."""
    cache = torch.zeros(3, 4, dtype=torch.bfloat16)
    with Writes([cache]) as writes:
        cache[1, 2:] = 0.0  # equal to what is there
        cache.index_copy_(0, torch.tensor([2]), cache[:1].clone())
    assert writes.mask(cache).tolist() == [[False] * 4, [False, False, True, True], [True] * 4]
    packed = torch.zeros(2, 8, dtype=torch.uint8)
    with Writes([packed]) as writes:
        packed[1, 4:8].view(torch.float32).fill_(1.0)
    assert writes.mask(packed).tolist() == [[False] * 8, [False] * 4 + [True] * 4]


def _run(ids: list[int], rows: list[list[float]]) -> Generation:
    return Generation([Sequence([1, 2], list(ids), [torch.tensor(r) for r in rows])])


def test_a_lower_precision_run_passes_with_near_ties_only_never_with_a_wrong_token():
    """compare_to_reference on a bundle whose tokens differ from float32 eager's at two
    steps: where both differences are near-ties (the reference's gap within the error
    allowed) the run passes, reporting the widest gap; where one of them is a genuinely
    wrong token (a gap of 0.1 where 0.08 is allowed), it fails, however near the other."""

    # The reference (float32 eager, forced along the bundle's tokens) prefers token 0 at
    # steps 1 and 2; the bundle chose token 1 there. Its logits and its twin's are within
    # 0.04 of the reference's: 0.08 allowed (twice the twin's error).
    def case(gap_at_2: float):
        ref = [[1.0, 0.0, 0.0], [0.0, -0.001, 0.0], [0.0, -gap_at_2, 0.0]]
        ours = [[r[0] + 0.01, r[1], r[2]] for r in ref]
        twin = [[r[0] + 0.04, r[1], r[2]] for r in ref]
        ids = [0, 1, 1]
        return compare_to_reference(_run(ids, ours), _run(ids, twin), _run(ids, ref), 1e-3, "bfloat16").per_prompt[0]

    near = case(0.05)
    assert near.passed and not near.equal and near.near_tie_gap == pytest.approx(0.05) and near.bound == pytest.approx(0.08)
    assert near.matching_tokens == 1 and near.eager_new_ids == [0, 0, 0]
    wrong = case(0.1)
    assert wrong.logits_close and not wrong.passed and wrong.near_tie_gap is None


def test_an_fp32_run_is_compared_up_to_its_first_differing_token_and_a_near_tie_there_is_named():
    """compare(): logits are compared at each step up to and with the first differing token
    (none after it: the runs no longer see the same tokens); a difference where eager's
    top two are within the tolerance is a near-tie with eager's gap; a wider one fails."""
    from aotc.runtime.check import CheckReport, compare

    ref_rows = [[2.0, 0.0, 0.0], [1.0, 1.0 - 5e-4, 0.0], [0.0, 0.0, 9.0]]
    ours_rows = [[2.0 + 1e-4, 0.0, 0.0], [1.0, 1.0 - 5e-4 + 2e-4, 0.0], [50.0, 0.0, 0.0]]  # step 2 is after the difference
    near = compare(_run([0, 1, 0], ours_rows), _run([0, 0, 2], ref_rows), 1e-3).per_prompt[0]
    assert (near.equal, near.matching_tokens, near.tokens) == (False, 1, 3)
    assert near.max_logit_diff == pytest.approx(2e-4, rel=1e-3) and near.near_tie_gap == pytest.approx(5e-4, rel=1e-3) and near.passed
    ref_rows[1][1] = 1.0 - 5e-3  # eager's gap at the difference: 5e-3, over 1e-3
    ours_rows[1][1] = ref_rows[1][1]
    wide = compare(_run([0, 1, 0], ours_rows), _run([0, 0, 2], ref_rows), 1e-3).per_prompt[0]
    assert wide.near_tie_gap is None and not wide.passed and wide.logits_close
    assert CheckReport(1e-3, []).max_logit_diff == 0.0 and CheckReport(1e-3, []).passed
    none = compare(_run([], []), _run([], []), 1e-3).per_prompt[0]  # no new token: nothing to compare
    assert none.max_logit_diff == 0.0 and none.equal and none.passed


def test_the_precision_a_check_reports_names_the_caches_where_they_are_not_the_models_dtype(tmp_path):
    from aotc.models.loader import load_model
    from aotc.runtime.bundle import Bundle
    from aotc.runtime.check import precision

    model_dir = write_tiny(tmp_path / "m", layers=1)
    assert precision(load_model(model_dir).model) == "float32"
    fp8 = build(BuildOptions(model_dir, out=tmp_path / "b", batch_buckets=(1,), chunk_buckets=(16,), max_seq=64, backend="export", kv_cache_dtype="fp8", use_cache=False))
    assert precision(load_model(model_dir, **Bundle.load(fp8.out, load_artifacts=False).model_args()).model) == "float32, fp8 caches"
