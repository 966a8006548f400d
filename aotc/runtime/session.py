"""aotc.Session: a bundle opened for generation inside a user's own program.

    from aotc import Session

    with Session.open("artifacts/tiny") as session:
        for done in session.generate(["The capital of France is"], max_new_tokens=16):
            print(done.text)

Opening does once what every generation needs: the bundle loaded and checked,
its model's weights found and loaded as its graphs take them, bound, the caches
allocated, the tokenizer, generation_config and chat template read. Each
generate() then runs through the bundle on those same caches: greedy decoding, or
sampling as each prompt's SamplingParams say, ending at stop tokens or strings.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ..errors import AotcError
from ..format import Manifest
from .bundle import Bundle
from .check import CheckReport, check_generation
from .completion import Completions, Prompt, TokenEvent, completions, token_events
from .generate import Generation, check_lengths, generate
from .sampling import SamplingParams
from .stops import StopText


class Session:
    """A bundle bound to its model, ready to generate. Open one with Session.open; close it
    (or use it as a context manager) to release the model and its caches."""

    def __init__(self, bundle: Bundle, loaded, model_dir: Path, threads: int | None, t0: float, rank: int = 0, world_size: int = 1):
        from ..models.generation import generation_defaults

        self.bundle, self.model_dir, self.threads = bundle, model_dir, threads
        self.rank, self.world_size = rank, world_size  # a parallel bundle: this process's rank of its launch
        self._loaded = loaded
        self.defaults = generation_defaults(model_dir, loaded.config_dict)
        self.tokenizer = read_tokenizer(model_dir)
        # Allocated once, for every generate(): a sequence writes each position before any step reads it.
        self._caches = loaded.model.allocate_caches(bundle.cache_slots, bundle.max_seq, bundle.device, split=True)
        self._eager = None
        self._service = None  # the open Service, which owns the model and caches while it runs
        self._load_s, self._setup_s = bundle.load_s, time.perf_counter() - t0

    @classmethod
    def open(
        cls, bundle: str | Path, model: str | Path | None = None, *, revision: str | None = None, threads: int | None = None,
        expect_digest: str | None = None, plugins: Sequence[str] = (),
    ) -> "Session":  # fmt: skip
        """Load the bundle at `bundle` (checked, and with expect_digest, refused unless its
        digest is that one) and the weights of its model: `model` (a folder, or a Hugging
        Face Hub id ORG/NAME at `revision`), else the folder it was built from, else the
        Hub snapshot it was built from. threads: CPU threads per kernel (default: those
        other processes leave free). plugins: modules that register architectures or
        backends (aotc build --plugin)."""
        from ..models.loader import load_model

        t0 = time.perf_counter()
        b = Bundle.load(bundle, plugins=list(plugins), expect_digest=expect_digest)
        rank, world, threads = _join(b, threads)
        model_dir = bundle_model(b.dir, b.manifest, None if model is None else str(model), revision)
        loaded = load_model(model_dir, **b.model_args(rank))
        b.check_model(loaded)
        check_memory(loaded.model, b)  # before the caches are allocated
        loaded.model.to(b.device)
        b.bind(loaded.model, rank=rank, world_size=world)
        return cls(b, loaded, model_dir, threads, t0, rank, world)

    @property
    def model(self):
        """The bound model (its entry methods run the bundle's graphs)."""
        if self._loaded is None:
            raise AotcError("this Session is closed; open the bundle again with Session.open")
        return self._loaded.model

    def encode(self, prompt: Prompt, chat: bool = False, index: int = 0) -> list[int]:
        """A prompt's token ids: text (with chat=True, as the model's chat template renders a
        user turn of it), token ids as given, or a conversation through the chat template."""
        from ..chat import render_messages

        if isinstance(prompt, str):
            text = render_messages(self.model_dir, [{"role": "user", "content": prompt}]) if chat else prompt
            return self._tokens(text, index, special=not chat)  # a chat template writes its own bos
        items = list(prompt) if isinstance(prompt, (list, tuple)) else None
        if items and all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            vocab = self.model.config.vocab_size
            bad = [i for i in items if not 0 <= i < vocab]
            if bad:
                raise AotcError(f"prompt {index}: token id {bad[0]} is outside the model's vocabulary (0 to {vocab - 1})")
            return items
        if items and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in items):
            return self._tokens(render_messages(self.model_dir, items), index, special=False)
        raise AotcError(
            f"prompt {index} is {type(prompt).__name__} {_short(prompt)}; expected text, a non-empty list of token ids, "
            'or a chat: a list of {"role": ..., "content": ...} messages'
        )

    def generate(
        self, prompts: Sequence[Prompt], *, max_new_tokens: int | None = None, chat: bool = False, stream: bool = False,
        on_token: Callable[[TokenEvent], None] | None = None, max_batch: int | None = None, check: bool = False,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None, stop: Sequence[str] = (),
    ) -> Completions | Iterator[TokenEvent]:  # fmt: skip
        """Generation of each prompt through the bundle, stopping at the model's stop
        tokens (generation_config.json's, else config.json's) or after max_new_tokens
        (default: generation_config.json's, else 32). chat=True: text prompts are sent as
        a user turn through the chat template. on_token(event) runs for each new token.
        stream=True: returns an iterator of TokenEvents instead, as the tokens come; the
        Completions are then the iterator's return value (StopIteration.value).
        max_batch: prompts run together (default: the bundle's largest batch bucket).
        sampling: greedy by default; a SamplingParams for every prompt, or a list of one
        per prompt (temperature, top_k, top_p, min_p, seed, penalties, logprobs).
        stop: strings that end a prompt's generation where its text first holds one; the
        text (streamed or not) stops before it, and no part of it is ever streamed.
        check=True: the Completions' .check is this generation checked against the eager
        model under the fidelity rule (check()), greedy only; on a parallel bundle, rank 0
        checks and the other ranks' .check is None."""
        if self._service is not None:
            raise AotcError("this Session's service is running and owns its caches: submit to it (service.submit), or close it first")
        ids = self._prompts(prompts, chat)
        new = self._new_tokens(ids, max_new_tokens)
        batch = self._max_batch(max_batch)
        params = self._sampling(sampling, len(ids), check)
        stops = self._stops(stop)
        if stream:
            return self._stream(ids, new, on_token, batch, check, params, stops)
        return self._run(ids, new, on_token, batch, check, params, stops)

    def check(self, prompts: Sequence[Prompt], *, max_new_tokens: int | None = None, chat: bool = False) -> CheckReport | None:
        """`aotc run --check` for these prompts: the bundle's generation against the eager
        model's under the product's fidelity rule (runtime.check); report.passed says.
        A parallel bundle's rank 0 checks against the whole eager model; the others get None."""
        return self.generate(prompts, max_new_tokens=max_new_tokens, chat=chat, check=True).check

    def service(self, *, max_waiting: int | None = None, prefix_cache: bool = True):
        """This Session's engine on a thread of its own, taking requests from any thread or
        asyncio task (runtime.service.Service: submit() returns a handle to iterate, await
        or abort), as a server runs it. One at a time; while it runs, generate() is refused.
        max_waiting: the most requests waiting while every slot is taken; one more is
        refused (QueueFull). prefix_cache: a prompt that starts like one a cache slot holds
        skips the shared part of its prefill (runtime.prefix; service.engine.prefix_off
        says why not, where the model or backend cannot)."""
        from .service import Service

        self.model  # a closed Session says so
        if self._service is not None:
            raise AotcError("this Session already has a service running; close it before opening another")
        self._service = Service(self, max_waiting=max_waiting, prefix_cache=prefix_cache)
        return self._service

    def close(self) -> None:
        """Unbind the model and let go of it and its caches; a rank of a parallel bundle
        leaves its process group. An open service is closed first, aborting what runs."""
        if self._service is not None:
            self._service.close(timeout=0)
        if self._loaded is not None:
            Bundle.unbind(self._loaded.model)
            if self.world_size > 1:
                import torch.distributed as dist

                dist.destroy_process_group()
        self._loaded = self._caches = self._eager = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _kwargs(self, max_batch: int | None = None) -> dict:
        b = self.bundle
        return dict(
            max_batch=max_batch or b.max_batch, max_seq=b.max_seq, slots=b.cache_slots, eos_ids=self.defaults.eos_token_ids, threads=self.threads,
            chunk=max(b.manifest.shapes.chunk),  # a step prefills at most the largest chunk graph's rows
        )  # fmt: skip

    def _max_batch(self, asked: int | None) -> int | None:
        if asked is not None and not 1 <= asked <= self.bundle.max_batch:
            raise AotcError(f"max_batch={asked}: expected 1 to {self.bundle.max_batch}, the bundle's largest batch bucket")
        return asked

    def _sampling(self, sampling, n: int, check: bool) -> list[SamplingParams] | None:
        if sampling is None:
            return None
        params = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling) if isinstance(sampling, (list, tuple)) else None
        if params is None or len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise AotcError(f"sampling: expected a SamplingParams, or a list of one per prompt ({n}); got {_short(sampling)}")
        if check and not all(p.greedy for p in params):
            raise AotcError("check=True compares greedy decoding with eager's; pass temperature 0 (the default) to check")
        if self.world_size > 1 and any(p.seed is None for p in params):
            # Every rank draws the same tokens: an unseeded request takes rank 0's seed.
            import torch
            import torch.distributed as dist

            from ..parallel import settled

            seeds = torch.tensor([int.from_bytes(os.urandom(7), "little") for _ in params])
            dist.broadcast(seeds, src=0)
            settled(seeds)
            params = [p if p.seed is not None else dataclasses.replace(p, seed=int(seed)) for p, seed in zip(params, seeds.tolist())]
        return params

    def _stops(self, stop: Sequence[str]) -> list[str]:
        StopText(stop)  # checks them: non-empty strings
        if stop and self.tokenizer is None:
            raise AotcError(f"stop: {list(stop)!r}: stop strings are matched on the text, and {self.model_dir} has no tokenizer.json")
        return [stop] if isinstance(stop, str) else list(stop)

    def _prompts(self, prompts: Sequence[Prompt], chat: bool) -> list[list[int]]:
        if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
            raise AotcError(f"prompts: expected a non-empty list of prompts, got {type(prompts).__name__} {_short(prompts)}; pass [prompt] for one")
        self.model  # a closed Session says so before anything else
        return [self.encode(p, chat, i) for i, p in enumerate(prompts)]

    def _new_tokens(self, ids: list[list[int]], asked: int | None) -> int:
        new = asked if asked is not None else self.defaults.max_new_tokens
        if new < 1:
            raise AotcError(f"max_new_tokens={new}: expected at least 1")
        max_seq = self.bundle.max_seq
        limit = f"the bundle's max_seq {max_seq}. Shorten the prompt, lower max_new_tokens, or build with a larger --max-seq"
        check_lengths(ids, new, max_seq, limit, asked="max_new_tokens=")
        return new

    def _run(self, ids: list[list[int]], new: int, on_token, max_batch: int | None = None, check: bool = False,
             sampling: list[SamplingParams] | None = None, stop: list[str] = ()) -> Completions:  # fmt: skip
        emit, stops = token_events(self.tokenizer, len(ids), new, self.defaults.eos_token_ids, stop, on_token)
        kwargs = self._kwargs(max_batch)
        gen = generate(self.model, ids, new, on_token=emit, caches=self._caches, keep_logits=check, sampling=sampling, **kwargs)
        if self.world_size > 1:
            from .launch import agree

            agree(gen)
        report = self._check(gen, new, kwargs) if check and self.rank == 0 else None
        return completions(gen, self.tokenizer, self.defaults.eos_token_ids, self._load_s, self._setup_s, report, stops)

    def _check(self, gen: Generation, new: int, kwargs: dict) -> CheckReport:
        """gen against the eager model. A full-precision bundle on one rank: the bound model's
        own weights are eager's, so the check unbinds it for the eager run and binds it again
        after (no second copy of the weights); otherwise a second instance (_eager_model)."""
        backend = self.bundle.manifest.backend.name
        if self.world_size > 1 or self.bundle.stored_params():
            return check_generation(self._eager_model(), gen, new, backend, **kwargs)
        model = self.model
        Bundle.unbind(model)
        try:
            return check_generation(model, gen, new, backend, **kwargs)
        finally:
            self.bundle.bind(model)

    def _stream(self, ids: list[list[int]], new: int, on_token, max_batch: int | None = None, check: bool = False,
                sampling: list[SamplingParams] | None = None, stop: list[str] = ()) -> Iterator[TokenEvent]:  # fmt: skip
        """The generation runs on a thread of its own; its events come through a queue. An
        iterator left early stops it at its next token."""
        events: queue.Queue = queue.Queue()
        left = threading.Event()  # the reader left early
        done: list = []

        def put(event: TokenEvent) -> None:
            if left.is_set():
                raise _Stopped
            if on_token is not None:
                on_token(event)
            events.put(event)

        def work() -> None:
            try:
                done.append(self._run(ids, new, put, max_batch, check, sampling, stop))
            except _Stopped:
                pass
            except BaseException as e:  # raised again in the caller's thread
                done.append(e)
            events.put(None)

        worker = threading.Thread(target=work, name="aotc-session-generate", daemon=True)
        worker.start()
        try:
            while (event := events.get()) is not None:
                yield event
        finally:
            left.set()
            worker.join()
        if done and isinstance(done[0], BaseException):
            raise done[0]
        return done[0] if done else None

    def _eager_model(self):
        """The model as eager code runs it, for check(): a second instance from the same folder,
        every low-precision weight dequantized (the bound one holds some only as stored), with
        the bundle's caches; loaded at the first check() and kept."""
        from ..models.loader import load_model

        if self._eager is None:
            self._eager = load_model(self.model_dir, **self.bundle.model_args(None, eager=True)).model
        return self._eager

    def _tokens(self, text: str, index: int, special: bool) -> list[int]:
        if self.tokenizer is None:
            raise AotcError(f"prompt {index} is text, but {self.model_dir} has no tokenizer.json to encode it; pass token ids, or add the model's tokenizer.json")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes that were not UTF-8 reach Python as lone surrogates
            raise AotcError(f"prompt {index} is not valid UTF-8 text; pass it as UTF-8") from None
        ids = self.tokenizer.encode(text, add_special_tokens=special).ids
        if not ids:
            raise AotcError(f"prompt {index} is empty: it encodes to no tokens")
        return ids


def _join(b: Bundle, threads: int | None) -> tuple[int, int, int | None]:
    """(rank, world size, threads) for this process: a parallel bundle's ranks each open it
    in a process of a launch (torchrun: RANK and WORLD_SIZE set), which joins its group here;
    the local ranks share the CPUs out unless threads says otherwise."""
    from ..parallel import flag, join, joined_rank
    from .launch import threads_per_rank

    layout = b.manifest.parallel
    if layout.world_size == 1:
        return 0, 1, threads
    launched = joined_rank()
    if launched is None:
        raise AotcError(
            f"{b.dir} runs on {layout.world_size} ranks ({flag(layout)}): open it in each "
            f"process of a launch, e.g. `torchrun --nproc-per-node {layout.world_size} your_program.py`, or run it with `aotc run {b.dir}`"
        )
    rank, world = launched
    if world != layout.world_size:
        raise AotcError(f"{b.dir} runs on {layout.world_size} ranks ({flag(layout)}); this launch has WORLD_SIZE={world}")
    join(layout, rank, b.device)
    return rank, world, threads or threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", world)))


class _Stopped(Exception):
    """The stream's reader left: the generation ends at its next token."""


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_tokenizer(model_dir: Path):
    """The folder's tokenizer.json, or None where it has none (token-id prompts still run)."""
    from tokenizers import Tokenizer

    from ..models.config import model_file

    path = model_file(model_dir, "tokenizer.json")
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for any parse error
        raise AotcError(f"{path}: not a tokenizer the tokenizers library reads ({e}); re-save it from the model's tokenizer") from None


def bundle_model(bundle: Path, manifest: Manifest, model: str | None, revision: str | None) -> Path:
    """The weights for a bundle: `model`, else the folder it was built from, else the Hub
    snapshot it was built from (the same commit) on this machine; a folder that is not
    there is an AotcError saying how to name one."""
    from ..models.hub import resolve_model

    if model is not None:
        model_dir = resolve_model(model, revision)[0]
    elif revision is not None:
        raise AotcError("--revision applies to --model ORG/NAME; the bundle's own model is the commit it was built from")
    else:
        model_dir, hub = Path(manifest.model.source), manifest.model.hub
        if hub is not None and not model_dir.is_dir():
            model_dir = resolve_model(hub.repo_id, hub.commit)[0]
    if not model_dir.is_dir():
        whose = "model=" if model is not None else f"the folder the bundle {bundle} was built from, and it is gone"
        raise AotcError(
            f"{model_dir}: no such folder ({whose}). Pass the folder or Hub id ORG/NAME with the model's weights: "
            f"Session.open({str(bundle)!r}, model=...), or aotc run {bundle} --model ..."
        )
    return model_dir


def check_memory(model, b: Bundle) -> None:
    """Refuse before allocating caches that would not fit (a bundle built for a larger host)."""
    from ..models.loader import memory_shortfall

    short = memory_shortfall(model, b.cache_slots, b.max_seq)
    if short:
        raise AotcError(
            f"{b.dir} cannot run here: {short}. Rebuild it with a smaller --max-seq or fewer/smaller --buckets "
            f"(now max_seq {b.max_seq}, batch buckets {','.join(map(str, b.manifest.shapes.batch))})"
        )
