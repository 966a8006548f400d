"""`aotc bisect`: shrink a compiler failure to the smallest failing run of graph nodes.

A bundle keeps no pickled graphs, so the failing artifact's graph is traced
again from the model folder, with the build options the manifest records,
through the same passes; it must have the artifact's own cache key (else it
is not the graph that failed, and bisect stops saying so). It is lowered as the
backend lowers it (its `Bisector`; xla and neuron: functional, decomposed, as
HLO). Its nodes are cut into contiguous ranges; a range becomes a graph of its
own, its live inputs as parameters and its live values as outputs, and is
given to the compiler with the artifact's own flags. Delta debugging on the two ends:

  1. the whole graph must fail; its error code (NCC_...) is the one sought;
  2. binary search for the shortest prefix [0, e) that fails with that code;
  3. binary search for the latest start s such that [s, e) still fails.

About 2 log2(nodes) + 1 compiler runs. A failure caused by one node (an op the
compiler mishandles) shrinks to that node; one that needs several to interact
shrinks to the shortest run that holds them all. Results are reported with each
node's source line in the user's model, the minimal HLO and a one-line command
that reproduces it. The work folder is kept.
"""

from __future__ import annotations

import operator
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import fx

from .errors import AotcError
from .format import artifact_label, read_manifest


@dataclass
class Attempt:
    start: int
    end: int
    failed: bool
    code: str | None  # the NCC error code, when failed
    folder: str
    command: list[str]  # run in `folder`
    input: str  # the file the compiler took, in `folder`
    log: str  # its output, in `folder`


@dataclass
class BisectResult:
    entry: str
    bucket: int
    context: int | None  # the artifact's context bucket; None for an entry without
    code: str
    nodes: list[str]  # the smallest failing range, "name = target"
    sources: list[str]  # each node's source line in the user's model
    hlo: str  # the minimal failing HLO
    log: str
    command: str  # one line that reproduces the failure
    runs: int  # compiler runs
    total_nodes: int
    work: str
    attempts: list[Attempt] = field(default_factory=list)


def bisect(
    bundle: Path | str, entry_id: str, bucket: int, context: int | None = None, *, model_dir: Path | str | None = None,
    compiler: str | None = None, work: Path | str | None = None, progress: Callable[[str], None] | None = None,
) -> BisectResult:  # fmt: skip
    """`context`: the artifact's context bucket (None: the entry's smallest)."""
    from .backends import Backend, Specs, backend_names, get_backend_class
    from .builder.key import retrace
    from .passes.base import source_line

    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    name = manifest.backend.name
    backend = get_backend_class(name)(**manifest.backend.flags)  # as the bundle was built
    bisector = backend.bisector()
    if bisector is None:
        able = [n for n in backend_names() if get_backend_class(n).bisector is not Backend.bisector]
        raise AotcError(f"{bundle} is a {name} bundle; aotc bisect shrinks failures of compilers that take HLO, in {' and '.join(able)} bundles")
    entry, art = manifest.find(entry_id, bucket, context)
    label = artifact_label(entry_id, bucket, art.context)
    argv0 = shlex.split(compiler) if compiler else None
    model_dir = Path(model_dir or manifest.model.source)
    say = progress or (lambda _: None)
    say(f"tracing {label} from {model_dir}")
    graph = retrace(manifest, entry, art, model_dir, backend).graph
    gm = bisector.lower(graph.program, Specs(graph.inputs, graph.outputs))
    units = _units(gm)
    work = Path(work) if work else Path(tempfile.mkdtemp(prefix=f"aotc-bisect-{Path(art.dir).parent.name}-{Path(art.dir).name}-"))
    work.mkdir(parents=True, exist_ok=True)
    attempts: dict[tuple[int, int], Attempt] = {}

    def attempt(start: int, end: int) -> Attempt:
        if (start, end) in attempts:
            return attempts[start, end]
        folder = work / f"nodes-{start}-{end}"
        if folder.exists():
            shutil.rmtree(folder)  # a folder of our own from an earlier attempt of this range
        folder.mkdir()
        done = bisector.attempt(_subgraph(gm, units[start:end]), folder, argv0)
        a = attempts[start, end] = Attempt(start, end, done.code is not None, done.code, str(folder), done.command, done.input, done.log)
        say(f"compile {len(attempts)}: nodes {start}..{end - 1} of {len(units)}: {'fails with ' + done.code if done.code else 'passes'}")
        return a

    whole = attempt(0, len(units))
    if not whole.failed:
        raise AotcError(f"{label} compiles; nothing to bisect (work folder {work})")
    code = whole.code
    fails = lambda s, e: attempt(s, e).code == code  # noqa: E731  (the same failure, not any)
    lo, hi = 1, len(units)  # shortest failing prefix: [0, hi) fails
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fails(0, mid) else (mid + 1, hi)
    end = hi
    lo, hi = 0, end - 1  # latest failing start: [lo, end) fails
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fails(mid, end) else (lo, mid - 1)
    start = lo
    minimal = attempt(start, end)
    nodes = [n for unit in units[start:end] for n in unit]
    folder = Path(minimal.folder)
    return BisectResult(
        entry_id, bucket, art.context, code,
        [f"{n.name} = {n.target}" for n in nodes], [source_line(n) for n in nodes],
        str(folder / minimal.input), str(folder / minimal.log), f"cd {shlex.quote(str(folder))} && {shlex.join(minimal.command)}",
        len(attempts), len(units), str(work), sorted(attempts.values(), key=lambda a: (a.start, -a.end)),
    )  # fmt: skip


def _units(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The graph's compute nodes in order, each with the getitems that unpack it: a cut
    never falls between a node that returns several tensors and their uses."""
    units: list[list[fx.Node]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and units and node.args[0] in units[-1]:
            units[-1].append(node)
        else:
            units.append([node])
    return units


def _subgraph(gm: fx.GraphModule, units: list[list[fx.Node]]) -> fx.GraphModule:
    """The nodes of `units` as a graph: what they read from outside as placeholders, what
    is read after them (or is the graph's output) as outputs."""
    inside = [n for unit in units for n in unit]
    members = set(inside)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def value(n: fx.Node) -> fx.Node:
        if n not in env:
            p = graph.placeholder(n.name)
            p.meta["val"] = n.meta["val"]
            env[n] = p
        return env[n]

    for n in inside:
        for used in n.all_input_nodes:
            if used not in members:
                value(used)
        env[n] = graph.node_copy(n, lambda x: env[x])
    live = [n for n in inside if isinstance(n.meta.get("val"), torch.Tensor) and any(u not in members for u in n.users)]
    graph.output(tuple(env[n] for n in (live or inside[-1:])))
    return fx.GraphModule(gm, graph)
