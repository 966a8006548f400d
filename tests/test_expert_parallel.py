"""Expert parallelism (--expert-parallel N) for DeepSeek V4: each rank holds and reads only
its share of every MoE layer's routed experts; attention, the caches, the routers and the
shared expert are whole on every rank, and every rank runs every row. One fp32 all-reduce
per MoE layer sums the ranks' parts (aotc.models.deepseek_v4.MoE)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from aotc import parallel
from aotc.builder import BuildOptions, build
from aotc.builder.key import key_graphs
from aotc.builder.plan import make_plan
from aotc.errors import AotcError
from aotc.models.loader import load_model
from aotc.models.tiny import write_tiny
from aotc.runtime import Bundle

from .conftest import checkpoint_reads
from .test_parallel import PROMPTS, eager_tokens, run_json, simulated_neuron_build, torchrun

EXPERT_WEIGHTS = ("stacked_w1", "stacked_w2", "stacked_w3")


def ep_options(model_dir, out, backend="export", degree=2, **more) -> BuildOptions:
    return BuildOptions(model_dir, out=out, batch_buckets=(1, 4), chunk_buckets=(16,), max_seq=128, backend=backend, expert_parallel=degree, **more)


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    """The tiny V4 (every attention kind, two hash-routed MoE layers and a top-k one) with
    8 experts, 2 per token: at 2 ranks a batch-1 decode makes fewer choices than a rank
    has experts (gathered), a batch of 4 or a prefill chunk as many or more (dense). Its
    hash tables send every third token to one expert in both slots."""
    from safetensors.torch import load_file, save_file

    folder = write_tiny(tmp_path_factory.mktemp("v4") / "v4", arch="deepseek_v4", layers=3, n_routed_experts=8)
    tensors = load_file(folder / "model.safetensors")
    for name, table in tensors.items():
        if name.endswith("tid2eid"):
            table[::3, 1] = table[::3, 0]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def ep_bundle(v4_dir, tmp_path_factory):
    return build(ep_options(v4_dir, tmp_path_factory.mktemp("ep") / "ep2", use_cache=False))


def collectives(bundle_dir: Path) -> dict[str, dict[str, int]]:
    """Per entry of an export bundle: its graph's collectives by name."""
    counts = {}
    for (entry, _, _), program in Bundle.load(bundle_dir).programs.items():
        targets = [str(n.target) for n in program.gm.graph.nodes if n.op == "call_function"]
        counts[entry] = {op: sum(t == f"_c10d_functional.{op}.default" for t in targets) for op in ("all_reduce", "all_to_all_single", "all_gather_into_tensor")}
    return counts


def test_v4_ranks_hold_half_the_experts_and_generate_the_unsharded_eager_tokens(ep_bundle, v4_dir):
    """The layout and the experts' shards in the manifest; one all-reduce in each block's
    graph and none in the head's; 2 rank processes give the unsharded eager model's tokens,
    with a prompt over two chunks in a batch of three."""
    m = ep_bundle.manifest
    assert (m.parallel.world_size, m.parallel.tensor_parallel, m.parallel.expert_parallel) == (2, 1, 2)
    for entry in m.entries:
        weights = {w.path: w for w in entry.weights}
        if entry.cls == "V4Head":
            assert all(w.shard is None for w in entry.weights)
            continue
        for name in EXPERT_WEIGHTS:
            w = weights[f"ffn.{name}"]
            assert (w.shape[0], w.shard.kind, w.shard.blocks, w.shard.ways) == (4, "experts", [8], 2), w
        assert weights["ffn.gate.weight"].shard is None and weights["ffn.gate.weight"].shape[0] == 8  # the router: every expert
        assert weights["ffn.expert_map"].shape == [8] and weights["ffn.expert_map"].dtype == "int64"
    counts = collectives(ep_bundle.out)
    assert all(c == {"all_reduce": 1, "all_to_all_single": 0, "all_gather_into_tensor": 0} for e, c in counts.items() if "Block" in e), counts
    assert counts["V4Head.forward"]["all_reduce"] == 0
    report = run_json(ep_bundle.out, PROMPTS)
    assert report["check"]["passed"] and report["check"]["tokens_equal"], report["check"]
    assert [p["new_ids"] for p in report["prompts"]] == eager_tokens(v4_dir, report, 12)


def test_each_rank_reads_and_binds_only_its_experts(ep_bundle, v4_dir):
    """Rank r loads experts [4r, 4r+4) of every layer, and only those of the checkpoint's
    expert tensors (counted at safetensors' reads); its stacks are those experts, its map
    takes the router's choices to them; bound, it holds half the routed experts' bytes."""
    full = load_model(v4_dir).model
    layout, bundle = ep_bundle.manifest.parallel, Bundle.load(ep_bundle.out)
    routed = sum(p.nbytes for n, p in full.named_parameters() if ".ffn.experts." in n)
    for rank in (0, 1):
        with checkpoint_reads() as reads:
            model = load_model(v4_dir, layout=layout, rank=rank).model
        read = reads.whole + reads.sliced
        experts = {n.split(".ffn.experts.")[1].split(".")[0] for n in read if ".ffn.experts." in n}
        assert experts == {str(4 * rank + j) for j in range(4)}, sorted(read)
        for layer, whole in zip(model.model.layers, full.model.layers):
            assert len(layer.ffn.experts) == 4
            for j in range(4):
                torch.testing.assert_close(layer.ffn.experts[j].w2.weight, whole.ffn.experts[4 * rank + j].w2.weight, rtol=0, atol=0)
            assert layer.ffn.expert_map.tolist() == ([0, 1, 2, 3, 4, 4, 4, 4] if rank == 0 else [4, 4, 4, 4, 0, 1, 2, 3])
            torch.testing.assert_close(layer.ffn.gate.weight, whole.ffn.gate.weight, rtol=0, atol=0)
        with parallel.tracing(layout, rank=rank):  # bind's check: a rank of a 2-rank group
            bundle.bind(model, rank=rank, world_size=2)
        stacks = {}
        for m in model.modules():
            for d in vars(m).values():
                for s in getattr(d, "steps", {}).values():
                    for st in s.values():
                        stacks.update({id(t): t.nbytes for t in st.weights if t.dim() == 3 and t.shape[0] == 4})
        assert sum(stacks.values()) == routed // 2, (sum(stacks.values()), routed)


def traced_at_ranks(options: BuildOptions, entries=("SlidingBlock.decode", "CSABlock.prefill")):
    """The cache keys of some entries' graphs traced at rank 0 and at rank 1, and rank 1's graphs."""
    keys = []
    for rank in (0, 1):
        with parallel.tracing(options.layout, rank=rank):
            plan = make_plan(options)
            graphs = key_graphs(plan, [t for t in plan.tasks if t[0].entry_id.startswith(entries)])
            keys.append([(g.id, g.key) for g in graphs])
    return keys, graphs


def test_a_bf16_v4_sums_its_parts_in_fp32_and_rank_1_traces_the_same_graphs(tmp_path):
    """Each MoE graph's one all-reduce takes fp32 parts (the parts of a bf16 model summed
    in fp32, then cast); no all-to-all; a trace at rank 1 gives rank 0's cache keys (its
    own experts and map are weights, never constants in the graph)."""
    model_dir = write_tiny(tmp_path / "v4", arch="deepseek_v4", layers=3, dtype="bfloat16", n_routed_experts=8)  # gathered and dense
    options = ep_options(model_dir, tmp_path / "b", use_cache=False)
    keys, graphs = traced_at_ranks(options)
    for g in graphs:
        nodes = list(g.graph.program.graph_module.graph.nodes)
        reduced = [n for n in nodes if "all_reduce" in str(n.target)]
        assert len(reduced) == 1 and reduced[0].args[0].meta["val"].dtype == torch.float32, g.id
        assert not any("all_to_all" in str(n.target) for n in nodes)
    assert keys[0] == keys[1]


def test_degrees_and_models_without_an_expert_plan_are_refused(v4_dir, tiny_dir, tmp_path):
    with pytest.raises(
        AotcError,
        match=r"--expert-parallel 3: model\.layers\.\*\.ffn\.experts\.\*\.w1\.weight: 8 routed experts \(n_routed_experts\) do not split into 3 equal parts; valid degrees for this model: 1, 2, 4, 8$",
    ):
        build(ep_options(v4_dir, tmp_path / "b", degree=3))
    with pytest.raises(
        AotcError,
        match=r"--expert-parallel 2: llama models have no expert-parallel plan in aotc \(DeepSeek V4 has one, and a transformers model whose config class has base_model_ep_plan\); build it with --expert-parallel 1",
    ):
        build(ep_options(tiny_dir, tmp_path / "b"))
    with pytest.raises(AotcError, match="--tensor-parallel 2 --expert-parallel 2: aotc builds one of them at a time"):
        ep_options(v4_dir, tmp_path / "b", tensor_parallel=2)
    assert not (tmp_path / "b").exists()


# -- the other backends, and the fp8 and transformers-made V4s (slow) ---------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inductor", "xla", "neuron"])
def test_v4_ranks_on_every_backend_generate_the_unsharded_eager_tokens(v4_dir, tmp_path, backend):
    env = None
    if backend == "neuron":
        result, env = simulated_neuron_build(ep_options(v4_dir, tmp_path / "ep2", backend=backend, use_cache=False, jobs=1), tmp_path)
        env = dict(os.environ, **env)
    else:
        result = build(ep_options(v4_dir, tmp_path / "ep2", backend=backend, use_cache=False, jobs=1))
    if backend != "inductor":  # one all-reduce per block's HLO, over both ranks, no channel
        for entry, art in result.manifest.artifacts():
            text = (result.out / art.dir / "hlo.txt").read_text()
            ops = [line for line in text.splitlines() if " all-reduce(" in line or " all-to-all(" in line]
            assert len(ops) == ("Block" in entry.id) and all("all-reduce(" in o and "f32[" in o and "replica_groups={{0,1}}" in o for o in ops), (entry.id, ops)
    report = run_json(result.out, PROMPTS, env=env)
    assert report["check"]["passed"] and report["check"]["tokens_equal"], report["check"]
    assert [p["new_ids"] for p in report["prompts"]] == eager_tokens(v4_dir, report, 12)


@pytest.mark.slow
def test_fp8_experts_stay_whole_with_their_scales(tmp_path):
    model_dir = write_tiny(tmp_path / "v4", arch="deepseek_v4", layers=3, quantize="fp8")
    result = build(ep_options(model_dir, tmp_path / "ep2", use_cache=False))
    stacked = [w for e in result.manifest.entries for w in e.weights if w.path.startswith("ffn.stacked_")]
    assert stacked and all(w.shard.kind == "experts" for w in stacked)
    report = run_json(result.out, PROMPTS)
    assert report["check"]["passed"] and report["check"]["tokens_equal"], report["check"]


TRANSFORMERS_PROGRAM = """\
import json, sys
from aotc import Session
with Session.open(sys.argv[1]) as session:
    done = [session.generate([p], max_new_tokens=16, check=True) for p in json.loads(sys.argv[2])]
    if session.rank == 0:  # rank 0 checks against the unsharded eager model
        print(json.dumps([[c.ids, c.finish_reason, d.check.passed] for d in done for c in d]))
"""


@pytest.mark.slow
def test_a_v4_that_transformers_makes_runs_on_two_ranks_with_its_greedy_tokens(tmp_path):
    """transformers' own DeepseekV4ForCausalLM (every layer and MoE kind), saved by
    save_pretrained, built at --expert-parallel 2 and run as 2 ranks: transformers' greedy
    tokens for a prompt of one chunk and one of four, and aotc's unsharded eager tokens
    (--check) for those and for a prompt of four chunks on which aotc's eager V4 and
    transformers' differ: transformers initialises the indexer so that its ReLU scores
    tie at exactly 0.0, and each breaks those ties its own way (aotc: the earliest entry,
    issue 69; transformers' generate and its own full forward disagree there too)."""
    from .test_deepseek_v4_compiled import transformers_v4

    transformers = pytest.importorskip("transformers")
    folder = transformers_v4(tmp_path / "hf", 11)
    out = build(BuildOptions(folder, out=tmp_path / "ep2", batch_buckets=(4,), chunk_buckets=(32,), max_seq=512, backend="export", expert_parallel=2)).out
    g = torch.Generator().manual_seed(11)
    passage = torch.randint(3, 400, (41,), generator=g).tolist()
    short, long, third = torch.randint(3, 400, (20,), generator=g).tolist(), passage * 3 + [7, 9], torch.randint(3, 400, (77,), generator=g).tolist()
    prompts = [short, third + third[:50], long]
    done = torchrun(tmp_path, TRANSFORMERS_PROGRAM, out, json.dumps(prompts), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads([line for line in done.stdout.splitlines() if line.startswith("[")][0])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert all(passed for _, _, passed in got), got
    for prompt, (ids, reason, _) in zip(prompts[:2], got):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
        # aotc stops at config.json's eos, which transformers' saved generation config leaves out.
        assert ids == want[: len(ids)] and (len(ids) == 16 or reason == "stop"), (ids, want, reason)
