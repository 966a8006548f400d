"""Shared fixtures: tiny model folders made here, never downloaded."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from aotc.backends.base import Step
from aotc.builder import BuildOptions, build
from aotc.models.tiny import write_tiny

# xdist's workers share the machine's cores: each runs torch (and the processes its tests
# start) on its share of them. At torch's default, every worker's OpenMP regions span all
# the cores, and two workers' threads spin against each other: on this 2-core machine the
# transformers, engine and bench modules took 116 s, against 91 s at one thread each
# (aotc's own runs still size their threads themselves).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and os.environ.get("PYTEST_XDIST_WORKER"):
    _SHARE = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_SHARE)
    os.environ.setdefault("OMP_NUM_THREADS", str(_SHARE))

# The modules that take longest, longest first, from `python -m pytest --durations=0`
# summed per module (seconds on a 2-core AMD EPYC with avx2, 2026-12-07, two workers).
# Each of the two workers takes the next whole module when it is free (--dist loadscope);
# started longest first, they finish within a short module of each other. xdist's default
# order (most tests first) left the few-test, long modules for last, and one worker idle
# for a minute or more. pytest-randomly still shuffles the tests within each module and
# the order of the modules not listed.
LONGEST_FIRST = [
    "test_transformers_path",  # 216
    "test_cache",  # 149
    "test_parallel",  # 146, most of it in processes of their own (the ranks)
    "test_inductor",  # 140
    "test_neuron",  # 128
    "test_verify",  # 98
    "test_expert_parallel",  # 94
    "test_quant",  # 84
    "test_data_parallel",  # 82, the ranks' processes
    "test_deepseek_v4_compiled",  # 80
    "test_bad_inputs",  # 77
    "test_hf_parallel",  # 77
    "test_bench",  # 59
    "test_fidelity",  # 59
    "test_ranks",  # 57
    "test_real_folders",  # 52
    "test_full_disk",  # 50
    "test_serve",  # 48
    "test_xla",  # 46
    "test_readme_claims",  # 44
    "test_strip_data_dependent",  # 42
    "test_bisect",  # 38
    "test_safety",  # 33
    "test_cli",  # 33
    "test_format",  # 32
    "test_kvcache",  # 24
    "test_runtime",  # 24
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py"), len(rank)))  # stable


@pytest.fixture(scope="session", autouse=True)
def private_compile_cache(tmp_path_factory):
    """Builds in tests use a compile cache of their own, never the user's ~/.cache/aotc:
    one for the whole run, shared by the xdist workers (the cache locks each entry, as for
    concurrent builds), so that a graph one worker compiled is a hit for the other. A test
    that counts hits and misses passes a cache folder of its own."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-N/, above popen-gwK/
    (shared / "aotc-cache").mkdir(exist_ok=True)
    os.environ["AOTC_CACHE_DIR"] = str(shared / "aotc-cache")


@pytest.fixture(scope="session", autouse=True)
def private_working_folder(tmp_path_factory):
    """Each test process works in a folder of its own: a build without -o writes
    artifacts/<name> under the working folder, and the README's first command leaves the
    user's artifacts/tiny in the clone, which those builds would find and refuse to replace."""
    os.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The embedded default model, with 2 layers to keep tests fast."""
    return write_tiny(tmp_path_factory.mktemp("models") / "tiny", layers=2)


@pytest.fixture(scope="session")
def near_tie_dir(tmp_path_factory):
    """tiny_dir with its LM head drawn as transformers initialises one (std 0.02): the
    top two logits come within 1e-2 of each other in about one step of ten. The other
    weights equal tiny_dir's, so every bundle built for tiny_dir runs it."""
    return write_tiny(tmp_path_factory.mktemp("models") / "near-ties", layers=2, head_std=0.02)


# Compiled against eager, fp32 logits of the tiny models (default head, 24 tokens, batch 1
# and 3): measured within 1.0e-5 on export, 2.0e-5 on inductor (other row counts and
# vector widths) and 2.0e-5 on xla (another summation order); 5x that is allowed.
LOGIT_ATOL = {"export": 5e-5, "inductor": 1e-4, "xla": 1e-4, "neuron": 1e-4}


def assert_generation_matches_eager(bundle_dir, model_dir, new_tokens=24, long_prompt=30, atol=None, exact=False):
    """Generation through the bundle against eager on the same checkpoint (with the
    bundle's KV cache dtype), at batch 1 and at batch 3 (padded, the long prompt in
    chunks). Full precision: logits within `atol` (default LOGIT_ATOL, tighter than the
    product's 1e-3), tokens equal up to a near-tie (eager's top-2 gap within atol).
    Lower precision (fp8 caches): the product's own rule, as `aotc run --check` applies
    it (runtime.check.check_generation); atol does not apply. exact=True: every token
    equal to eager's (lower precision: eager at the bundle's precision, forced along the
    bundle's tokens, chose each). Returns eager's smallest top-2 gap over the steps compared
    (full precision; lower: None)."""
    from aotc.models.loader import full_precision, load_model
    from aotc.runtime import Bundle, check_generation, compare, generate

    bundle = Bundle.load(bundle_dir)
    loaded = load_model(model_dir, kv_cache=bundle.manifest.model.kv_cache)
    bundle.check_model(loaded)
    backend = bundle.manifest.backend.name
    atol = atol or LOGIT_ATOL[backend]
    g = torch.Generator().manual_seed(0)
    smallest_gap = float("inf") if full_precision(loaded.model) else None
    for lengths in ((9,), (5, long_prompt, 21)):
        prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
        kw = dict(max_batch=min(len(prompts), bundle.max_batch), max_seq=bundle.max_seq, slots=bundle.cache_slots, stop_at_eos=False)
        bundle.bind(loaded.model)
        got = generate(loaded.model, prompts, new_tokens, keep_logits=True, **kw)
        Bundle.unbind(loaded.model)
        if smallest_gap is None:
            report = check_generation(loaded.model, got, new_tokens, backend, **kw)
        else:
            ref = generate(loaded.model, prompts, new_tokens, keep_logits=True, **kw)
            report = compare(got, ref, atol)
        assert report.passed, [(p.matching_tokens, p.error, p.bound, p.near_tie_gap) for p in report.per_prompt]
        if exact:  # every token the reference's (full precision), or eager's at the bundle's precision
            if smallest_gap is None:
                assert all(p.twin_new_ids == s.new_ids for p, s in zip(report.per_prompt, got.sequences)), [
                    (p.twin_new_ids, s.new_ids) for p, s in zip(report.per_prompt, got.sequences)
                ]
            else:
                assert report.tokens_equal, [(p.matching_tokens, p.near_tie_gap) for p in report.per_prompt]
        if smallest_gap is not None:
            for p, r in zip(report.per_prompt, ref.sequences):
                top2 = torch.stack(r.logits[: p.matching_tokens + 1]).topk(2).values
                smallest_gap = min(smallest_gap, (top2[:, 0] - top2[:, 1]).min().item())
    return smallest_gap


def assert_check_report(report: dict, backend: str) -> None:
    """An `aotc run --check --json` report: every token equal, logits within LOGIT_ATOL."""
    c = report["check"]
    assert c["tokens_equal"], c["per_prompt"]
    assert c["max_logit_diff"] <= LOGIT_ATOL[backend], c["max_logit_diff"]


@pytest.fixture(scope="session")
def tiny_bundle(tiny_dir, tmp_path_factory):
    """An export-backend bundle of tiny_dir: batch buckets 1,2,4, prefill chunk 16 and 64."""
    out = tmp_path_factory.mktemp("bundles") / "tiny"
    return build(BuildOptions(tiny_dir, out=out, batch_buckets=(1, 2, 4), chunk_buckets=(16, 64), max_seq=256, backend="export"))


@pytest.fixture(scope="session")
def context_bundle(tiny_dir, tmp_path_factory):
    """Graphs that read the first 64 cache positions, and all 256; prefill chunks of 16 and
    32 also at the chunk contexts 16, 32 (16 at both, 32 at 32) and 128; a first chunk
    from position 0 (the fresh form) of 8, 16, 24 or 32 rows (export)."""
    out = tmp_path_factory.mktemp("bundles") / "contexts"
    options = BuildOptions(tiny_dir, out=out, batch_buckets=(1, 2), chunk_buckets=(16, 32), first_chunk_buckets=(8, 24), max_seq=256, context_buckets=(64,), backend="export")
    return build(options).out


def hf_save(tmp_path, config_cls, model_cls, seed=0, **fields):
    """Save a tiny random transformers model with save_pretrained; returns (folder, model)."""
    torch.manual_seed(seed)
    config = config_cls(**fields)
    model = model_cls(config).eval()
    model.save_pretrained(tmp_path)
    return tmp_path, model


def rehash(bundle) -> None:
    """What an attacker does after tampering with a bundle: fix every sha256 in its manifest."""
    import hashlib
    import json

    manifest = json.loads((bundle / "manifest.json").read_text())
    for e in manifest["entries"]:
        for a in e["artifacts"]:
            for name in a["files"]:
                a["files"][name] = hashlib.sha256((bundle / a["dir"] / name).read_bytes()).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def swapped_copy(src, dst, other=2, entry="LlamaDecoderLayer.decode", context=None):
    """A copy of a bundle whose `entry` artifacts for buckets 1 and `other` (at context
    bucket `context`; None: the entry's only one, or none) trade places, hashes fixed."""
    import shutil

    from aotc.format import artifact_dir, read_manifest

    shutil.copytree(src, dst)
    found = read_manifest(dst).entry(entry).artifacts
    context = context if context is not None else found[0].context
    a, b = dst / artifact_dir(entry, 1, context), dst / artifact_dir(entry, other, context)
    a.rename(dst / "swap")
    b.rename(a)
    (dst / "swap").rename(b)
    rehash(dst)
    return dst


def cross_weights(manifest_file, a="mlp.gate_proj.weight", b="mlp.up_proj.weight") -> None:
    """Two weights of one shape crossed in every entry that lists both (a manifest or a
    build recipe): as written, it would run each layer with the other's tensor."""
    import json

    manifest = json.loads(manifest_file.read_text())
    crossed = 0
    for e in manifest["entries"]:
        paths = [w["path"] for w in e["weights"]]
        if a in paths and b in paths:
            i, j = paths.index(a), paths.index(b)
            assert e["weights"][i]["shape"] == e["weights"][j]["shape"]
            e["weights"][i]["path"], e["weights"][j]["path"] = b, a
            crossed += 1
    assert crossed
    manifest_file.write_text(json.dumps(manifest))


def wrap_steps(dispatcher, wrap) -> None:
    """Each step of one bound entry method (a Dispatcher) replaced, for this instance only,
    by one whose run is wrap(context, bucket, run) (run: the step's own)."""

    def through(context, bucket, step):
        def run(args, call=0):
            return wrap(context, bucket, lambda a: step.run(a, call))(args)

        return Step(step.device, run, step.weights)

    dispatcher.steps = {context: {bucket: through(context, bucket, s) for bucket, s in steps.items()} for context, steps in dispatcher.steps.items()}


def wrap_programs(bundle, wrap) -> None:
    """Each program of a loaded bundle replaced by one whose steps run through
    wrap(key, run), key (entry id, bucket), for every instance it is bound to."""
    for key, program in list(bundle.programs.items()):
        bundle.programs[key] = _Wrapped(program, lambda run, key=key: wrap(key, run))


class _Wrapped:
    def __init__(self, program, wrap):
        self.program, self.wrap, self.label = program, wrap, program.label

    def bind(self, weights, **where):
        step = self.program.bind(weights, **where)
        return Step(step.device, lambda args, call=0: self.wrap(lambda a: step.run(a, call))(args), step.weights)


def record_contexts(dispatcher) -> list:
    """The context bucket of each call of a bound entry method, in order."""
    used = []
    wrap_steps(dispatcher, lambda context, bucket, run: lambda args: used.append(context) or run(args))
    return used


def perturbing(part: str):
    """A wrap for wrap_programs: steps whose outputs (part "output": the floating ones;
    "choice": the integer ones, each token id moved to its neighbour) or cache writes (part
    "cache": each byte the graph wrote, its bit 0x40 flipped) are not the graph's."""

    def wrap(key, run):
        def changed(args):
            if part == "output":
                return [o + 0.5 * (1 + o.abs()) if o.is_floating_point() else o for o in run(args)]
            if part == "choice":
                return [o if o.is_floating_point() else torch.where(o > 0, o - 1, o + 1) for o in run(args)]
            before = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
            outs = run(args)
            for a, b in zip(args, before):
                if b is not None and a.numel():
                    now, was = a.view(torch.uint8), b.view(torch.uint8)
                    now[now != was] ^= 0x40
            return outs

        return changed

    return wrap


def assert_verify_catches_differences(monkeypatch, path, reference: bool = False, **kw):
    """`aotc verify` of the bundle at `path` passes, and fails once every program's outputs
    differ (each artifact, with its output message), and again once its cache writes differ
    (each artifact that writes a cache, with the cache message). reference=True: the
    backend's reference runner is what differs (a bundle whose programs cannot load here)."""
    from aotc.backends import get_backend_class
    from aotc.format import read_manifest
    from aotc.runtime import verify as verify_mod

    report = verify_mod.verify(path, **kw)
    assert report.passed and report.artifacts, [(a.entry, a.bucket, a.context, a.problems) for a in report.artifacts]
    manifest = read_manifest(path)
    writes = {e.id for e in manifest.entries if any(i.kind == "cache" for i in e.artifacts[0].inputs)}
    # Token ids beside their logits (a whole decode step's argmax): judged as choices.
    chooses = {e.id for e in manifest.entries if any(not getattr(torch, o.dtype).is_floating_point for o in e.artifacts[0].outputs)}
    parts = [("output", "output 0 differs by up to"), ("cache", "differently from eager where eager wrote")]
    for part, said in parts + ([("choice", "output 1 chose token")] if chooses else []):
        with monkeypatch.context() as m:
            if reference:
                cls = get_backend_class(manifest.backend.name)
                own = cls.reference
                m.setattr(cls, "reference", lambda self, d, r: _Wrapped(own(self, d, r), lambda run: perturbing(part)(None, run)))
            else:
                load = verify_mod.Bundle.load

                def loading(*a, **k):
                    bundle = load(*a, **k)
                    wrap_programs(bundle, perturbing(part))
                    return bundle

                m.setattr(verify_mod.Bundle, "load", loading)
            got = verify_mod.verify(path, **kw)
        failed = {(a.entry, a.bucket, a.context) for a in got.artifacts if any(said in p for p in a.problems)}
        expected = {(a.entry, a.bucket, a.context) for a in got.artifacts if part == "output" or a.entry in (writes if part == "cache" else chooses)}
        assert failed == expected and expected, (part, [(a.entry, a.bucket, a.problems) for a in got.artifacts])
        assert not any(a.passed for a in got.artifacts if (a.entry, a.bucket, a.context) in expected)
    return report


@contextlib.contextmanager
def checkpoint_reads():
    """The names of the checkpoint tensors whose values aotc reads while inside: `whole`
    (safetensors' get_tensor) and `sliced` (a get_slice indexed: only those bytes; the
    headers' shapes, read through get_slice too, are not counted)."""
    from unittest import mock

    from aotc.models import checkpoint

    reads = type("Reads", (), {})()
    reads.whole, reads.sliced = [], []
    real = checkpoint.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            reads.whole.append(name)
            return self.inner.get_tensor(name)

        def get_slice(self, name):
            inner = self.inner.get_slice(name)

            class Slice:
                def __getitem__(self, index):
                    reads.sliced.append(name)
                    return inner[index]

                def __getattr__(self, attr):
                    return getattr(inner, attr)

            return Slice()

        def __getattr__(self, name):  # the header readers (keys, metadata)
            return getattr(self.inner, name)

    with mock.patch.object(checkpoint, "safe_open", Recording):
        yield reads
