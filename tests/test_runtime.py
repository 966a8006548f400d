"""The runtime: bundle loading and validation, dispatch, padding, chunked prefill."""

from __future__ import annotations

import collections
import json
import shutil

import pytest
import torch

from aotc.builder import BuildOptions, build
from aotc.errors import AotcError, BundleError
from aotc.format import FORMAT_VERSION
from aotc.models.loader import load_model
from aotc.runtime import Bundle, Dispatcher, generate

from .conftest import assert_generation_matches_eager, record_contexts, wrap_programs, wrap_steps

SENTINEL = 7.0


@pytest.fixture()
def bound(tiny_dir, tiny_bundle):
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(tiny_bundle.out)
    bundle.check_model(loaded)
    bundle.bind(loaded.model)
    return loaded, bundle


def prompts(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def test_bind_replaces_entries_with_dispatchers(bound):
    loaded, bundle = bound
    layer = loaded.model.model.layers[1]
    assert isinstance(layer.decode, Dispatcher) and isinstance(layer.prefill, Dispatcher)
    assert isinstance(loaded.model.head.forward, Dispatcher)
    assert layer.decode.buckets == [1, 2, 4] and layer.prefill.buckets == [16, 64]
    Bundle.unbind(loaded.model)
    assert not isinstance(layer.decode, Dispatcher)


@pytest.mark.parametrize("lengths", [(9,), (5, 30, 70)])
def test_bundle_generation_equals_eager(bound, lengths):
    """Batch 1, and batch 3 padded into bucket 4, its 105 prompt tokens packed into chunks 64 + 64."""
    loaded, bundle = bound
    ps = prompts(*lengths)
    kw = dict(max_batch=bundle.max_batch, max_seq=bundle.max_seq, slots=bundle.cache_slots, keep_logits=True, stop_at_eos=False)
    compiled = generate(loaded.model, ps, 10, **kw)
    Bundle.unbind(loaded.model)
    eager = generate(loaded.model, ps, 10, **kw)
    for c, e in zip(compiled.sequences, eager.sequences):
        assert c.new_ids == e.new_ids
        torch.testing.assert_close(torch.stack(c.logits), torch.stack(e.logits), atol=1e-4, rtol=1e-4)


def test_near_ties_match_eager_up_to_the_tie(tiny_bundle, tiny_dir, near_tie_dir):
    """The default tiny head keeps the top two logits apart; one drawn at transformers'
    scale brings them within 1e-2, and the bundle still matches eager."""
    assert assert_generation_matches_eager(tiny_bundle.out, tiny_dir) > 1e-2
    assert assert_generation_matches_eager(tiny_bundle.out, near_tie_dir) < 1e-2


def test_padding_rows_write_only_the_scratch_slot(bound):
    loaded, bundle = bound
    model = loaded.model
    slots, max_seq = bundle.cache_slots, bundle.max_seq  # 5 slots: 0..3 for sequences, 4 is scratch
    ps = prompts(6, 11, 4)
    compiled = {k: v.fill_(SENTINEL) for k, v in model.allocate_caches(slots, max_seq).items()}
    for i, p in enumerate(ps):
        model.prefill(torch.tensor(p), i, compiled)
    ids, positions = torch.tensor([p[-1] for p in ps]), torch.tensor([len(p) for p in ps])
    model.decode(ids, positions, compiled)  # 3 rows -> bucket 4: one padding row
    Bundle.unbind(model)
    eager = {k: v.fill_(SENTINEL) for k, v in model.allocate_caches(slots, max_seq).items()}
    for i, p in enumerate(ps):
        model.prefill(torch.tensor(p), i, eager)
    model.decode(ids, positions, eager)
    for kind in ("k", "v"):
        c, e = compiled[kind], eager[kind]
        torch.testing.assert_close(c[:, :3], e[:, :3], atol=1e-5, rtol=1e-5)  # real sequences: as eager
        assert c[:, 3].eq(SENTINEL).all()  # the slot no sequence owns: never touched
        assert not c[:, 4].eq(SENTINEL).all()  # padding rows (and padded prefill tokens) wrote here
        assert e[:, 4].eq(SENTINEL).all()  # eager has no padding


@pytest.fixture(scope="module")
def long_bundle(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundles") / "chunk128"
    return build(BuildOptions(tiny_dir, out=out, batch_buckets=(1, 2), chunk_buckets=(128,), max_seq=768, backend="export"))


def test_715_token_prompt_prefills_in_6_chunks_and_matches_unchunked_eager(tiny_dir, long_bundle):
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(long_bundle.out)
    calls = []
    wrap_programs(bundle, lambda key, run: lambda args: calls.append(key) or run(args))
    bundle.bind(loaded.model)
    (ids,) = prompts(715)
    ids = torch.tensor(ids)
    model = loaded.model
    compiled = model.allocate_caches(bundle.cache_slots, bundle.max_seq)
    logits = model.prefill(ids, 0, compiled)
    per_layer = [k[0] for k in calls if k[0].startswith("LlamaDecoderLayer.prefill")]
    # 5 full chunks + 1 padded chunk per layer, the first from position 0 in the fresh form
    assert per_layer == (["LlamaDecoderLayer.prefill_fresh"] + ["LlamaDecoderLayer.prefill"] * 5) * len(model.model.layers)
    Bundle.unbind(model)
    eager = model.allocate_caches(bundle.cache_slots, bundle.max_seq)
    expected = model.prefill(ids, 0, eager)  # one unchunked call
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(compiled["k"][:, 0, :, :715], eager["k"][:, 0, :, :715], atol=1e-5, rtol=1e-5)


def test_batch_larger_than_largest_bucket_runs_in_several_calls(bound):
    loaded, bundle = bound
    ps = prompts(3, 8, 5, 12, 7, 4)  # 6 prompts, largest bucket 4: groups of 4 and 2
    kw = dict(max_batch=bundle.max_batch, max_seq=bundle.max_seq, slots=bundle.cache_slots, stop_at_eos=False)
    compiled = generate(loaded.model, ps, 6, **kw)
    Bundle.unbind(loaded.model)
    eager = generate(loaded.model, ps, 6, max_batch=len(ps), max_seq=bundle.max_seq, stop_at_eos=False)
    assert [s.new_ids for s in compiled.sequences] == [s.new_ids for s in eager.sequences]


def test_decode_rows_beyond_largest_bucket_are_an_error(bound):
    loaded, _ = bound
    layer = loaded.model.model.layers[0]
    with pytest.raises(BundleError, match="5 rows but the largest bucket is 4"):
        layer.decode(*([torch.zeros(5)] * 5), torch.zeros(1), torch.zeros(1))


def test_too_long_prompt_is_an_error_before_any_work(bound, monkeypatch):
    loaded, bundle = bound
    called = []
    monkeypatch.setattr(loaded.model, "prefill", lambda *a, **k: called.append(a))
    with pytest.raises(AotcError, match=r"prompt 1 has 250 tokens; with --max-new-tokens 10 .*\(max_seq 256\)"):
        generate(loaded.model, prompts(5, 250), 10, max_batch=4, max_seq=bundle.max_seq)
    assert not called


def test_cache_with_other_strides_is_an_error_at_the_call(bound):
    loaded, bundle = bound
    layer, model = loaded.model.model.layers[0], loaded.model
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq)
    x = torch.zeros(2, 256)
    cos, sin = model.rope(torch.tensor([0, 1]))
    bad = caches["k"][0].transpose(2, 3).contiguous().transpose(2, 3)  # same shape, other strides
    with pytest.raises(BundleError, match=r"cache 'k_cache' has shape .* strides .* built for"):
        layer.decode(x, cos, sin, torch.tensor([0, 1]), torch.tensor([0, 1]), bad, caches["v"][0])


def test_config_mismatch_is_an_error_naming_the_field(tiny_dir, tiny_bundle, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (other / "config.json").write_text(json.dumps(config))
    bundle = Bundle.load(tiny_bundle.out)
    with pytest.raises(BundleError, match=r"rms_norm_eps is 0.001, but bundle .* was built with 1e-05"):
        bundle.check_model(load_model(other))


def test_weight_shape_mismatch_is_an_error_naming_the_weight(tiny_dir, tiny_bundle):
    loaded = load_model(tiny_dir)
    layer = loaded.model.model.layers[1]
    layer.mlp.up_proj.weight = torch.nn.Parameter(torch.zeros(700, 256))
    with pytest.raises(BundleError, match=r"weight model.layers.1.mlp.up_proj.weight is \[700, 256\]"):
        Bundle.load(tiny_bundle.out).bind(loaded.model)


def test_changed_artifact_is_refused(tiny_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle.out, copy)
    victim = next(copy.glob("entries/LMHead.forward/b1/*"))
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(BundleError, match=rf"{victim.name}: sha256 differs"):
        Bundle.load(copy)


def test_other_format_version_is_refused(tiny_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle.out, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["format_version"] = 999
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=f"format_version is 999, this aotc reads format {FORMAT_VERSION} only; rebuild"):
        Bundle.load(copy)


def test_dispatch_uses_the_smallest_bucket_that_fits(bound):
    loaded, bundle = bound
    layer = loaded.model.model.layers[0]
    used = []
    wrap_steps(layer.decode, lambda context, bucket, run: lambda args: used.append(bucket) or run(args))
    for batch, bucket in [(1, 1), (2, 2), (3, 4), (4, 4)]:
        used.clear()
        generate(loaded.model, prompts(*[5] * batch), 2, max_batch=batch, max_seq=bundle.max_seq, slots=bundle.cache_slots)
        assert used and set(used) == {bucket}, (batch, used)


@pytest.mark.parametrize(
    "length, chunks",
    [
        (70, [("fresh", 64), 16]),
        (80, [("fresh", 64), 16]),
        (40, [("fresh", 64)]),
        (32, [("fresh", 64)]),
        (17, [("fresh", 64)]),
        (16, [("fresh", 16)]),
        (64, [("fresh", 64)]),
        (8, [("fresh", 16)]),
    ],
)
def test_a_prompt_runs_in_the_chunks_that_cost_least(bound, length, chunks):
    """Whole 64-token chunks, then the rest in the chunk buckets (16, 64) at the least cost,
    a call counted as 48 rows: 17 to 40 tokens as one 64 (64 + 48), not 16 + 16 (32 + 96),
    the first in the fresh form (from position 0); logits are eager's."""
    loaded, bundle = bound
    layer = loaded.model.model.layers[0]
    used = []
    wrap_steps(layer.prefill, lambda context, bucket, run: lambda args: used.append(bucket) or run(args))
    wrap_steps(layer.prefill_fresh, lambda context, bucket, run: lambda args: used.append(("fresh", bucket)) or run(args))
    ids = torch.tensor(prompts(length)[0])
    caches = loaded.model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
    got = loaded.model.prefill(ids, 0, caches)
    assert used == chunks
    Bundle.unbind(loaded.model)
    want = loaded.model.prefill(ids, 0, loaded.model.allocate_caches(bundle.cache_slots, bundle.max_seq))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "n, first, fresh, rows",
    [
        (20, (16, 32, 128), False, [16, 4]),  # two calls of 16 (16 + 16 + 2 x 48), not one of 128 (128 + 48)
        (20, (16, 32, 128), True, [20]),  # from position 0: one first chunk of 32 (32 + 48)
        (20, (16, 128), True, [16, 4]),  # no finer first chunk: as any other
        (100, (16, 32, 128), True, [100]),
        (200, (16, 32, 128), True, [128, 72]),  # whole largest chunks first, fresh or not
    ],
)
def test_a_first_chunk_runs_as_one_call_where_its_finer_buckets_cost_least(n, first, fresh, rows):
    """Dispatcher.pieces for chunks 16 and 128: a call's first chunk from position 0 runs the
    fresh form at its own buckets, so rows that fit one of those run as that one call where
    it costs least (rows padded plus 48 a call)."""
    from types import SimpleNamespace

    from aotc.runtime.dispatch import _covers

    def buckets(bs):
        return SimpleNamespace(buckets=list(bs), bucket_for=[None] + [min(b for b in bs if b >= r) for r in range(1, bs[-1] + 1)], cover=_covers(bs))

    dispatcher = buckets((16, 128))
    dispatcher.fresh = buckets(first)
    assert Dispatcher.pieces(dispatcher, n, fresh) == rows


@pytest.mark.parametrize("lengths, contexts", [((60,), [64] * 4 + [256] * 5), ((3, 70), [256] * 9), ((3, 50), [64] * 9)])
def test_decode_runs_the_smallest_context_bucket_that_holds_every_row(context_bundle, tiny_dir, lengths, contexts):
    """A batch runs the context bucket of its longest sequence: a prompt of 60 decodes
    positions 60 to 63 in 64 positions, then moves to 256; tokens and logits are eager's."""
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(context_bundle)
    assert bundle.manifest.shapes.context == [64, 256]
    ps = prompts(*lengths)
    # Each prompt prefilled in one step (not the bundle's chunk of 32), before any decodes.
    kw = dict(max_batch=bundle.max_batch, max_seq=bundle.max_seq, slots=bundle.cache_slots, keep_logits=True, stop_at_eos=False, chunk=128)
    bundle.bind(loaded.model)
    used = record_contexts(loaded.model.model.layers[1].decode)
    compiled = generate(loaded.model, ps, 10, **kw)
    Bundle.unbind(loaded.model)
    eager = generate(loaded.model, ps, 10, **kw)
    assert used == contexts
    for c, e in zip(compiled.sequences, eager.sequences):
        assert c.new_ids == e.new_ids
        torch.testing.assert_close(torch.stack(c.logits), torch.stack(e.logits), atol=1e-5, rtol=1e-5)


def test_a_position_beyond_max_seq_is_an_error(context_bundle, tiny_dir):
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(context_bundle)
    bundle.bind(loaded.model)
    caches = loaded.model.allocate_caches(bundle.cache_slots, bundle.max_seq)
    with pytest.raises(BundleError, match=r"LlamaDecoderLayer.decode: position 256 is beyond the cache \(max_seq 256\)"):
        loaded.model.decode(torch.tensor([5]), torch.tensor([256]), caches)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts each aten op that runs."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func] += 1
        return func(*args, **(kwargs or {}))


def test_decode_steps_find_their_context_bucket_without_reading_positions(context_bundle, tiny_dir):
    """The engine made each step's positions from Python ints and says their largest
    (known_top): no step reduces the positions tensor to find its context bucket (a
    reduction and a read of the tensor each step)."""
    loaded, bundle = _bound_unobserved(tiny_dir, context_bundle)
    used = record_contexts(loaded.model.model.layers[1].decode)
    counts = []
    for new in (1, 2, 10):  # the first a warm-up (the RoPE tables are made once); then 1 and 9 decode steps
        ops = _Ops()
        with ops:
            generate(loaded.model, prompts(60, 3), new, max_batch=2, max_seq=bundle.max_seq, slots=bundle.cache_slots, stop_at_eos=False, chunk=128)
        counts.append(ops.count[torch.ops.aten.max.default])
    assert counts[2] == counts[1], counts  # 8 more steps, from positions 60 (context 64) past 64 (256), no more reductions
    assert used[-9:] == [64] * 4 + [256] * 5  # the context each step's top asks for


def test_a_wrong_known_top_is_refused_by_the_graph(context_bundle, tiny_dir):
    """A caller's word too small for its positions picks a context that misses a row's
    position: the graph's write refuses it (eager's index check here; Inductor's kernels
    check each indirect index), nothing is written past the context's view."""
    from aotc.runtime.dispatch import known_top, step_memos

    loaded, bundle = load_model(tiny_dir), Bundle.load(context_bundle)
    bundle.bind(loaded.model)
    caches = loaded.model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
    positions = torch.tensor([100])
    used = record_contexts(loaded.model.model.layers[1].decode)
    known_top(step_memos(loaded.model), positions, 10)
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        loaded.model.decode(torch.tensor([5]), positions, caches)
    assert not caches["k"][:, :, :, 64:].any() and not caches["v"][:, :, :, 64:].any()
    known_top(step_memos(loaded.model), positions, 100)
    loaded.model.decode(torch.tensor([5]), positions, caches)
    known_top(step_memos(loaded.model), positions, 100)
    positions -= 90  # changed in place after the word: the tensor is read again
    loaded.model.decode(torch.tensor([5]), positions, caches)
    assert used == [256, 64]  # the first call failed in layer 0, before layer 1's


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten outputs with a storage of their own (views and in-place ops make none)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.count += sum(t.untyped_storage().data_ptr() not in given for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _host_allocations_per_step(model_dir, out, batch: int) -> float:
    """Tensors the runtime makes per decode step outside the graphs (which are not counted)."""
    loaded, bundle = _bound_unobserved(model_dir, out)
    counts = []
    for new in (2, 10):  # the difference between 9 steps and 1: decode steps only
        counter = _Allocations()
        with counter:
            generate(loaded.model, prompts(*[5] * batch), new, max_batch=batch, max_seq=bundle.max_seq, slots=bundle.cache_slots, stop_at_eos=False)
        counts.append(counter.count)
    return (counts[1] - counts[0]) / 8


def _bound_unobserved(model_dir, out):
    """The model bound to the bundle, its graphs run outside any dispatch mode (a mode then
    sees only the runtime's own ops) -> (loaded model, bundle)."""
    from torch.utils._python_dispatch import _disable_current_modes

    loaded, bundle = load_model(model_dir), Bundle.load(out)
    bundle.bind(loaded.model)
    for m in loaded.model.modules():
        for d in vars(m).values():
            if isinstance(d, Dispatcher):
                wrap_steps(d, lambda context, bucket, run: lambda args: _run_without_modes(run, args, _disable_current_modes))
    return loaded, bundle


def _run_without_modes(run, args, disable):
    with disable():
        return run(args)


def test_host_allocations_per_decode_step_do_not_grow_with_layers(tmp_path):
    """Inputs every layer shares are padded once a step, and a padded layer's output feeds
    the next layer whole: at batch 3 (padded to 4) a step makes as many tensors outside
    the graphs with 2 layers as with 6. The builds trace as many graphs, context buckets
    included: decode at 2 batch buckets x 2 context buckets, one prefill chunk at 3 contexts
    and in its fresh form, the head at 2."""
    from aotc.models.tiny import write_tiny

    per_step, traced = {}, {}
    for layers in (2, 6):
        model_dir = write_tiny(tmp_path / f"tiny{layers}", layers=layers)
        result = build(
            BuildOptions(model_dir, out=tmp_path / f"b{layers}", batch_buckets=(1, 4), chunk_buckets=(16,), max_seq=64, context_buckets=(32,), backend="export", use_cache=False)
        )
        traced[layers] = result.graphs_traced
        per_step[layers] = {batch: _host_allocations_per_step(model_dir, result.out, batch) for batch in (1, 3)}
    assert traced == {2: 10, 6: 10}  # decode at 1 and 4, context 32 and 64; prefill at the chunk context 16, 32 and 64, and fresh; the head at 1 and 4
    assert per_step[2] == per_step[6], per_step
    assert per_step[2][1] <= 6 and per_step[2][3] <= 12, per_step


def test_check_tolerance_grows_with_the_logit():
    """tol + tol x |eager|: a bf16 logit near 10 moves in steps of 0.06, one near 0 in far finer ones."""
    from aotc.runtime.check import compare
    from aotc.runtime.generate import Generation, Sequence

    def generation(logits):
        return Generation([Sequence([1], [int(logits.argmax())], [logits])])

    eager = torch.tensor([10.0, 0.0, -3.0])
    assert compare(generation(eager + torch.tensor([0.5, 0.0, 0.0])), generation(eager), 0.1).passed  # 0.5 <= 0.1 + 1.0
    report = compare(generation(eager + torch.tensor([0.0, 0.2, 0.0])), generation(eager), 0.1)
    assert not report.passed and report.per_prompt[0].equal and not report.per_prompt[0].logits_close  # 0.2 > 0.1 at 0


def test_step_memo_forgets_a_tensor_changed_in_place_or_replaced():
    from aotc.runtime.dispatch import StepMemo

    memo, t = StepMemo(), torch.arange(4)
    made = memo.put(t, "padded", torch.zeros(8))
    assert memo.get(t, "padded") is made and memo.get(t, "other") is None
    t += 1  # the same object, changed in place: what was made from it is stale
    assert memo.get(t, "padded") is None
    assert memo.get(torch.arange(4), "padded") is None  # an equal tensor is not the one it was made from
    # Past LIMIT entries the least recently used goes: `t` was used, so the next-oldest goes first.
    keep = [torch.arange(2) for _ in range(StepMemo.LIMIT)]
    memo = StepMemo()
    for k in keep:
        memo.put(k, "x", k)
    assert memo.get(keep[0], "x") is keep[0]
    memo.put(t, "x", t)
    assert memo.get(keep[0], "x") is keep[0] and memo.get(keep[1], "x") is None and len(memo.made) == StepMemo.LIMIT
    # A padded call's output: its first rows feed the next call as the whole it was cut from.
    whole = torch.ones(4, 3)
    (view,) = memo.sliced([whole], 3)
    assert memo.whole(view, 4) is whole and memo.whole(view, 2) is None and memo.whole(view.clone(), 4) is None
    view += 1
    assert memo.whole(view, 4) is None


def test_positions_advanced_in_place_match_eager(bound, tiny_dir):
    """A caller that advances one positions tensor in place between steps (batch 3, padded
    to bucket 4 once per step for every layer) gets eager's logits at every step."""
    loaded, bundle = bound
    eager = load_model(tiny_dir).model
    caches = [m.allocate_caches(bundle.cache_slots, bundle.max_seq) for m in (loaded.model, eager)]
    ids, positions = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    for _ in range(3):
        got = loaded.model.decode(ids, positions, caches[0])
        torch.testing.assert_close(got, eager.decode(ids, positions.clone(), caches[1]), atol=1e-4, rtol=1e-4)
        positions += 1


def test_an_argument_of_another_dtype_is_an_error_naming_it(bound):
    loaded, bundle = bound
    layer, model = loaded.model.model.layers[0], loaded.model
    caches = model.allocate_caches(bundle.cache_slots, bundle.max_seq)
    cos, sin = model.rope(torch.tensor([0, 1]))
    with pytest.raises(BundleError, match=r"LlamaDecoderLayer.decode: argument 'x' is torch.float64, the graph takes torch.float32"):
        layer.decode(torch.zeros(2, 256, dtype=torch.float64), cos, sin, torch.tensor([0, 1]), torch.tensor([0, 1]), caches["k"][0], caches["v"][0])
    with pytest.raises(BundleError, match=r"argument 'positions' is torch.int32, the graph takes torch.int64"):
        layer.decode(torch.zeros(2, 256), cos, sin, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1]), caches["k"][0], caches["v"][0])


@pytest.mark.parametrize("max_seq, contexts", [(100, (100,)), (256, (256,)), (257, (256, 257)), (4096, (256, 1024, 4096)), (5000, (256, 1024, 4096, 5000))])
def test_default_context_buckets_are_256_times_powers_of_4_below_max_seq(tiny_dir, max_seq, contexts):
    options = BuildOptions(tiny_dir, max_seq=max_seq)
    options.resolve_contexts()
    assert options.context_buckets == contexts
    given = BuildOptions(tiny_dir, max_seq=max_seq, context_buckets=(64,))
    given.resolve_contexts()
    assert given.context_buckets == (64, max_seq)


@pytest.mark.parametrize(
    "max_seq, chunks, first",
    [
        (1024, (16, 48, 160), (16, 24, 32, 40, 48, 64, 96, 128, 160)),
        (160, (16, 48, 160), (16, 24, 32, 40, 48, 64, 96, 128, 160)),
        (128, (16, 48, 128), (16, 24, 32, 40, 48, 64, 96, 128)),
        (32, (16, 32), (16, 24, 32)),
        (8, (8,), (8,)),
    ],
)
def test_default_chunk_buckets_are_cut_to_max_seq(tiny_dir, max_seq, chunks, first):
    """A build that names no chunks takes the defaults, each at most max_seq, and the finer
    first chunks up to the largest; chunks the user names are checked, not cut (the error
    names both options), and are the first chunks too unless --first-chunk adds others."""
    options = BuildOptions(tiny_dir, max_seq=max_seq)
    options.resolve_chunks()
    assert (options.chunk_buckets, options.first_chunk_buckets) == (chunks, first)
    given = BuildOptions(tiny_dir, max_seq=max_seq, chunk_buckets=(8, 2048))
    with pytest.raises(AotcError, match=rf"--prefill-chunk 8,2048: 2048 is more than --max-seq {max_seq}"):
        given.resolve_chunks()
    named = BuildOptions(tiny_dir, max_seq=max_seq, chunk_buckets=chunks)
    named.resolve_chunks()
    assert named.first_chunk_buckets == chunks
    named = BuildOptions(tiny_dir, max_seq=max_seq, chunk_buckets=chunks, first_chunk_buckets=(4,))
    named.resolve_chunks()
    assert named.first_chunk_buckets == (4, *chunks)


def test_first_chunks_above_the_largest_chunk_or_for_a_model_without_a_fresh_form_are_an_error(tiny_dir, tmp_path):
    from aotc.builder.plan import make_plan

    from .conftest import hf_save

    with pytest.raises(AotcError, match=r"--first-chunk 24,64: 64 is more than the largest --prefill-chunk bucket, 32; a longer prompt runs whole largest"):
        make_plan(BuildOptions(tiny_dir, chunk_buckets=(16, 32), first_chunk_buckets=(24, 64), max_seq=64, backend="export"))
    import transformers

    folder, _ = hf_save(
        tmp_path,
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    generic = make_plan(BuildOptions(folder, chunk_buckets=(16, 32), max_seq=64, backend="export"))
    assert generic.options.first_chunk_buckets == (16, 32) and "first" not in {v.spec.bucket for v in generic.variants}
    with pytest.raises(AotcError, match=r"--first-chunk 24: .* has no fresh form of its prefill .* leave --first-chunk out"):
        make_plan(BuildOptions(folder, chunk_buckets=(16, 32), first_chunk_buckets=(24,), max_seq=64, backend="export"))


class _HostAsDevice:
    """A resident device made of host tensors: put, get and hold copy, as a real device's
    transfers do, so the runtime's resident path (caches as device allocations, outputs
    kept as Resident between layers) runs the export bundle here."""

    resident = True

    def __init__(self):
        self.puts = 0

    def place(self, weight):
        return weight

    def put(self, t, key=None):
        self.puts += 1
        return t.clone()

    def get(self, value, dtype=None):
        return value.clone()

    def allocate(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    def hold(self, t):
        return t.clone()


def test_the_resident_path_matches_eager(tiny_dir, tiny_bundle, monkeypatch):
    """Batch 3 in bucket 4 and a 70-token prompt in chunks 64 + 16, every value on a
    (host-made) resident device: tokens and logits are eager's, and a layer's output
    reaches the next layer as the device's value, never through the host."""
    from aotc.backends.base import DeviceBuffer, Step
    from aotc.runtime.resident import Resident

    device = _HostAsDevice()
    loaded, bundle = load_model(tiny_dir), Bundle.load(tiny_bundle.out)
    monkeypatch.setattr(bundle.backend, "device_for", lambda rank, world_size: device)
    # An export graph below max_seq (the chunk context) takes a view of the cache, which a
    # resident device, holding whole caches as xla's does, cannot give: max_seq's graphs only.
    for entry in bundle.manifest.entries:
        entry.artifacts = [a for a in entry.artifacts if a.context in (None, bundle.max_seq)]
    bundle.programs = {k: p for k, p in bundle.programs.items() if k[2] in (None, bundle.max_seq)}

    def on_device(key, run):
        return lambda args: run([a.value if isinstance(a, DeviceBuffer) else a for a in args])

    wrap_programs(bundle, on_device)
    for key, program in bundle.programs.items():
        bind = program.bind
        program.bind = lambda weights, bind=bind, **where: Step(device, bind(weights, **where).run)
    bundle.bind(loaded.model)
    ps = prompts(5, 70, 21)
    kw = dict(max_batch=3, max_seq=bundle.max_seq, slots=bundle.cache_slots, keep_logits=True, stop_at_eos=False)
    compiled = generate(loaded.model, ps, 8, **kw)
    layers = loaded.model.model.layers
    caches = loaded.model.allocate_caches(bundle.cache_slots, bundle.max_seq)
    x = torch.zeros(3, 256)
    positions = torch.tensor([0, 1, 2])
    cos, sin = loaded.model.rope(positions)
    h = layers[0].decode(x, cos, sin, positions, positions, caches["k"][0], caches["v"][0])
    puts = device.puts
    layers[1].decode(h, cos, sin, positions, positions, caches["k"][1], caches["v"][1])
    assert isinstance(h, Resident) and isinstance(caches["k"][0], DeviceBuffer)
    assert device.puts == puts  # the shared inputs were put once for both layers; the hidden state went as it was
    Bundle.unbind(loaded.model)
    eager = generate(loaded.model, ps, 8, **kw)
    for c, e in zip(compiled.sequences, eager.sequences):
        assert c.new_ids == e.new_ids
        torch.testing.assert_close(torch.stack(c.logits), torch.stack(e.logits), atol=1e-4, rtol=1e-4)
