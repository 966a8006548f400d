"""`aotc run`: generation through a bundle, streamed, with --check against eager; on a parallel bundle, one process per rank."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..errors import AotcError
from ..models.corpus import CORPUS
from .common import PLUGIN, _encode, _fail, _options, _print_algorithms, _stop_on_sigterm, _tokenizer, app, console, err_console

# The smoke prompts of `aotc run`: four lengths, the last (412 tokens with the tiny
# model's tokenizer) longer than two prefill chunks of 160, the largest default.
DEFAULT_PROMPTS = (
    "Hello, world!",
    "What is the capital of France?",
    "Once upon a time there was a small model that learned to count: one, two, three,",
    (CORPUS.strip() + " ") * 2,
)


@app.command(short_help="Generate through a bundle (greedy); --check compares with eager.")
def run(
    path: Path = typer.Argument(..., help="Bundle folder written by aotc build (with --eager: a model folder or Hub id ORG/NAME)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or Hugging Face Hub id (ORG/NAME) with the weights (default: the one the bundle was built from)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of --model ORG/NAME."),
    prompt: list[str] = typer.Option(
        [], "--prompt", show_default=False, help="Prompt text; repeat for a batch (default: four smoke prompts, one longer than two chunks of 160, cut to fit the bundle)."
    ),
    chat: bool = typer.Option(False, "--chat", help="Send each prompt as a user turn through the model's chat template (tokenizer_config.json), as instruct models expect."),
    messages: list[Path] = typer.Option(
        [],
        "--messages",
        show_default=False,
        help='FILE.json: a conversation, as the OpenAI message list ([{"role": "system", "content": ...}, {"role": "user", ...}, ...]), sent through the chat template as one prompt; repeat for a batch (after the --prompt ones).',
    ),
    max_new_tokens: Optional[int] = typer.Option(
        None, "--max-new-tokens", min=1, show_default=False, help="Tokens to generate per prompt (default: generation_config.json's max_new_tokens, else 32)."
    ),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", min=1, help="Prompts per batch (default: the largest batch bucket)."),
    check: bool = typer.Option(
        False,
        "--check",
        help="Also run the eager model; exit 1 unless the bundle keeps to the fidelity rule (docs/verify.md, Fidelity): float32, every token eager's (a near-tie reported, not failed) and logits within 1e-3 + 1e-3 x |eager| (x5 on xla and neuron); lower precision, an error against float32 eager at most max(2 x eager's own at that precision, 1e-3). Names each module class whose compiled form runs another algorithm than its eager code (check.algorithms in --json).",
    ),
    eager: bool = typer.Option(False, "--eager", help="Generate with the eager model alone, no bundle: PATH is a model folder."),
    plugin: list[str] = PLUGIN,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object at the end instead of streaming text."),
    threads: Optional[int] = typer.Option(
        None,
        "--threads",
        min=1,
        show_default=False,
        help="CPU threads per kernel, 1 to the machine's CPUs (default: the CPUs that other processes leave free, re-read every tenth of a second).",
    ),
    expect_digest: Optional[str] = typer.Option(None, "--expect-digest", help="HEX: refuse the bundle unless its digest (printed by aotc build and aotc inspect) is this one."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="Sample at this temperature (0: greedy, the default)."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Sample from the K most likely tokens only (0: all)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample from the most likely tokens whose probabilities reach P, in (0, 1] (1: all)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Sample only tokens at least P times as likely as the most likely one, in [0, 1] (0: all)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of each prompt's random stream: the same seed gives the same tokens (default: a fresh one)."),
    stop: list[str] = typer.Option(
        [], "--stop", show_default=False, help="TEXT: end a prompt's generation where its text reaches TEXT, which is left out of the output; repeat for several."
    ),
):
    """Generation through a bundle (or, with --eager, with the eager model), greedy unless
    --temperature says otherwise. Stops at the model's eos tokens (generation_config.json's,
    else config.json's) and at --stop strings. Text streams
    as it is generated, without special tokens; notes after it name the prompts cut at
    the token limit before a stop token, and say so where the model answers with a stop
    token at once without --chat in a folder that has a chat template. A parallel bundle
    (--tensor-parallel) runs as that many local ranks, started and watched here, or as
    the ranks of a torchrun launch (RANK and WORLD_SIZE set); rank 0 prints. Every wait on
    other ranks lasts at most AOTC_RANK_TIMEOUT seconds (default 60)."""
    from ..format import read_manifest
    from ..models.config import model_file, read_json_object
    from ..models.generation import generation_defaults
    from ..models.hub import resolve_model
    from ..models.loader import load_model, memory_shortfall
    from ..parallel import joined_rank
    from ..plugins import load_plugins
    from ..runtime import generate
    from ..runtime.bundle import check_pin
    from ..runtime.completion import completions, token_events
    from ..runtime.generate import check_lengths
    from ..runtime.sampling import SamplingError, SamplingParams
    from ..runtime.session import Session, bundle_model

    session = None
    try:
        t0 = time.perf_counter()
        try:
            sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        except SamplingError as e:  # worded by field: the option's name is the field's
            raise AotcError(f"--{str(e).replace('_', '-', 1)}") from None
        if check and not sampling.greedy:
            raise AotcError(f"--check compares greedy decoding with eager's; leave --temperature out (it is {temperature}) to check")
        load_plugins(plugin)
        if eager:
            if check:
                raise AotcError("--check compares a bundle with the eager model; it has nothing to compare with --eager")
            model_dir, _ = resolve_model(model or str(path), revision)
            loaded = load_model(model_dir)
            defaults = generation_defaults(model_dir, loaded.config_dict)
        else:
            manifest = read_manifest(path)
            layout = manifest.parallel
            if layout.world_size > 1 and joined_rank() is None:
                # Checked here, once, before any rank starts: the pin, and the arguments.
                check_pin(Path(path), manifest, expect_digest, plugin)
                _check_max_batch(max_batch, max(manifest.shapes.batch))
                model_dir = bundle_model(Path(path), manifest, model, revision)
                defaults = generation_defaults(model_dir, read_json_object(model_file(model_dir, "config.json")))
                prompts = _run_prompts(_tokenizer(model_dir), model_dir, prompt, messages, chat)[1]
                _fit_bundle(prompts, max_new_tokens or defaults.max_new_tokens, manifest.shapes.max_seq, smoke=not prompt and not messages)
                return _launch_ranks(layout.world_size, _rank_arguments(locals()))
            session = Session.open(path, model, revision=revision, threads=threads, expect_digest=expect_digest, plugins=plugin)
            model_dir, defaults = session.model_dir, session.defaults
        new_tokens = max_new_tokens or defaults.max_new_tokens
        tokenizer = (session and session.tokenizer) or _tokenizer(model_dir)  # none: the command's own message
        asked, prompts = _run_prompts(tokenizer, model_dir, prompt, messages, chat)
        notes = []
        if session is None:
            # The bundle path's checks, for eager: the model's positions, and memory for the caches.
            # An eager run reaches at most config.json's max_position_embeddings (where the
            # model's rotary tables and trained range end), as a bundle's max_seq does.
            positions = getattr(loaded.config, "max_position_embeddings", None)
            if positions is not None:
                check_lengths(
                    prompts, new_tokens, positions, f"{model_dir / 'config.json'} allows (max_position_embeddings {positions}). Shorten the prompt or lower --max-new-tokens"
                )
            max_seq = loaded.model.round_max_seq(max(map(len, prompts)) + new_tokens)
            short = memory_shortfall(loaded.model, (max_batch or len(prompts)) + 1, max_seq)
            if short:
                raise AotcError(f"aotc run --eager: {short}. Shorten the prompts, lower --max-new-tokens or --max-batch")
            check_lengths(prompts, new_tokens, max_seq)  # before anything streams
        else:
            max_seq = session.bundle.max_seq
            _check_max_batch(max_batch, session.bundle.max_batch)
            prompts, notes = _fit_bundle(prompts, new_tokens, max_seq, smoke=not prompt and not messages)  # checks their lengths
        rank = 0 if session is None else session.rank
        stream = None if as_json or rank != 0 else _Stream(asked, prompts, notes)
        with stream or contextlib.nullcontext():
            if session is None:
                kwargs = dict(max_batch=max_batch or len(prompts), max_seq=max_seq, eos_ids=defaults.eos_token_ids, threads=threads)
                setup_s = time.perf_counter() - t0
                if stop and tokenizer is None:
                    raise AotcError(f"--stop: stop strings are matched on the text, and {model_dir} has no tokenizer.json")
                emit, stops = token_events(tokenizer, len(prompts), new_tokens, defaults.eos_token_ids, stop, stream and stream.event)
                gen = generate(loaded.model, prompts, new_tokens, on_token=emit, sampling=[sampling] * len(prompts), **kwargs)
                done = completions(gen, tokenizer, defaults.eos_token_ids, 0.0, setup_s, stops=stops)
            else:
                done = session.generate(
                    prompts, max_new_tokens=new_tokens, max_batch=max_batch, on_token=stream and stream.event, check=check, sampling=sampling, stop=stop,
                )  # fmt: skip
        if rank != 0:  # rank 0 reports, and checked against the whole eager model
            return session.close()
        after = _endings(done, defaults, new_tokens, max_new_tokens, model_dir, chat)
        generation = {
            "eos_token_ids": list(defaults.eos_token_ids), "eos_from": defaults.eos_from, "max_new_tokens": new_tokens,
            "max_new_tokens_from": "--max-new-tokens" if max_new_tokens else defaults.max_new_tokens_from, "chat": chat,
        }  # fmt: skip
        backend, source = ("eager", str(model_dir)) if session is None else (session.bundle.manifest.backend.name, str(session.bundle.dir))
        report = _report(asked, done, backend, source)
        if done.check is not None:
            from ..layout import compiled_forms

            # Where a module compiles another algorithm than its eager code, the check compares the
            # two: the modules that the bundle's entries run (a whole step's, or a layer's).
            instances = (session.model.get_submodule(p) for e in session.bundle.manifest.entries for p in e.instances)
            report["check"]["algorithms"] = [dataclasses.asdict(f) for f in compiled_forms(*instances)]
        report.update(generation=generation, notes=notes + after)
    except AotcError as e:
        _fail(e)
    finally:
        if session is not None:
            session.close()
    if as_json:
        print(json.dumps(report))
    else:
        _print_report(report, after)
    if check and not report["check"]["passed"]:
        raise typer.Exit(1)


def _rank_arguments(values: dict) -> dict:
    """aotc run's own arguments, as the rank entry point (run_rank) takes them again."""
    names = ("model", "revision", "prompt", "chat", "messages", "max_new_tokens", "max_batch", "check", "eager", "plugin", "as_json", "threads", "expect_digest",
             "temperature", "top_k", "top_p", "min_p", "seed", "stop")  # fmt: skip
    return {"path": str(values["path"]), **{n: values[n] for n in names}, "messages": [str(m) for m in values["messages"]]}


def run_rank(**arguments) -> int:
    """One rank of `aotc run` on a parallel bundle (the launcher's entry point, in a process of
    its own with the launch's RANK and WORLD_SIZE): the command, with its exit status."""
    import click

    _options(verbose=False)  # as the command line would: --verbose reaches the ranks as VERBOSE_ENV
    _stop_on_sigterm()  # the launcher ends a rank with SIGTERM: its bundle copy is removed as for Ctrl-C
    try:
        run(**{**arguments, "path": Path(arguments["path"]), "messages": [Path(m) for m in arguments["messages"]]})
    except (click.exceptions.Exit, typer.Exit) as e:  # typer's own Exit is no click Exit (typer 0.20+)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


def _check_max_batch(max_batch: int | None, largest: int) -> None:
    if max_batch is not None and max_batch > largest:
        raise AotcError(f"--max-batch {max_batch}: the bundle's largest batch bucket is {largest}")


def _launch_ranks(world_size: int, arguments: dict) -> None:
    """aotc run on a parallel bundle: run_rank once per rank, started and watched (runtime.launch)."""
    from ..runtime.launch import launch

    try:
        code, why = launch("aotc.cli.run:run_rank", arguments, world_size)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM: the launcher has ended the ranks and removed its folder
        err_console.print("[yellow]interrupted[/]: ended the ranks", highlight=False)
        raise typer.Exit(130) from None
    if why:
        err_console.print(f"[red]error:[/] {escape(why)}; ended the other ranks", highlight=False)
    raise typer.Exit(code)


def _endings(done, defaults, new_tokens: int, asked_new: int | None, model_dir: Path, chat: bool) -> list[str]:
    """Notes on how the sequences ended, printed after them: prompts cut at the token limit
    before a stop token, and a stop token first where the folder has a chat template that
    --chat would have sent the prompt through."""
    from ..chat import has_chat_template

    notes = [defaults.note] if defaults.note else []
    eos = set(defaults.eos_token_ids)
    cut = [i for i, c in enumerate(done) if c.finish_reason == "length"]
    if cut and eos:
        if asked_new:
            where = "--max-new-tokens"
        elif defaults.max_new_tokens_from == "generation_config.json":
            where = "generation_config.json's max_new_tokens"
        else:
            where = "aotc's default"
        which = "prompt" if len(cut) == 1 else "prompts"
        notes.append(f"{which} {', '.join(map(str, cut))} stopped at {new_tokens} new tokens ({where}) before a stop token; --max-new-tokens N generates more")
    if not chat and any(c.ids[:1] and c.ids[0] in eos for c in done) and has_chat_template(model_dir):
        notes.append(f"the model answered with a stop token at once; {model_dir} has a chat template: run with --chat to send each prompt as a user turn")
    return notes


def _run_prompts(tokenizer, model_dir: Path, prompt: list[str], messages: list[Path], chat: bool) -> tuple[list[str], list[list[int]]]:
    """aotc run's prompts, as shown (a conversation as its last message) and as token ids:
    --prompt texts (through the chat template with --chat), then --messages conversations;
    neither: the smoke prompts."""
    asked = prompt or ([] if messages else list(DEFAULT_PROMPTS))
    texts = asked
    if chat:
        from ..chat import render_user_turn

        texts = [render_user_turn(model_dir, t) for t in asked]
    prompts = _encode(tokenizer, texts, special=not chat)  # a chat template writes its own bos
    if messages:
        from ..chat import read_messages, render_messages

        conversations = [read_messages(m) for m in messages]
        asked = asked + [c[-1]["content"] for c in conversations]  # shown as its last message
        prompts += _encode(tokenizer, [render_messages(model_dir, c) for c in conversations], special=False)
    return asked, prompts


def _fit_bundle(prompts: list[list[int]], new_tokens: int, max_seq: int, smoke: bool) -> tuple[list[list[int]], list[str]]:
    """The prompts checked against the bundle's cache with the new tokens, the smoke
    prompts each cut to what fits it; with notes on the cuts."""
    from ..runtime.generate import check_lengths

    notes = []
    if smoke:
        room = max_seq - new_tokens
        if room < 1:
            raise AotcError(f"--max-new-tokens {new_tokens}: the bundle's max_seq is {max_seq}; generate at most {max_seq - 1} tokens")
        notes = [
            f"smoke prompt {i} cut from {len(p)} to {room} tokens to fit the bundle's max_seq {max_seq} with {new_tokens} new tokens"
            for i, p in enumerate(prompts)
            if len(p) > room
        ]
        prompts = [p[:room] for p in prompts]
    check_lengths(prompts, new_tokens, max_seq)
    return prompts, notes


class _Stream:
    """Text as it is generated: a single prompt streams to stdout; a batch is a live view
    with a line per sequence on a terminal, and is printed whole at the end elsewhere.
    Per token it takes the Session's TokenEvent (its text: tokenizers' DecodeStream, which
    holds back a character split across tokens, special tokens such as a stop token left
    out, as in the batch view and --json's "text"; a stop string held back and left out);
    a batch only adds the text to its line, so that the redraws stay off the decode loop's
    cost."""

    def __init__(self, shown: list[str], prompts: list[list[int]], notes: list[str]):
        self.shown, self.prompts, self.notes = shown, prompts, notes
        self.texts = [""] * len(prompts)
        self.live = None

    def __enter__(self):
        for note in self.notes:
            console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
        if len(self.prompts) == 1:
            console.print(self._header(0), highlight=False)
            console.out("  -> ", end="", highlight=False)
        elif console.is_terminal:
            from rich.live import Live

            # Redrawn a few times a second from what has come, not once per token.
            self.live = Live(get_renderable=self._view, console=console, refresh_per_second=8)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if len(self.prompts) == 1:
            console.out("")
        elif self.live is not None:
            self.live.__exit__(*exc)  # a last redraw, with every token
        else:
            console.print(self._view())

    def _header(self, i: int) -> str:
        p = self.shown[i]
        shown = p if len(p) <= 80 else p[:77] + "..."
        return f"[bold]prompt {i}[/] ({len(self.prompts[i])} tokens): {escape(repr(shown))}"

    def _view(self):
        from rich.console import Group
        from rich.text import Text

        lines = []
        for i, text in enumerate(self.texts):
            lines += [Text.from_markup(self._header(i)), Text("  -> " + text)]
        return Group(*lines)

    def event(self, event) -> None:
        """The Session's on_token."""
        self.texts[event.index] += event.text
        if len(self.prompts) == 1 and event.text:
            console.out(event.text, end="", highlight=False)
            console.file.flush()


def _report(prompts, done, backend, source) -> dict:
    t, checked = done.timings, done.check
    out = {
        "bundle": source,
        "backend": backend,
        "prompts": [{"prompt": p, "prompt_ids": c.prompt_ids, "new_ids": c.ids, "text": c.text, "finish_reason": c.finish_reason} for p, c in zip(prompts, done)],
        "timings": {
            "bundle_load_s": round(t.load_s, 4),
            "setup_s": round(t.setup_s, 4),
            "ttft_s": round(t.ttft_s, 4),
            "prefill_s": round(t.prefill_s, 4),
            "prefill_tokens": t.prefill_tokens,
            "decode_s": round(t.decode_s, 4),
            "decode_steps": t.decode_steps,
            "decode_tokens_per_s": round(t.decode_tokens_per_s, 1),
            **({"exchange_s": round(t.exchange_s, 4), "idle_calls": t.idle_calls} if t.exchange_s else {}),
        },
    }
    if checked is not None:
        out["check"] = {
            "passed": checked.passed,
            "tokens_equal": checked.tokens_equal,
            "max_logit_diff": checked.max_logit_diff,
            "tolerance": checked.tolerance,
            "reference": checked.reference,
            "twin": checked.twin,
            "per_prompt": [{**dataclasses.asdict(p), "passed": p.passed} for p in checked.per_prompt],
        }
    return out


def _print_report(report: dict, notes: list[str]) -> None:
    """What follows the streamed text: notes on how it ended, timings, and the check."""
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    t = report["timings"]
    load = "" if report["backend"] == "eager" else f"bundle load {t['bundle_load_s'] * 1e3:.0f} ms, "  # --eager loads no bundle
    console.print(
        f"{report['backend']}: {load}time to first token {t['ttft_s'] * 1e3:.0f} ms, "
        f"prefill {t['prefill_tokens']} tokens in {t['prefill_s'] * 1e3:.0f} ms, decode {t['decode_tokens_per_s']:.1f} tokens/s"
    )
    if "check" in report:
        c = report["check"]
        # Full precision: against eager float32. Lower: against the float32 reference, beside the eager twin.
        against = "eager" if c["twin"] is None else "the float32 reference"
        for i, r in enumerate(c["per_prompt"]):
            if r["equal"]:
                mark = "[green]equal[/]"
            elif r["near_tie_gap"] is not None:
                mark = f"[yellow]differs after {r['matching_tokens']} tokens at a near-tie ({against}'s gap {r['near_tie_gap']:.1e})[/]"
            else:
                mark = f"[red]differs after {r['matching_tokens']} tokens[/]"
            twin = "" if r["twin_error"] is None else f" ({c['twin']}: {r['twin_error']:.2e}, allowed {r['bound']:.2e})"
            console.print(f"  check prompt {i}: {r['tokens']} tokens {mark}, max logit diff {r['max_logit_diff']:.2e}, error {r['error']:.2e}{twin}")
        if c["tokens_equal"]:
            verdict = f"[green]every token matches {against}[/]"
        elif c["passed"]:
            verdict = f"[green]tokens match {against} except at near-ties[/]"
        else:
            verdict = f"[red]tokens differ from {against}[/]"
        over = "" if all(r["logits_close"] for r in c["per_prompt"]) else " [red](over the error allowed)[/]"
        if c["twin"] is None:
            rule = f"error allowed {c['tolerance']:.0e} (|diff| <= {c['tolerance']:.0e} + {c['tolerance']:.0e} x |eager|)"
        else:
            rule = f"error allowed max(2 x {c['twin']}'s, {c['tolerance']:.0e})"
        error = max((r["error"] for r in c["per_prompt"]), default=0.0)
        console.print(f"check: {verdict}; error {error:.2e}{over}, {rule}; error = max |diff| / (1 + |reference|)")
        _print_algorithms(c["algorithms"], "the check compares")
