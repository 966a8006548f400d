"""The benchmark harness: models, bundles, timing, the roofline's two figures, tables.

Each section of bench/perf.py is a module of bench/sections that registers one
function with @section: it takes a Run (a scratch folder, --quick, the models
made on first use) and returns its results, a JSON-able dict. A section needs no
other to have run; the harness writes each one's results under its name.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from aotc.builder import BuildOptions, build
from aotc.format import read_manifest
from aotc.models.tiny import write_tiny

HERE = Path(__file__).resolve().parent
console = Console()

BUCKETS = (1, 2, 4, 8)
MAX_SEQ = 256
POSITION = 128  # decode steps are timed at this context position
# ~100M parameters, fp32: 8 layers of hidden 1024, GQA 16/4, vocab 8192
POSITIONS = dict(max_position_embeddings=8192)
M100 = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=8192)
# The CPU flags that decide how fast each number format runs (bf16 and int8 dot products).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


@dataclass
class Run:
    """What a section gets: a scratch folder for this run, --quick, the models, each
    written on first use (tiny: the embedded default; 100m: ~100M parameters, not made
    under --quick, where the sections that time it take the tiny one), the aotc backend
    the sections build with (--backend), and torch.compile's backend for the baselines
    (tests set "eager", which traces with dynamo and compiles nothing). Every row says
    what ran: "aotc BACKEND" from the bundle's manifest, "torch.compile (BACKEND)" where
    that is not inductor."""

    root: Path
    quick: bool = False
    peers_cache: Path | None = None
    backend: str = "inductor"
    torch_compile_backend: str = "inductor"
    # What --quick's timings are scaled by. The tests take less (0.1): they check what the
    # rows' labels claim (dtypes, shapes, bytes, ratios of two columns), not a speed.
    quick_scale: float = 1.0
    _models: dict[str, Path] = field(default_factory=dict)

    @property
    def aotc(self) -> str:
        """The label of the rows and columns of aotc's backend."""
        return f"aotc {self.backend}"

    @property
    def baseline(self) -> str:
        """The label of torch.compile's rows and columns."""
        return "torch.compile" if self.torch_compile_backend == "inductor" else f"torch.compile ({self.torch_compile_backend})"

    def compile(self, fn, **kw):
        """torch.compile with this run's backend."""
        return torch.compile(fn, backend=self.torch_compile_backend, **kw)

    @property
    def main(self) -> str:
        """The model a single-model section measures."""
        return "tiny" if self.quick else "100m"

    @property
    def names(self) -> tuple[str, ...]:
        return ("tiny",) if self.quick else ("tiny", "100m")

    def model(self, name: str) -> Path:
        if name not in self._models:
            # The tokenizer has 512 tokens; the 100m model's other vocab rows are unused ids, as in real models.
            # Positions as SmolLM2's (8192): the context section builds a max_seq-4096 bundle, and
            # a bundle's max_seq is at most the model's max_position_embeddings.
            shape = {"tiny": POSITIONS, "100m": dict(layers=8, **M100, **POSITIONS)}[name]
            self._models[name] = write_tiny(self.root / "models" / name, **shape)
        return self._models[name]

    def bundle(self, model_dir: Path, where: str = "", *, backend: str | None = None, **kw) -> Path:
        """Build model_dir with `backend` (default the run's) into a folder named after
        both (and `where`), and check that the manifest says that backend built it."""
        backend = backend or self.backend
        out = self.root / "bundles" / where / f"{model_dir.name}-{backend}"
        kw.setdefault("max_seq", MAX_SEQ)
        build(BuildOptions(model_dir, out=out, backend=backend, **kw))
        if read_manifest(out).backend.name != backend:
            raise SystemExit(f"{out}: built by {read_manifest(out).backend.name}, not {backend}")
        return out

    def times(self, full: float, quick: float = 0.3) -> float:
        """A timing's min_time: shorter under --quick."""
        return quick * self.quick_scale if self.quick else full


SECTIONS: dict[str, Callable[[Run], dict]] = {}
OPTIONAL: set[str] = set()  # sections that run only when named (--peers)


def section(name: str, *, optional: bool = False):
    """Register fn(run) -> results as the section `name`."""

    def register(fn):
        SECTIONS[name] = fn
        if optional:
            OPTIONAL.add(name)
        return fn

    return register


def load_sections() -> dict[str, Callable[[Run], dict]]:
    """Import every module of bench/sections (each registers its section)."""
    import importlib

    for path in sorted((HERE / "sections").glob("*.py")):
        if path.stem != "__init__":
            importlib.import_module(f"sections.{path.stem}")
    return dict(sorted(SECTIONS.items()))


def machine() -> dict:
    """What ran the figures: cores, torch, the ISA torch dispatches to, and the CPU flags
    that decide which number formats have arithmetic of their own."""
    flags: set[str] = set()
    if Path("/proc/cpuinfo").is_file():
        line = next((x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")), "")
        flags = set(line.split(":", 1)[-1].split())
    return {
        "cpus": os.cpu_count(), "torch": str(torch.__version__), "threads": torch.get_num_threads(),
        "cpu": torch.backends.cpu.get_cpu_capability(), "cpu_flags": {f: f in flags for f in ISA_FLAGS},
    }  # fmt: skip


def timeit(fn, *, min_time=0.5, repeats=5, best=False) -> float:
    """Median (or best) seconds per call over `repeats` runs of about min_time/repeats each."""
    fn()
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    n = max(1, int(min_time / repeats / once))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return min(samples) if best else statistics.median(samples)


def transformers_model(folder: Path, config: str, model: str, **fields) -> Path:
    """A random model that transformers makes (its `config` and `model` classes, seed 0),
    saved into `folder` once, as transformers saves it."""
    import transformers

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        made = getattr(transformers, model)(getattr(transformers, config)(initializer_range=0.05, **fields))
        made.eval().save_pretrained(folder)
    return folder


def transformers_decode_step(hf, prompts: torch.Tensor, ids: torch.Tensor):
    """transformers' own decode step, as its users run it: the model with its DynamicCache,
    prefilled with `prompts` [B, P]; each call decodes `ids` [B] at position P (the step's
    token is dropped from the cache after it) and returns float logits [B, V]."""
    import transformers

    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(input_ids=prompts, cache=cache, use_cache=True)

    @torch.no_grad()
    def step():
        out = hf(input_ids=ids[:, None], cache=cache, use_cache=True)
        cache.crop(-1)
        return out.logits[:, -1].float()

    return step


def copy_bandwidth(nbytes: int = 1 << 30, min_time: float = 3.0) -> float:
    """Copy bandwidth, as issue 19 defines it: bytes read per second by a streaming
    reduction (a sum) over a buffer of 1 GiB (default), far larger than any cache; best of 10."""
    buf = torch.ones(nbytes // 4)
    return nbytes / timeit(lambda: buf.sum(), min_time=min_time, repeats=10, best=True)


def gemm_peak(n: int = 2048, min_time: float = 2.0, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a large matmul (n x n x n) in `dtype`, best of 5: the compute side of the roofline."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / timeit(lambda: a @ b, min_time=min_time, repeats=5, best=True)


def write_results(out: Path, results: dict) -> None:
    """A standalone bench's results as JSON at `out` (written whole or not at all), with the
    torch version and thread count they ran with; says where."""
    from aotc.format import encode, write_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, encode({"torch": str(torch.__version__), "threads": torch.get_num_threads(), **results}))
    console.print(f"wrote {out}")


def print_misses(misses: list[str]) -> None:
    for miss in misses:
        console.print(f"  target missed: {miss}", highlight=False)


def table(title: str, rows: list[dict]) -> None:
    t = Table(title=title)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    for c in cols:
        t.add_column(c, justify="left" if c in ("model", "what") else "right")
    for r in rows:
        t.add_row(*[_fmt(r.get(c, "")) for c in cols])
    console.print(t)


def _fmt(v) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    if isinstance(v, float):
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return str(v)
