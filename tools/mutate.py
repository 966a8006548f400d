"""Mutation testing: how many deliberately broken copies of a module the tests catch.

    python tools/mutate.py                      # every target, every mutant
    python tools/mutate.py aotc/fp8.py --sample 60 --json /tmp/mutation.json
    python tools/mutate.py aotc/runtime/verify.py --sample 30 --seed 34 --shard 1/2   # and 2/2 beside it

cosmic-ray writes each mutant into the module's file and runs the target's
tests. It runs on a copy of the working tree (tracked and untracked files, not
ignored ones), with PYTHONPATH pointing there, so the tests that run `aotc` in a
subprocess import the mutant too and the checkout is never touched.

A survivor is a change to the code that no test noticed: either a missing
check, or a mutant that cannot change behaviour (say, `x * 1` turned into
`x / 1`). Read the diffs it prints. Needs the dev extra: pip install -e '.[dev]'.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each module with the pytest arguments that select the tests guarding it. The
# first listed run first, and `pytest -x` stops at the first failure, so most
# mutants die within seconds; a survivor costs a whole run of its selection.
TARGETS = {
    "aotc/runtime/dispatch.py": ["tests/test_runtime.py", "tests/test_kvcache.py::test_a_packed_cache_given_whole_to_a_split_graph_is_an_error"],
    "aotc/passes/reslice_cache_views.py": ["tests/passes/test_reslice_cache_views.py", "tests/test_trace.py"],
    "aotc/cache/local.py": ["tests/test_cache.py", "tests/test_safety.py"],
    "aotc/cache/keys.py": [
        "tests/test_keys.py",
        "tests/test_cache.py::test_weights_and_paths_do_not_change_keys",
        "tests/test_cache.py::test_shapes_buckets_flags_and_versions_change_keys",
        "tests/test_cache.py::test_source_digest_follows_every_python_file_and_nothing_else",
        "tests/test_cache.py::test_a_config_with_its_fields_in_another_order_is_the_same_recipe",
        "tests/test_cache.py::test_each_build_keeps_its_own_recipe",
        "tests/test_readme_claims.py::test_cpu_target_is_in_the_cache_key",
        "tests/test_readme_claims.py::test_recipe_is_invalidated_when_a_source_changes",
    ],
    "aotc/cache/recipes.py": ["tests/test_cache.py", "tests/test_readme_claims.py"],
    "aotc/cache/remote.py": ["tests/test_cache.py", "tests/test_readme_claims.py"],
    "aotc/fp8.py": ["tests/test_fp8.py", "tests/test_neuron.py"],
    "aotc/runtime/verify.py": ["tests/test_verify.py"],
    "aotc/runtime/threads.py": ["tests/test_threads.py"],
    "aotc/chat.py": ["tests/test_chat.py", "tests/test_real_folders.py", "-k", "chat"],
    "aotc/passes/rewrite_skinny_linears.py": ["tests/passes/test_rewrite_skinny_linears.py"],
    "aotc/passes/rewrite_skinny_matmuls.py": ["tests/passes/test_rewrite_skinny_matmuls.py"],
    "aotc/backends/export_archive.py": [
        "tests/test_export_archive.py",
        "tests/test_safety.py::test_export_program_that_calls_python_or_unpickles_is_refused_and_never_runs",
        "tests/test_safety.py::test_swapped_artifacts_are_refused_before_they_run",
        "tests/test_safety.py::test_loading_reads_nothing_outside_the_bundle",
    ],
    "aotc/kvcache.py": ["tests/test_kvcache.py"],
    "aotc/runtime/check.py": ["tests/test_fidelity.py", "tests/test_runtime.py::test_check_tolerance_grows_with_the_logit"],
    "aotc/runtime/launch.py": [
        "tests/test_parallel.py::test_the_launcher_names_a_rank_killed_by_a_signal_before_one_that_exited_after_it",
        "tests/test_parallel.py::test_ending_the_ranks_asks_each_running_one_to_stop_before_killing_it",
        "tests/test_parallel.py::test_the_launcher_runs_a_python_entry_point_per_rank_and_a_failed_rank_ends_the_rest",
        "tests/test_parallel.py::test_ranks_that_generated_other_tokens_are_an_error_on_every_rank_naming_them",
        "tests/test_parallel.py::test_a_killed_rank_ends_the_run_naming_it_and_leaves_no_process",
        "tests/test_parallel.py::test_a_killed_launcher_takes_its_ranks_with_it",
        "tests/test_parallel.py::test_two_local_ranks_generate_the_unsharded_eager_tokens",
        "tests/test_parallel.py::test_aotc_serve_starts_the_ranks_serves_from_rank_0_and_drains_or_dies_with_them",
    ],
    "aotc/quantize_checkpoint.py": ["tests/test_quantize.py"],
    "aotc/passes/split_dtype_regions.py": ["tests/test_kvcache.py"],
}

# cosmic-ray replaces each binary and comparison operator with every other one
# (12 mutants per `+`). One replacement per operator keeps the run to hours,
# not days: the negation or the boundary shift, which a missing check lets through.
KEPT_SWAPS = {
    "ReplaceBinaryOperator": {
        ("Add", "Sub"), ("Sub", "Add"), ("Mul", "Div"), ("Div", "Mul"), ("FloorDiv", "Mul"), ("Mod", "FloorDiv"),
        ("Pow", "Mul"), ("LShift", "RShift"), ("RShift", "LShift"), ("BitAnd", "BitOr"), ("BitOr", "BitAnd"), ("BitXor", "BitOr"),
    },
    "ReplaceComparisonOperator": {
        ("Eq", "NotEq"), ("NotEq", "Eq"), ("Lt", "LtE"), ("LtE", "Lt"), ("Gt", "GtE"), ("GtE", "Gt"),
        ("Is", "IsNot"), ("IsNot", "Is"), ("In", "NotIn"), ("NotIn", "In"),
    },
}  # fmt: skip
SWAP = re.compile(r"core/(ReplaceBinaryOperator|ReplaceComparisonOperator)_(\w+?)_(\w+)$")


def kept(operator: str) -> bool:
    m = SWAP.match(operator)
    return m is None or (m[2], m[3]) in KEPT_SWAPS[m[1]]


INERT = "in an annotation that is never evaluated"
# Decorators that leave a function's annotations unread (typer, msgspec and dataclasses read them).
PLAIN_DECORATORS = {"staticmethod", "classmethod", "property", "cache", "lru_cache", "cached_property", "contextmanager", "no_grad", "inference_mode"}


def unevaluated_annotations(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions, as cosmic-ray's (line, column), of the parameter and return
    annotations of functions that nothing reads them of, in a module whose annotations are
    strings (`from __future__ import annotations`): no mutant there can change behaviour.
    Class-level annotations are left out: msgspec and dataclasses read those."""
    import ast

    module = ast.parse(path.read_text())
    postponed = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names) for n in module.body)
    if not postponed:
        return []

    def plain(fn) -> bool:
        names = {d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", None) for d in (x.func if isinstance(x, ast.Call) else x for x in fn.decorator_list)}
        return names <= PLAIN_DECORATORS

    spans = []
    for fn in ast.walk(module):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and plain(fn):
            args = fn.args
            annotations = [a.annotation for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a is not None and a.annotation is not None]
            for node in [*annotations, fn.returns]:
                if node is not None:
                    spans.append(((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)))
    return spans


def copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def run_target(target: str, tree: Path, sample: int | None, seed: int, timeout: float, shard: tuple[int, int] | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    tests = " ".join(TARGETS[target])
    command = f"{sys.executable} -m pytest -x -q -n 0 -p no:randomly -p no:cacheprovider {tests}"
    config, db = tree / "cosmic-ray.toml", tree / "session.sqlite"
    config.write_text(f'[cosmic-ray]\nmodule-path = "{target}"\ntimeout = {timeout}\nexcluded-modules = []\ntest-command = "{command}"\n[cosmic-ray.distributor]\nname = "local"\n')
    db.unlink(missing_ok=True)
    where = subprocess.run([sys.executable, "-c", "import aotc; print(aotc.__file__)"], cwd=tree, env=env, capture_output=True, text=True).stdout
    if not Path(where.strip()).is_relative_to(tree):  # the mutants would never be imported
        raise SystemExit(f"the tests would import aotc from {where.strip()}, not from the mutated copy in {tree}")
    t0 = time.perf_counter()
    base = subprocess.run(command.split(), cwd=tree, env=env, capture_output=True, text=True)
    if base.returncode != 0:  # every mutant would count as killed
        raise SystemExit(f"{target}: its tests fail without any mutation:\n{base.stdout[-3000:]}")
    baseline_s = time.perf_counter() - t0
    exe = Path(sys.executable).parent / "cosmic-ray"
    r = subprocess.run([str(exe), "init", str(config), str(db)], cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"cosmic-ray init failed for {target}:\n{r.stderr}")
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(db), WorkDB.Mode.open) as work:
        specs = {item.job_id: item.mutations[0] for item in work.work_items}
        jobs = [(job, m.operator_name) for job, m in specs.items()]
        total = len(jobs)
        # Job ids are random: order by what the mutant is, so a seed picks the same mutants each run.
        where = lambda job: (specs[job].start_pos, specs[job].end_pos, specs[job].operator_name, specs[job].occurrence)  # noqa: E731
        candidates = sorted((job for job, op in jobs if kept(op)), key=where)
        chosen = set(random.Random(seed).sample(candidates, sample)) if sample and sample < len(candidates) else set(candidates)
        # What is not chosen is recorded as skipped, as cosmic-ray's own filters do. So is a
        # chosen mutant inside an annotation that is never evaluated (it cannot change
        # behaviour, so no test could catch it): left out of the score, after sampling, so
        # that a seed still picks the same mutants.
        if shard is not None:  # this process's share of the sample, by position (the others run theirs)
            i, n = shard
            chosen = {job for k, job in enumerate(sorted(chosen, key=where)) if k % n == i - 1}
        spans = unevaluated_annotations(tree / target)
        inert = {job for job in chosen if any(a <= specs[job].start_pos and specs[job].end_pos <= b for a, b in spans)}
        work.set_multiple_results([job for job, _ in jobs if job not in chosen], WorkResult(WorkerOutcome.SKIPPED, output="not chosen"))
        work.set_multiple_results(sorted(inert), WorkResult(WorkerOutcome.SKIPPED, output=INERT))
    note = f", {len(inert)} in annotations never evaluated, not run" if inert else ""
    print(f"{target}: {len(chosen)} mutants of {total} ({len(candidates)} after one swap per operator{note}); tests take {baseline_s:.0f} s unmutated", flush=True)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([str(exe), "exec", str(config), str(db)], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            time.sleep(30)
            with use_db(str(db), WorkDB.Mode.open) as work:
                done = work.num_results - (total - len(chosen))
            print(f"  {done} of {len(chosen)} mutants tested, {time.perf_counter() - t0:.0f} s", flush=True)
        if proc.returncode != 0:
            log.seek(0)
            raise SystemExit(f"cosmic-ray exec failed for {target}:\n{log.read()[-3000:]}")
    return summarize(target, db, total, len(candidates), time.perf_counter() - t0)


def summarize(target: str, db: Path, total: int, candidates: int, seconds: float) -> dict:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    with use_db(str(db), WorkDB.Mode.open) as work:
        rows = [(item.mutations[0], result) for item, result in work.completed_work_items if result.worker_outcome != WorkerOutcome.SKIPPED]
        inert = [item.mutations[0] for item, result in work.completed_work_items if result.worker_outcome == WorkerOutcome.SKIPPED and result.output == INERT]
    timeouts = [m for m, r in rows if r.worker_outcome == WorkerOutcome.ABNORMAL]  # the tests hung on the mutant: caught
    killed = [m for m, r in rows if r.test_outcome == TestOutcome.KILLED and r.worker_outcome != WorkerOutcome.ABNORMAL]
    incompetent = [m for m, r in rows if r.test_outcome == TestOutcome.INCOMPETENT]  # the mutant does not even import
    survivors = sorted(((m, r) for m, r in rows if r.test_outcome == TestOutcome.SURVIVED), key=lambda mr: mr[0].start_pos)
    tested = len(killed) + len(timeouts) + len(survivors)
    return {
        "file": target,
        "mutants": total,
        "after_swap_filter": candidates,
        "run": len(rows),
        "killed": len(killed),
        "timeouts": len(timeouts),
        "incompetent": len(incompetent),
        "survived": len(survivors),
        "score": round((len(killed) + len(timeouts)) / tested, 3) if tested else None,
        "inert": [{"line": m.start_pos[0], "operator": m.operator_name} for m in inert],  # in annotations: not run, not scored
        "seconds": round(seconds),
        "survivors": [{"line": m.start_pos[0], "operator": m.operator_name, "diff": r.diff} for m, r in survivors],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help=f"modules to mutate (default: {', '.join(TARGETS)})")
    parser.add_argument("--sample", type=int, help="run this many mutants per module, chosen at random with --seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600, help="seconds one mutant's tests may run")
    parser.add_argument("--json", type=Path, help="write the scores and survivors here")
    parser.add_argument("--shard", help="I/N: run the I-th of N shares of the sample (by position), so that N processes run one sample; add their counts")
    args = parser.parse_args()
    targets = args.targets or list(TARGETS)
    shard = None
    if args.shard:
        try:
            shard = tuple(int(x) for x in args.shard.split("/"))
            assert len(shard) == 2 and 1 <= shard[0] <= shard[1]
        except (ValueError, AssertionError):
            parser.error(f"--shard {args.shard}: expected I/N with 1 <= I <= N, such as 1/2")
    for t in targets:
        if t not in TARGETS:
            parser.error(f"{t}: not a target; known targets are {', '.join(TARGETS)} (add it, with its tests, to TARGETS)")
    results = []
    with tempfile.TemporaryDirectory(prefix="aotc-mutate-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        for t in targets:
            results.append(run_target(t, tree, args.sample, args.seed, args.timeout, shard))
            res = results[-1]
            print(f"  killed {res['killed'] + res['timeouts']} of {res['killed'] + res['timeouts'] + res['survived']} ({res['score']:.0%}) in {res['seconds']} s", flush=True)
            for s in res["survivors"]:
                print(f"  survived: line {s['line']} {s['operator']}")
    print(f"\n{'file':40} {'run':>5} {'killed':>7} {'survived':>9} {'score':>6}")
    for r in results:
        print(f"{r['file']:40} {r['run']:>5} {r['killed'] + r['timeouts']:>7} {r['survived']:>9} {r['score']:>6.0%}")
    if args.json:
        tmp_json = args.json.with_suffix(".tmp")
        tmp_json.write_text(json.dumps({"sample": args.sample, "seed": args.seed, "results": results}, indent=2) + "\n")
        os.replace(tmp_json, args.json)


if __name__ == "__main__":
    main()
