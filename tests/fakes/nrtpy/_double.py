"""What the nrtpy test double adds to the documented API, for the tests only: the XLA CPU
client that stands in for a NeuronCore, and counters of the bytes that cross."""

from __future__ import annotations

from collections import defaultdict


class Counters:
    """Bytes host -> device and device -> host, in all, per tensor (by id), and since the
    last execution; the bytes sent before each execution."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.to_device = self.to_host = self.executions = 0
        self.per_tensor: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # id -> [to device, to host]
        self.before_execution: list[int] = []  # bytes sent since the previous execution, per execution
        self._since = 0

    def sent(self, tensor, nbytes: int) -> None:
        self.to_device += nbytes
        self.per_tensor[id(tensor)][0] += nbytes
        self._since += nbytes

    def received(self, tensor, nbytes: int) -> None:
        self.to_host += nbytes
        self.per_tensor[id(tensor)][1] += nbytes

    def executed(self) -> None:
        self.executions += 1
        self.before_execution.append(self._since)
        self._since = 0


COUNTERS = Counters()


def compile_hlo(hlo: bytes, replicas: int = 1):
    """The HLO module compiled as it is by XLA's CPU client (jaxlib's own API, as aotc verify
    runs hlo.pb); at `replicas` > 1, for that many replicas, one per process of the
    jax.distributed world this process joined (join), replica r on process r's device."""
    import numpy as np
    from jax._src import xla_bridge
    from jax._src.lib import _jax, xla_client

    client = xla_bridge.get_backend("cpu")
    options = xla_client.CompileOptions()
    if replicas == 1:
        devices = [client.local_devices()[0]]
    else:
        devices = sorted(client.devices(), key=lambda d: (d.process_index, d.id))
        options.num_replicas = replicas
        options.device_assignment = xla_client.DeviceAssignment.create(np.array([[d.id] for d in devices], dtype=np.int32))
    executable = client.compile_and_load(_jax.mlir.hlo_to_stablehlo(hlo), xla_client.DeviceList(tuple(devices)), options)
    return executable, devices, client.local_devices()[0]


def execute(compiled, args):
    import jax
    import numpy as np

    executable, devices, device = compiled
    if len(devices) == 1:
        return [np.asarray(o) for o in executable.execute([jax.device_put(a, device) for a in args])]
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    # This process's replica: each argument a global array whose only shard here is its own.
    mine = NamedSharding(Mesh(np.array(devices), ("replica",)), PartitionSpec())
    shards = [jax.make_array_from_single_device_arrays(a.shape, mine, [jax.device_put(a, device)]) for a in args]
    return [np.asarray(o[0]) for o in executable.execute_sharded(shards).disassemble_into_single_device_arrays()]


JOINED: list = []  # (coordinator, world_size, rank_id) once this process joined its peers


def join(coordinator: str, world_size: int, rank_id: int) -> None:
    """The collectives' world for this process: jax.distributed, with the root as its
    coordinator (rank 0 hosts it), once per process, as libnrt is one per process."""
    import jax

    if not JOINED:
        jax.distributed.initialize(coordinator, num_processes=world_size, process_id=rank_id, initialization_timeout=60)
        JOINED.append((coordinator, world_size, rank_id))


class Runtime:
    """get_nrtpy_singleton(): the documented free_tensor."""

    def free_tensor(self, tensor) -> None:
        tensor.tensor_ref.data = None


RUNTIME = Runtime()
