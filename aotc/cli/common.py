"""What the commands share: the app, the consoles, how errors end a command, and the options several commands take."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import AotcError
from ..quiet import VERBOSE_ENV, silence_third_party_warnings
from ..terminal import print_whole_when_piped

app = typer.Typer(help="Ahead-of-time compilation of PyTorch LLM inference graphs.", no_args_is_help=True, add_completion=False)


@app.callback()
def _options(
    verbose: bool = typer.Option(False, "--verbose", help="Also show the warnings torch and JAX raise about their own internals (aotc/quiet.py lists them); hidden by default."),
):
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # build workers inherit it
    silence_third_party_warnings()
    print_whole_when_piped(console, err_console)


console = Console()


err_console = Console(stderr=True)


def _stop_on_sigterm() -> None:
    """SIGTERM stops like Ctrl-C: the same cleanup (temporary folders, workers) runs."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def _disk_error(e: OSError) -> AotcError:
    """An OSError while writing, as the user can act on it: where, and what to do."""
    import errno

    fix = {
        errno.ENOSPC: "the disk is full: free space there, or write elsewhere",
        errno.EDQUOT: "the disk quota is used up: free space there, or write elsewhere",
        errno.EROFS: "the file system is read-only: write elsewhere",
        errno.EACCES: "it is not writable by you: write elsewhere, or change its permissions",
        errno.EPERM: "it is not writable by you: write elsewhere, or change its permissions",
    }.get(e.errno, "check the path and the disk")
    return AotcError(f"{e.filename or 'a file'}: {e.strerror or e}; {fix}. Nothing was left half-written")


def _fail(e: AotcError) -> None:
    # soft_wrap: the terminal wraps the line, so paths and commands in it stay whole to copy.
    err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


PLUGIN = typer.Option([], "--plugin", help="PACKAGE.MODULE that registers a model architecture or a backend (repeatable); see docs/models.md, Bring your own model.")


def _build_options(model_dir, buckets, prefill_chunk, max_seq, backend, device, compiler_flag, plugin, context_buckets=None, first_chunk=None, **more):
    from ..builder import BuildOptions, parse_buckets, parse_flags

    options = BuildOptions(
        model_dir,
        batch_buckets=parse_buckets(buckets, "--buckets"),
        chunk_buckets=parse_buckets(prefill_chunk, "--prefill-chunk") if prefill_chunk is not None else None,
        first_chunk_buckets=parse_buckets(first_chunk, "--first-chunk") if first_chunk is not None else None,
        max_seq=max_seq,
        context_buckets=parse_buckets(context_buckets, "--context-buckets") if context_buckets is not None else None,
        backend=backend,
        device=device,
        compiler_flags=parse_flags(compiler_flag, "--compiler-flag"),
        plugins=tuple(plugin),
        **more,
    )
    if options.backend_note:
        err_console.print(f"[yellow]{escape(options.backend_note)}[/]", highlight=False)
    return options


BUCKETS = typer.Option("1,2,4,8", "--buckets", help="Decode batch buckets, comma-separated.")


PREFILL_CHUNK = typer.Option(
    None, "--prefill-chunk", show_default=False,
    help="Prefill chunk lengths, comma-separated (default: 16,48,160, each at most --max-seq): a prompt runs in whole largest chunks, then its rest in the fewest calls and rows (a call costs about 48 rows); a batch's prompts share chunks. Each is built per context bucket.",
)  # fmt: skip


FIRST_CHUNK = typer.Option(
    None, "--first-chunk", show_default=False,
    help="Lengths of a call's first chunk from position 0 (every prompt in it starts there: it reads no cached positions, one graph each), comma-separated, none above the largest --prefill-chunk; the chunk buckets join them. A new prompt pads to the next of these (default: 16,24,32,40,48,64,96,128,160 with the default --prefill-chunk, else the chunk buckets).",
)  # fmt: skip


MAX_SEQ = typer.Option(None, "--max-seq", help="Cache length in tokens, at most config.json's max_position_embeddings (default: min(max_position_embeddings, 1024)).")


CONTEXT = typer.Option(None, "--context", help="With --entry and --bucket: the artifact of this context bucket (default: the entry's smallest).")


CONTEXT_BUCKETS = typer.Option(
    None, "--context-buckets",
    help="Decode graphs per context length, comma-separated: each reads only the first C cache positions, and a step runs the smallest C that holds its longest sequence (default: 256, 1024, 4096, ... below --max-seq; --max-seq always joins). Prefill graphs are also built at each --prefill-chunk below them and at each context bucket doubled below the next (512 between 256 and 1024), each chunk at those as long as itself: a chunk reads no more positions than that.",
)  # fmt: skip


BACKEND = typer.Option(None, "--backend", help="export | inductor | xla | neuron (default: inductor where a C++ compiler is present, else export).")


DEVICE = typer.Option("cpu", "--device", help="cpu | cuda: where the inductor backend's code runs.")


COMPILER_FLAG = typer.Option(
    [], "--compiler-flag", help="KEY=VALUE backend option, repeatable (inductor: a torch._inductor.config name; neuron: target, optlevel, lnc, auto_cast, auto_cast_type)."
)


KV_CACHE_DTYPE = typer.Option(
    "auto",
    "--kv-cache-dtype",
    help="auto (the model's dtype) | fp8: KV caches as fp8, each group scaled by its largest magnitude (float32 scales), packed per token (llama family: a scale per token and head; DeepSeek V4: NoPE dims a scale per 64, RoPE dims in bf16, indexer keys a scale per 128), quantized to the target's fp8 maximum (448; trn2: 224) | fp8-values (llama family): values so, keys in bf16, which keep answers that fp8 keys lose.",
)


MODELING = typer.Option(
    "auto",
    "--modeling",
    help="Whose code runs the model: auto (aotc's own for llama, qwen2, mistral and deepseek_v4; transformers' for any other decoder-only model it has) | aotc | transformers (needs aotc\\[hf]).",
)


TENSOR_PARALLEL = typer.Option(
    1, "--tensor-parallel", min=1,
    help="Ranks to split the model across (llama family, and transformers models by their config's base_model_tp_plan; every backend): one graph per entry and bucket serves every rank, with the collectives inside it (on xla and neuron, per-rank HLO collectives; on neuron each rank takes a NeuronCore of its own); each rank loads its part of the weights. aotc run starts the ranks itself, or joins a torchrun launch.",
)  # fmt: skip


EXPERT_PARALLEL = typer.Option(
    1, "--expert-parallel", min=1,
    help="Ranks to split the routed experts across (DeepSeek V4, and transformers MoE models by their config's base_model_ep_plan; every backend): attention, caches, the shared expert and the routers on every rank, each rank holding and reading only its experts; one fp32 all-reduce per MoE layer. Started as --tensor-parallel's ranks are.",
)  # fmt: skip


DATA_PARALLEL_ATTENTION = typer.Option(
    False, "--data-parallel-attention",
    help="With --expert-parallel N (DeepSeek V4): each rank runs its own sequences in its own cache slots (--buckets are per rank: N times the sequences at once, each rank holding only its slots); each MoE layer gathers every rank's rows, routes them, runs the rank's experts and reduce-scatters the fp32 sums back. The ranks step in lockstep.",
)  # fmt: skip


CACHE_DIR = typer.Option(None, "--cache-dir", help="Compile cache folder (default: $AOTC_CACHE_DIR or ~/.cache/aotc).")


def _print_lint(backend: str, findings: list[str], more: str, limit: int = 10) -> list[str]:
    """A backend's lint findings (Backend.findings) as warnings, each once, the first `limit` of them."""
    lint = sorted(set(findings))
    for finding in lint[:limit]:
        console.print(f"[yellow]{backend} lint:[/] {escape(finding)}", highlight=False)
    if len(lint) > limit:
        console.print(f"[yellow]{backend} lint:[/] {len(lint) - limit} more ({more} lists them)", highlight=False)
    return lint


def _print_algorithms(algorithms: list[dict], what: str) -> None:
    for a in algorithms:
        console.print(f"{what} two algorithms in {a['cls']} ({a['modules']} modules): eager {a['eager']}; compiled {a['compiled']}", highlight=False, markup=False)


def _size(n: int) -> str:
    from ..cache import format_size

    return format_size(n)


def _tokenizer(model_dir: Path):
    from ..models.config import model_file
    from ..runtime.session import read_tokenizer

    tokenizer = read_tokenizer(model_dir)
    if tokenizer is None:
        raise AotcError(f"{model_file(model_dir, 'tokenizer.json')}: missing; `aotc run` needs the model's tokenizer.json to encode --prompt text")
    return tokenizer


def _encode(tokenizer, prompts: list[str], special: bool = True) -> list[list[int]]:
    ids = []
    for i, p in enumerate(prompts):
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:  # bytes that were not UTF-8 reach Python as lone surrogates
            raise AotcError(f"--prompt number {i + 1} is not valid UTF-8 text; pass the prompt as UTF-8") from None
        ids.append(tokenizer.encode(p, add_special_tokens=special).ids)
    return ids


def name_value_types(*typers: typer.Typer) -> None:
    """--help shows each option's value as a word (N, TEXT, PATH), not typer's <int> and
    <str>, and a flag without one (typer shows <bool>). Where an option names its own
    metavar, that stays."""
    import inspect
    import typing

    words = {bool: "", int: "N", float: "X", str: "TEXT", Path: "PATH"}
    for t in typers:
        callbacks = [c.callback for c in t.registered_commands] + ([t.registered_callback.callback] if t.registered_callback else [])
        for callback in callbacks:
            hints = typing.get_type_hints(callback)
            for name, param in inspect.signature(callback).parameters.items():
                info = param.default
                if not isinstance(info, typer.models.OptionInfo) or info.metavar is not None:
                    continue
                kind = hints.get(name)
                args = [a for a in typing.get_args(kind) if a is not type(None)]
                if typing.get_origin(kind) in (typing.Union, list) and args:
                    kind = args[0]  # Optional[X], list[X]
                info.metavar = words.get(kind)
