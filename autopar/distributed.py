"""Multi-process (multi-host) runs on JAX's own runtime, `jax.distributed`: joining the
processes from the launcher's environment, turning host values into global arrays that
follow a plan's shardings, building a global batch from per-process slices, and making
one plan that every process uses."""
from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

ENV_COORDINATOR = "AUTOPAR_COORDINATOR"
ENV_NUM_PROCESSES = "AUTOPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "AUTOPAR_PROCESS_ID"
ENV_TRANSFER_ADDRESS = "AUTOPAR_TRANSFER_ADDRESS"
ENV_HEARTBEAT_S = "AUTOPAR_HEARTBEAT_S"
PLAN_TIMEOUT_MS = 30 * 60 * 1000
# every process makes its plans in the same order (same script), so the n-th plan of each
# process is the same plan
_plan_numbers = itertools.count()


def next_plan_key() -> str:
    return f"autopar/plan/{next(_plan_numbers)}"


def initialize_from_env() -> bool:
    """Join the run the `autopar.launch` launcher started (its AUTOPAR_* variables): gloo
    CPU collectives, a cross-host transfer socket per process, `jax.distributed.initialize`.
    Returns False (and does nothing) when the variables are not set."""
    coordinator = os.environ.get(ENV_COORDINATOR)
    if not coordinator:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    transfer = os.environ.get(ENV_TRANSFER_ADDRESS)
    if transfer:
        jax.config.update("jax_cross_host_transfer_socket_address", transfer)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=int(os.environ[ENV_NUM_PROCESSES]),
                               process_id=int(os.environ[ENV_PROCESS_ID]),
                               heartbeat_timeout_seconds=int(os.environ.get(ENV_HEARTBEAT_S, "100")))
    return True


def is_multi_process() -> bool:
    return jax.process_count() > 1


def to_global(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host value (or an uncommitted array), the same in every process, as a global
    array laid out by `sharding`: each process supplies its own devices' shards."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _mesh_of(sharding: jax.sharding.Sharding) -> Mesh:
    if isinstance(sharding, NamedSharding):
        return sharding.mesh
    return _device_mesh(list(sharding._device_assignment))


def transfer(value: Any, target: NamedSharding) -> Any:
    """`jax.device_put(value, target)` that also works with several processes. Host values
    and uncommitted arrays (the same in every process) become global arrays directly. A
    global array on other devices than the target's is replicated on its own devices, sent
    replicated to the target's devices (JAX's cross-host transfers move an array only
    between equally many devices, so in groups of that size) and resharded there."""
    if not is_multi_process():
        return jax.device_put(value, target)
    if not isinstance(value, jax.Array) or not value._committed:
        return to_global(value, target)
    src = value.sharding
    if src == target or src.device_set == target.device_set:
        return jax.device_put(value, target)
    if (len(src.device_set) == len(target.device_set)
            and src._to_xla_hlo_sharding(value.ndim) == target._to_xla_hlo_sharding(value.ndim)):
        return jax.device_put(value, target)
    rep = jax.device_put(value, replicated(_mesh_of(src)))
    there = _replicated_on(rep, list(target.mesh.devices.flat))
    return jax.device_put(there, target)


def everywhere() -> NamedSharding:
    """Replicated on every device of every process."""
    return replicated(_device_mesh(jax.devices()))


def barrier(name: str, timeout_ms: int) -> None:
    """Wait until every process reaches the barrier `name` (no-op with one process)."""
    if is_multi_process():
        _coordinator().wait_at_barrier(name, timeout_ms)


def _coordinator() -> Any:
    from jax._src import distributed

    return distributed.global_state.client


def fetch(value: Any) -> np.ndarray:
    """A global array's whole value as numpy, in every process (its shards may sit on
    other processes' devices): replicated over all devices, then read locally."""
    if not is_multi_process() or not isinstance(value, jax.Array):
        return np.asarray(value)
    return np.asarray(transfer(value, everywhere()).addressable_data(0))


def _device_mesh(devices: Sequence[Any]) -> Mesh:
    return Mesh(np.array(devices), ("devices",))


def _pick(rep: jax.Array, devices: Sequence[Any]) -> jax.Array:
    """A replicated array restricted to some of its devices (no data moves)."""
    keep = set(devices)
    shards = [s.data for s in rep.addressable_shards if s.device in keep]
    return jax.make_array_from_single_device_arrays(rep.shape, replicated(_device_mesh(devices)), shards,
                                                    dtype=rep.dtype)


def _replicated_on(rep: jax.Array, devices: Sequence[Any]) -> jax.Array:
    """The replicated array `rep` replicated on `devices` instead."""
    have = list(rep.sharding._device_assignment)
    if set(devices) <= set(have):
        return _pick(rep, devices)
    n = len(have)
    if len(devices) < n:
        rep, have, n = _pick(rep, have[:len(devices)]), have[:len(devices)], len(devices)
    parts = []
    for i in range(0, len(devices), n):
        group = devices[i:i + n] if i + n <= len(devices) else devices[-n:]
        parts.append(jax.device_put(rep, replicated(_device_mesh(group))))
    shards, seen = [], set()
    for part in parts:
        for s in part.addressable_shards:
            if s.device not in seen:
                seen.add(s.device)
                shards.append(s.data)
    return jax.make_array_from_single_device_arrays(rep.shape, replicated(_device_mesh(devices)), shards,
                                                    dtype=rep.dtype)


def global_batch(local: Any, devices: Sequence[Any] | None = None) -> Any:
    """The global batch from each process's slice of it: every leaf of `local` holds this
    process's rows (the same count in every process) and the result is a pytree of global
    arrays split along axis 0 over `devices` (default all), process 0's rows first."""
    devices = list(devices) if devices is not None else jax.devices()
    mesh = Mesh(np.array(sorted(devices, key=lambda d: (d.process_index, d.id))), ("batch",))
    sharding = NamedSharding(mesh, PartitionSpec("batch"))
    return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local)


def shared_text(key: str, make: Callable[[], str]) -> str:
    """`make()` run on process 0 only, its result handed to every process through the
    coordinator's key-value store (so every process runs the same plan, even where the
    planner's solver time limits could make two runs differ). Single-process: `make()`."""
    if not is_multi_process():
        return make()
    client = _coordinator()
    if jax.process_index() == 0:
        try:
            text = make()
        except Exception as e:  # the others must not wait out the timeout for a plan that never comes
            client.key_value_set(key, "error:" + f"{type(e).__name__}: {e}")
            raise
        client.key_value_set(key, "ok:" + text)
        return text
    status, _, text = client.blocking_key_value_get(key, PLAN_TIMEOUT_MS).partition(":")
    if status != "ok":
        raise RuntimeError(f"planning failed on process 0 ({text}); see its output")
    return text
