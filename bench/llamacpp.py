"""llama.cpp beside aotc: what the `peers` section of bench/perf.py (sections/peers.py) builds and runs.

    python bench/perf.py --sections peers [--peers-cache DIR]

llama.cpp is what a user on a CPU would pick instead. This builds it once, from
the source distribution of llama-cpp-python on PyPI (its vendored llama.cpp,
GGML_NATIVE=ON, as a user installing it from source gets; on a CPU with AMX, its
other extensions without AMX, whose Q8_0 path segfaults there), into a cache folder
keyed by the version and this CPU's instruction set. The bench's model folder is
converted to GGUF F32, F16, BF16 and Q8_0 by llama.cpp's own convert_hf_to_gguf.py,
and each is timed at batch 1: the same prompt ids, the same thread count, greedy
decoding, decode tokens per second. At F32 the greedy tokens are compared with
aotc's.

Where cmake or a C++ compiler is missing, the section is skipped with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from filelock import FileLock

LLAMA_CPP_PYTHON = "0.3.36"
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
FORMATS = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}  # convert_hf_to_gguf.py --outtype
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aotc" / "bench-peers"


class Skipped(Exception):
    """The peer cannot be built here; the message says why."""


def missing_tools() -> str | None:
    for tool, what in (("cmake", "cmake"), ("c++", "a C++ compiler (c++)"), ("cc", "a C compiler (cc)")):
        if shutil.which(tool) is None:
            return f"{what} is not on PATH; llama.cpp is built from source"
    return None


# llama.cpp's AMX matrix multiply (the Q8_0 and Q4 paths on a CPU with AMX) segfaults
# on this VM's Xeon (ggml_backend_amx_mul_mat; ggml-org/llama.cpp#20824, open), and a
# native build compiles it in wherever the CPU has AMX. There it is built for the CPU's
# own x86 extensions, named one by one, without AMX: what a user does after the crash.
GGML_FLAGS = {
    "avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2", "avxvnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512vnni": "GGML_AVX512_VNNI", "avx512bf16": "GGML_AVX512_BF16",
}  # fmt: skip


def cmake_args() -> str:
    """GGML_NATIVE=ON, or on a CPU with AMX its other extensions (GGML_FLAGS) without AMX."""
    from aotc.backends.inductor import host_isa

    common = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
    isa = host_isa()
    if "amxint8" not in isa:
        return f"-DGGML_NATIVE=ON {common}"
    return " ".join(["-DGGML_NATIVE=OFF", *(f"-D{option}=ON" for flag, option in GGML_FLAGS.items() if flag in isa), common])


def build_dir(cache: Path) -> Path:
    """Where this version, built for this CPU (cmake_args), lives in the cache."""
    from aotc.backends.inductor import host_isa

    isa = hashlib.sha256(" ".join(sorted(host_isa())).encode()).hexdigest()[:12]
    native = "" if "amxint8" not in host_isa() else "-no-amx"
    return cache / f"llama-cpp-python-{LLAMA_CPP_PYTHON}-{platform.machine()}-{isa}{native}"


def _run(command: list[str], log: Path, **env: str) -> None:
    with open(log, "a") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    if result.returncode != 0:
        raise Skipped(f"`{' '.join(command[:6])} ...` failed (exit {result.returncode}); see {log}")


_PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


def _fetch_source(tmp: Path, log: Path) -> Path:
    """llama-cpp-python's source distribution, unpacked under tmp/src: its folder."""
    _run([*_PIP, "download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(tmp / "sdist")], log)
    (archive,) = (tmp / "sdist").glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp / "src", filter="data")
    (src,) = (tmp / "src").iterdir()
    return src


def _keep_converter(src: Path, tmp: Path, log: Path) -> None:
    """llama.cpp's converter (with the package it imports, and gguf-py) into tmp/converter,
    and its Python requirements into tmp/convert: it reads the config and tokenizer
    through transformers."""
    _run([*_PIP, "install", "--target", str(tmp / "convert"), "transformers", "sentencepiece"], log)
    (tmp / "converter").mkdir()
    for part in CONVERTER:
        shutil.move(src / "vendor" / "llama.cpp" / part, tmp / "converter" / part)


def _build_once(done: Path, finished: Path, what: str, steps, say) -> Path:
    """Runs steps(tmp, log) once into a temporary folder beside `done`, then renames it, under
    a lock, so that an interrupted build leaves nothing that looks finished (`finished`,
    a path inside `done`, is what marks it so)."""
    if finished.exists():
        return done
    reason = missing_tools()
    if reason:
        raise Skipped(reason)
    done.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(done) + ".lock"):
        if finished.exists():
            return done
        tmp = Path(tempfile.mkdtemp(prefix=done.name + ".tmp-", dir=done.parent))
        log = done.parent / f"{done.name}.build.log"  # kept beside the build, failed or not
        log.unlink(missing_ok=True)
        say(f"building {what} from llama-cpp-python {LLAMA_CPP_PYTHON}'s source distribution (once, minutes; log: {log})")
        try:
            steps(tmp, log)
            for scratch in ("src", "sdist", "cmake"):
                shutil.rmtree(tmp / scratch, ignore_errors=True)
            os.replace(tmp, done)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return done


def ensure_llama_cpp(cache: Path, say=print) -> Path:
    """The built llama.cpp: `py/` holds the llama_cpp package with its shared
    libraries, `converter/` llama.cpp's convert_hf_to_gguf.py (with its
    `conversion` package and gguf-py), `convert/` the converter's Python
    requirements."""

    def steps(tmp: Path, log: Path) -> None:
        src = _fetch_source(tmp, log)
        _run([*_PIP, "install", "--target", str(tmp / "py"), str(src)], log, CMAKE_ARGS=cmake_args(), CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
        _keep_converter(src, tmp, log)

    done = build_dir(cache)
    return _build_once(done, done / "py" / "llama_cpp", "llama.cpp", steps, say)


# llama-server alone, linked statically; its web UI neither built (npm) nor downloaded
# (a prebuilt one from Hugging Face, which CI cannot reach): it embeds an empty one.
SERVER_CMAKE = (
    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release",
)  # fmt: skip


def ensure_llama_server(cache: Path, say=print) -> Path:
    """llama.cpp's own OpenAI-compatible server, the cmake target `llama-server` of the same
    vendored source as ensure_llama_cpp's, with the same CPU flags (cmake_args): `bin/llama-server`,
    and the converter as ensure_llama_cpp keeps it (`converter/`, `convert/`)."""

    def steps(tmp: Path, log: Path) -> None:
        src = _fetch_source(tmp, log)
        build = tmp / "cmake"
        _run(["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(build), *cmake_args().split(), *SERVER_CMAKE], log)
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)], log)
        (tmp / "bin").mkdir()
        shutil.copy2(build / "bin" / "llama-server", tmp / "bin" / "llama-server")
        _keep_converter(src, tmp, log)

    done = build_dir(cache).with_name(build_dir(cache).name + "-server")
    return _build_once(done, done / "bin" / "llama-server", "llama-server", steps, say)


# Run in a subprocess: convert_hf_to_gguf.py picks the BPE pre-tokenizer by hashing how
# the tokenizer splits a test string, and does not know the bench's toy tokenizer. Its
# pre-tokenizer is byte-level with GPT-2's split, so it is declared as "gpt-2". Decoding
# below is fed token ids, so the tokenizer does not affect the timing or the tokens.
_CONVERT = """
import runpy, sys
converter, model, outtype, out = sys.argv[1:]
sys.path[:0] = [converter, converter + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", outtype, "--outfile", out]
runpy.run_path(converter + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(built: Path, model_dir: Path, fmt: str, out_dir: Path) -> Path:
    out = out_dir / f"{model_dir.name}-{fmt}.gguf"
    if not out.is_file():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(built / "convert"), os.environ.get("PYTHONPATH", "")])}
        log = out_dir / f"convert-{fmt}.log"
        with open(log, "w") as f:
            result = subprocess.run(
                [sys.executable, "-c", _CONVERT, str(built / "converter"), str(model_dir), FORMATS[fmt], str(out) + ".tmp"],
                stdout=f, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        if result.returncode != 0:
            raise Skipped(f"convert_hf_to_gguf.py --outtype {FORMATS[fmt]} failed (exit {result.returncode}); see {log}")
        os.replace(str(out) + ".tmp", out)
    return out


# Greedy decoding through llama-cpp-python's low-level eval, in a subprocess that
# imports the built package: the prompt in one batch, then one token a step.
_DECODE = """
import json, sys, time
import numpy as np
import llama_cpp
gguf, prompt, new, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(prompt) + new, n_batch=len(prompt), n_threads=threads, n_threads_batch=threads, verbose=False)
def next_token():  # the last evaluated token's logits, as llama.cpp returns them
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))))
llm.eval(prompt)
tokens = [next_token()]
t0 = time.perf_counter()
for _ in range(new - 1):
    llm.eval(tokens[-1:])
    tokens.append(next_token())
print(json.dumps({"tokens": tokens, "decode_s": time.perf_counter() - t0}))
"""


def decode(built: Path, gguf: Path, prompt: list[int], new_tokens: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(built / "py"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", _DECODE, str(gguf), json.dumps(prompt), str(new_tokens), str(threads)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if result.returncode != 0:
        raise Skipped(f"llama.cpp decode of {gguf.name} failed: {result.stderr.strip().splitlines()[-1:]}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    out["tokens_per_s"] = (new_tokens - 1) / out["decode_s"]
    return out


# Teacher-forced logits over a passage: every position's, as llama-cpp-python keeps them
# with logits_all (its `scores`), the passage in one batch.
_LOGITS = """
import sys, json
import numpy as np
import llama_cpp
gguf, ids, threads, out = sys.argv[1], json.loads(open(sys.argv[2]).read()), int(sys.argv[3]), sys.argv[4]
llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(ids), n_batch=len(ids), n_ubatch=len(ids), n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
llm.eval(ids)
np.save(out, np.asarray(llm.scores[: len(ids)], dtype=np.float32))
"""


def passage_logits(built: Path, gguf: Path, ids: list[int], threads: int, work: Path):
    """llama.cpp's logits at every position of `ids` ([len(ids), vocab], float32 numpy)."""
    import numpy as np

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(built / "py"), os.environ.get("PYTHONPATH", "")])}
    (work / "passage.json").write_text(json.dumps(ids))
    out = work / f"{gguf.stem}-logits.npy"
    result = subprocess.run([sys.executable, "-c", _LOGITS, str(gguf), str(work / "passage.json"), str(threads), str(out)], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise Skipped(f"llama.cpp logits of {gguf.name} failed: {result.stderr.strip().splitlines()[-1:]}")
    return np.load(out)


def bytes_per_step(gguf_file: Path) -> int:
    """The bytes of weights one decode step reads, from the GGUF's own tensor table: all
    of them but the embedding table, which a step reads a row of, unless the model has no
    `output.weight` and the table is its head too (tied embeddings)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(gguf_file).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def agreement(a: list[int], b: list[int]) -> int:
    """How many greedy tokens agree before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
