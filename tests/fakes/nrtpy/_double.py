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


def compile_hlo(hlo: bytes):
    """The HLO module compiled as it is by XLA's CPU client (jaxlib's own API, as aotc verify
    runs hlo.pb)."""
    from jax._src import xla_bridge
    from jax._src.lib import _jax, xla_client

    client = xla_bridge.get_backend("cpu")
    device = client.local_devices()[0]
    return client.compile_and_load(_jax.mlir.hlo_to_stablehlo(hlo), xla_client.DeviceList((device,)), xla_client.CompileOptions()), device


def execute(compiled, args):
    import jax
    import numpy as np

    executable, device = compiled
    return [np.asarray(o) for o in executable.execute([jax.device_put(a, device) for a in args])]


class Runtime:
    """get_nrtpy_singleton(): the documented free_tensor."""

    def free_tensor(self, tensor) -> None:
        tensor.tensor_ref.data = None


RUNTIME = Runtime()
