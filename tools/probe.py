"""The trust and nothing-lost probe: hostile and careless inputs, each run as a process of
its own against an aotc source tree, and the outcomes counted per class.

    python tools/probe.py [--tree DIR] [--only NAME ...] [--classes CLASS ...] [--json FILE]

--tree: the aotc source tree the cases run (as PYTHONPATH; default: this one). A
worktree of an older commit gives that commit's counts, with the same cases. Each
case builds from that tree what it needs (a tiny model, bundles, a cache), changes
one thing, runs one aotc command in a new process, and is judged by what the
process did and what is left on disk:

    refused    exit 2, naming the culprit (the words the case expects)
    handled    what the README documents happened (a reported miss, a right answer)
    traceback  an uncaught exception, a signal (segfault, abort) or a crash
    silent     accepted anyway, or a wrong result with exit 0
    hang       still running at the case's time limit
    lost       a file aotc did not make deleted or written, or a process left running

The first three are said as the issue "Trust and nothing lost, round two" counts them;
the rest as "Bad inputs, round two" (issue 45) counts them: resources (full and
read-only disks, threads, a huge layer count), the eager path, chat templates, model
folders and Hub ids.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
GOOD = ("refused", "handled")
SLOW_CXX = '#!/bin/sh\ncase " $* " in *" -o "*) sleep 30 ;; esac\nexec g++ "$@"\n'
BUILD = ["--buckets", "1,2", "--prefill-chunk", "16", "--max-seq", "64"]


@dataclass
class Result:
    rc: int | None  # None: timed out
    out: str


@dataclass
class Case:
    cls: str  # "trust" or "nothing lost"
    name: str
    run: Callable[["Probe", Path], str]  # the outcome


class Probe:
    def __init__(self, tree: Path, work: Path):
        self.tree, self.work = tree, work
        self.env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "300", "HF_HUB_OFFLINE": "1"}
        self._built: dict[str, Path] = {}

    def aotc(self, *args, timeout: float = 300, env: dict | None = None) -> Result:
        return self.python("from aotc.cli import app; app()", *args, timeout=timeout, env=env)

    def python(self, code: str, *args, timeout: float = 300, env: dict | None = None) -> Result:
        try:
            r = subprocess.run([sys.executable, "-c", code, *map(str, args)], env={**self.env, **(env or {})}, cwd=self.work,
                               capture_output=True, text=True, timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return Result(None, "")
        return Result(r.returncode, r.stdout + r.stderr)

    # -- what the cases start from, made once by the tree under test --

    def model(self, name: str = "tiny", **overrides) -> Path:
        key = f"model-{name}"
        if key not in self._built:
            out = self.work / key
            fields = ", ".join(f"{k}={v!r}" for k, v in {"layers": 2, **overrides}.items())
            r = self.python(f"from aotc.models.tiny import write_tiny; write_tiny({str(out)!r}, {fields})")
            assert r.rc == 0, r.out
            self._built[key] = out
        return self._built[key]

    def bundle(self, backend: str = "export", *extra: str, model: str = "tiny") -> Path:
        key = f"bundle-{backend}-{model}-{'-'.join(extra)}"
        if key not in self._built:
            out = self.work / key
            m = self.model() if model == "tiny" else self.model(model, rms_norm_eps=0.5)
            r = self.aotc("build", m, "-o", out, "--backend", backend, *BUILD, *extra, "--cache-dir", self.work / f"cache-{key}")
            assert r.rc == 0, r.out
            self._built[key] = out
        return self._built[key]


def judge(r: Result, refused: str | None = None) -> str:
    """The outcome of a process that should refuse (exit 2 naming `refused`)."""
    if r.rc is None:
        return "hang"
    if r.rc < 0 or "Traceback (most recent call last)" in r.out or r.rc not in (0, 1, 2):
        return "traceback"
    if r.rc == 2 and (refused is None or refused.lower() in " ".join(r.out.split()).lower()):
        return "refused"
    return "silent" if r.rc == 0 else f"other (exit {r.rc}: {r.out.strip()[-200:]})"


def edited(p: Probe, ws: Path, edit: Callable[[dict], None], backend: str = "export", *extra: str) -> Path:
    """A copy of a bundle with its manifest edited."""
    b = ws / "b"
    shutil.copytree(p.bundle(backend, *extra), b)
    manifest = json.loads((b / "manifest.json").read_text())
    edit(manifest)
    (b / "manifest.json").write_text(json.dumps(manifest))
    return b


def entry(m: dict, prefix: str) -> dict:
    return next(e for e in m["entries"] if e["id"].startswith(prefix))


def cross(m: dict) -> None:
    for e in m["entries"]:
        paths = [w["path"] for w in e["weights"]]
        if "mlp.gate_proj.weight" in paths:
            i, j = paths.index("mlp.gate_proj.weight"), paths.index("mlp.up_proj.weight")
            e["weights"][i]["path"], e["weights"][j]["path"] = paths[j], paths[i]


def run_refused(p: Probe, b: Path, words: str) -> str:
    return judge(p.aotc("run", b, "--prompt", "hi", "--max-new-tokens", "4"), words)


def manifest_case(name: str, edit: Callable[[dict], None], words: str, *extra: str, backend: str = "export") -> Case:
    return Case("trust", name, lambda p, ws: run_refused(p, edited(p, ws, edit, backend, *extra), words))


def _set(path: str, value):
    """An edit that sets manifest field `path` ("shapes.cache_slots", "entries.0.id")."""

    def edit(m):
        *parents, last = path.split(".")
        for part in parents:
            m = m[int(part)] if part.isdigit() else m[part]
        m[int(last) if last.isdigit() else last] = value

    return edit


def _regions(edit: Callable[[list], None]):
    def change(m):
        kind = next(k for k, c in m["caches"].items() if c["regions"])
        edit(m["caches"][kind]["regions"])

    return change


FP8 = ("--kv-cache-dtype", "fp8")

# -- trust: a pinned bundle runs what was checked, every field checked against the others --

RACE = """
import sys, shutil, torch
from pathlib import Path
from aotc.backends.export import ExportBackend
from aotc.runtime import Bundle
from aotc.models.loader import load_model
bundle, other = Path(sys.argv[1]), Path(sys.argv[2])
signature, swapped = ExportBackend.signature, []
def swap_then_sign(self, art_dir):  # the moment after the hash check: a watcher of the folder swaps the file
    if not swapped and Path(art_dir).as_posix().endswith("LMHead.forward/b1"):
        shutil.copyfile(other / "entries/LMHead.forward/b1/program.pt2", bundle / "entries/LMHead.forward/b1/program.pt2")
        swapped.append(1)
    return signature(self, art_dir)
ExportBackend.signature = swap_then_sign
b = Bundle.load(bundle)
loaded = load_model(b.manifest.model.source)
h = torch.randn(1, 256)
want = loaded.model.head(h)
b.bind(loaded.model)
got = loaded.model.head(h)
sys.exit(0 if swapped and torch.allclose(got, want) else 3)
"""


def race(p: Probe, ws: Path) -> str:
    b = ws / "b"
    shutil.copytree(p.bundle(), b)
    r = p.python(RACE, b, p.bundle(model="other"))
    return "handled" if r.rc == 0 else "silent" if r.rc == 3 else judge(r)


def crossed(backend: str) -> Case:
    return manifest_case(f"crossed weights ({backend})", cross, "the artifact takes weight", backend=backend)


def poisoned_recipe(edit: Callable[[dict], None], name: str) -> Case:
    def run(p: Probe, ws: Path) -> str:
        m, cache = p.model(), ws / "cache"
        r = p.aotc("build", m, "-o", ws / "a", "--backend", "export", *BUILD, "--cache-dir", cache)
        assert r.rc == 0, r.out
        (recipe,) = (cache / "builds").glob("*.json")
        manifest = json.loads(recipe.read_text())
        edit(manifest)
        recipe.write_text(json.dumps(manifest))
        r = p.aotc("build", m, "-o", ws / "b", "--backend", "export", *BUILD, "--cache-dir", cache)
        if r.rc != 0:
            return judge(r)
        # The bundle it wrote must be the model's (a bad recipe is a miss, then a normal
        # build): --check compares every token with eager.
        check = p.aotc("run", ws / "b", "--prompt", "hello", "--max-new-tokens", "8", "--check")
        return "handled" if check.rc == 0 else "silent"

    return Case("trust", f"poisoned recipe: {name}", run)


TRUST = [
    Case("trust", "a program swapped right after its hash check", race),
    crossed("export"),
    crossed("inductor"),
    crossed("xla"),
    poisoned_recipe(cross, "crossed weights"),
    poisoned_recipe(_set("shapes.cache_slots", 0), "cache_slots 0"),
    poisoned_recipe(lambda m: entry(m, "LMHead").update(cls="os.system"), "entry cls os.system"),
    manifest_case("cache regions overlap", _regions(lambda rs: rs[1].update(start=rs[0]["start"])), "regions", *FP8),
    manifest_case("a cache region past the row", _regions(lambda rs: rs[-1].update(end=rs[-1]["end"] + 64)), "region", *FP8),
    manifest_case("a cache region of an unknown dtype", _regions(lambda rs: rs[0].update(dtype="float7")), "float7", *FP8),
    manifest_case("a cache shape", lambda m: m["caches"]["k"]["shape"].__setitem__(1, 7), "shape"),
    manifest_case("an output shape", lambda m: entry(m, "LMHead")["artifacts"][0]["outputs"][0]["shape"].__setitem__(0, 9), "shape"),
    manifest_case("an input kind", lambda m: entry(m, "LMHead")["artifacts"][0]["inputs"][0].update(kind="weight"), "inputs"),
    manifest_case("an extra key in dims", lambda m: entry(m, "LMHead")["artifacts"][0]["dims"].update(rows=3), "dims"),
    manifest_case("context buckets unsorted", _set("shapes.context", [64, 32]), "context"),
    manifest_case("context buckets duplicated", _set("shapes.context", [64, 64]), "context"),
    manifest_case("a context bucket above max_seq", _set("shapes.context", [128]), "context"),
    manifest_case("batch buckets unsorted", _set("shapes.batch", [2, 1]), "batch"),
    manifest_case("chunk buckets duplicated", _set("shapes.chunk", [16, 16]), "chunk"),
    manifest_case("cache_slots 0", _set("shapes.cache_slots", 0), "cache_slots"),
    manifest_case("an entry twice", lambda m: m["entries"].append(m["entries"][0]), "names two entries"),
    manifest_case("an entry cls os.system", lambda m: entry(m, "LMHead").update(cls="os.system"), "os.system"),
    manifest_case("an entry id ../../x", lambda m: entry(m, "LMHead").update(id="../../x"), "../../x"),
    manifest_case("fp8_max 0", _set("model.kv_cache.fp8_max", 0.0), "fp8_max", *FP8),
    manifest_case("fp8_max negative", _set("model.kv_cache.fp8_max", -448.0), "fp8_max", *FP8),
    manifest_case("a cache dtype unknown", lambda m: m["caches"]["k"].update(dtype="float7"), "float7"),
    manifest_case("an instance path not a module path", lambda m: entry(m, "LMHead")["instances"].__setitem__(0, "__class__.__init__"), "which the model does not have"),
]

# -- nothing lost: aotc deletes only what it made, writes nothing into a model folder --


def _tree_state(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(f.relative_to(folder)): (f.stat().st_size, f.stat().st_mtime_ns) for f in folder.rglob("*") if f.is_file() or f.is_dir()}


def foreign_folder(ws: Path) -> Path:
    """A folder aotc did not make, shaped like a cache: what prune used to delete."""
    d = ws / "mine"
    (d / "tmp" / "notes").mkdir(parents=True)
    (d / "tmp" / "notes" / "draft.txt").write_text("mine")
    (d / "entries" / "ab" / "abc").mkdir(parents=True)
    (d / "entries" / "ab" / "abc" / "record.json").write_text("{}")
    (d / "photos").mkdir()
    (d / "photos" / "a.jpg").write_bytes(b"\xff\xd8")
    old = time.time() - 7200
    for f in d.rglob("*"):
        os.utime(f, (old, old))
    return d


def prune(p: Probe, ws: Path) -> str:
    d = foreign_folder(ws)
    before = _tree_state(d)
    r = p.aotc("cache", "prune", "--cache-dir", d, "--max-size", "0")
    if _tree_state(d) != before:
        return "lost"
    return judge(r, "not a cache aotc made") if r.rc != 0 else "silent"


def build_into(where: Callable[[Path, Path], Path], words: str) -> Callable:
    def run(p: Probe, ws: Path) -> str:
        m = ws / "m"
        shutil.copytree(p.model(), m)
        target = where(m, ws)
        before = _tree_state(m)
        r = p.aotc("build", m, "-o", ws / "b", "--backend", "export", *BUILD, "--cache-dir", target)
        if _tree_state(m) != before:
            return "lost"
        return judge(r, words)

    return run


def build_foreign(p: Probe, ws: Path) -> str:
    d = foreign_folder(ws)
    before = _tree_state(d)
    r = p.aotc("build", p.model(), "-o", ws / "b", "--backend", "export", *BUILD, "--cache-dir", d)
    if _tree_state(d) != before:
        return "lost"
    return "handled" if r.rc == 0 and "building without it" in " ".join(r.out.split()) else judge(r)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tagged(tag: str) -> list[int]:
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"AOTC_PROBE_RUN={tag}".encode() in environ.read_bytes().split(b"\0") and _alive(int(environ.parent.name)):
                found.append(int(environ.parent.name))
        except OSError:
            pass
    return found


def interrupted(how: str) -> Callable:
    def run(p: Probe, ws: Path) -> str:
        tag = uuid.uuid4().hex
        cxx = ws / "slow-cxx"
        cxx.write_text(SLOW_CXX)
        cxx.chmod(0o755)
        argv = [sys.executable, "-c", "from aotc.cli import app; app()", "build", str(p.model()), "--backend", "inductor", "--jobs", "2", *BUILD,
                "--cache-dir", str(ws / "cache"), "-o", str(ws / "b")]  # fmt: skip
        # SIGINT as a terminal delivers it: a probe started in the background (nohup ... &)
        # would hand the build an ignored SIGINT, and Python then never raises KeyboardInterrupt.
        restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
        proc = subprocess.Popen(argv, env={**p.env, "AOTC_PROBE_RUN": tag, "CXX": str(cxx)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=restore)
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:  # both workers started, a compiler running
            names, workers = set(), 0
            for pid in _tagged(tag):
                try:
                    names.add(Path(f"/proc/{pid}/comm").read_text().strip())
                    workers += b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    pass
            if "slow-cxx" in names and workers >= 2:
                break
            time.sleep(0.05)
        else:
            proc.kill()
            return "other (the build never ran its compiler)"
        proc.send_signal(getattr(signal, how))
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return "hang"
        time.sleep(1)
        left = _tagged(tag)
        for pid in left:  # the probe cleans up after a case that failed
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return "lost" if left else "handled"

    return run


NOTHING_LOST = [
    Case("nothing lost", "prune of a folder aotc did not make", prune),
    Case("nothing lost", "build --cache-dir the model folder", build_into(lambda m, ws: m, "model folder")),
    Case("nothing lost", "build --cache-dir inside the model folder", build_into(lambda m, ws: m / "cache", "model folder")),
    Case("nothing lost", "build --cache-dir around the model folder", build_into(lambda m, ws: ws, "model folder")),
    Case("nothing lost", "build --cache-dir a folder aotc did not make", build_foreign),
    Case("nothing lost", "SIGINT of an inductor --jobs 2 build", interrupted("SIGINT")),
    Case("nothing lost", "SIGTERM of an inductor --jobs 2 build", interrupted("SIGTERM")),
    Case("nothing lost", "SIGKILL of an inductor --jobs 2 build", interrupted("SIGKILL")),
]
# -- bad inputs, round two (issue 45): resources, the eager path, templates, model folders, Hub ids --


def in_model(prepare: Callable[[Path, Path], list], words: str) -> Callable[["Probe", Path], str]:
    """A case on a copy of the tiny model: prepare(model, ws) changes it and gives the
    aotc command line; the process must refuse it naming `words`, and leave the copy's
    files as prepare left them."""

    def run(p: Probe, ws: Path) -> str:
        m = ws / "model"
        shutil.copytree(p.model(), m)
        argv = prepare(m, ws)
        before = {f: f.read_bytes() for f in m.rglob("*") if f.is_file() and not f.is_symlink()}
        outcome = judge(p.aotc(*argv, timeout=120), words)
        after = {f: f.read_bytes() for f in m.rglob("*") if f.is_file() and not f.is_symlink()}
        return "lost" if before != after else outcome

    return run


def _config(m: Path, **changes) -> Path:
    cfg = json.loads((m / "config.json").read_text())
    cfg.update(changes)
    (m / "config.json").write_text(json.dumps(cfg))
    return m


def _template(m: Path, template) -> Path:
    (m / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return m


def _index(m: Path, shard) -> Path:
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    return m


def _linked(m: Path, ws: Path, name: str) -> Path:
    outside = ws / f"outside-{name}"
    shutil.move(str(m / name), outside)
    (m / name).symlink_to(outside)
    return m


def _fifo(m: Path) -> Path:
    (m / "model.safetensors").unlink()
    os.mkfifo(m / "model.safetensors")
    return m


BUILT = ["--backend", "export", *BUILD, "--no-cache"]


def build_of(change: Callable[[Path], Path]) -> Callable[[Path, Path], list]:
    return lambda m, ws: ["build", change(m), *BUILT, "-o", ws / "out"]


def chat_of(template) -> Callable[[Path, Path], list]:
    return lambda m, ws: ["run", _template(m, template), "--eager", "--chat", "--prompt", "hi", "--max-new-tokens", "2"]


@contextlib.contextmanager
def _small_disk(ws: Path, *options: str):
    """A 64 KiB tmpfs under `ws` (read-only with "ro") for the case, or None where mount is refused."""
    disk = ws / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=64k", *options)), "tmpfs", str(disk)], capture_output=True).returncode:
        yield None
        return
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)])


def on_small_disk(argv: Callable[["Probe", Path, Path], list], words: str, *options: str) -> Callable[["Probe", Path], str]:
    """The command writing onto a small disk: refused naming `words`, nothing left on it."""

    def run(p: Probe, ws: Path) -> str:
        with _small_disk(ws, *options) as disk:
            if disk is None:
                return "other (cannot mount a tmpfs here)"
            outcome = judge(p.aotc(*argv(p, ws, disk), timeout=120), words)
            return "lost" if [f for f in disk.rglob("*") if not f.name.endswith(".lock")] else outcome

    return run


def _cache_full(p: Probe, ws: Path) -> str:
    """A cache on a full disk: the build goes on without it (README), and the bundle runs."""
    with _small_disk(ws) as disk:
        if disk is None:
            return "other (cannot mount a tmpfs here)"
        r = p.aotc("build", p.model(), "--backend", "export", *BUILD, "--cache-dir", disk / "cache", "-o", ws / "out", timeout=120)
        if judge(r) != "silent":  # exit 0 is what the README promises here
            return judge(r)
        ran = p.aotc("run", ws / "out", "--prompt", "hi", "--max-new-tokens", "2")
        return "handled" if "cannot be written" in r.out and ran.rc == 0 else "silent"


def bad_input(cls: str, name: str, prepare: Callable[[Path, Path], list], words: str) -> Case:
    return Case(cls, name, in_model(prepare, words))


MIXED = """
import sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
from aotc import lowp_weights
m = Path(sys.argv[1]) / "model.safetensors"
t = load_file(m)
for name in [n for n in t if n.startswith("model.layers.1.") and n.endswith("_scale_inv")]:
    w = name.removesuffix("_scale_inv")
    t[w] = lowp_weights.dequantize("fp8", t[w], t.pop(name), torch.float32)
save_file(t, m, metadata={"format": "pt"})
"""


def _mixed(p: Probe, ws: Path) -> str:
    """fp8 layer 0, plain layer 1 (the README allows both): builds, and runs."""
    m = ws / "model"
    shutil.copytree(p.model("fp8", quantize="fp8"), m)
    assert p.python(MIXED, m).rc == 0
    r = p.aotc("build", m, *BUILT, "-o", ws / "out")
    if r.rc != 0:
        return judge(r)
    ran = p.aotc("run", ws / "out", "--prompt", "hi", "--max-new-tokens", "2")
    return "handled" if ran.rc == 0 else judge(ran)


def _v4_rates(rate) -> Callable[["Probe", Path], str]:
    def run(p: Probe, ws: Path) -> str:
        m = ws / "model"
        shutil.copytree(p.model("v4", arch="deepseek_v4", layers=3), m)
        cfg = json.loads((m / "config.json").read_text())
        cfg["compress_rates"]["compressed_sparse_attention"] = rate
        (m / "config.json").write_text(json.dumps(cfg))
        return judge(p.aotc("build", m, *BUILT, "-o", ws / "out"), "expected a positive integer")

    return run


ROUND_TWO = [
    Case("model folders", "fp8 and plain layers in one checkpoint", _mixed),
    *[Case("model folders", f"V4 compress_rates {v!r}", _v4_rates(v)) for v in ("x", -4, 4.7)],
    Case("resources", "init tiny onto a full disk", on_small_disk(lambda p, ws, d: ["init", "tiny", d / "m"], "No space left on device")),
    Case("resources", "build -o onto a full disk", on_small_disk(lambda p, ws, d: ["build", p.model(), *BUILT, "-o", d / "b"], "No space left on device")),
    Case("resources", "build --cache-dir on a full disk", _cache_full),
    Case("resources", "build -o under a read-only file system", on_small_disk(lambda p, ws, d: ["build", p.model(), *BUILT, "-o", d / "b"], "Read-only file system", "ro")),
    Case("resources", "init tiny under a read-only file system", on_small_disk(lambda p, ws, d: ["init", "tiny", d / "m"], "Read-only file system", "ro")),
    Case(
        "resources",
        "run --threads 100000",
        lambda p, ws: judge(p.aotc("run", p.bundle(), "--threads", "100000", "--prompt", "hi", "--max-new-tokens", "2"), "--threads 100000: expected 1 to"),
    ),
    bad_input("resources", "num_hidden_layers 10**7", build_of(lambda m: _config(m, num_hidden_layers=10**7)), "the checkpoint has tensors for layers 0 to 1 only"),
    bad_input("eager path", "a 20,000-word prompt", lambda m, ws: ["run", m, "--eager", "--prompt", "word " * 20000, "--max-new-tokens", "2"], "max_position_embeddings"),
    bad_input("eager path", "--max-new-tokens 10**12", lambda m, ws: ["run", m, "--eager", "--prompt", "hi", "--max-new-tokens", str(10**12)], "max_position_embeddings"),
    *[
        bad_input("templates", f"chat template {k}", chat_of(t), w)
        for k, t, w in (
            ("range(10**9)", "{% for i in range(10**9) %}{% endfor %}", "Range too big"),
            ("recursive macro", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
            ("include", "{% include 'x.jinja' %}", "includes, imports or extends"),
            ("import", "{% import 'x.jinja' as x %}", "includes, imports or extends"),
            ("extends", "{% extends 'x.jinja' %}", "includes, imports or extends"),
            ("1/0", "{{ 1/0 }}", "ZeroDivisionError"),
            ("'a'+1", "{{ 'a' + 1 }}", "TypeError"),
            ("'x'*4e9", "{{ 'x' * 4e9 }}", "TypeError"),
            ("'x'*4000000000", "{{ 'x' * 4000000000 }}", "a repetition of"),
            ("double loop 10**5 x 10**5", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "it took more than"),
            ("a named template with a list name", [{"name": ["default"], "template": "x"}], "no chat_template"),
            ("__class__.__mro__", "{{ ''.__class__.__mro__ }}", "unsafe"),
            ("__subclasses__", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
            ("cycler.__init__.__globals__", "{{ cycler.__init__.__globals__ }}", "unsafe"),
            ("joiner.__init__.__globals__", "{{ joiner.__init__.__globals__ }}", "unsafe"),
            ("namespace.__init__.__globals__", "{{ namespace.__init__.__globals__ }}", "unsafe"),
            ("lipsum.__globals__", "{{ lipsum.__globals__ }}", "unsafe"),
            ("self._TemplateReference__context", "{{ self._TemplateReference__context }}", "unsafe"),
            ("|attr('__class__')", "{{ ''|attr('__class__') }}", "unsafe"),
            ("'{0.__class__}'.format", "{{ '{0.__class__}'.format(1) }}", "unsafe"),
        )
    ],
    # The .jinja file is read where tokenizer_config.json has no chat_template (init tiny writes one there).
    bad_input(
        "templates",
        "chat_template.jinja not UTF-8",
        lambda m, ws: ["run", _template(m, None), "--eager", "--chat", "--prompt", "hi"] if (m / "chat_template.jinja").write_bytes(b"\xff\xfe") else [],
        "not UTF-8",
    ),
    bad_input(
        "templates",
        "chat_template.jinja linked outside",
        lambda m, ws: (
            ["run", m, "--eager", "--chat", "--prompt", "hi"] if (ws / "t.jinja").write_text("{{ 1 }}") and (m / "chat_template.jinja").symlink_to(ws / "t.jinja") is None else []
        ),
        "outside the model folder",
    ),
    *[
        bad_input("model folders", f"weight_map value {v!r}", build_of(lambda m, v=v: _index(m, v)), "expected the name of a shard file")
        for v in ("../../x.safetensors", "/etc/passwd", 5, ["a"])
    ],
    bad_input(
        "model folders",
        "a tensor in two shards",
        build_of(
            lambda m: (
                shutil.copy(m / "model.safetensors", m / "a.safetensors"),
                shutil.move(str(m / "model.safetensors"), m / "b.safetensors"),
                (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": "a.safetensors", "lm_head.weight": "b.safetensors"}})),
                m,
            )[-1]
        ),
        "a checkpoint holds each tensor once",
    ),
    bad_input("model folders", "a FIFO named model.safetensors", build_of(_fifo), "not a regular file"),
    bad_input("model folders", "config.json linked outside", lambda m, ws: ["build", _linked(m, ws, "config.json"), *BUILT, "-o", ws / "out"], "outside the model folder"),
    *[
        bad_input("model folders", f"{k} {v!r}", build_of(lambda m, k=k, v=v: _config(m, **{k: v})), w)
        for k, v, w in (
            ("rope_theta", "x", "'rope_theta' must be a number"),
            ("rope_theta", 0, "'rope_theta' must be a finite number above 0"),
            ("rms_norm_eps", -1e-6, "'rms_norm_eps' must be a finite number above 0"),
            ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be a finite number above 0"),
            ("rope_scaling", {"rope_type": "linear", "factor": 0}, "'factor' must be a finite number above 0"),
            ("quantization_config", {"weight_block_size": [64, 64]}, "quantization_config.weight_block_size is [64, 64]"),
        )
    ],
    bad_input(
        "model folders",
        "llama3 low_freq_factor == high_freq_factor",
        build_of(
            lambda m: _config(m, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0, "original_max_position_embeddings": 64})
        ),
        "high_freq_factor above low_freq_factor",
    ),
    bad_input("model folders", "sliding_window 0", build_of(lambda m: _config(m, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=0)), "sliding_window"),
    bad_input(
        "model folders",
        "a 5,000-digit integer",
        build_of(lambda m: (m / "config.json").write_text((m / "config.json").read_text().replace('"vocab_size": 512', '"vocab_size": ' + "9" * 5000)) and m),
        "not valid JSON",
    ),
    bad_input(
        "model folders",
        "config.json nested 100,000 deep",
        build_of(lambda m: (m / "config.json").write_text((m / "config.json").read_text()[:-2] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}") and m),
        "not valid JSON",
    ),
    *[
        bad_input("hub ids", f"build {name}", lambda m, ws, name=name: ["build", name, *BUILT], "not a Hugging Face Hub id")
        for name in ("org/..", "org/tïny", "org/-tiny", "org/tiny.git", "org/" + "x" * 300)
    ],
    bad_input("hub ids", "--revision ''", lambda m, ws: ["build", "org/tiny", "--revision", "", *BUILT], "--revision"),
]

# -- ranks (issue 76): a launch's environment, ranks that cannot meet, the launcher's signals --

TP2 = ("--tensor-parallel", "2")


def launched(env: dict, words: str, ranks: int = 1, args: tuple = ("--prompt", "hi")) -> Callable[["Probe", Path], str]:
    """`aotc run` on a TP=2 bundle as torchrun-style ranks with `env` (a deadline of 2 s;
    RANK and WORLD_SIZE None: aotc run's own launcher): refused when every one exits 2
    naming `words` within the deadline and start-up."""

    def run(p: Probe, ws: Path) -> str:
        b = p.bundle("export", *TP2)
        base = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "AOTC_RANK_TIMEOUT": "2"}
        command = [sys.executable, "-c", "from aotc.cli import app; app()", "run", str(b), *args]
        full = {**p.env, **base, **env}
        procs = [
            subprocess.Popen(command, env={k: v for k, v in full.items() if v is not None}, cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(ranks)
        ]
        outcomes = []
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                return "hang"
            outcomes.append(judge(Result(proc.returncode, proc.stdout.read()), words))
        return next((o for o in outcomes if o != "refused"), "refused")

    return run


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_sigterm(p: Probe, ws: Path) -> str:
    """SIGTERM to `aotc run`'s launcher once both ranks opened the bundle: handled when it
    exits 130 and its temp folder is empty (no aotc-ranks-* log folder, no bundle copy)."""
    b = p.bundle("export", *TP2)
    temp = ws / "tmp"
    temp.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "from aotc.cli import app; app()", "run", str(b), "--prompt", "hi", "--max-new-tokens", "60"],
                            env={**p.env, "TMPDIR": str(temp)}, cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    line = proc.stdout.readline()  # rank 0 prints the prompt once both ranks opened the bundle
    if not line.startswith("prompt 0 "):
        proc.kill()
        return f"other (the ranks never started: {line}{proc.stdout.read()[-200:]})"
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "hang"
    time.sleep(2)  # the ranks remove their copies as they end
    left = sorted(x.name for x in temp.iterdir() if x.name != f"torchinductor_{getpass.getuser()}")  # torch's own cache (killed_run)
    if left:
        return f"lost ({', '.join(left)} left)"
    return "handled" if proc.returncode == 130 else f"other (exit {proc.returncode})"


RANKS = [
    *[
        Case("ranks", f"{k}={v!r}", launched({"RANK": "0", k: v}, words))
        for k, v, words in (
            ("MASTER_ADDR", None, "MASTER_ADDR is not set"),
            ("MASTER_PORT", "abc", "MASTER_PORT='abc'"),
            ("MASTER_PORT", "0", "MASTER_PORT='0'"),
            ("LOCAL_WORLD_SIZE", "0", "LOCAL_WORLD_SIZE='0'"),
            ("LOCAL_WORLD_SIZE", "abc", "LOCAL_WORLD_SIZE='abc'"),
            ("LOCAL_RANK", "5", "LOCAL_RANK='5'"),
            ("AOTC_RANK_TIMEOUT", "abc", "AOTC_RANK_TIMEOUT='abc'"),
        )
    ],
    Case("ranks", "a lone RANK=1", launched({"RANK": "1"}, "could not meet the other ranks")),
    Case("ranks", "two RANK=0", launched({"RANK": "0"}, "could not meet the other ranks", ranks=2)),
    Case("ranks", "an unreachable MASTER_ADDR", launched({"RANK": "1", "MASTER_ADDR": "192.0.2.1"}, "could not meet the other ranks")),
    Case("ranks", "SIGTERM to the launcher", launcher_sigterm),
    Case("ranks", "a prompt longer than the cache, to the launcher", launched({"RANK": None, "WORLD_SIZE": None}, "more than the cache holds", args=("--prompt", "hi " * 400))),
]

# -- issue 77: the bundle copy, quantize's leftovers, strict arguments --

HOLDING = """
import sys
from aotc import Session
with Session.open(sys.argv[1]) as session:
    session.generate(["Hi"], max_new_tokens=2)
    print("generated", flush=True)
    sys.stdin.read()
"""


def killed_run(backend: str) -> Callable[["Probe", Path], str]:
    """A program that opened a bundle and generated, killed with SIGKILL: handled when its
    temp folder (TMPDIR) is empty (no aotc-bundle-* copy, no torch extraction)."""

    def run(p: Probe, ws: Path) -> str:
        b, temp = p.bundle(backend), ws / "tmp"
        temp.mkdir()
        env = {**{k: v for k, v in p.env.items() if k != "TORCHINDUCTOR_CACHE_DIR"}, "TMPDIR": str(temp)}
        proc = subprocess.Popen([sys.executable, "-c", HOLDING, str(b)], env=env, cwd=ws,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        line = proc.stdout.readline()
        proc.kill()
        proc.wait()
        if line != "generated\n":
            return f"other (it did not run: {line}{proc.stdout.read()[-200:]})"
        # torch's own compile cache folder, made by importing its export serializer, is
        # left by a run that ends by itself too: it is torch's, reused, not the run's.
        left = sorted(x.name for x in temp.iterdir() if x.name != f"torchinductor_{getpass.getuser()}")
        return f"lost ({', '.join(left)} left)" if left else "handled"

    return run


def killed_quantize(p: Probe, ws: Path) -> str:
    """What a SIGKILLed quantize leaves beside -o (.q.tmp-*) is removed by the next quantize to it."""
    out = ws / "out"
    (out / ".q.tmp-x1y2z3").mkdir(parents=True)
    r = p.aotc("quantize", p.model(), "-o", out / "q")
    if r.rc != 0:
        return judge(r)
    return "handled" if sorted(x.name for x in out.iterdir()) == ["q"] else f"lost ({', '.join(sorted(x.name for x in out.iterdir()))})"


def _full_temp(p: Probe, ws: Path) -> str:
    """A temp folder too small for the bundle's checked copy: refused naming it, nothing left in it."""
    with _small_disk(ws) as disk:
        if disk is None:
            return "other (cannot mount a tmpfs here)"
        outcome = judge(p.aotc("run", p.bundle(), "--prompt", "hi", "--max-new-tokens", "2", env={"TMPDIR": str(disk)}), "(the temp folder, $TMPDIR): No space left on device")
        return "lost" if list(disk.iterdir()) else outcome


def _eos_beyond(p: Probe, ws: Path) -> str:
    """A stop token beyond the vocabulary runs (transformers writes its class's default ids
    even for a tiny vocabulary), and the run says the model never produces it."""
    m = ws / "model"
    shutil.copytree(p.model(), m)
    r = p.aotc("run", _config(m, eos_token_id=10**9), "--eager", "--prompt", "hi", "--max-new-tokens", "2")
    return "handled" if r.rc == 0 and "the model never produces a stop token" in " ".join(r.out.split()) else judge(r)


ROUND_THREE = [
    Case("bundle copy", "a killed run of an export bundle", killed_run("export")),
    Case("bundle copy", "a killed run of an inductor bundle", killed_run("inductor")),
    Case("bundle copy", "a full temp folder", _full_temp),
    Case("quantize", "what a killed quantize left", killed_quantize),
    *[
        Case("strict", f"cache prune --max-size {v[:12]!r}", lambda p, ws, v=v: judge(p.aotc("cache", "prune", "--max-size", v, "--cache-dir", ws / "c"), "--max-size"))
        for v in ("5Ki", "5 G", "9" * 400)
    ],
    Case(
        "strict",
        "--prefill-chunk 128 --max-seq 64",
        lambda p, ws: judge(p.aotc("build", p.model(), *BUILT, "--prefill-chunk", "128", "-o", ws / "b"), "128 is more than --max-seq 64"),
    ),
    bad_input("strict", "--max-seq beyond max_position_embeddings", build_of(lambda m: _config(m, max_position_embeddings=32)), "max_position_embeddings is 32"),
    Case("strict", "--jobs 1000000", lambda p, ws: judge(p.aotc("build", p.model(), *BUILT, "--jobs", "1000000", "-o", ws / "b"), "--jobs 1000000")),
    Case("strict", "init tiny --layers 1000000", lambda p, ws: judge(p.aotc("init", "tiny", ws / "m", "--layers", "1000000", timeout=60), "--layers")),
    Case("strict", "eos_token_id 10**9", _eos_beyond),
    manifest_case("an unknown manifest key", lambda m: m.update(surprise=1), "surprise: no such field"),
    manifest_case("backend.flags a list", lambda m: m["backend"].update(flags=[1, 2]), "backend.flags"),
]

CASES = TRUST + NOTHING_LOST + ROUND_TWO + RANKS + ROUND_THREE
CLASSES = ("trust", "nothing lost", "resources", "eager path", "templates", "model folders", "hub ids", "ranks", "bundle copy", "quantize", "strict")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the aotc source tree to probe (default: this one)")
    parser.add_argument("--only", nargs="*", default=[], help="run the cases whose names start with these")
    parser.add_argument("--classes", nargs="*", default=[], help=f"run the cases of these classes only ({', '.join(CLASSES)})")
    parser.add_argument("--json", type=Path, help="write each case's outcome here")
    args = parser.parse_args()
    cases = [c for c in CASES if (not args.only or any(c.name.startswith(o) for o in args.only)) and (not args.classes or c.cls in args.classes)]
    results = []
    with tempfile.TemporaryDirectory(prefix="aotc-probe-") as tmp:
        probe = Probe(args.tree.resolve(), Path(tmp))
        for i, case in enumerate(cases):
            ws = Path(tmp) / f"case{i}"
            ws.mkdir()
            t0 = time.perf_counter()
            try:
                outcome = case.run(probe, ws)
            except AssertionError as e:  # the tree could not make what the case starts from
                outcome = f"other (setup: {str(e)[-200:]})"
            results.append({"class": case.cls, "case": case.name, "outcome": outcome, "seconds": round(time.perf_counter() - t0, 1)})
            print(f"{case.cls:13} {case.name:52} {outcome}", flush=True)
            shutil.rmtree(ws, ignore_errors=True)
    print()
    for cls in CLASSES:
        counts = Counter(r["outcome"] if r["outcome"] in ("refused", "handled", "traceback", "silent", "hang", "lost") else "other" for r in results if r["class"] == cls)
        print(f"{cls:13} " + "  ".join(f"{k} {counts[k]}" for k in ("refused", "handled", "traceback", "silent", "hang", "lost", "other")))
    if args.json:
        tmp_json = args.json.with_suffix(".tmp")
        tmp_json.write_text(json.dumps({"tree": str(args.tree), "results": results}, indent=1) + "\n")
        os.replace(tmp_json, args.json)
    bad = [r for r in results if r["outcome"] not in GOOD]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
