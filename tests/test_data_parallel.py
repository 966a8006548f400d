"""Data-parallel attention (--data-parallel-attention with --expert-parallel N) for DeepSeek
V4: each rank runs its own sequences in its own cache slots; each MoE layer gathers every
rank's rows, routes them, runs the rank's experts and reduce-scatters the fp32 sums back
(aotc.models.deepseek_v4.MoE); the ranks step in lockstep (aotc.runtime.engine)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from aotc.builder import BuildOptions, build
from aotc.errors import AotcError, BundleError
from aotc.format import read_manifest
from aotc.models.loader import load_model
from aotc.runtime import Bundle

from .test_expert_parallel import traced_at_ranks, v4_dir  # noqa: F401 (the fixture)
from .test_parallel import PROMPTS, eager_tokens, run_json, served_eager_tokens, simulated_neuron_build, torchrun


def dp_options(model_dir, out, backend="export", **more) -> BuildOptions:
    # Buckets per rank: 2 rows each, 4 sequences at once on 2 ranks.
    # Context buckets 32 and 128: a rank whose rows reach 32 positions runs at 128, and so
    # must every other rank beside it.
    return BuildOptions(
        model_dir, out=out, batch_buckets=(1, 2), chunk_buckets=(16,), max_seq=128, context_buckets=(32, 128), backend=backend,
        expert_parallel=2, data_parallel_attention=True, **more,
    )  # fmt: skip


@pytest.fixture(scope="module")
def dp_bundle(v4_dir, tmp_path_factory):  # noqa: F811
    return build(dp_options(v4_dir, tmp_path_factory.mktemp("dp") / "dp2", use_cache=False))


def collectives(bundle_dir: Path) -> dict[str, dict[str, list]]:
    """Per artifact of an export bundle: the dtypes of each collective's input, by collective."""
    found = {}
    for (entry, bucket, _), program in Bundle.load(bundle_dir).programs.items():
        ops = {op: [] for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")}
        for n in program.gm.graph.nodes:
            name = str(n.target).removeprefix("_c10d_functional.").removesuffix(".default")
            if n.op == "call_function" and name in ops:
                ops[name].append(n.args[0].meta["val"].dtype)
        found[f"{entry}/{bucket}"] = ops
    return found


@pytest.mark.slow  # CI runs the service test below on the same bundle: its ranks give the unsharded eager tokens too
def test_ranks_run_their_own_sequences_and_give_the_unsharded_eager_tokens(dp_bundle, v4_dir):  # noqa: F811
    """The layout; one all-gather and one fp32 reduce-scatter in each MoE layer's graph, no
    all-reduce or all-to-all, none in the head's; each rank's caches hold only its own slots
    (2 and the scratch slot, where every rank holding all 4 sequences needs 5); 3 prompts of
    unequal lengths on 2 ranks give the unsharded eager tokens, rank 0 running calls with no
    row of its own (its prompts end first; the other rank still prefills its long one)."""
    m = dp_bundle.manifest
    assert (m.parallel.expert_parallel, m.parallel.attention, m.parallel.gather) == (2, "data-parallel", "collectives")
    assert m.shapes.cache_slots == 3 and all(c.shape[1] == 3 for c in m.caches.values())
    for art, ops in collectives(dp_bundle.out).items():
        if art.startswith("V4Head"):
            assert not any(ops.values()), (art, ops)
        else:
            assert ops["all_gather_into_tensor"] == [torch.float32] and ops["reduce_scatter_tensor"] == [torch.float32], (art, ops)
            assert not ops["all_reduce"] and not ops["all_to_all_single"], (art, ops)
    report = run_json(dp_bundle.out, PROMPTS, max_batch=2)
    assert report["check"]["passed"] and report["check"]["tokens_equal"], report["check"]
    assert [p["new_ids"] for p in report["prompts"]] == eager_tokens(v4_dir, report, 12)
    assert report["timings"]["idle_calls"] > 0, report["timings"]
    full = load_model(v4_dir).model
    assert full.cache_bytes(m.shapes.cache_slots, 128) / full.cache_bytes(2 * 2 + 1, 128) == 3 / 5  # 2 of 4 sequence slots, and a scratch slot


SERVICE_PROGRAM = """\
import hashlib, json, os, sys, threading
from aotc import SamplingParams, Session
from aotc.runtime import Bundle

PROMPTS = ["Hello, world!", "Once upon a time there was a small model that learned to count: one, two, three", "Hi",
           "Good morning", "a b c d e f g h i j k l m n o p", "Why?", "The sea is", "Count: 1 2 3 4 5 6 7 8 9 10"]
SEEDED = SamplingParams(temperature=0.9, seed=4)
calls = []  # each layer graph (those with collectives) this rank runs: (entry, context bucket, bucket)
def wrap(run, key):
    def counted(args, call=0):
        if "Block" in key[0]:
            calls.append(key)
        return run(args, call) if call else run(args)
    return counted
with Session.open(sys.argv[1]) as session:
    Bundle.wrap_steps(session.model, wrap)
    service = session.service()
    slots = {kind: tuple(c.shape[:2]) for kind, c in session._caches.items() if hasattr(c, "shape")}
    if session.rank == 0:
        handles = [None] * len(PROMPTS)
        def ask(i):
            handles[i] = service.submit(PROMPTS[i], max_tokens=10, sampling=SEEDED if i == 5 else None)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together = [h.result(60) for h in handles]
        solo = [service.submit(p, max_tokens=10, sampling=SEEDED if i == 5 else None).result(60) for i, p in enumerate(PROMPTS)]
        stop = session.tokenizer.decode(solo[7].ids[:4])[-2:]
        stopped = service.submit(PROMPTS[7], max_tokens=10, stop=[stop])
        beside = [service.submit(p, max_tokens=10) for p in PROMPTS[:4]]  # the stopped one's rank ends it a step later
        print(json.dumps({"together": [c.ids for c in together], "solo": [c.ids for c in solo], "prompt_ids": [c.prompt_ids for c in solo],
                          "stopped": [stopped.result(60).text, stopped.result().finish_reason, solo[7].text, stop],
                          "beside": [h.result(60).ids for h in beside]}))
    service.close()
    digest = hashlib.sha256(json.dumps(calls).encode()).hexdigest()
    contexts = sorted({c for _, c, _ in calls if c})
    # One write, so that the two ranks' lines never interleave.
    os.write(2, f"rank {session.rank} {json.dumps({'capacity': service.engine.capacity, 'slots': slots, 'calls': [len(calls), digest], 'contexts': contexts})}\\n".encode())
"""


def test_a_service_serves_8_concurrent_requests_across_the_ranks_each_as_it_runs_alone(dp_bundle, v4_dir, tmp_path):  # noqa: F811
    """A service under torchrun on the bundle: 8 requests from 8 threads (4 at once on each
    rank, one sampled with a seed) give each request's solo output and the unsharded eager
    tokens; a stop string that rank 0 reads ends a request whichever rank runs it, and the
    requests beside it run on; each rank allocates 3 cache slots and the service takes 4;
    both ranks run the same layer graphs in the same order, at one context bucket each step
    (the head, which has no collective, runs only where a rank has a row of its own)."""
    done = torchrun(tmp_path, SERVICE_PROGRAM, dp_bundle.out)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads(line.split(" ", 2)[2]) for line in done.stderr.splitlines() if line.startswith("rank ")]
    assert len(ranks) == 2
    assert all(r["capacity"] == 4 and all(shape[1] == 3 for shape in r["slots"].values()) for r in ranks), ranks
    assert ranks[0]["calls"] == ranks[1]["calls"] and ranks[0]["contexts"] == [32, 128], ranks  # the same graphs, in lockstep
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("{")]
    got = json.loads(line)
    assert got["together"] == got["solo"]
    greedy = [i for i in range(8) if i != 5]
    eager = eager_tokens(v4_dir, {"prompts": [{"prompt_ids": got["prompt_ids"][i]} for i in greedy]}, 10)
    assert [got["solo"][i] for i in greedy] == eager
    text, reason, whole, stop = got["stopped"]
    assert reason == "stop" and stop in whole and text == whole[: whole.index(stop)]
    assert got["beside"] == got["solo"][:4]


@pytest.mark.slow  # 30 s of traces at two ranks and two backends; CI traces rank 1 of a bf16 V4 with expert parallelism (test_expert_parallel.py)
def test_rank_1_traces_the_same_graphs_and_inductor_gathers_by_all_reduce(v4_dir, tmp_path):  # noqa: F811
    """A trace at rank 1 gives rank 0's cache keys (the rank is a value of the expert map,
    never a constant); a bf16 model's reduce-scatter takes fp32 parts; on inductor each MoE
    graph gathers and scatters by two all-reduces (its runtime cannot run all-gather and
    reduce-scatter safely: Backend.gathers_with), the rows' parts summed in fp32."""
    from aotc.models.tiny import write_tiny

    bf16 = write_tiny(tmp_path / "v4", arch="deepseek_v4", layers=3, dtype="bfloat16", n_routed_experts=8)
    for backend, want in (("export", {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}), ("inductor", {"all_reduce": 2})):
        options = dp_options(bf16, tmp_path / backend, backend=backend, use_cache=False)
        keys, graphs = traced_at_ranks(options)
        assert keys[0] == keys[1], backend
        for g in graphs:
            nodes = [n for n in g.graph.program.graph_module.graph.nodes if n.op == "call_function" and "_c10d_functional" in str(n.target)]
            ops = {}
            for n in nodes:
                name = str(n.target).split(".")[1]
                if name != "wait_tensor":
                    ops[name] = ops.get(name, 0) + 1
            assert ops == want, (backend, g.id, ops)
            scattered = [n for n in nodes if "reduce_scatter" in str(n.target) or "all_reduce" in str(n.target)][-1]
            assert scattered.args[0].meta["val"].dtype == torch.float32, (backend, g.id)


def test_data_parallel_attention_comes_with_expert_parallelism_and_a_manifest_says_so(dp_bundle, v4_dir, tmp_path):  # noqa: F811
    with pytest.raises(AotcError, match=r"--data-parallel-attention with --expert-parallel 1: .* give --expert-parallel N \(N >= 2\) with it"):
        BuildOptions(v4_dir, out=tmp_path / "b", data_parallel_attention=True)
    text = (dp_bundle.out / "manifest.json").read_text()
    cases = {
        "parallel": [('"expert_parallel": 2', '"expert_parallel": 1')],
        "parallel.gather": [('"attention": "data-parallel"', '"attention": "replicated"'), ('"gather": "collectives"', '"gather": "all-reduce"')],
    }
    for field, edits in cases.items():
        bad, changed = tmp_path / field, text
        for old, new in edits:
            assert old in changed
            changed = changed.replace(old, new, 1)
        bad.mkdir()
        (bad / "manifest.json").write_text(changed)
        with pytest.raises(BundleError, match=rf"{field.replace('.', '[.]')}"):
            read_manifest(bad)
    assert not (tmp_path / "b").exists()


# -- the other backends (slow) --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inductor", "xla", "neuron"])
def test_every_backend_gives_the_unsharded_eager_tokens(v4_dir, tmp_path, backend):  # noqa: F811
    """inductor (its MoE graphs gathering by all-reduce), xla and neuron (the fake SDK, after
    --resume): each block's HLO holds one all-gather and one f32 reduce-scatter over both
    ranks, no all-reduce or all-to-all; 3 prompts give the unsharded eager tokens, three
    times over on inductor (whose ranks once hung in gloo: parallel.settled)."""
    env = None
    options = dp_options(v4_dir, tmp_path / "dp2", backend=backend, use_cache=False, jobs=1)
    if backend == "neuron":
        result, env = simulated_neuron_build(options, tmp_path)
        env = dict(os.environ, **env)
    else:
        result = build(options)
    if backend != "inductor":
        for entry, art in result.manifest.artifacts():
            text = (result.out / art.dir / "hlo.txt").read_text()
            ops = [line for line in text.splitlines() if any(f" {op}(" in line for op in ("all-reduce", "all-to-all", "all-gather", "reduce-scatter"))]
            if "Block" not in entry.id:
                assert not ops, (entry.id, ops)
                continue
            gathers = [o for o in ops if " all-gather(" in o]
            scatters = [o for o in ops if " reduce-scatter(" in o]
            assert len(gathers) == 1 and len(scatters) == 1 and len(ops) == 2, (entry.id, ops)
            assert "f32[" in scatters[0] and all("replica_groups={{0,1}}" in o for o in ops), (entry.id, ops)
    for _ in range(3 if backend == "inductor" else 1):
        report = run_json(result.out, PROMPTS, max_batch=2, env=env)
        assert report["check"]["passed"] and report["check"]["tokens_equal"], report["check"]
        assert [p["new_ids"] for p in report["prompts"]] == eager_tokens(v4_dir, report, 12)
        assert report["timings"]["idle_calls"] > 0, report["timings"]


# Under slow (issue 64): CI runs aotc serve over ranks (test_parallel.py's TP=2 server, its
# SIGTERM drain and its killed rank) and the service spreading 8 concurrent requests over
# these ranks (test_a_service_serves_8_concurrent_requests_...).
@pytest.mark.slow
def test_aotc_serve_spreads_8_concurrent_requests_over_the_ranks(dp_bundle, v4_dir):  # noqa: F811
    """aotc serve on the bundle, judged by the openai client in strict mode: 8 concurrent
    completions (4 at once on each rank) give the unsharded eager tokens, and SIGTERM
    drains through rank 0: status 0."""
    served_eager_tokens(dp_bundle.out, v4_dir, ["Hello, world!", "Once upon a time", "Hi", "The sea is", "Good morning", "Why?", "a b c d e f", "Count: 1 2 3"])
