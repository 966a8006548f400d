"""The `aotc` command line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import AotcError
from .models.corpus import CORPUS
from .quiet import VERBOSE_ENV, silence_third_party_warnings
from .terminal import print_whole_when_piped

app = typer.Typer(help="Ahead-of-time compilation of PyTorch LLM inference graphs.", no_args_is_help=True, add_completion=False)


@app.callback()
def _options(
    verbose: bool = typer.Option(False, "--verbose", help="Also show the warnings torch and JAX raise about their own internals (aotc/quiet.py lists them); hidden by default."),
):
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # build workers inherit it
    silence_third_party_warnings()
    print_whole_when_piped(console, err_console)


init_app = typer.Typer(help="Create model folders.", no_args_is_help=True)
app.add_typer(init_app, name="init")
console = Console()
err_console = Console(stderr=True)

# The smoke prompts of `aotc run`: four lengths, the last longer than two
# prefill chunks of 128 with the tiny model's tokenizer.
DEFAULT_PROMPTS = (
    "Hello, world!",
    "What is the capital of France?",
    "Once upon a time there was a small model that learned to count: one, two, three,",
    (CORPUS.strip() + " ") * 2,
)


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


MAX_TINY_LAYERS = 256  # more than any released model has; a test model with more only fills the disk


@init_app.command("tiny")
def init_tiny(
    out: Path = typer.Argument(..., help="Folder to write: new or empty (with --force, replaced)."),
    arch: str = typer.Option("llama", "--arch", help="llama | qwen2 | mistral | deepseek_v4 (or an architecture a --plugin registers)."),
    layers: int = typer.Option(4, "--layers", min=1, max=MAX_TINY_LAYERS, help=f"Number of decoder layers (at most {MAX_TINY_LAYERS})."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    set_field: list[str] = typer.Option([], "--set", help="KEY=VALUE: override a config.json field (VALUE is JSON where it parses), e.g. --set sliding_window=16; repeatable."),
    force: bool = typer.Option(False, "--force", help="Replace OUT even if it holds files."),
    quantize: str = typer.Option(
        "none",
        "--quantize",
        help="none | fp8 (the decoder layers' linear weights as float8_e4m3fn, a scale per 128x128 block) | fp4-experts (also routed experts as packed fp4, an E8M0 scale per 32: DeepSeek V4) | int8 (the decoder layers' linear weights as int8, a float32 scale per 32 inputs).",
    ),
    checkpoint_layout: str = typer.Option("hf", "--checkpoint-layout", help="hf (Hugging Face names, float32 weight_scale_inv) | deepseek (DeepSeek's names, E8M0 .scale)."),
    plugin: list[str] = PLUGIN,
):
    """Write a small random model in the Hugging Face layout (the defaults make the embedded default model)."""
    from .build import parse_flags
    from .models.tiny import write_tiny
    from .plugins import load_plugins

    try:
        load_plugins(plugin)
        path = write_tiny(out, arch=arch, layers=layers, seed=seed, force=force, quantize=quantize, layout=checkpoint_layout, **parse_flags(set_field, "--set"))
    except AotcError as e:
        _fail(e)
    except OSError as e:  # a full or read-only disk: write_tiny writes a temporary folder, renamed when whole
        _fail(_disk_error(e))
    console.print(f"wrote {arch} model with {layers} layers{'' if quantize == 'none' else f', {quantize} weights'} to {path}", markup=False)


@app.command(short_help="Write a low-precision (fp8, fp4, int8) checkpoint of a model folder.")
def quantize(
    model: str = typer.Argument(..., help="A bf16 or fp32 model folder, or a Hugging Face Hub id (ORG/NAME) in the local cache."),
    out: Path = typer.Option(..., "-o", "--out", help="Folder to write: new or empty, outside MODEL."),
    fmt: str = typer.Option(
        "fp8",
        "--format",
        help="fp8 (the decoder layers' linear weights as float8_e4m3fn, a float32 scale per 128x128 block) | fp4-experts (also the routed experts as packed fp4, an E8M0 scale per 32) | int8 (the decoder layers' linear weights and the LM head as int8, a float32 scale per 32 inputs: llama.cpp's Q8_0 grid, activations unrounded).",
    ),
    head: Optional[str] = typer.Option(
        None,
        "--head",
        help="keep (the LM head at the source precision; fp8's default) | fp8 | int8 (the head in the layers' format, as llama.cpp's Q8_0 does; int8's default; a head tied to the embedding is written as its own tensor, the embedding kept).",
    ),
    revision: Optional[str] = typer.Option(None, "--revision", help="With a Hub id: a branch, tag or commit."),
    plugin: list[str] = PLUGIN,
):
    """Write a low-precision checkpoint of a model folder, in the formats aotc builds from (see docs/low-precision.md)."""
    from .models.hub import resolve_model
    from .plugins import load_plugins
    from .quantize import quantize_model

    _stop_on_sigterm()  # SIGTERM mid-write: the temporary folder is removed as for Ctrl-C
    try:
        load_plugins(plugin)
        source, _ = resolve_model(model, revision)
        done = quantize_model(source, out, fmt, head)
    except AotcError as e:
        _fail(e)
    except OSError as e:  # a full or read-only disk: the folder is written under a temporary name, renamed when whole
        _fail(_disk_error(e))
    counts = {f: sum(1 for v in done.tensors.values() if v == f) for f in ("fp8", "fp4", "int8")}
    what = " and ".join(f"{n} tensors to {f}" for f, n in counts.items() if n)
    console.print(
        f"quantized {what} ({_size(done.bytes_in)} -> {_size(done.bytes_out)} with their scales); {len(done.kept)} tensors kept as they were", highlight=False, markup=False
    )
    console.print(f"LM head: {done.head}", highlight=False, markup=False)
    console.print(f"wrote {done.out}", highlight=False, markup=False)


def _build_options(model_dir, buckets, prefill_chunk, max_seq, backend, device, compiler_flag, plugin, context_buckets=None, **more):
    from .build import BuildOptions, parse_buckets, parse_flags

    options = BuildOptions(
        model_dir,
        batch_buckets=parse_buckets(buckets, "--buckets"),
        chunk_buckets=parse_buckets(prefill_chunk, "--prefill-chunk"),
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
    "16,64", "--prefill-chunk",
    help="Prefill chunk lengths, comma-separated: a prompt runs in whole largest chunks, then its rest in the fewest calls and rows (a call costs about 48 rows); a batch's prompts share chunks. Each is built per context bucket.",
)  # fmt: skip
MAX_SEQ = typer.Option(None, "--max-seq", help="Cache length in tokens, at most config.json's max_position_embeddings (default: min(max_position_embeddings, 1024)).")
CONTEXT = typer.Option(None, "--context", help="With --entry and --bucket: the artifact of this context bucket (default: the entry's smallest).")
CONTEXT_BUCKETS = typer.Option(
    None, "--context-buckets",
    help="Decode graphs per context length, comma-separated: each reads only the first C cache positions, and a step runs the smallest C that holds its longest sequence (default: 256, 1024, 4096, ... below --max-seq; --max-seq always joins).",
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


@app.command(short_help="Trace and compile a model's entries, once per bucket, into a bundle.")
def build(
    model_dir: Optional[str] = typer.Argument(
        None, help="Hugging Face model folder (config.json, *.safetensors), or a Hub id ORG/NAME (resolved through the Hugging Face cache; downloaded unless HF_HUB_OFFLINE=1)."
    ),
    buckets: str = BUCKETS,
    prefill_chunk: str = PREFILL_CHUNK,
    max_seq: Optional[int] = MAX_SEQ,
    context_buckets: Optional[str] = CONTEXT_BUCKETS,
    backend: Optional[str] = BACKEND,
    device: str = DEVICE,
    compiler_flag: list[str] = COMPILER_FLAG,
    plugin: list[str] = PLUGIN,
    kv_cache_dtype: str = KV_CACHE_DTYPE,
    modeling: str = MODELING,
    tensor_parallel: int = TENSOR_PARALLEL,
    expert_parallel: int = EXPERT_PARALLEL,
    data_parallel_attention: bool = DATA_PARALLEL_ATTENTION,
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="Parallel compile processes, at most the machine's CPUs (default: from cores and free memory)."),
    out: Optional[Path] = typer.Option(
        None, "-o", "--out", help="Bundle folder (default: artifacts/<model folder name>): new, empty, or an aotc bundle to replace; never the model folder."
    ),
    cache_dir: Optional[Path] = CACHE_DIR,
    no_cache: bool = typer.Option(False, "--no-cache", help="Compile everything; neither read nor fill the compile cache."),
    require_cache: bool = typer.Option(False, "--require-cache", help="Fail, naming them, if any artifact is not cached (deploy jobs)."),
    remote_cache: Optional[str] = typer.Option(None, "--remote-cache", help="s3://bucket/prefix: read-through, write-back remote cache."),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: compile only this shard's artifacts into the cache; no bundle."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="BUNDLE: compile the pending artifacts of a neuron cross-build (needs neuronx-cc)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of MODEL_DIR given as ORG/NAME."),
    force: bool = typer.Option(False, "--force", help="Without -o: replace the bundle at the default artifacts/<model name> even when it is of another model or backend."),
):
    """Trace and compile every entry of a model once per bucket into a bundle."""
    from .backends import get_backend_class
    from .build import build as run_build
    from .build import parse_shard

    _stop_on_sigterm()

    if resume is not None:
        return _resume(resume, jobs)
    if model_dir is None:
        _fail(AotcError("aotc build needs MODEL_DIR (or --resume BUNDLE)"))
    options = None
    try:
        from .models.hub import resolve_model

        model_path, hub = resolve_model(model_dir, revision)  # a Hub id may download: interruptible
        options = _build_options(
            model_path,
            buckets,
            prefill_chunk,
            max_seq,
            backend,
            device,
            compiler_flag,
            plugin,
            context_buckets,
            out=out,
            jobs=jobs,
            cache_dir=cache_dir,
            use_cache=not no_cache,
            require_cache=require_cache,
            remote_cache=remote_cache,
            shard=parse_shard(shard) if shard else None,
            hub=hub,
            kv_cache_dtype=kv_cache_dtype,
            modeling=modeling,
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
            data_parallel_attention=data_parallel_attention,
            force=force,
        )
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        # Off a terminal rich's live bars render only at exit: a CI log (stdout to a file or a
        # pipe) gets a plain line per artifact as it finishes instead, and the bars are drawn
        # only where stderr is a terminal.
        with Progress(*columns, console=err_console, transient=False, disable=not err_console.is_terminal) as progress:
            tasks = {}

            def report(event, **info):
                if event == "entry":
                    tasks[info["id"]] = progress.add_task(info["id"], total=info["total"])
                    return
                progress.advance(tasks[info["id"]])
                if not console.is_terminal:
                    context = "" if info["context"] is None else f" context {info['context']}"
                    console.print(f"{info['id']} bucket {info['bucket']}{context}: {info['source']}, {info['seconds']:.2f} s", highlight=False, markup=False)
                    console.file.flush()

            result = run_build(options, progress=report)
    except AotcError as e:
        _fail(e)
    except OSError as e:  # a full or read-only disk under -o: the bundle writer removed its temporary folder
        _fail(_disk_error(e))
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM: the bundle writer has removed its temporary folder
        where = "nothing was written" if options is None else f"{options.out or 'the cache'} is as it was before this build"
        err_console.print(f"interrupted: {escape(where)}", highlight=False)
        raise typer.Exit(130) from None
    where = result.out if result.out else f"cache {result.cache_dir} (shard {shard})"
    table = Table(title=f"{escape(str(where))}  ({options.backend}, {result.jobs} job{'s' if result.jobs > 1 else ''})")
    for col in ("entry", "bucket", "context", "from", "seconds", "size"):
        table.add_column(col, justify="left" if col in ("entry", "from") else "right")
    for a in result.artifacts:
        table.add_row(a.entry_id, str(a.bucket), "" if a.context is None else str(a.context), a.source, f"{a.seconds:.2f}", _size(a.size))
    console.print(table)
    entries = {v.entry_id: v for v in result.variants}  # an entry traced per context bucket is one entry
    for v in entries.values():
        if v.attributes:  # one class's instances split into variants: say which and why
            attrs = ", ".join(f"{k}={val!r}" for k, val in v.attributes.items())
            paths = [p for p, _ in v.instances]
            console.print(f"variant {v.entry_id} ({escape(attrs)}): {len(paths)} modules, {', '.join(paths[:4])}{' ...' if len(paths) > 4 else ''}", highlight=False)
    if result.graphs_traced:
        layers = len({(path, v.spec.method) for v in result.variants for path, _ in v.instances})  # context buckets: one instance
        console.print(
            f"traced {result.graphs_traced} graphs for {len(entries)} entries serving {layers} module instances in {result.seconds:.1f} s -> {where}",
            markup=False,
        )
    else:
        console.print(f"assembled {len(result.artifacts)} cached artifacts without tracing in {result.seconds:.1f} s -> {where}", markup=False)
    if result.manifest is not None:
        # A bundle is code: pin this to run exactly what was built (aotc run --expect-digest).
        console.print(f"bundle digest {result.manifest.digest()}", highlight=False)
    if result.cache_dir:
        line = f"cache: {result.count('cache')} hits, {result.count('compiled')} misses compiled"
        if remote_cache:
            line += f", {result.count('remote')} from {remote_cache}"
        console.print(line + f" ({result.cache_dir})", markup=False)
    pending = [a for a in result.artifacts if a.record.pending]
    if pending:
        console.print(
            f"[yellow]{len(pending)} artifacts are pending:[/] {pending[0].record.pending}. "
            f"Each has its HLO and command.txt; on a host with the Neuron SDK run: aotc build --resume {result.out}",
            highlight=False,
        )
    kind = get_backend_class(options.backend)
    _print_lint(options.backend, [f for a in result.artifacts for f in kind.findings(a.record.extra)], f"aotc verify {result.out} --json")
    for note in result.notes:
        console.print(f"[yellow]warning:[/] {escape(note)}", highlight=False)
    for note in result.cache_notes:
        console.print(f"[yellow]cache:[/] {escape(note)}", highlight=False)
    if result.remote_errors:
        console.print(f"[yellow]remote cache unavailable, build went on without it:[/] {escape(result.remote_errors[0])}", highlight=False)


def _resume(bundle: Path, jobs: Optional[int]) -> None:
    from .build import resume

    try:
        done = resume(bundle, jobs)
    except AotcError as e:
        _fail(e)
    if not done:
        console.print(f"{bundle}: nothing pending", markup=False)
        return
    console.print(f"compiled {len(done)} pending artifacts: {', '.join(done)}; {bundle} is ready to run", markup=False)


cache_app = typer.Typer(help="The compile cache.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("key")
def cache_key_command(
    model_dir: str = typer.Argument(
        ..., help="What aotc build takes: a model folder, or a Hub id ORG/NAME (resolved through the Hugging Face cache; downloaded unless HF_HUB_OFFLINE=1)."
    ),
    buckets: str = BUCKETS,
    prefill_chunk: str = PREFILL_CHUNK,
    max_seq: Optional[int] = MAX_SEQ,
    context_buckets: Optional[str] = CONTEXT_BUCKETS,
    backend: Optional[str] = BACKEND,
    device: str = DEVICE,
    compiler_flag: list[str] = COMPILER_FLAG,
    plugin: list[str] = PLUGIN,
    kv_cache_dtype: str = KV_CACHE_DTYPE,
    modeling: str = MODELING,
    tensor_parallel: int = TENSOR_PARALLEL,
    expert_parallel: int = EXPERT_PARALLEL,
    data_parallel_attention: bool = DATA_PARALLEL_ATTENTION,
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of MODEL_DIR given as ORG/NAME."),
):
    """Print one key for a whole build, without compiling (a CI cache key): the same
    arguments as aotc build, so that a CI job's key step and build step take one."""
    from .build import build_key
    from .models.hub import resolve_model

    try:
        model_path, hub = resolve_model(model_dir, revision)
        options = _build_options(
            model_path,
            buckets,
            prefill_chunk,
            max_seq,
            backend,
            device,
            compiler_flag,
            plugin,
            context_buckets,
            kv_cache_dtype=kv_cache_dtype,
            modeling=modeling,
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
            data_parallel_attention=data_parallel_attention,
            hub=hub,
            force=True,  # writes nothing
        )
        print(build_key(options))
    except AotcError as e:
        _fail(e)


@cache_app.command("ls")
def cache_ls(
    cache_dir: Optional[Path] = CACHE_DIR,
    filter_: Optional[str] = typer.Option(
        None, "--filter", help="Only the entries whose model, entry or backend contains this text (e.g. a model name, LlamaDecoderLayer.decode, inductor)."
    ),
):
    """List the cached artifacts: what each was compiled for (model, entry and bucket,
    backend, from the finished builds' recipes), its size and when it was last used."""
    import datetime

    from .cache import RECORD, LocalCache
    from .cache.recipes import served_by

    try:
        cache = LocalCache(cache_dir)
    except AotcError as e:
        _fail(e)
    served = served_by(cache)
    table = Table(title=escape(str(cache.root)))
    for col in ("key", "model", "entry", "backend", "files", "size", "last used"):
        table.add_column(col)
    total = 0
    for e in sorted(cache.entries(), key=lambda e: -(e.dir / RECORD).stat().st_mtime):
        uses = sorted(served.get(e.key, ())) or [("", "(no finished build)", "")]
        if filter_ is not None and not any(filter_ in part for use in uses for part in use):
            continue
        size = e.size
        total += size
        used = datetime.datetime.fromtimestamp((e.dir / RECORD).stat().st_mtime).strftime("%Y-%m-%d %H:%M")
        more = f" and {len(uses) - 1} more" if len(uses) > 1 else ""
        model, entry, backend = (escape(part) for part in uses[0])
        table.add_row(e.key[:16], model, entry + more, backend, escape(", ".join(e.record.files)), _size(size), used)
    console.print(table)
    console.print(f"{len(table.rows)} entries, {_size(total)}" + ("" if filter_ is None else f" matching {filter_!r}"), markup=False)


@cache_app.command("prune")
def cache_prune(
    max_size: str = typer.Option(
        ...,
        "--max-size",
        help="Keep at most this much, dropping least recently used first: decimal units as sizes are printed (2G = 2e9 bytes, 500M, 0), or binary ones spelled out (1.5GiB); at most 1000000T.",
    ),
    cache_dir: Optional[Path] = CACHE_DIR,
):
    """Shrink the cache to a size, and remove what dead builds left behind."""
    from .cache import LocalCache, parse_size

    try:
        removed, freed = LocalCache(cache_dir).prune(parse_size(max_size))
    except AotcError as e:
        _fail(e)
    console.print(f"removed {removed} entries, freed {_size(freed)}")


@app.command(short_help="Generate through a bundle (greedy); --check compares with eager.")
def run(
    path: Path = typer.Argument(..., help="Bundle folder written by aotc build (with --eager: a model folder or Hub id ORG/NAME)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or Hugging Face Hub id (ORG/NAME) with the weights (default: the one the bundle was built from)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of --model ORG/NAME."),
    prompt: list[str] = typer.Option(
        [], "--prompt", show_default=False, help="Prompt text; repeat for a batch (default: four smoke prompts, one longer than two chunks of 128, cut to fit the bundle)."
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
    from .format import read_manifest
    from .models.config import model_file, read_json_object
    from .models.generation import generation_defaults
    from .models.hub import resolve_model
    from .models.loader import load_model, memory_shortfall
    from .parallel import joined_rank
    from .plugins import load_plugins
    from .runtime import generate
    from .runtime.bundle import check_pin
    from .runtime.completion import completions, token_events
    from .runtime.generate import check_lengths
    from .runtime.sampling import SamplingError, SamplingParams
    from .runtime.session import Session, bundle_model

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
            from .layout import compiled_forms

            # Where a module compiles another algorithm than its eager code, the check compares the two.
            report["check"]["algorithms"] = [dataclasses.asdict(f) for f in compiled_forms(session.model)]
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
    from .runtime.launch import launch

    try:
        code, why = launch("aotc.cli:run_rank", arguments, world_size)
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
    from .chat import has_chat_template

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
        from .chat import render_user_turn

        texts = [render_user_turn(model_dir, t) for t in asked]
    prompts = _encode(tokenizer, texts, special=not chat)  # a chat template writes its own bos
    if messages:
        from .chat import read_messages, render_messages

        conversations = [read_messages(m) for m in messages]
        asked = asked + [c[-1]["content"] for c in conversations]  # shown as its last message
        prompts += _encode(tokenizer, [render_messages(model_dir, c) for c in conversations], special=False)
    return asked, prompts


def _fit_bundle(prompts: list[list[int]], new_tokens: int, max_seq: int, smoke: bool) -> tuple[list[list[int]], list[str]]:
    """The prompts checked against the bundle's cache with the new tokens, the smoke
    prompts each cut to what fits it; with notes on the cuts."""
    from .runtime.generate import check_lengths

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


@app.command(short_help="Serve a bundle over the OpenAI API (completions, chat, streaming).")
def serve(
    path: Path = typer.Argument(..., help="Bundle folder written by aotc build."),
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or Hugging Face Hub id (ORG/NAME) with the weights (default: the one the bundle was built from)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) of --model ORG/NAME."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (default: loopback only; 0.0.0.0 for every interface)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port to listen on (0: any free one, printed)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model name clients send (default: the bundle folder's name)."),
    api_key: list[str] = typer.Option(
        [],
        "--api-key",
        show_default=False,
        help="KEY: requests must send Authorization: Bearer KEY; repeat for several keys (default: none needed). /health and /metrics are open.",
    ),
    max_queue: int = typer.Option(64, "--max-queue", min=0, help="Requests that may wait while every cache slot is taken; one more gets 429 with Retry-After."),
    shutdown_timeout: float = typer.Option(
        30.0,
        "--shutdown-timeout",
        min=0.0,
        help="Seconds a SIGTERM lets running requests finish (new ones get 503); streams still running then end with an error event and the exit status is 1.",
    ),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, show_default=False, help="CPU threads per kernel (default: the CPUs that other processes leave free)."),
    expect_digest: Optional[str] = typer.Option(None, "--expect-digest", help="HEX: refuse the bundle unless its digest is this one."),
    plugin: list[str] = PLUGIN,
):
    """An OpenAI-compatible server over a bundle: /v1/completions and /v1/chat/completions
    (streaming or not, sampling, stop strings, usage), /v1/models, /tokenize, /detokenize,
    /health and /metrics (docs/serving.md). Requests batch continuously on the bundle's
    cache slots. SIGTERM drains: exit 0 once every running request has ended. A parallel
    bundle runs as its local ranks, started and watched here; rank 0 serves."""
    from .format import read_manifest
    from .parallel import joined_rank

    try:
        try:
            from .server.run import serve as run_server
        except ImportError as e:
            raise AotcError(f"aotc serve needs the serve extra ({e.name} is missing): pip install 'aotc[serve]'") from None
        layout = read_manifest(path).parallel
        if layout.world_size > 1 and joined_rank() is None:  # start the ranks; rank 0 serves
            from .runtime.launch import launch

            arguments = {n: v for n, v in locals().items() if n in SERVE_ARGUMENTS}
            code, why = launch("aotc.cli:serve_rank", {**arguments, "path": str(path)}, layout.world_size, forward=True)
            if why:
                err_console.print(f"[red]error:[/] {escape(why)}; ended the other ranks", highlight=False)
            raise typer.Exit(code)
        from .runtime.session import Session

        session = Session.open(path, model, revision=revision, threads=threads, expect_digest=expect_digest, plugins=plugin)
    except AotcError as e:
        _fail(e)
    if session.rank != 0:  # its service steps with rank 0's, until rank 0's closes
        session.service().close()
        session.close()
        raise typer.Exit(0)
    name = served_model_name or Path(path).resolve().name
    try:
        status = run_server(session, name=name, host=host, port=port, api_keys=api_key, max_queue=max_queue, shutdown_timeout=shutdown_timeout,
                            ready=lambda address: console.print(f"serving {name} on http://{address} (slots {session.bundle.capacity}, max_seq {session.bundle.max_seq})", highlight=False))  # fmt: skip
    finally:
        session.close()
    raise typer.Exit(status)


SERVE_ARGUMENTS = ("model", "revision", "host", "port", "served_model_name", "api_key", "max_queue", "shutdown_timeout", "threads", "expect_digest", "plugin")


def serve_rank(**arguments) -> int:
    """One rank of `aotc serve` on a parallel bundle (the launcher's entry point): rank 0
    serves, the others step with it; the exit status."""
    import click

    _options(verbose=False)
    try:
        serve(**{**arguments, "path": Path(arguments["path"])})
    except (click.exceptions.Exit, typer.Exit) as e:  # typer's own Exit is no click Exit (typer 0.20+)
        return e.exit_code
    return 0


@app.command(short_help="Run every artifact against eager, on the model's own inputs.")
def verify(
    path: Path = typer.Argument(..., help="Bundle folder written by aotc build."),
    model: Optional[Path] = typer.Option(
        None, "--model", help="Model folder with the weights (default: the one the bundle was built from, if it is still there; else random weights of the right shapes)."
    ),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Also fail on neuron lint findings: dynamic dimensions, f64, 64-bit integers, custom calls in the HLO, and ops that neuronx-cc list-operators does not list (where it is installed).",
    ),
    entry: Optional[str] = typer.Option(None, "--entry", help="Check this entry's artifacts only (an id as aotc inspect lists it, e.g. LlamaDecoderLayer.decode)."),
    bucket: Optional[int] = typer.Option(None, "--bucket", help="With --entry: the artifact of this bucket only."),
    context: Optional[int] = CONTEXT,
    plugin: list[str] = PLUGIN,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
):
    """Run every artifact (or the one --entry, --bucket and --context choose) once against the eager entry method, on inputs the model's own
    decode and prefill make (rows one under the bucket where that still maps to it, so
    padding runs), caches filled with random values. Passes when each output and each
    cache entry eager wrote keep to the fidelity rule (where eager wrote is what its write
    ops touched, not where values changed), every other cache entry is unchanged but the
    scratch slot's, and, for xla and neuron bundles, hlo.pb (the file neuronx-cc
    compiles), compiled as it is by XLA's CPU client, agrees with model.jax
    (xla) or eager (neuron). The rule: float32 models, error within 1e-3 of eager
    (x5 on xla and neuron); lower precision (bf16 or fp8 weights, fp8 caches), error
    against the same call by a float32 twin of the weights at most max(2 x eager's own,
    1e-3); error = max |diff| / (1 + |reference|). Exit 1 on any mismatch. Lists each
    module class whose compiled form runs another algorithm than the eager method it is
    compared with."""
    from .format import artifact_label
    from .runtime.verify import verify as run_verify

    try:
        report = run_verify(path, model, plugin, strict, entry, bucket, context)
    except AotcError as e:
        _fail(e)
    if as_json:
        data = dataclasses.asdict(report)
        data["passed"] = report.passed
        print(json.dumps(data))
    else:
        table = Table(title=f"{escape(str(report.bundle))}  ({report.backend}, weights: {escape(str(report.weights))})")
        for col in ("entry", "bucket", "context", "rows", "max abs", "max rel", "error", "allowed", "reference", "result"):
            table.add_column(col, justify="left" if col in ("entry", "reference", "result") else "right", no_wrap=col == "entry")
        for a in report.artifacts:
            ref = "" if a.reference_vs is None else f"{a.reference} vs {a.reference_vs} {a.reference_max_abs:.2g}"
            table.add_row(
                a.entry,
                str(a.bucket),
                "" if a.context is None else str(a.context),
                str(a.rows),
                f"{a.max_abs:.2g}",
                f"{a.max_rel:.2g}",
                f"{a.error:.2g}",
                f"{a.allowed:.2g}",
                ref,
                "[green]ok[/]" if a.passed else "[red]FAIL[/]",
            )
        console.print(table)
        for a in report.artifacts:
            for problem in a.problems:
                console.print(f"[red]{artifact_label(a.entry, a.bucket, a.context)}:[/] {escape(problem)}", highlight=False)
        lint = _print_lint(report.backend, [f for a in report.artifacts for f in a.lint], "--json")
        failed = sum(not a.passed for a in report.artifacts)
        precision = report.artifacts[0].precision if report.artifacts else "float32"
        rule = "match eager" if precision == "float32" else f"keep within 2 x eager {precision}'s error against a float32 twin (or 1e-3)"
        console.print(f"{len(report.artifacts) - failed} of {len(report.artifacts)} artifacts {rule}" + (f"; {len(lint)} lint findings" if lint else ""))
        _print_algorithms([dataclasses.asdict(a) for a in report.algorithms], "verify compares")
    if not report.passed:
        raise typer.Exit(1)


@app.command(short_help="Shrink a compiler failure to the smallest failing run of nodes.")
def bisect(
    path: Path = typer.Argument(..., help="Bundle folder (xla or neuron) whose artifact fails to compile."),
    entry: str = typer.Option(..., "--entry", help="Entry id, as aotc inspect lists it (e.g. LlamaDecoderLayer.decode)."),
    bucket: int = typer.Option(..., "--bucket", help="The artifact's bucket."),
    context: Optional[int] = CONTEXT,
    model: Optional[Path] = typer.Option(None, "--model", help="Model folder to trace again (default: the one the bundle was built from)."),
    compiler: Optional[str] = typer.Option(
        None,
        "--compiler",
        help="CMD run in place of neuronx-cc, with the same argv (compile hlo.pb ... --output model.neff): any HLO checker that fails with a non-zero exit works, an NCC_ code in its output naming the failure.",
    ),
    work: Optional[Path] = typer.Option(None, "--work", help="Folder for the attempts (default: a new temporary folder); kept for inspection."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
    plugin: list[str] = PLUGIN,
):
    """Shrink a compiler failure to the smallest run of graph nodes that fails the same way:
    the artifact's graph is traced again, cut into node ranges that are compiled alone
    (about 2 log2(nodes) compiler runs), and the result names each node's source line,
    with the minimal HLO and a command that reproduces it."""
    from .bisect import bisect as run_bisect
    from .format import artifact_label
    from .plugins import load_plugins

    try:
        load_plugins(plugin)
        with err_console.status("bisecting") as status:
            result = run_bisect(path, entry, bucket, context, model_dir=model, compiler=compiler, work=work, progress=lambda line: status.update(line))
    except AotcError as e:
        _fail(e)
    if as_json:
        print(json.dumps(dataclasses.asdict(result)))
        return
    console.print(
        f"{artifact_label(result.entry, result.bucket, result.context)} fails with {result.code}; the smallest failing range is {len(result.nodes)} of {result.total_nodes} nodes ({result.runs} compiler runs):",
        highlight=False,
        markup=False,
    )
    for node, source in zip(result.nodes, result.sources):
        console.print(f"  {node}    {source}", highlight=False, markup=False)
    console.print(f"minimal HLO: {result.hlo}\nlog: {result.log}\nreproduce: {result.command}\nwork folder: {result.work}", highlight=False, markup=False)


@app.command(short_help="Show a bundle's manifest, or one entry's artifacts.")
def inspect(
    bundle: Path = typer.Argument(..., help="Bundle folder."),
    entry: Optional[str] = typer.Option(None, "--entry", help="Show this entry's artifacts only."),
    bucket: Optional[int] = typer.Option(None, "--bucket", help="With --entry: the artifact of this bucket only."),
    context: Optional[int] = CONTEXT,
    as_json: bool = typer.Option(False, "--json", help="Print manifest.json."),
    plugin: list[str] = PLUGIN,
):
    """Show a bundle's manifest (or, with --entry, --bucket and --context, one entry's artifacts)."""
    from .format import as_dict, read_manifest
    from .parallel import flag
    from .plugins import load_plugins

    try:
        load_plugins(plugin)  # a bundle of a plugin's backend is read with that backend's record
        m = read_manifest(bundle)
        shown = m.select(entry, bucket, context)
    except AotcError as e:
        _fail(e)
    if as_json:
        print(json.dumps(as_dict(m), indent=2))
        return
    s = m.shapes
    console.print(
        f"[bold]{bundle}[/]  format {m.format_version}  {m.model.model_class} ({m.model.architecture})  "
        f"backend {m.backend.name} {m.backend.version}\n"
        f"batch buckets {s.batch}  prefill chunks {s.chunk}  max_seq {s.max_seq}  context buckets {s.context}  "
        f"cache slots {s.cache_slots} (last is scratch)  graphs {m.graphs_traced}\n"
        f"kv cache {m.model.kv_cache.dtype}{f' (max {m.model.kv_cache.fp8_max:g})' if m.model.kv_cache.dtype == 'fp8' else ''}  "
        + (f"{flag(m.parallel).lstrip('-').replace('-', ' ')} (collectives {m.parallel.collectives}; shapes per rank)  " if m.parallel.world_size > 1 else "")
        + f"digest {m.digest()}"
    )
    table = Table()
    for col in ("entry", "modules", "bucket", "context", "form", "inputs w/c/a", "outputs", "compile s", "cache key"):
        table.add_column(col, no_wrap=col == "entry")
    for e, art in shown:
        kinds = [i.kind for i in art.inputs]
        inputs = f"{len(e.weights)}/{kinds.count('cache')}/{kinds.count('activation')}"
        outs = " ".join("x".join(map(str, o.shape)) for o in art.outputs)
        table.add_row(
            e.id, str(len(e.instances)), str(art.bucket), "" if art.context is None else str(art.context), art.form, inputs, outs, f"{art.compile_s:.2f}", art.cache_key[:8]
        )
    console.print(table)


def _print_lint(backend: str, findings: list[str], more: str, limit: int = 10) -> list[str]:
    """A backend's lint findings (Backend.findings) as warnings, each once, the first `limit` of them."""
    lint = sorted(set(findings))
    for finding in lint[:limit]:
        console.print(f"[yellow]{backend} lint:[/] {escape(finding)}", highlight=False)
    if len(lint) > limit:
        console.print(f"[yellow]{backend} lint:[/] {len(lint) - limit} more ({more} lists them)", highlight=False)
    return lint


def _tokenizer(model_dir: Path):
    from .models.config import model_file
    from .runtime.session import read_tokenizer

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


def _print_algorithms(algorithms: list[dict], what: str) -> None:
    for a in algorithms:
        console.print(f"{what} two algorithms in {a['cls']} ({a['modules']} modules): eager {a['eager']}; compiled {a['compiled']}", highlight=False, markup=False)


def _size(n: int) -> str:
    from .cache import format_size

    return format_size(n)


def _name_value_types(*typers: typer.Typer) -> None:
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


_name_value_types(app, init_app, cache_app)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
