"""torch's functional collectives lowered to per-rank HLO (aotc/backends/xla_collectives.py),
run over 2 replicas on XLA's CPU client against torch. The lowering and the run happen in
a subprocess of their own: JAX's CPU client takes its device count (jax_num_cpu_devices)
once, when it starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aotc.backends.xla import XlaBackend

pytestmark = pytest.mark.skipif(XlaBackend().can_compile() is not None, reason=str(XlaBackend().can_compile()))

# Each op as a graph of one collective on the world group "0" of 2 ranks, traced under
# torch's fake process group as a build traces; each rank's input differs.
PROGRAM = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np, torch
from torch.distributed import _functional_collectives as funcol
from aotc.backends.xla_lower import import_torchax, jitted
from aotc.parallel import record, tracing
from jax._src import xla_bridge
from jax._src.lib import _jax, xla_client
from jax.sharding import Mesh, NamedSharding, PartitionSpec

CALLS = {
    "sum": lambda x: funcol.all_reduce(x, "sum", "0"), "avg": lambda x: funcol.all_reduce(x, "avg", "0"),
    "max": lambda x: funcol.all_reduce(x, "max", "0"), "min": lambda x: funcol.all_reduce(x, "min", "0"),
    "all_gather": lambda x: funcol.all_gather_tensor(x, 0, "0"), "reduce_scatter": lambda x: funcol.reduce_scatter_tensor(x, "sum", 0, "0"),
    "all_to_all": lambda x: funcol.all_to_all_single(x, None, None, "0"),
}

class One(torch.nn.Module):
    def __init__(self, call):
        super().__init__()
        self.call = call
    def forward(self, x):
        return self.call(x)

def replicas(pb, per_rank):
    client = xla_bridge.get_backend("cpu")
    devices = client.local_devices()[:2]
    options = xla_client.CompileOptions()
    options.num_replicas = 2
    options.device_assignment = xla_client.DeviceAssignment.create(np.array([[0], [1]], dtype=np.int32))
    exe = client.compile_and_load(_jax.mlir.hlo_to_stablehlo(pb), xla_client.DeviceList(tuple(devices)), options)
    shards = [jax.device_put(x, d) for x, d in zip(per_rank, devices)]
    whole = jax.make_array_from_single_device_arrays((2 * per_rank[0].shape[0], *per_rank[0].shape[1:]), NamedSharding(Mesh(np.array(devices), ("r",)), PartitionSpec("r")), shards)
    (out,) = exe.execute_sharded([whole]).disassemble_into_single_device_arrays()
    return [np.asarray(a).tolist() for a in out]

import_torchax()
found = {}
with tracing(record(2)):
    for name in sys.argv[1:]:
        xs = [np.random.default_rng(r).standard_normal((4, 3)).astype(np.float32) for r in range(2)]
        program = torch.export.export(One(CALLS[name]), (torch.from_numpy(xs[0]),)).run_decompositions({})
        fn, specs = jitted(program.graph_module)
        hlo = fn.lower(*specs).compiler_ir("hlo")
        found[name] = {"inputs": [x.tolist() for x in xs], "hlo": hlo.as_hlo_text(), "outputs": replicas(hlo.as_serialized_hlo_module_proto(), xs)}
print(json.dumps(found))
"""

OPCODE = {
    "sum": "all-reduce",
    "avg": "all-reduce",
    "max": "all-reduce",
    "min": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
}


def expected(name: str, xs: list) -> list:
    """What torch's collective gives each of the 2 ranks, from their inputs."""
    import torch

    a, b = (torch.tensor(x) for x in xs)
    if name in ("sum", "avg", "max", "min"):
        whole = {"sum": a + b, "avg": (a + b) / 2, "max": torch.maximum(a, b), "min": torch.minimum(a, b)}[name]
        return [whole, whole]
    if name == "all_gather":  # tiled on dim 0, in rank order
        return [torch.cat([a, b]), torch.cat([a, b])]
    if name == "reduce_scatter":
        return list((a + b).chunk(2))
    return [torch.cat([a[:2], b[:2]]), torch.cat([a[2:], b[2:]])]  # all_to_all: rank r gets every rank's r-th split


@pytest.fixture(scope="module")
def lowered():
    done = subprocess.run([sys.executable, "-c", PROGRAM, *OPCODE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(OPCODE))
def test_each_collective_is_one_cross_replica_op_and_computes_torchs_result(lowered, name):
    import torch

    found = lowered[name]
    ops = [line for line in found["hlo"].splitlines() if f" {OPCODE[name]}(" in line]
    assert len(ops) == 1, found["hlo"]
    assert "replica_groups={{0,1}}" in ops[0]
    # The per-rank form Neuron compiles: no channel, no global device ids, no sharding calls.
    assert not any(word in found["hlo"] for word in ("channel_id", "use_global_device_ids", "xla.sdy", "custom-call")), found["hlo"]
    if OPCODE[name] in ("all-gather", "reduce-scatter", "all-to-all"):
        assert "dimensions={0}" in ops[0]
    for got, want in zip(found["outputs"], expected(name, found["inputs"])):
        torch.testing.assert_close(torch.tensor(got), want)
