"""XLA: each post-pass graph lowered to an HLO module, caches donated.

The artifact holds the HLO module as a serialized HloModuleProto (`hlo.pb`,
what neuronx-cc takes) and as text (`hlo.txt`), plus the same computation as
a serialized `jax.export` module (`model.jax`) that the runtime runs on XLA
(JAX's CPU client here). Cache inputs are donated: the HLO carries an
`input_output_alias` from each cache input to its updated value.

Lowering goes through torchax (PyTorch ops -> JAX) onto JAX, installed with
`pip install 'aotc[xla]'`; the base install does not pull JAX.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import BackendError
from ..format import ArtifactRecord
from .base import HOST, Backend, Bisector, CompileResult, Device, DeviceBuffer, Program, Specs, Step, Weights, joined_ranks, one_device
from .registry import get_backend_class, register_backend
from .xla_lower import HLO_PROTO, HLO_TEXT, INSTALL, JAX_MODULE, import_torchax, jax_dtype, lower, module_weights

if TYPE_CHECKING:
    from torch.export import ExportedProgram


@dataclass
class XlaExtra:
    # Input positions of the written caches, in the order of the leading outputs
    # that hold their updates.
    mutated: list[int]


class JaxDevice(Device):
    """A JAX device (the CPU here): weights placed once, caches allocated on it as JAX arrays
    (JAX has no views of torch tensors that survive a donation), activations copied in,
    outputs copied out. It counts the bytes that cross."""

    resident = True
    copies = True

    def __init__(self, index: int = 0):
        import jax

        self.jax_device = jax.local_devices()[index]
        self.sent = self.received = self.placed = 0  # bytes: host -> device per call, device -> host, weights
        self._placed: dict[int, tuple[torch.Tensor, object]] = {}
        self._copies: dict[int, object] = {}  # copy_positions' jitted program, by positions dim

    def place(self, weight: torch.Tensor):
        found = self._placed.get(id(weight))
        if found is None or found[0] is not weight:
            import jax

            array = to_numpy(weight)
            self.placed += array.nbytes
            found = self._placed[id(weight)] = (weight, jax.device_put(array, self.jax_device))
        return found[1]

    def put(self, t: torch.Tensor, key=None):
        import jax.numpy as jnp

        array = to_numpy(t)
        self.sent += array.nbytes
        # jnp.array copies into a buffer of XLA's own, which a donating call writes in place;
        # jax.device_put's buffer is copied when donated, some shapes or always (jax 0.10, CPU).
        return jnp.array(array, device=self.jax_device)

    def get(self, value, dtype: torch.dtype | None = None) -> torch.Tensor:
        import numpy as np

        array = np.asarray(value)
        self.received += array.nbytes
        return to_torch(array)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype):
        import jax.numpy as jnp

        return jnp.zeros(shape, jax_dtype(dtype), device=self.jax_device)

    def hold(self, t: torch.Tensor):
        return self.put(t)  # an array of XLA's own, donatable

    def copy_positions(self, buffer, dim: int, src: int, dst: int, n: int):
        # One jitted program per cache shape and dim, the slots and count its arguments; the
        # cache donated, so XLA writes the copied rows into the cache's own buffer.
        import jax

        copy = self._copies.get(dim)
        if copy is None:
            import jax.numpy as jnp

            def rows(cache, src, dst, n):
                at = jnp.arange(cache.shape[dim])
                keep = (at < n).reshape([-1 if d == dim - 1 else 1 for d in range(cache.ndim - 1)])
                return cache.at[dst].set(jnp.where(keep, cache[src], cache[dst]))

            copy = self._copies[dim] = jax.jit(rows, donate_argnums=0)
        return copy(buffer.value, src, dst, n)


class JaxProgram(Program):
    """model.jax on a JAX device, each written cache donated to the output that updates it:
    XLA writes the new rows into the cache's own buffer, and the runtime keeps the array
    it returns."""

    label = JAX_MODULE

    def __init__(self, backend: "XlaBackend", exported, mutated: list[int], weights: list[str]):
        self.backend, self.exported, self.mutated, self.weights = backend, exported, mutated, weights

    def bind(self, weights: Weights, *, rank: int = 0, world_size: int = 1) -> Step:
        import jax

        one_device(XlaBackend.name, rank, world_size)
        device = self.backend.device_for(rank, world_size)
        placed = [device.place(weights.tensor(i)) for i in range(len(weights))]
        exported, paths = self.exported, self.weights

        def flat_call(*flat):
            # The module's input tree (jitted) is rebuilt once, at trace time: each call then
            # passes flat arrays, as fast as a flat tree (dicts would be flattened per call).
            return exported.call(*[{p: w} for p, w in zip(paths, flat)], *flat[len(paths) :])

        run = jax.jit(flat_call, donate_argnums=tuple(self.mutated))
        # The written caches, by their position among the method's arguments.
        written = [position - len(placed) for position in self.mutated]

        def step(args: list, call: int = 0) -> list:
            outs = run(*placed, *[a.value if isinstance(a, DeviceBuffer) else a for a in args])
            for at, new in zip(written, outs):
                args[at].value = new  # the donated buffer, updated in place
            return list(outs[len(written) :])

        return Step(device, step, placed)


class HloProgram(Program):
    """hlo.pb, the file neuronx-cc compiles, compiled as it is by XLA's CPU client (a private
    jaxlib API: the jax range aotc tests is pinned in pyproject): aotc verify's check that
    the HLO computes what the artifact's other files do. A checker, run on host tensors:
    every input is copied in and every written cache copied back per call."""

    label = HLO_PROTO

    def __init__(self, hlo_pb: Path, mutated: list[int]):
        from jax._src import xla_bridge
        from jax._src.lib import _jax, xla_client

        client = xla_bridge.get_backend("cpu")
        self.device = client.local_devices()[0]
        options = xla_client.CompileOptions()
        self.executable = client.compile_and_load(_jax.mlir.hlo_to_stablehlo(hlo_pb.read_bytes()), xla_client.DeviceList((self.device,)), options)
        self.mutated = mutated

    def bind(self, weights: Weights, *, rank: int = 0, world_size: int = 1) -> Step:
        import jax
        import numpy as np

        tensors = weights.tensors()
        written = [position - len(tensors) for position in self.mutated]

        def step(args: list, call: int = 0) -> list:
            outs = self.executable.execute([jax.device_put(to_numpy(a), self.device) for a in [*tensors, *args]])
            outs = [to_torch(np.asarray(o)) for o in outs]
            for at, new in zip(written, outs):
                args[at].copy_(new)
            return outs[len(written) :]

        return Step(HOST, step, tensors)


class ReplicaProgram(Program):
    """hlo.pb of a parallel bundle, run as this rank's replica of `world_size`: its
    collectives (xla_collectives) reach the other ranks' replicas through jax.distributed,
    which the ranks join after torch's process group (join_replicas). model.jax is never
    run at world > 1: compiled for one replica, an all-reduce returns its input, and each
    rank would go on with its partial sums without a word."""

    label = HLO_PROTO

    def __init__(self, backend: "XlaBackend", hlo_pb: Path, mutated: list[int]):
        self.backend, self.hlo, self.mutated = backend, hlo_pb.read_bytes(), mutated

    def bind(self, weights: Weights, *, rank: int = 0, world_size: int = 1) -> Step:
        import jax
        import numpy as np
        from jax._src.lib import _jax, xla_client
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        if world_size < 2:
            raise BackendError(f"bind(world_size={world_size}): this program is one replica of a parallel bundle; bind it on each of its ranks (aotc run starts them)")
        joined_ranks(XlaBackend.name, rank, world_size)
        device = self.backend.device_for(rank, world_size)
        client = device.jax_device.client
        # Replica r is rank r: the devices in the order of their processes, which joined as their ranks.
        devices = sorted(client.devices(), key=lambda d: (d.process_index, d.id))
        if len(devices) != world_size or devices[rank] != device.jax_device:
            raise BackendError(f"rank {rank} of {world_size}: JAX sees devices {[str(d) for d in devices]}; expected one per rank, this rank's at {rank}")
        options = xla_client.CompileOptions()
        options.num_replicas = world_size
        options.device_assignment = xla_client.DeviceAssignment.create(np.array([[d.id] for d in devices], dtype=np.int32))
        executable = client.compile_and_load(_jax.mlir.hlo_to_stablehlo(self.hlo), xla_client.DeviceList(tuple(devices)), options)
        # Each input is this replica's own array; execute_sharded takes it as a global array
        # whose only shard here is this device's.
        mine = NamedSharding(Mesh(np.array(devices), ("replica",)), PartitionSpec())

        def replica(x):
            return jax.make_array_from_single_device_arrays(x.shape, mine, [x])

        placed = [device.place(weights.tensor(i)) for i in range(len(weights))]
        held = [replica(w) for w in placed]  # the weights' wrappers, made once: a step wraps only its arguments
        written = [position - len(placed) for position in self.mutated]

        def step(args: list, call: int = 0) -> list:
            results = executable.execute_sharded([*held, *[replica(a.value if isinstance(a, DeviceBuffer) else a) for a in args]])
            outs = [shards[0] for shards in results.disassemble_into_single_device_arrays()]
            for at, new in zip(written, outs):
                args[at].value = new
            return outs[len(written) :]

        return Step(device, step, placed)


COORDINATOR = "aotc/jax-coordinator"  # the key in torch's store under which rank 0 publishes JAX's coordinator


def join_replicas(rank: int, world_size: int) -> None:
    """Join jax.distributed as rank `rank` of `world_size`, after torch's process group
    (whose store carries the coordinator's address, published by rank 0), before JAX's
    backend starts: on the CPU its cross-process collectives run over gloo."""
    import jax

    from ..parallel import rank0_address

    joined_ranks(XlaBackend.name, rank, world_size)
    address = rank0_address(COORDINATOR)
    try:
        jax.distributed.initialize(address, num_processes=world_size, process_id=rank, initialization_timeout=60)
    except RuntimeError as e:
        raise BackendError(f"rank {rank} of {world_size}: could not join JAX's ranks at {address}: {e}") from e


def use_compilation_cache(digest: str) -> Path | None:
    """Point JAX's persistent compilation cache at this bundle's own folder in aotc's cache
    (<root>/jax/<digest>, 0700), so that a run after the first skips XLA's compile of every
    program: the tiny xla bundle's first token 1.6 -> 0.8 s. JAX runs what it finds there
    unchecked, so the folder is private (LocalCache.private) and never pushed to a remote
    cache; one folder per digest keeps a bundle's executables with the bundle that made
    them, for `aotc cache prune`. A cache folder the user set for JAX is left as it is.
    Returns the folder in use, or None."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    from ..cache.local import LocalCache  # run time: the folder of the user's aotc cache

    global _cache_set
    current = jax.config.jax_compilation_cache_dir
    if current and current != _cache_set:
        return Path(current)  # the user's own choice
    folder = LocalCache().private("jax", digest)
    if folder is None or str(folder) == current:
        return folder
    jax_cache.reset_cache()  # JAX opens its cache once, at its first compile: open it again here
    jax_cache.set_cache_dir(str(folder))
    # Every program of a bundle, though the tiny ones compile in well under JAX's default 1 s.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    _cache_set = str(folder)
    return folder


_cache_set: str | None = None  # the JAX cache folder use_compilation_cache set last


def to_numpy(t: torch.Tensor):
    """A host tensor as the numpy array an HLO parameter takes (ml_dtypes for bf16 and fp8)."""
    import ml_dtypes

    t = t.detach().contiguous()
    if t.dtype == torch.int64:  # JAX lowers without x64: the HLO takes int32 (lower())
        return t.to(torch.int32).numpy()
    special = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16), torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn)}
    if t.dtype in special:
        raw, np_dtype = special[t.dtype]
        return t.view(raw).numpy().view(np_dtype)
    return t.numpy()


def to_torch(a) -> torch.Tensor:
    """A numpy array (ml_dtypes included) as a torch tensor of its own memory."""
    import ml_dtypes
    import numpy as np

    special = {np.dtype(ml_dtypes.bfloat16): (np.int16, torch.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn)}
    if a.dtype in special:
        raw, dtype = special[a.dtype]
        return torch.from_numpy(a.view(raw).copy()).view(dtype)
    return torch.from_numpy(a.copy())


def hlo_reference(art_dir: Path, record: ArtifactRecord) -> Program | None:
    """hlo.pb on XLA's CPU client, where jaxlib and ml_dtypes are installed."""
    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("ml_dtypes") is None:
        return None
    return HloProgram(art_dir / HLO_PROTO, record.extra.mutated)


@register_backend
class XlaBackend(Backend):
    name = "xla"
    files = (HLO_PROTO, HLO_TEXT, JAX_MODULE)
    extra_type = XlaExtra
    # XLA sums in another order than eager; a discrete choice inside the model (DeepSeek
    # V4's indexer keeps the top-k compressed entries) then flips at near-ties. Measured on
    # the tiny V4, 715-token prompt: logits within 2.4e-3 of eager on xla (2e-5 on export
    # and inductor); with index_topk covering every entry, within 1e-5.
    tolerance_factor = 5.0
    static_shapes = True
    views = False
    collectives_in_graph = True  # lowered to per-rank HLO (xla_collectives), run as replicas (ReplicaProgram)

    def __init__(self):
        self._device: JaxDevice | None = None
        self._world = 1  # the opened bundle's ranks (opening)

    def version(self) -> str:
        import jax

        torchax = import_torchax()
        from .xla_collectives import VERSION

        return f"torch-{torch.__version__}-jax-{jax.__version__}-torchax-{getattr(torchax, '__version__', '?')}-{VERSION}"

    def can_compile(self) -> str | None:
        missing = [m for m in ("jax", "torchax") if importlib.util.find_spec(m) is None]
        return f"{' and '.join(missing)} not installed: {INSTALL}" if missing else None

    def can_load(self) -> str | None:
        # model.jax is a jax.export module: running it needs JAX only, not torchax.
        return None if importlib.util.find_spec("jax") else f"jax not installed: {INSTALL}"

    def incompatible(self, manifest) -> str | None:
        # Running needs the JAX that serialized model.jax, not the torchax that lowered it.
        import jax

        if f"-jax-{jax.__version__}-" not in manifest.backend.version:
            return f"built with {manifest.backend.version}, this machine has jax {jax.__version__}"
        return None

    def opening(self, manifest) -> None:
        self._world = manifest.parallel.world_size
        use_compilation_cache(manifest.digest())

    def compile(self, program: "ExportedProgram", specs: Specs, out_dir: Path) -> CompileResult:
        lowered = lower(program, specs)
        (out_dir / HLO_PROTO).write_bytes(lowered.hlo_proto)
        (out_dir / HLO_TEXT).write_text(lowered.hlo_text)
        (out_dir / JAX_MODULE).write_bytes(lowered.jax_module)
        return CompileResult([HLO_PROTO, HLO_TEXT, JAX_MODULE], XlaExtra(lowered.mutated))

    def load(self, art_dir: Path, record: ArtifactRecord) -> Program:
        import jax

        if self._world > 1:  # model.jax is one replica's module: see ReplicaProgram
            return ReplicaProgram(self, art_dir / HLO_PROTO, record.extra.mutated)
        exported = jax.export.deserialize(bytearray((art_dir / JAX_MODULE).read_bytes()))
        return JaxProgram(self, exported, record.extra.mutated, module_weights(exported, art_dir / JAX_MODULE))

    def device_for(self, rank: int = 0, world_size: int = 1) -> Device:
        if self._device is None:
            if world_size > 1:
                join_replicas(rank, world_size)
            self._device = JaxDevice(0 if world_size > 1 else rank)  # a rank's process has one local device
        return self._device

    def reference(self, art_dir: Path, record: ArtifactRecord) -> Program | None:
        return hlo_reference(art_dir, record)

    def signature(self, art_dir: Path) -> list[tuple[list[int], str]]:
        import jax

        exported = jax.export.deserialize(bytearray((art_dir / JAX_MODULE).read_bytes()))
        # Without JAX's x64 mode, int64 inputs are int32 in the module (see lower()).
        return [(list(a.shape), str(a.dtype).replace("int32", "int64")) for a in exported.in_avals]

    def weight_paths(self, art_dir: Path) -> list[str]:
        import jax

        return module_weights(jax.export.deserialize(bytearray((art_dir / JAX_MODULE).read_bytes())), art_dir / JAX_MODULE)

    def bisector(self) -> Bisector:
        # The HLO compiler an xla bundle is bisected with: neuronx-cc at its defaults
        # (aotc bisect --compiler runs another with the same argv). Found by name, as a
        # bundle's backend is: neuron is built on xla and imports it, not the other way.
        return get_backend_class("neuron")().bisector()
