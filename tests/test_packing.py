"""Packed prefill (aotc.models.packing): a batch's prompts prefilled in shared chunks,
eager and compiled, and caches kept across generate calls."""

from __future__ import annotations

import pytest
import torch

from aotc.errors import AotcError
from aotc.kvcache import kv_cache_record
from aotc.models.llama import softmax_attend
from aotc.models.loader import load_model
from aotc.models.packing import TILE, attend_in_tiles, pack, packed_bias, packed_rows
from aotc.models.tiny import write_tiny
from aotc.runtime import Bundle, generate

from .conftest import record_contexts, wrap_steps

T, F = True, False


def prompts(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def folders(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    # mistral's tiny model attends to a 48-token window: a 60-token prompt outgrows it
    return {"llama": tiny_dir, "mistral": write_tiny(root / "mistral", arch="mistral"), "deepseek_v4": write_tiny(root / "v4", arch="deepseek_v4")}


def test_pack_puts_prompts_one_after_another():
    p = pack([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], [2, 0])
    assert p.ids.tolist() == [5, 6, 7, 8, 9]
    assert p.positions.tolist() == [0, 1, 2, 0, 1]
    assert p.slots.tolist() == [2, 2, 2, 0, 0]
    assert p.last.tolist() == [2, 4]


def packed_visible(positions, slots, cached, window=None):
    bias = packed_bias(positions, slots, cached, window)
    assert bias.dtype == torch.float32 and set(bias.unique().tolist()) <= {0.0, float("-inf")}
    return bias == 0


def test_packed_bias_lets_each_row_see_its_own_sequence_only():
    """A chunk: the sequence in slot 2 at positions 3 and 4 (0 to 2 cached before the
    chunk), the one in slot 0 from position 0, and a padding row (scratch slot 9)."""
    positions, slots = torch.tensor([3, 4, 0, 1, 2, 0]), torch.tensor([2, 2, 0, 0, 0, 9])
    cache, chunk = packed_visible(positions, slots, cached=5).split([5, 6], dim=1)
    assert cache.tolist() == [[T, T, T, F, F]] * 2 + [[F] * 5] * 4
    assert chunk.tolist() == [
        [T, F, F, F, F, F],
        [T, T, F, F, F, F],
        [F, F, T, F, F, F],
        [F, F, T, T, F, F],
        [F, F, T, T, T, F],
        [F, F, F, F, F, T],
    ]
    cache, chunk = packed_visible(positions, slots, cached=5, window=2).split([5, 6], dim=1)
    assert cache[:2].tolist() == [[F, F, T, F, F], [F] * 5]  # position 3 sees 2 and 3; 4 sees 3 and 4
    assert chunk[:2, :2].tolist() == [[T, F], [T, T]]
    assert chunk[4].tolist() == [F, F, F, T, T, F]


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("cached", [0, 100])
def test_attention_in_tiles_is_the_whole_chunks_attention(cached, window):
    """attend_in_tiles: a chunk of 3 1/2 tiles holding a sequence that continues (after
    `cached` positions in the cache; none: a fresh chunk) and four that start in it,
    attended tile by tile, is the one softmax over all its keys."""
    g = torch.Generator().manual_seed(0)
    lengths, kv, rep, hd = (70, 90, 5, 46, 13), 2, 3, 8
    c = sum(lengths)
    assert c > 3 * TILE
    p = pack([torch.zeros(n, dtype=torch.long) for n in lengths], [1, 2, 3, 4, 9], start=7 if cached else 0)
    cache = torch.randn(10, kv, cached or 128, hd, generator=g)  # the general form reads all of a slot's positions
    cache[p.slots, :, p.positions] = torch.randn(c, kv, hd, generator=g)  # the chunk's rows, as project writes them
    keys = packed_rows(None, cache, p.slots, p.positions, torch.float32, fresh=not cached)
    values = keys.flip(-1)
    bias = packed_bias(p.positions, p.slots, cached, window)
    q = torch.randn(kv, rep, c, hd, generator=g)
    attend = lambda q, k, v, b: softmax_attend(q, k, v, b, hd**-0.5)  # noqa: E731
    whole = attend(q.reshape(kv, rep * c, hd), keys, values, bias.repeat(rep, 1)).view(kv, rep, c, hd)
    torch.testing.assert_close(attend_in_tiles(attend, q, keys, values, bias, cached), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch, modeling", [("llama", "aotc"), ("mistral", "aotc"), ("llama", "transformers"), ("mistral", "transformers")])
def test_a_packed_prefill_gives_each_prompt_what_transformers_gives_it_alone(folders, arch, modeling):
    """Four prompts (two past mistral's window; 166 rows, so aotc's attention runs in
    tiles) in one packed prefill: each prompt's last logits are those of transformers'
    model run on that prompt alone, and the caches are those that separate prefills write."""
    from transformers import AutoModelForCausalLM

    folder = folders[arch]
    model = load_model(folder, modeling=modeling).model
    ps = [torch.tensor(p) for p in prompts(5, 60, 21, 80)]
    assert sum(map(len, ps)) > 2 * TILE
    packed = model.allocate_caches(4, 128)
    logits = model.prefill_batch(ps, [0, 1, 2, 3], packed)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([hf(p[None]).logits[0, -1] for p in ps])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    separate = model.allocate_caches(4, 128)
    for i, p in enumerate(ps):
        model.prefill(p, i, separate)
    for kind in packed:
        torch.testing.assert_close(packed[kind], separate[kind], atol=1e-5, rtol=1e-5)


def test_a_packed_prefill_writes_fp8_caches_as_separate_prefills_do(tiny_dir):
    model = load_model(tiny_dir, kv_cache=kv_cache_record("fp8", "e4m3fn")).model
    ps = [torch.tensor(p) for p in prompts(9, 33, 4)]
    packed, separate = model.allocate_caches(4, 64), model.allocate_caches(4, 64)
    logits = model.prefill_batch(ps, [0, 1, 2], packed)
    want = torch.stack([model.prefill(p, i, separate) for i, p in enumerate(ps)])
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    # The same bytes, but where float32 projections of another row count (last bits apart)
    # fall on either side of an fp8 rounding boundary: measured 21 of 278528 bytes on the tiny model.
    for kind in packed:
        differ = (packed[kind].view(torch.uint8) != separate[kind].view(torch.uint8)).sum().item()
        assert differ <= packed[kind].numel() // 1000, (kind, differ)


@pytest.fixture()
def bound(tiny_dir, tiny_bundle):
    """The tiny model bound to the session's export bundle: chunks 16 and 64, batches 1, 2, 4."""
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(tiny_bundle.out)
    bundle.bind(loaded.model)
    return loaded.model, bundle


def test_a_batch_prefills_its_prompts_in_shared_chunks(bound):
    """Prompts of 5, 30 and 70 tokens: 105 rows as chunks 64 + 64, two calls per layer
    where prompt after prompt takes five (16; 16 + 16; 64 + 16), the first in the fresh
    form (every prompt in it starts there); the tokens and logits are eager's."""
    model, bundle = bound
    ps = prompts(5, 30, 70)
    used = []
    layer = model.model.layers[1]
    wrap_steps(layer.prefill, lambda context, bucket, run: lambda args: used.append(bucket) or run(args))
    wrap_steps(layer.prefill_fresh, lambda context, bucket, run: lambda args: used.append(("fresh", bucket)) or run(args))
    kw = dict(max_batch=bundle.max_batch, max_seq=bundle.max_seq, slots=bundle.cache_slots, keep_logits=True, stop_at_eos=False)
    compiled = generate(model, ps, 6, **kw)
    assert used == [("fresh", 64), 64]
    Bundle.unbind(model)
    eager = generate(model, ps, 6, **kw)
    for c, e in zip(compiled.sequences, eager.sequences):
        assert c.new_ids == e.new_ids
        torch.testing.assert_close(torch.stack(c.logits), torch.stack(e.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "steps, contexts",
    [
        ([(70,)], [("fresh", 32), 64, 128]),  # calls of 32, 32 and 6 rows: 0-31 from position 0, 32-63, 64-69
        ([(3, 70)], [("fresh", 32), 64, 128]),  # packed: rows 0-31 from position 0, 32-63 reach 60, 64-72 69
        ([(9,), (16,)], [("fresh", 16), 32]),  # a prompt's 16 rows from position 9, in a chunk of 16 at the chunk context 32
        ([(12, 10)], [("fresh", 24)]),  # every sequence starts in the chunk: 22 rows in a first chunk of 24, not 32
        ([(5,)], [("fresh", 8)]),
        ([(9,), (4, 14)], [("fresh", 16), 32]),  # 4 rows continuing from 9, then a new prompt: not fresh
    ],
)
def test_each_prefill_chunk_runs_the_context_bucket_its_rows_need(context_bundle, tiny_dir, steps, contexts):
    """Chunks of 16 and 32, context buckets 64 and 256: a call's first chunk from position
    0 runs the fresh form (prefill_fresh: its own rows only) at the first-chunk bucket that
    holds it (8, 16, 24, 32); any other chunk runs at the smallest context its chunk bucket
    was built at that holds its positions: the chunk contexts, which only the chunk entry
    has (16 and 32, at least as long as the bucket, and 128, 64 doubled below 256), and 64
    and 256. Each step's logits are eager's (eager runs the general form only; a step after
    the first continues the first prompt)."""
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(context_bundle)
    got = []
    for bound in (True, False):
        if bound:
            bundle.bind(loaded.model)
            layer = loaded.model.model.layers[1]
            used = record_contexts(layer.prefill)
            wrap_steps(layer.prefill_fresh, lambda context, bucket, run: lambda args: used.append(("fresh", bucket)) or run(args))
        caches = loaded.model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=bound)
        logits, start = [], 0
        for i, lengths in enumerate(steps):
            ps = [torch.tensor(p) for p in prompts(*lengths, seed=i)]
            logits.append(loaded.model.prefill_batch(ps, list(range(len(ps))), caches, start=start))
            start += len(ps[0])
        got.append(logits)
        if bound:
            assert used == contexts
            Bundle.unbind(loaded.model)
    for compiled, eager in zip(*got):
        torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_generate_on_a_bound_model_prefills_its_largest_chunk_a_step(context_bundle, tiny_dir):
    """As a Session's engine: a step prefills at most the bundle's largest chunk (32), so
    a 3-token prompt decodes while a 70-token one is still prefilling (with 128 tokens a
    step, both are prefilled in the first step)."""
    model = load_model(tiny_dir).model
    bundle = Bundle.load(context_bundle)
    bundle.bind(model)
    kw = dict(max_batch=2, max_seq=bundle.max_seq, slots=bundle.cache_slots, stop_at_eos=False)
    steps = {chunk: generate(model, prompts(3, 70), 4, chunk=chunk, **kw).decode_steps for chunk in (None, 32, 128)}
    assert steps[None] == steps[32] != steps[128]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v4"])
def test_caches_kept_across_generate_calls_give_fresh_caches_tokens(folders, arch):
    """A server's caches: a request of long prompts, then one of short prompts in the same
    caches, decodes as the short request does in new ones (what the long one left is never
    read, DeepSeek V4's compressed caches included)."""
    model = load_model(folders[arch]).model
    # One thread for all three: the governor's count follows the machine's load, and another
    # count sums a matmul in another order (1.7e-5 apart once on a busy CI host), which is not
    # what this compares.
    kw = dict(max_batch=3, max_seq=128, slots=4, keep_logits=True, stop_at_eos=False, threads=1)
    kept = model.allocate_caches(4, 128)
    generate(model, prompts(70, 50, 90, seed=1), 8, caches=kept, **kw)
    again = generate(model, prompts(6, 20, 11), 8, caches=kept, **kw)
    fresh = generate(model, prompts(6, 20, 11), 8, **kw)
    for a, f in zip(again.sequences, fresh.sequences):
        assert a.new_ids == f.new_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(f.logits), atol=1e-5, rtol=1e-5)


def test_caches_kept_across_calls_on_a_bound_model(bound):
    model, bundle = bound
    kw = dict(max_batch=bundle.max_batch, max_seq=bundle.max_seq, slots=bundle.cache_slots, stop_at_eos=False)
    kept = model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
    generate(model, prompts(40, 70, seed=1), 4, caches=kept, **kw)
    again = generate(model, prompts(7, 3), 6, caches=kept, **kw)
    assert [s.new_ids for s in again.sequences] == [s.new_ids for s in generate(model, prompts(7, 3), 6, **kw).sequences]


def test_caches_of_another_shape_are_an_error_naming_what_to_allocate(tiny_dir):
    model = load_model(tiny_dir).model
    kw = dict(max_batch=2, max_seq=64, slots=3)
    with pytest.raises(AotcError, match=r"caches\['k'\]: shape .* expected .*model.allocate_caches\(3, 64\)"):
        generate(model, prompts(4), 2, caches=model.allocate_caches(3, 32), **kw)
    with pytest.raises(AotcError, match=r"caches: expected the kinds \['k', 'v'\]"):
        generate(model, prompts(4), 2, caches={"k": model.allocate_caches(3, 64)["k"]}, **kw)


def test_the_prefill_graph_masks_attention_with_a_float_bias(context_bundle):
    """packing.packed_bias: the prefill graph adds a float32 bias of 0 and -inf to the
    scores, and no bool mask reaches the softmax (Inductor's CPU softmax kernel over a
    bool mask in memory ran at a sixth of its speed with the same mask as floats)."""
    program = torch.export.load(str(context_bundle / "entries" / "LlamaDecoderLayer.prefill" / "b16-c64" / "program.pt2"))
    nodes = [n for n in program.graph_module.graph.nodes if n.op == "call_function"]
    softmaxes = [n for n in nodes if "softmax" in str(n.target)]
    assert softmaxes and not [n for n in nodes if "masked_fill" in str(n.target)]
    for softmax in softmaxes:
        scores, bias = softmax.args[0].args
        assert "add" in str(softmax.args[0].target) and bias.meta["val"].dtype == torch.float32, softmax.args[0].format_node()


def test_the_fresh_prefill_graph_attends_to_the_chunks_own_rows_only(context_bundle):
    """A chunk of 16 at context 64 attends to 64 cached positions and its 16 rows; its fresh
    form (one graph per chunk, on the whole cache) to its 16 rows only."""
    for entry, artifact, keys in (("LlamaDecoderLayer.prefill", "b16-c64", 64 + 16), ("LlamaDecoderLayer.prefill_fresh", "b16", 16)):
        program = torch.export.load(str(context_bundle / "entries" / entry / artifact / "program.pt2"))
        softmaxes = [n for n in program.graph_module.graph.nodes if "softmax" in str(n.target)]
        # [KV heads, query heads per KV head x rows, keys]: the tiny llama's 4 query heads over 2 KV heads
        assert softmaxes and {tuple(n.meta["val"].shape) for n in softmaxes} == {(2, 2 * 16, keys)}, entry


def test_ranks_in_lockstep_run_the_general_prefill_at_their_floor(context_bundle, tiny_dir):
    """Under context_floor (ranks that must run one graph: another rank's chunk may
    continue a prompt), a chunk from position 0 runs the general form at the floor's
    context, not the fresh one; its logits are eager's."""
    from aotc.runtime.dispatch import context_floor, step_memos

    loaded, bundle = load_model(tiny_dir), Bundle.load(context_bundle)
    ps = [torch.tensor(p) for p in prompts(5, 9)]
    eager = loaded.model.prefill_batch(ps, [0, 1], loaded.model.allocate_caches(bundle.cache_slots, bundle.max_seq))
    bundle.bind(loaded.model)
    layer = loaded.model.model.layers[1]
    used = record_contexts(layer.prefill)
    wrap_steps(layer.prefill_fresh, lambda context, bucket, run: lambda args: used.append("fresh") or run(args))
    caches = loaded.model.allocate_caches(bundle.cache_slots, bundle.max_seq, split=True)
    with context_floor(step_memos(loaded.model), 64):
        compiled = loaded.model.prefill_batch(ps, [0, 1], caches)
    assert used == [64]
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
