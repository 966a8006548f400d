"""aotc.Session, the public Python API: the docs' examples run as written; generation
through it is the runtime's own, token for token; errors name the fix."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

import aotc
from aotc import AotcError, Completion, SamplingParams, Session, TokenEvent
from aotc.chat import render_messages
from aotc.models.loader import load_model
from aotc.models.tiny import write_tiny
from aotc.runtime import Bundle, generate
from aotc.runtime.dispatch import is_bound

DOCS = Path(__file__).resolve().parent.parent / "docs" / "python-api.md"
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def with_template(tiny_dir, out: Path) -> Path:
    shutil.copytree(tiny_dir, out)
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "bos_token": "<s>", "eos_token": "</s>"}))
    return out


@pytest.fixture(scope="module")
def session(tiny_bundle):
    with Session.open(tiny_bundle.out) as s:
        yield s


def test_the_docs_examples_run_as_written(tiny_bundle, tiny_dir, tmp_path, monkeypatch):
    """Each python block of docs/python-api.md (and the README's), run as it stands, in a folder holding the
    bundle it opens (artifacts/tiny: the tiny model's); the first, a program of at most 6
    lines, prints what the runtime generates."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    assert len(blocks) == 3 and len(blocks[0].strip().splitlines()) <= 8  # the import, a blank line, 6 lines
    readme = (DOCS.parent.parent / "README.md").read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks += re.findall(r"```python\n(.*?)```", readme, re.S)  # the README's shorter one
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "tiny").symlink_to(tiny_bundle.out)
    monkeypatch.chdir(tmp_path)
    printed, raw = [], []
    for block in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(DOCS), "exec"), {})
        printed.append(out.getvalue().splitlines())
        raw.append(out.getvalue())
    # What the first block printed: each completion, then each streamed token, as the runtime makes them.
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(tiny_bundle.out)
    bundle.bind(loaded.model)
    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    kw = dict(max_batch=bundle.max_batch, max_seq=bundle.max_seq, slots=bundle.cache_slots, eos_ids=(2,))
    texts = ["The capital of France is", "Once upon a time"]
    gen = generate(loaded.model, [tokenizer.encode(t).ids for t in texts], 16, **kw)
    decoded = [tokenizer.decode(s.new_ids) for s in gen.sequences]
    expected = [f"{'stop' if s.new_ids[-1] == 2 else 'length'} {d!r}" for s, d in zip(gen.sequences, decoded)]
    assert printed[0][:2] == expected
    hello = generate(loaded.model, [tokenizer.encode("Hello").ids], 8, **kw).sequences[0].new_ids
    assert [int(line.split()[1]) for line in printed[0][2:]] == hello
    reason, text = printed[1][0].split(" ", 1)  # the sampled one: cut before its stop string
    assert reason in ("stop", "length") and "." not in text
    assert len(printed[2]) >= 1
    assert raw[3] == decoded[0] + "\n"  # the README's: the first completion's text


def test_generate_is_the_runtimes_generation(session, tiny_bundle, tiny_dir):
    """Text and token-id prompts in one call (batched as the bundle's buckets allow): each
    completion's ids are what runtime.generate makes on a model bound to the bundle, its text
    their decoding, its finish reason the stop token or the length."""
    prompts = ["Hello", [1, 17, 42, 300, 7], "one two three four five six seven"]
    got = session.generate(prompts, max_new_tokens=10)
    assert isinstance(got, aotc.runtime.session.Completions) and all(isinstance(c, Completion) for c in got)
    loaded = load_model(tiny_dir)
    bundle = Bundle.load(tiny_bundle.out)
    bundle.bind(loaded.model)
    ids = [session.tokenizer.encode("Hello").ids, [1, 17, 42, 300, 7], session.tokenizer.encode(prompts[2]).ids]
    ref = generate(loaded.model, ids, 10, max_batch=4, max_seq=bundle.max_seq, slots=bundle.cache_slots, eos_ids=(2,))
    for c, s in zip(got, ref.sequences):
        assert (c.prompt_ids, c.ids) == (s.prompt_ids, s.new_ids)
        assert c.text == session.tokenizer.decode(s.new_ids)
        assert c.finish_reason == ("stop" if s.new_ids[-1] == 2 else "length") and (len(c.ids) == 10) == (c.finish_reason == "length")
    t = got.timings
    assert t.ttft_s > 0 and t.decode_steps > 0 and t.prefill_tokens == sum(map(len, ids)) and t.setup_s >= t.load_s > 0


def test_a_stop_token_ends_a_completion_with_finish_reason_stop(tiny_bundle, tiny_dir, tmp_path):
    """generation_config.json's eos_token_id stops it: the last id is that token."""
    with Session.open(tiny_bundle.out) as s:
        free = s.generate(["Hello"], max_new_tokens=12)[0].ids
    stop = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": stop, "max_new_tokens": 12}))
    with Session.open(tiny_bundle.out, model=model) as s:
        (done,) = s.generate(["Hello"])
    assert done.ids == free[: free.index(stop) + 1] and done.finish_reason == "stop"


def test_stream_yields_each_token_as_it_comes_and_stops_when_left(session):
    """The events of each prompt are its completion's ids, and their texts join to its text;
    on_token sees the same events; a stream left after one event stops the generation."""
    prompts = ["Hello", "the quick brown fox"]
    whole = session.generate(prompts, max_new_tokens=9)
    seen = []
    events = list(session.generate(prompts, max_new_tokens=9, stream=True, on_token=seen.append))
    assert events == seen and all(isinstance(e, TokenEvent) for e in events)
    for i, c in enumerate(whole):
        mine = [e for e in events if e.index == i]
        assert [e.token_id for e in mine] == c.ids and "".join(e.text for e in mine) == c.text
    calls = []
    stream = session.generate(["Hello"], max_new_tokens=200, stream=True, on_token=calls.append)
    next(stream)
    stream.close()  # the reader leaves: the generation ends at its next token, and close() waits for it
    # Tokens made while the reader was leaving still came (the engine thread runs on until
    # it sees the reader gone: a few on a loaded machine), then none: not the 200 asked for.
    assert 1 <= len(calls) < 200
    got = session.generate(["Hello"], max_new_tokens=9)  # and the session still generates
    assert got[0].ids == whole[0].ids


def test_a_seeded_request_samples_the_same_tokens_alone_and_among_others(session):
    """Each request's random stream is its own: seeded, its tokens do not depend on the
    requests beside it. top_k=1 is greedy at any temperature; logprobs are the model's."""
    warm = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    alone = session.generate(["The capital of France is"], max_new_tokens=12, sampling=warm)[0]
    others = [SamplingParams(temperature=1.2, seed=s) for s in (1, 2, 3)]
    among = session.generate(["Once upon", "The capital of France is", "A B C", "x"], max_new_tokens=12, sampling=[others[0], warm, *others[1:]])
    assert among[1].ids == alone.ids
    unseeded = session.generate(["The capital of France is"] * 2, max_new_tokens=12, sampling=SamplingParams(temperature=1.0))
    greedy = session.generate(["The capital of France is"], max_new_tokens=12)[0]
    assert alone.ids != greedy.ids and unseeded[0].ids != unseeded[1].ids  # it did sample: 10^-4 chance of a false alarm at most
    top1 = session.generate(["The capital of France is"], max_new_tokens=12, sampling=SamplingParams(temperature=2.0, top_k=1, logprobs=2))[0]
    assert top1.ids == greedy.ids and [c.token for c in top1.logprobs] == top1.ids
    assert all(c.top[0][0] == c.token and c.logprob == pytest.approx(c.top[0][1]) for c in top1.logprobs)
    with pytest.raises(AotcError, match=r"sampling: expected a SamplingParams, or a list of one per prompt \(2\)"):
        session.generate(["a", "b"], sampling=[warm])
    with pytest.raises(AotcError, match="check=True compares greedy decoding"):
        session.generate(["a"], sampling=warm, check=True)


def test_on_ranks_an_unseeded_request_takes_rank_0s_seed(session, monkeypatch):
    """Every rank of a parallel bundle samples, and `agree` fails the run where their tokens
    differ: a request without a seed takes the one rank 0 broadcasts (dist.broadcast,
    stood in for here)."""
    import torch.distributed as dist

    def broadcast(tensor, src):
        assert src == 0
        tensor.copy_(tensor.new_tensor([42, 43]))

    monkeypatch.setattr(dist, "broadcast", broadcast)
    monkeypatch.setattr(session, "world_size", 2)
    params = session._sampling([SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=7)], 2, False)
    assert [p.seed for p in params] == [42, 7] and params[0].temperature == 1.0


def test_a_stop_string_across_three_tokens_never_streams_and_ends_the_completion(session):
    greedy = session.generate(["The capital of France is"], max_new_tokens=24)[0]
    tokenizer = session.tokenizer
    # The text that three tokens from the middle of the answer add, as the stop string.
    start = len(tokenizer.decode(greedy.ids[:8]))
    stop = tokenizer.decode(greedy.ids[:11])[start:]
    assert len(stop) > 3 and greedy.text.find(stop) == start, (greedy.text, stop)
    events = session.generate(["The capital of France is"], max_new_tokens=24, stream=True, stop=["never there", stop])
    pieces = []
    while True:
        try:
            pieces.append(next(events).text)
        except StopIteration as end:
            done = end.value[0]
            break
    assert done.text == "".join(pieces) == greedy.text[:start] and done.finish_reason == "stop"
    # It ended at the token that completed the stop string, or the next: tokenizers'
    # DecodeStream gives a token's text once the token after it shows how it joins.
    assert done.ids[:11] == greedy.ids[:11] and len(done.ids) <= 12, (done.ids, greedy.ids)
    assert not any(stop[:2] in p for p in pieces[-4:]), pieces
    plain = session.generate(["The capital of France is"], max_new_tokens=24, stop=[stop])[0]
    assert plain.text == done.text and plain.ids == done.ids
    with pytest.raises(AotcError, match="stop: .*expected non-empty strings"):
        session.generate(["a"], stop=[""])


def test_stop_strings_without_a_tokenizer_are_refused_naming_the_folder(session, monkeypatch):
    monkeypatch.setattr(session, "tokenizer", None)  # a folder without tokenizer.json: token-id prompts only
    with pytest.raises(AotcError, match=r"stop: \['x'\]: stop strings are matched on the text, and .* has no tokenizer.json"):
        session.generate([[5, 6]], stop=["x"])


def test_caches_are_allocated_once(tiny_bundle):
    with Session.open(tiny_bundle.out) as s:
        caches = s._caches
        s.model.allocate_caches = lambda *a, **k: pytest.fail("generate allocated caches")
        s.generate(["Hello"], max_new_tokens=4)
        s.generate([[5, 6, 7]], max_new_tokens=4)
        assert s._caches is caches
    assert s._caches is None


def test_chat_messages_render_through_the_template(tiny_bundle, tiny_dir, tmp_path):
    model = with_template(tiny_dir, tmp_path / "chat")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    with Session.open(tiny_bundle.out, model=model) as s:
        rendered = render_messages(model, chat)
        assert rendered.endswith("<|im_start|>assistant\n") and rendered.count("<|im_start|>") == 5
        assert s.encode(chat) == s.tokenizer.encode(rendered, add_special_tokens=False).ids
        as_turn = s.encode("Hi", chat=True)
        assert as_turn == s.tokenizer.encode(render_messages(model, [{"role": "user", "content": "Hi"}]), add_special_tokens=False).ids
        done = s.generate([chat, "Hi"], chat=True, max_new_tokens=4)
        assert [c.prompt_ids for c in done] == [s.encode(chat), as_turn]


def test_the_tiny_models_chat_template_renders_as_transformers_does(session, tiny_dir):
    """aotc init tiny's tokenizer_config.json: transformers loads the folder's tokenizer from it,
    and its apply_chat_template makes the ids the Session sends for the same chat."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_dir)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    expected = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert session.encode(chat) == expected and expected[0] == 1 and expected.count(2) == 4  # bos, and eos after each turn
    assert render_messages(tiny_dir, chat).endswith("<|user|>\nBye</s>\n<|assistant|>\n")
    (done,) = session.generate([[{"role": "user", "content": "Hi"}]], max_new_tokens=4)
    assert done.prompt_ids == session.encode("Hi", chat=True) == hf.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)["input_ids"]


def test_check_is_aotc_run_check(session, monkeypatch):
    """check() and generate(check=True) compare the generation they make with eager; a
    full-precision bundle's check runs eager on the bound model's own weights (no second
    load), and the session is bound again after it."""
    import aotc.models.loader

    monkeypatch.setattr(aotc.models.loader, "load_model", lambda *a, **k: pytest.fail("check loaded a second model"))
    report = session.check(["Hello", [3, 4, 5, 6, 7, 8, 9]], max_new_tokens=8)
    assert report.passed and report.tokens_equal and len(report.per_prompt) == 2
    done = session.generate(["Hello", [3, 4, 5, 6, 7, 8, 9]], max_new_tokens=8, check=True, max_batch=1)
    assert done.check.passed and done.check.tokens_equal and [p.tokens for p in done.check.per_prompt] == [8, 8]
    assert done.timings.decode_steps == 2 * 7  # max_batch=1: one prompt after the other
    assert session.generate(["Hello"], max_new_tokens=8).check is None
    assert is_bound(session.model)  # bound again: the next generate runs the graphs


def test_errors_name_the_fix(session, tiny_bundle, tmp_path):
    with pytest.raises(
        AotcError,
        match=r"prompt 1 has 300 tokens; with max_new_tokens=8 that is 308 positions, more than the bundle's max_seq 256\. Shorten the prompt, lower max_new_tokens, or build with a larger --max-seq",
    ):
        session.generate([[5], [5] * 300], max_new_tokens=8)
    with pytest.raises(AotcError, match=r"prompt 0: token id 512 is outside the model's vocabulary \(0 to 511\)"):
        session.generate([[1, 512]])
    with pytest.raises(AotcError, match=r"prompts: expected a non-empty list of prompts, got str 'Hello'; pass \[prompt\] for one"):
        session.generate("Hello")
    with pytest.raises(AotcError, match=r'prompt 0 is dict .*; expected text, a non-empty list of token ids, or a chat: a list of \{"role"'):
        session.generate([{"role": "user", "content": "hi"}])
    with pytest.raises(AotcError, match=r"max_batch=8: expected 1 to 4, the bundle's largest batch bucket"):
        session.generate(["Hello"], max_batch=8)
    with pytest.raises(AotcError, match=r"max_new_tokens=0: expected at least 1"):
        session.generate(["Hello"], max_new_tokens=0)
    other = write_tiny(tmp_path / "qwen", arch="qwen2", layers=2)
    with pytest.raises(AotcError, match=r"was built for a llama model; .*qwen is qwen2"):
        Session.open(tiny_bundle.out, model=other)
    with pytest.raises(AotcError, match=r"gone: no such folder \(model=\)\. Pass the folder or Hub id ORG/NAME with the model's weights"):
        Session.open(tiny_bundle.out, model=tmp_path / "gone")
    moved = tmp_path / "bundle"
    shutil.copytree(tiny_bundle.out, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["model"]["source"] = str(tmp_path / "deleted")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AotcError, match=r"deleted: no such folder \(the folder the bundle .* was built from, and it is gone\)"):
        Session.open(moved)
    closed = Session.open(tiny_bundle.out)
    closed.close()
    with pytest.raises(AotcError, match=r"this Session is closed; open the bundle again with Session.open"):
        closed.generate(["Hello"])
