"""What a build is asked to do: `BuildOptions`, and the parsers of its CLI values."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..backends import Backend
from ..backends.base import parallel_jobs
from ..backends.registry import backend_names, get_backend_class
from ..errors import AotcError
from ..format import DEFAULT_ARTIFACTS, HubRecord, KvCacheRecord
from ..kvcache import kv_cache_record
from ..models.loader import MODELING, modeling_of
from ..parallel import flag, record

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)
# A chat turn runs in one call of 16 or 48 rows, and four of them (152 tokens, packed) or a
# long prompt's chunks in calls of 160: a call costs about 35 rows' work whatever its rows
# (it reads every weight), so fewer, fuller calls win. bench/chunk_buckets.py, interleaved,
# 2026-12-06, against 16,64,128 (the same 15 prefill graphs): one 38-token prompt 0.81x
# to 0.97x, four 0.72x to 0.81x, a 500-token prompt 0.90x to 1.10x (noise), fp32 and bf16.
DEFAULT_CHUNK_BUCKETS = (16, 48, 160)
# A new prompt's first chunk (the prefill's fresh form: one graph per bucket, no context
# buckets) pads to the next of these, not to the next chunk bucket: a GEMM's time grows with
# its rows, padding included (SmolLM2-135M fp32: one 38-token chat turn at 40 rows, not 48,
# bench/fresh_prefill.py). Steps of 8 up to 48, then of 32.
DEFAULT_FIRST_CHUNK_BUCKETS = (16, 24, 32, 40, 48, 64, 96, 128, 160)
DEFAULT_MAX_SEQ = 1024
KV_CACHE_DTYPES = ("auto", "fp8", "fp8-values")


def parse_buckets(text: str, option: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); errors name the option."""
    parts = str(text).replace(" ", "").split(",")
    if "" in parts and parts != [""]:  # "32," or "1,,2": a bucket left out, or a comma too many
        raise AotcError(f"{option} {text!r}: an empty bucket between commas; expected comma-separated positive integers, e.g. 1,2,4,8")
    try:
        values = [int(v) for v in parts if v]
    except ValueError:
        raise AotcError(f"{option} {text!r}: expected comma-separated positive integers, e.g. 1,2,4,8") from None
    if not values or any(v <= 0 for v in values):
        raise AotcError(f"{option} {text!r}: expected comma-separated positive integers, e.g. 1,2,4,8")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise AotcError(f"{option} {text!r}: {', '.join(map(str, repeated))} given more than once; list each bucket once")
    return tuple(sorted(values))


def parse_shard(text: str) -> tuple[int, int]:
    """'2/4' -> (2, 4): the second of four shards."""
    try:
        i, n = (int(v) for v in str(text).split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise AotcError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. 1/2")
    return i, n


def parse_flags(items: list[str], option: str) -> dict:
    """['cpp.simdlen=256', 'x=true'] -> {'cpp.simdlen': 256, 'x': True}; values are JSON where they parse."""
    flags = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise AotcError(f"{option} {item!r}: expected KEY=VALUE")
        try:
            flags[key] = json.loads(value)
        except json.JSONDecodeError:
            flags[key] = value
    return flags


def default_backend() -> tuple[str, str | None]:
    """inductor where it can compile here, else export with the reason."""
    why = get_backend_class("inductor")().can_compile()
    return ("export", why) if why else ("inductor", None)


@dataclass
class BuildOptions:
    model_dir: Path
    out: Path | None = None
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    # Prefill chunk lengths. Default: DEFAULT_CHUNK_BUCKETS, each at most max_seq; set by plan.
    chunk_buckets: tuple[int, ...] | None = None
    # A prompt's first chunk from position 0 (fresh forms), with every chunk bucket. Default:
    # DEFAULT_FIRST_CHUNK_BUCKETS up to the largest chunk with the default chunks, else the
    # chunk buckets; set by plan.
    first_chunk_buckets: tuple[int, ...] | None = None
    first_chunk_given: tuple[int, ...] | None = field(default=None, init=False, repr=False)  # --first-chunk as given (resolve_chunks)
    max_seq: int | None = None  # default: min(max_position_embeddings, DEFAULT_MAX_SEQ), set by plan
    # Decode graphs per context bucket (the cache positions they read); max_seq always
    # joins. Default: powers of 4 from 256 below max_seq, then max_seq; set by plan.
    context_buckets: tuple[int, ...] | None = None
    backend: str | None = None  # default: inductor where a C++ compiler is present, else export
    device: str = "cpu"
    compiler_flags: dict = field(default_factory=dict)  # backend options (inductor: inductor configs)
    jobs: int | None = None  # default: from cores and free memory (inductor), 1 (export)
    cache_dir: Path | None = None  # default: $AOTC_CACHE_DIR or ~/.cache/aotc
    use_cache: bool = True
    require_cache: bool = False  # fail on any miss instead of compiling
    remote_cache: str | None = None  # s3://bucket/prefix
    shard: tuple[int, int] | None = None  # (i, n): compile the i-th of n shares into the cache, no bundle
    plugins: tuple[str, ...] = ()  # modules that register architectures (--plugin)
    hub: HubRecord | None = None  # the Hub id model_dir was resolved from (aotc.models.hub)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8: packed fp8 caches (aotc.kvcache)
    # Whose code runs the model (models.loader.resolve): auto, aotc's own, or transformers'.
    modeling: str = "auto"
    # Ranks the graphs are split across (aotc.parallel): one SPMD graph per artifact for all.
    tensor_parallel: int = 1
    # Ranks the routed experts are split across, attention whole on every rank (DeepSeek V4).
    expert_parallel: int = 1
    # Each rank its own sequences and cache slots, the MoE layers gathering every rank's rows
    # (with expert_parallel; DeepSeek V4).
    data_parallel_attention: bool = False
    # Replace what the default -o holds even when it is a bundle of another model or backend.
    force: bool = False
    backend_note: str | None = field(default=None, init=False)  # why the default backend is not inductor

    def __post_init__(self):
        self.model_dir = Path(self.model_dir)
        defaulted = self.out is None
        if defaulted:  # a Hub snapshot folder is named by its commit: use the model's name
            self.out = DEFAULT_ARTIFACTS / (self.hub.repo_id.split("/")[1] if self.hub else self.model_dir.resolve().name)
        self.out = Path(self.out)
        if self.max_seq is not None and self.max_seq <= 0:
            raise AotcError(f"--max-seq {self.max_seq}: expected a positive integer")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise AotcError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
        if self.modeling not in MODELING:
            raise AotcError(f"--modeling {self.modeling!r}: expected one of {', '.join(MODELING)}")
        for name, degree in (("--tensor-parallel", self.tensor_parallel), ("--expert-parallel", self.expert_parallel)):
            if degree < 1:
                raise AotcError(f"{name} {degree}: expected a positive integer (1: one device)")
        if self.tensor_parallel > 1 and self.expert_parallel > 1:
            raise AotcError(
                f"--tensor-parallel {self.tensor_parallel} --expert-parallel {self.expert_parallel}: aotc builds one of them at a time; "
                "give --expert-parallel N alone (experts split, attention on every rank), or --tensor-parallel N alone"
            )
        if self.data_parallel_attention and self.expert_parallel < 2:
            raise AotcError(
                f"--data-parallel-attention with --expert-parallel {self.expert_parallel}: data-parallel attention splits the "
                "sequences across the ranks that split the experts; give --expert-parallel N (N >= 2) with it"
            )
        check_jobs(self.jobs)
        model, out = self.model_dir.resolve(), self.out.resolve()
        if out == model or out.is_relative_to(model) or model.is_relative_to(out):
            raise AotcError(
                f"-o {self.out}: the bundle folder would replace the model folder {self.model_dir} or a folder "
                "inside or around it; write the bundle elsewhere (default: artifacts/<model name>)"
            )
        if self.use_cache and self.cache_dir is not None:
            cache = Path(self.cache_dir).resolve()
            if cache == model or cache.is_relative_to(model) or model.is_relative_to(cache):
                raise AotcError(
                    f"--cache-dir {self.cache_dir}: the compile cache would write into the model folder {self.model_dir} "
                    "or a folder around it; aotc writes nothing there. Pass a folder outside it (default: ~/.cache/aotc)"
                )
        if not self.use_cache and (self.require_cache or self.remote_cache or self.shard):
            raise AotcError("--no-cache cannot be combined with --require-cache, --remote-cache or --shard")
        if self.backend is None:  # resolved here, once
            self.backend, why = default_backend()
            if why:
                self.backend_note = f"using the export backend: inductor is unavailable: {why}"
        if defaulted and not self.force:
            self._check_default_out()
        if self.layout.world_size > 1 and not get_backend_class(self.backend).collectives_in_graph:
            able = [n for n in backend_names() if get_backend_class(n).collectives_in_graph]
            raise AotcError(
                f"{flag(self.layout)} --backend {self.backend}: parallel bundles are built on the "
                f"{', '.join(able[:-1])} and {able[-1]} backends; this backend does not say its graphs can hold collectives (Backend.collectives_in_graph)"
            )

    @property
    def layout(self):
        """How the graphs split across ranks (format.ParallelRecord)."""
        gather = get_backend_class(self.backend).gathers_with if self.data_parallel_attention else "collectives"
        return record(self.tensor_parallel, self.expert_parallel, self.data_parallel_attention, gather)

    @classmethod
    def of_manifest(cls, manifest, model_dir: Path) -> "BuildOptions":
        """The options a bundle was built with, as far as they make its graphs (its shapes,
        context buckets, KV cache dtype, backend and device, plugins): what re-tracing
        one of its graphs takes. Nothing is compiled or written with them."""
        shapes = manifest.shapes
        return cls(
            Path(model_dir), batch_buckets=tuple(shapes.batch),
            chunk_buckets=tuple(shapes.chunk), first_chunk_buckets=tuple(shapes.first), max_seq=shapes.max_seq, context_buckets=tuple(shapes.context),
            backend=manifest.backend.name, device=manifest.backend.flags.get("device", "cpu"), plugins=tuple(manifest.plugins),
            kv_cache_dtype=manifest.model.kv_cache.dtype, use_cache=False, modeling=modeling_of(manifest.model.architecture),
            tensor_parallel=manifest.parallel.tensor_parallel, expert_parallel=manifest.parallel.expert_parallel,
            data_parallel_attention=manifest.parallel.attention == "data-parallel", force=True,  # nothing is written: no -o to check
        )  # fmt: skip

    def resolve_chunks(self) -> None:
        """Fill in chunk_buckets from max_seq (set first): the defaults, each cut to
        max_seq (a chunk's tokens all go into the cache), or the given ones checked; then
        first_chunk_buckets: with every chunk bucket, none above the largest."""
        ladder = DEFAULT_FIRST_CHUNK_BUCKETS if self.chunk_buckets is None else ()
        if self.chunk_buckets is None:
            self.chunk_buckets = tuple(sorted({min(c, self.max_seq) for c in DEFAULT_CHUNK_BUCKETS}))
        long = [c for c in self.chunk_buckets if c > self.max_seq]
        if long:
            raise AotcError(
                f"--prefill-chunk {','.join(map(str, self.chunk_buckets))}: {long[0]} is more than --max-seq {self.max_seq}; "
                "a chunk's tokens all go into the cache, so a chunk is at most max_seq tokens"
            )
        largest = self.chunk_buckets[-1]
        given = self.first_chunk_buckets
        above = [c for c in given or () if c > largest]
        if above:
            raise AotcError(
                f"--first-chunk {','.join(map(str, given))}: {above[0]} is more than the largest --prefill-chunk bucket, {largest}; "
                "a longer prompt runs whole largest chunks first. Give first-chunk buckets up to it, or a larger --prefill-chunk"
            )
        self.first_chunk_given = given
        finer = [c for c in ladder if c <= largest] if given is None else given
        self.first_chunk_buckets = tuple(sorted({*finer, *self.chunk_buckets}))

    def resolve_contexts(self) -> None:
        """Fill in context_buckets from max_seq (set first): the default, or the given ones
        checked, with max_seq added last."""
        given = self.context_buckets
        if given is None:
            given = tuple(c for c in (256 * 4**k for k in range(32)) if c < self.max_seq)
        above = [c for c in given if c > self.max_seq]
        if above:
            raise AotcError(
                f"--context-buckets {','.join(map(str, given))}: {above[0]} is more than --max-seq {self.max_seq}; a context bucket is a number of cache positions, at most max_seq"
            )
        self.context_buckets = tuple(sorted({*given, self.max_seq}))

    def buckets(self, kind: str) -> tuple[int, ...]:
        return {"batch": self.batch_buckets, "chunk": self.chunk_buckets, "first": self.first_chunk_buckets}[kind]

    def kv_cache(self, backend: Backend) -> KvCacheRecord:
        """The caches' dtype, and the fp8 maximum of the backend's target."""
        return kv_cache_record(self.kv_cache_dtype, backend.fp8_reading())

    def make_backend(self) -> Backend:
        """The backend, ready to compile on this machine (an error says what is missing)."""
        backend = get_backend_class(self.backend).from_options(self.device, self.compiler_flags)
        why = backend.can_compile()
        if why:
            raise AotcError(f"backend {self.backend!r} cannot compile here: {why}")
        return backend

    def _check_default_out(self) -> None:
        """The default -o is named after the model's folder or Hub name alone, which two models
        (models/tiny and me/tiny) or two backends of one model share: it replaces only a
        bundle of this model and backend without --force."""
        from ..format import read_manifest

        try:
            held = read_manifest(self.out)
        except (AotcError, OSError):  # nothing there, or not a readable bundle: check_replaceable decides
            return
        # A model is its Hub id where it came from the Hub (a snapshot's folder is per commit), else its folder.
        mine, theirs = self.hub.repo_id if self.hub else str(self.model_dir.resolve()), held.model.hub.repo_id if held.model.hub else held.model.source
        if (mine, self.backend) == (theirs, held.backend.name):
            return
        raise AotcError(
            f"-o {self.out} (the default, from the model's name) holds a bundle of {theirs} on {held.backend.name}; this build "
            f"is of {mine} on {self.backend}. Pass -o to write it elsewhere, or --force to replace that bundle"
        )


def check_jobs(jobs: int | None) -> None:
    """--jobs: a positive count, at most this machine's CPUs (each compile process keeps one
    busy, and takes gigabytes)."""
    import os

    cpus = os.cpu_count() or 1
    if jobs is not None and not 0 < jobs <= cpus:
        raise AotcError(f"--jobs {jobs}: expected 1 to {cpus}, this machine's CPUs (default: from cores and free memory)")


def default_jobs(tasks: int, backend: Backend) -> int:
    """Parallel compile processes: bounded by cores, by each compile's memory, and by the
    CPUs other processes leave free. A CPU that another process keeps busy would be shared,
    and each compile process costs a start-up of its own (torch's import, seconds of CPU)."""
    import os

    from ..runtime.threads import running_elsewhere

    if backend.compile_memory_gb is None or tasks <= 1:
        return 1  # a compile is a file write: processes would cost more than they save
    free_cpus = (os.cpu_count() or 1) - (running_elsewhere() or 0)
    return max(1, min(parallel_jobs(tasks, backend.compile_memory_gb), free_cpus))
