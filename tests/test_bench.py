"""Each section of bench/perf.py, run on the tiny model (--quick) with aotc's export
backend and torch.compile's eager backend (labelled as such; bench runs use inductor for
both). Each test checks the claims its section's labels make: the dtype a row names, a
shape, a byte count, a ratio of two columns. CI runs the sections that take about 10 s
this way on a 2-core machine of 2026-12 (chat: 19); those that take longer (the time is by
each mark), start many processes or build DeepSeek V4 are marked slow."""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """(Run, sections): one run shared by this module's tests, as perf.py makes one."""
    sys.path.insert(0, str(BENCH))
    try:
        import common

        sections = common.load_sections()
        run = common.Run(tmp_path_factory.mktemp("bench"), quick=True, backend="export", torch_compile_backend="eager", quick_scale=0.1)
        yield run, sections
    finally:
        sys.path.remove(str(BENCH))


def ratio(row, a, b):
    return row[a] / row[b]


SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in ("common", "gptfast", "llamacpp", "ttft"))


def test_each_benchmark_script_parses_its_options(bench, monkeypatch, capsys):
    """Every script imports what it needs and answers --help (in this process: one import of torch)."""
    for name in SCRIPTS:
        module = runpy.run_path(str(BENCH / f"{name}.py"), run_name=f"bench_{name}")
        monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
        with pytest.raises(SystemExit) as stopped:
            module["main"]()
        assert stopped.value.code == 0 and "usage:" in capsys.readouterr().out, name


def test_perf_lists_every_section_and_refuses_an_unknown_one(bench, monkeypatch, capsys):
    main = runpy.run_path(str(BENCH / "perf.py"), run_name="bench_perf")["main"]
    monkeypatch.setattr(sys, "argv", ["perf.py", "--help"])
    with pytest.raises(SystemExit):
        main()
    out = capsys.readouterr().out
    names = sorted(p.stem for p in (BENCH / "sections").glob("*.py") if p.stem != "__init__")
    assert all(f"  {name}: " in out for name in names), out
    monkeypatch.setattr(sys, "argv", ["perf.py", "--sections", "decode,nope"])
    with pytest.raises(SystemExit) as stopped:
        main()
    assert stopped.value.code == 2 and "--sections: unknown nope; expected some of" in capsys.readouterr().err


def test_decode_rows_are_each_batch_bucket_of_the_bundles_timed(bench):
    run, sections = bench
    result = sections["decode"](run)
    assert [r["batch"] for r in result["rows"]] == [1, 2, 4, 8]
    for r in result["rows"]:
        # the columns name what ran: the bundle's backend, torch.compile's backend
        assert {"eager", "aotc export", "torch.compile (eager)"} <= set(r)
        assert math.isclose(r["export/eager"], ratio(r, "aotc export", "eager"))
        assert math.isclose(r["export/torch.compile (eager)"], ratio(r, "aotc export", "torch.compile (eager)"))


@pytest.mark.slow  # 14 s here
def test_bandwidth_counts_every_weight_but_the_embedding_table(bench):
    run, sections = bench
    result = sections["bandwidth"](run)
    with safe_open(run.model("tiny") / "model.safetensors", "pt") as f:
        weights = sum(f.get_tensor(k).nbytes for k in f.keys() if not k.startswith("model.embed_tokens"))
    assert result["weight_bytes"] == weights and "256 MiB" in result["definitions"]["copy bandwidth"]
    for r in result["rows"]:
        assert math.isclose(r["of roofline"], ratio(r, "roofline ms", "aotc export ms"))
        assert math.isclose(r["weight GB/s"], weights / r["aotc export ms"] / 1e6)
        assert r["targets met"] == (r["of roofline"] >= 0.7 and r["aotc / eager"] <= 0.4)


@pytest.mark.slow
def test_build_traces_as_many_graphs_at_every_layer_count(bench):
    run, sections = bench
    rows = sections["build"](run)["rows"]
    assert [r["layers"] for r in rows] == [2, 4]
    # decode, prefill at the chunk context (128) and at max_seq, its fresh form (a first chunk
    # from position 0), head: one layer graph serves every layer
    assert rows[0]["aotc graphs"] == rows[1]["aotc graphs"] == 5
    bundle = run.root / "build-4-bundle"
    assert math.isclose(rows[1]["aotc bundle MB"], sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()) / 1e6)
    assert all("whole-model export MB" in r and "torch.compile (eager) s" in r for r in rows)


@pytest.mark.slow
def test_memory_compares_with_the_checkpoint_it_built(bench):
    run, sections = bench
    result = sections["memory"](run)
    config = json.loads((run.root / "mem" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (result["layers"], result["hidden"]) == (32, 256)
    weights = (run.root / "mem" / "model.safetensors").stat().st_size
    assert math.isclose(result["weight_MB"], weights / 1e6)
    for r in result["rows"]:
        assert math.isclose(r["of weight bytes"], r["peak RSS MB"] * 1e6 / weights)


@pytest.mark.slow  # 35 s here
def test_lowp_each_row_reads_the_format_its_label_names(bench):
    """The bf16 row once ran fp32 weights (config.json's dtype won over torch_dtype)."""
    run, sections = bench
    result = sections["lowp"](run)
    rows = {r["weights"]: r for r in result["rows"]}
    assert rows["fp32"]["layer matrices"] == "float32" and set(rows["fp32"]["MB read by dtype"]) == {"float32"}
    assert rows["bf16"]["layer matrices"] == "bfloat16" and set(rows["bf16"]["MB read by dtype"]) == {"bfloat16"}
    assert rows["fp8"]["layer matrices"] == "float8_e4m3fn"
    assert rows["int8"]["layer matrices"] == "int8" and set(rows["int8"]["MB read by dtype"]) == {"int8", "float32"}  # int8 bytes, fp32 scales
    for r in rows.values():
        assert math.isclose(r["stored MB read"], sum(r["MB read by dtype"].values()))
    assert math.isclose(rows["bf16"]["stored MB read"], rows["fp32"]["stored MB read"] / 2)  # every weight in half the bytes
    for kind in ("fp32", "bf16"):  # the checkpoints hold what the rows name
        with safe_open(run.root / f"lowp-tiny-{kind}" / "model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32" if kind == "fp32" else "BF16"}
    assert math.isclose(rows["fp8"]["fp32 ms / this"], rows["fp32"]["step ms"] / rows["fp8"]["step ms"])


@pytest.mark.slow
def test_v4_bytes_read_are_the_chosen_experts_and_the_rest(bench):
    run, sections = bench
    result = sections["v4"](run)
    from aotc.models.loader import load_model

    model = load_model(run.root / "v4-tiny").model
    c = model.config
    experts = sum(p.nbytes for n, p in model.named_parameters() if ".ffn.experts." in n)
    assert result["expert_bytes_read"] == experts * c.num_experts_per_tok // c.n_routed_experts
    assert result["params"] == sum(p.numel() for p in model.parameters())
    assert result["bandwidth"]["bytes_read"] == result["expert_bytes_read"] + result["other_bytes_read"]
    assert [r["what"] for r in result["rows"]] == ["prefill", "decode b1", "decode b4"]
    assert (result["prompt_tokens"], result["chunk"], result["max_seq"]) == (40, 16, 64)


@pytest.mark.slow  # 27 s here
def test_generic_times_llama_both_ways_and_qwen3_against_transformers(bench):
    run, sections = bench
    result = sections["generic"](run)
    assert [(r["model"], r["batch"]) for r in result["llama"]] == [("llama tiny", 1), ("llama tiny", 4)]
    assert [(r["model"], r["batch"]) for r in result["qwen3"]] == [("qwen3 tiny", 1), ("qwen3 tiny", 4)]
    for r in result["llama"]:
        assert math.isclose(r["generic / llama path"], r["aotc export generic path ms"] / r["aotc export llama path ms"])
    assert set(result["build_s"]) == {"llama path", "generic path (llama)", "generic path (qwen3)"}


@pytest.mark.slow  # 17 s here
def test_moe_graphs_read_each_tokens_chosen_experts_and_every_other_weight(bench):
    """At batch 1 the decode graphs read exactly the chosen experts and every other weight
    (the token's k experts are distinct); at batch 4, each token's k, counted from the
    graphs' indexing, at least the distinct ones."""
    run, sections = bench
    result = sections["moe"](run)
    c = result["config"]
    layers, k = c["num_hidden_layers"], c["num_experts_per_tok"]
    assert [r["batch"] for r in result["rows"]] == [1, 4]
    assert result["chosen_expert_bytes"][1] == layers * k * result["expert_bytes"]
    assert result["graph_bytes_read"][1] == result["chosen_expert_bytes"][1] + result["other_bytes_read"]
    assert result["graph_bytes_read"][4] == layers * 4 * k * result["expert_bytes"] + result["other_bytes_read"]
    assert result["chosen_expert_bytes"][4] <= layers * 4 * k * result["expert_bytes"]
    assert result["params"] > 0 and all(r["aotc export ms"] > 0 and r["transformers ms"] > 0 for r in result["rows"])


@pytest.mark.slow  # 15 s here
def test_kvcache_fp8_rows_store_fp8_in_fewer_bytes(bench):
    run, sections = bench
    rows = sections["kvcache"](run)["rows"]
    full, fp8, values = rows
    assert full["dtypes stored"] == "float32" and fp8["dtypes stored"] == "float32,float8_e4m3fn"  # fp8 values, float32 scales
    assert values["cache"] == "fp8 values, bf16 keys" and values["dtypes stored"] == "bfloat16,float32,float8_e4m3fn"
    from aotc.models.loader import load_model

    model = load_model(run.model("tiny")).model
    c = model.config
    assert full["bytes per token"] == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # k and v, fp32
    assert 3.5 < fp8["full / this, bytes"] < 4  # an fp8 byte per value, and the scales
    assert math.isclose(fp8["full / this, bytes"], full["bytes per token"] / fp8["bytes per token"])
    assert values["bytes per token"] == c.num_hidden_layers * c.num_key_value_heads * (c.head_dim * 2 + c.head_dim + 4)  # bf16 keys; fp8 values and a scale


@pytest.mark.slow
def test_prefill_chunks_cover_the_prompt_and_count_their_padding(bench):
    run, sections = bench
    rows = sections["prefill"](run)["rows"]
    assert [r["chunk buckets"] for r in rows] == ["128", "512", "128,512"]
    for r in rows:
        pieces = [int(p) for p in r["chunks"].split("+")]
        assert sum(pieces) == 715
        buckets = [int(b) for b in r["chunk buckets"].split(",")]
        assert r["rows computed"] == sum(min(b for b in buckets if b >= p) for p in pieces) >= 715
    assert rows[2]["chunks"] == "512+128+75"  # the tail in the chunks that pad it least


def test_chat_packs_a_batchs_prompts_and_rates_the_rows_it_ran(bench):
    """One 38-token prompt runs as one first chunk of 40 rows (not a chunk of 48, nor three
    of 16), four as one call of 160 rows (a step prefills up to the largest chunk, 160
    tokens); the first tokens are eager's; the ratios and GFLOP/s are of the columns."""
    run, sections = bench
    result = sections["chat"](run)
    one, four = result["rows"]
    assert (one["prompts"], one["tokens"], one["chunks"], one["rows computed"]) == (1, 38, "38", 40)
    assert (four["prompts"], four["tokens"], four["chunks"], four["rows computed"]) == (4, 152, "152", 160)
    assert one["first tokens as eager's"] and four["first tokens as eager's"]
    for r in (one, four):
        assert math.isclose(r["aotc/eager"], ratio(r, "aotc ms", "eager ms"))
        assert math.isclose(r["aotc GFLOP/s padding included"] / r["aotc GFLOP/s"], r["rows computed"] / r["tokens"])
    assert math.isclose(four["4 prompts / 1"], four["aotc ms"] / one["aotc ms"])
    assert all(r["target met"] == (r["aotc/transformers"] <= 0.9) for r in (one, four))


@pytest.mark.slow  # 23 s here
def test_context_reads_the_smallest_bucket_that_holds_the_position(bench):
    run, sections = bench
    result = sections["context"](run)
    short, long = result["rows"]
    assert (short["position"], short["positions read (4096 bundle)"]) == (128, "256")
    assert (long["position"], long["positions read (4096 bundle)"]) == (4000, "4096")
    assert math.isclose(result["figures"]["aotc/eager at 4000"], long["aotc export max_seq 4096 ms"] / long["eager ms"])


@pytest.mark.slow
def test_resident_counts_the_cache_bytes_a_step_copies(bench):
    run, sections = bench
    rows = sections["resident"](run)["rows"]
    from aotc.models.loader import load_model

    c = load_model(run.model("tiny")).model.config
    long, short = rows[1], rows[2]
    assert (long["max_seq"], short["max_seq"]) == (1024, 256) and long["positions read"] == short["positions read"] == 256
    slots = 2  # a batch-1 bundle's cache slots: the sequence and the scratch one
    assert long["cache bytes"] == 2 * c.num_hidden_layers * slots * c.num_key_value_heads * 1024 * c.head_dim * 4
    assert long["cache bytes copied / step"] == short["cache bytes copied / step"] == 0


def test_overhead_rows_are_each_layer_count_and_batch(bench):
    run, sections = bench
    rows = sections["overhead"](run)["rows"]
    assert [(r["layers"], r["batch"]) for r in rows] == [(2, 1), (2, 8), (4, 1), (4, 8)]
    for r in rows:
        assert r["bundle"] == "aotc export"
        assert math.isclose(r["host us per step"], (r["step ms"] - r["in graphs ms"]) * 1e3)
        assert r["target met"] == (r["layers"] != 2 or r["overhead / graphs"] <= {1: 0.25, 8: 0.10}[r["batch"]])  # issue 75's
        assert all(r[f"host us: {part}"] > 0 for part in ("engine", "before the first graph", "between graphs", "after the last graph"))
        assert r["graph calls a step"] == r["layers"] + 1  # export: a graph per layer, then the head
        in_step = r["host us: before the first graph"] + r["layers"] * r["host us: between graphs"] + r["host us: after the last graph"]
        assert math.isclose(r["model host us in the step"], in_step) and r["alone, graphs stubbed"] > 0
    by = {(r["layers"], r["batch"]): r["allocations per step"] for r in rows}
    assert by[2, 1] == by[4, 1] and by[2, 8] == by[4, 8]  # the runtime's work per step does not grow with the layers


def test_overhead_splits_each_steps_host_work_at_its_graphs(bench):
    _, sections = bench
    host_split = sys.modules[sections["overhead"].__module__].host_split
    # Two decode calls of three graphs each: 1 s in each graph, 2 s before the first, 1 s
    # between graphs, 3 s after the last, and 4 s in the engine between the two calls.
    decodes = [(0, 10), (14, 24)]
    graphs = [(2, 3), (4, 5), (6, 7), (16, 17), (18, 19), (20, 21)]
    assert host_split(decodes, graphs) == {"calls": 3, "graphs": 3, "engine": 4, "before the first graph": 2, "between graphs": 1, "after the last graph": 3}
    with pytest.raises(RuntimeError, match="5 graph calls in 2 decode calls"):
        host_split(decodes, graphs[:5])


@pytest.mark.slow  # 35 s here
def test_engine_runs_both_schedules_on_the_same_requests_and_rates_them(bench):
    run, sections = bench
    result = sections["engine"](run)
    static, engine = result["rows"]
    assert (static["run"], engine["run"]) == ("static groups", "engine") and static["bundle"] == engine["bundle"] == "aotc export"
    asked = sum(result["max tokens"])  # greedy with no stop token: every request runs to its own length
    assert static["output tokens"] == engine["output tokens"] == asked and engine["tokens as static groups'"] == result["requests"]
    assert math.isclose(result["rate requests/s"], 1.5 * result["capacity requests/s"])
    assert all(b > a for a, b in zip(result["arrivals s"], result["arrivals s"][1:]))
    assert math.isclose(engine["tokens/s vs static"], engine["tokens/s"] / static["tokens/s"])
    assert math.isclose(engine["TTFT p99 vs static"], engine["TTFT p99 ms"] / static["TTFT p99 ms"])
    for r in (static, engine):
        assert math.isclose(r["tokens/s"], r["output tokens"] / r["makespan s"]) and r["TTFT p50 ms"] <= r["TTFT p99 ms"]


@pytest.mark.slow
def test_contention_runs_both_thread_policies_alone_and_beside_a_busy_loop(bench):
    run, sections = bench
    result = sections["contention"](run)
    assert [r["threads"] for r in result["rows"]] == [f"{result['cpus']} (fixed)", "aotc default (free CPUs)"]
    for r in result["rows"]:
        assert math.isclose(r["with / alone"], ratio(r, "busy loop", "alone"))


@pytest.mark.slow
def test_ttft_runs_agree_on_the_first_token(bench):
    run, sections = bench
    result = sections["ttft"](run)
    from aotc.models.loader import load_model

    model = load_model(run.model("tiny")).model
    prompt = torch.arange(3, 3 + result["prompt_tokens"]) % 500 + 3  # bench/ttft.py's prompt
    assert result["first_token"] == int(model.prompt_logits(prompt)[-1].argmax())
    assert [r["what"] for r in result["rows"]] == ["aotc run (export bundle)", "torch.compile (eager), cold cache", "torch.compile (eager), warm cache", "eager"]
    for r in result["rows"]:
        assert math.isclose(r["vs torch.compile (eager) cold"], r["process_s"] / result["rows"][1]["process_s"])


def test_peers_sections_are_skipped_with_the_reason_without_cmake(bench, monkeypatch):
    """--peers builds llama.cpp (and llama-server) from source: without cmake each section
    says so, records the reason in the results, and writes nothing into the cache folder."""
    run, sections = bench
    import llamacpp

    which = llamacpp.shutil.which
    monkeypatch.setattr(llamacpp.shutil, "which", lambda tool: None if tool == "cmake" else which(tool))
    monkeypatch.setattr(run, "peers_cache", run.root / "peers-cache")
    for name in ("peers", "serve"):
        assert sections[name](run) == {"skipped": "cmake is not on PATH; llama.cpp is built from source"}, name
    assert not run.peers_cache.exists()


def test_llama_cpp_builds_native_but_without_amx_on_a_cpu_with_amx(bench, monkeypatch):
    """llama.cpp's AMX matrix multiply segfaults on this VM's Xeon: there the build names
    the CPU's other extensions and none of AMX, in a cache folder of its own."""
    import llamacpp

    from aotc.backends import inductor

    for isa, native in ((frozenset({"avx2", "fma", "avx512f", "avx512bf16"}), True), (frozenset({"avx2", "fma", "avx512f", "avx512bf16", "amxint8", "amxtile"}), False)):
        monkeypatch.setattr(inductor, "host_isa", lambda isa=isa: isa)
        args = llamacpp.cmake_args().split()
        assert ("-DGGML_NATIVE=ON" in args) == native and ("-DGGML_NATIVE=OFF" in args) != native
        assert not any("AMX" in a for a in args)
        assert native or {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_BF16=ON"} <= set(args)
        assert llamacpp.build_dir(Path("/c")).name.endswith("-no-amx") != native


def test_a_gguf_step_reads_every_tensor_but_an_embedding_that_is_not_the_head(bench, tmp_path):
    import llamacpp
    import numpy as np
    from gguf import GGUFWriter

    def gguf(name, tensors):
        w = GGUFWriter(str(tmp_path / name), "llama")
        for n, shape in tensors.items():
            w.add_tensor(n, np.zeros(shape, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    layers = {"token_embd.weight": (64, 8), "blk.0.attn_q.weight": (8, 8)}
    assert llamacpp.bytes_per_step(gguf("tied.gguf", layers)) == 4 * (64 * 8 + 8 * 8)  # the table is the head
    assert llamacpp.bytes_per_step(gguf("untied.gguf", {**layers, "output.weight": (64, 8)})) == 4 * (8 * 8 + 64 * 8)


@pytest.mark.slow  # two 30-layer builds, and transformers at both precisions
def test_smollm2_rows_run_the_precision_they_name_and_keep_to_the_rule(bench):
    run, sections = bench
    results = sections["smollm2"](run)
    assert [(r["model"], r["batch"]) for r in results["rows"]] == [(f"SmolLM2-135M {d}", b) for d in ("float32", "bfloat16") for b in (1, 4)]
    assert all(r["model"].endswith(("float32", "bfloat16")) and r[f"{run.aotc} tok/s"] > 0 for r in results["rows"])
    fidelity = {f["model"]: f for f in results["fidelity"]}
    assert all(f["check"] == "pass" and f["error"] <= f["bound"] for f in fidelity.values()), fidelity
    assert fidelity["SmolLM2-135M float32"]["eager twin error"] == 0.0 < fidelity["SmolLM2-135M bfloat16"]["eager twin error"]


def test_the_real_model_is_kept_outside_the_compile_cache(bench, monkeypatch, tmp_path):
    """The compile cache refuses a folder that holds files aotc did not write: the model
    folders once went into ~/.cache/aotc/models, and builds then ran without the cache."""
    import smollm2

    from aotc.cache.local import default_root

    for env in ({}, {"XDG_CACHE_HOME": str(tmp_path)}):
        with monkeypatch.context() as m:
            for k in ("AOTC_MODELS", "AOTC_CACHE_DIR", "XDG_CACHE_HOME"):
                m.delenv(k, raising=False)
            for k, v in env.items():
                m.setenv(k, v)
            assert not smollm2.models_dir().resolve().is_relative_to(default_root().resolve()), env


@pytest.mark.slow  # five aotc run processes, two of them two ranks each
def test_parallel_ranks_decode_the_eager_tokens_and_hold_half_the_split_weights(bench):
    run, sections = bench
    result = sections["parallel"](run)
    tp1, tp2, eager = result["rows"]
    assert (tp1["ranks"], tp2["ranks"], eager["what"]) == (1, 2, "eager, one process")
    assert tp1["tokens equal eager"] and tp2["tokens equal eager"]
    assert tp2["vs tensor parallel 1"] == tp2["decode tokens/s"] / tp1["decode tokens/s"]
    one, *two = result["weights"]
    assert (one["tensor parallel"], [w["rank"] for w in two]) == (1, [0, 1])
    for w in two:  # each rank: half of what the plan splits, all of the rest
        assert w["split MB"] == pytest.approx(one["split MB"] / 2) and w["whole MB"] == pytest.approx(one["whole MB"])
    part1, part2 = result["v4_data_parallel"]
    assert part1["tokens equal eager"] and part2["tokens equal eager"] and part2["sequences at once"] == part1["sequences at once"] == 4
    assert (part1["cache slots per rank"], part2["cache slots per rank"]) == (5, 3) and part2["caches / part 1's"] == pytest.approx(3 / 5)
    assert part2["weights MB per rank"] == pytest.approx(part1["weights MB per rank"]) and part2["idle calls (rank 0)"] >= 0
