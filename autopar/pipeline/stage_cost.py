"""Cost of running a range of layers as one pipeline stage on a submesh.

`StageCost` is what the stage DP needs; `roofline_stage_cost` is the default estimate
(FLOPs over peak, Megatron-style tensor-parallel all-reduces of the layer boundary,
data-parallel gradient all-reduce) until the intra-op ILP cost is plugged in through a
`stage_cost_fn(layer_range, submesh_shape, logical_mesh_shape)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class StageCost:
    """Per-device cost of one stage: time of one micro-batch (forward + backward), time
    once per step (gradient all-reduce, update), and memory with k micro-batches alive."""

    micro_batch_s: float
    iteration_s: float = 0.0
    weight_bytes: float = 0.0
    activation_bytes: float = 0.0   # per micro-batch in flight

    def memory_bytes(self, in_flight: int) -> float:
        return self.weight_bytes + in_flight * self.activation_bytes


@dataclass(frozen=True)
class LayerProfile:
    """One clustered layer, per micro-batch: forward FLOPs, parameter bytes, bytes kept
    for the backward pass, and bytes it sends to later layers."""

    flops: float
    param_bytes: float
    activation_bytes: float
    boundary_bytes: float
    model_parallel_bytes: float | None = None   # all-reduced over the model axis per
    # micro-batch, forward + backward; None: 4 x boundary_bytes (Megatron: 2 + 2 per layer)


@dataclass(frozen=True)
class DeviceModel:
    """What the roofline needs of a cluster: per-device peak and memory, link speeds."""

    peak_flops: float
    memory_bytes: float
    devices_per_host: int
    intra_host_Bps: float
    inter_host_Bps: float
    latency_s: float = 5e-6
    state_bytes_per_param_byte: float = 4.0   # params + grads + 2 Adam moments
    memory_bandwidth_Bps: float = float("inf")  # HBM/DRAM; streams kept activations


def device_model_from_cluster(cluster: Any, dtype: str = "float32",
                              state_bytes_per_param_byte: float = 4.0) -> DeviceModel:
    """Read an `autopar.cluster.Cluster` into the plain numbers the roofline uses."""
    return DeviceModel(cluster.device.peak_flops_for(dtype), float(cluster.device.memory_bytes),
                       cluster.devices_per_host, cluster.intra_host.bandwidth_Bps,
                       cluster.inter_host.bandwidth_Bps, cluster.intra_host.latency_s,
                       state_bytes_per_param_byte, cluster.device.memory_bandwidth_Bps)


def all_reduce_s(nbytes: float, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """Ring all-reduce: 2 (n-1)/n of the bytes over the slowest link, 2 (n-1) hops."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth_Bps + 2 * (n - 1) * latency_s


def roofline_stage_cost(layers: Sequence[LayerProfile], layer_range: tuple[int, int],
                        submesh: tuple[int, int], logical_mesh: tuple[int, int],
                        device: DeviceModel, micro_batch_size: int | None = None) -> StageCost:
    """Layers [start, end) on `submesh` viewed as (data, model) = `logical_mesh`.

    Compute: 3x forward FLOPs over all devices, plus streaming the kept activations
    through device memory 3 times (written forward, read and their gradients written
    backward). Model axis: 4 all-reduces of each layer's boundary activation per
    micro-batch (2 forward, 2 backward; Megatron). Data axis: one all-reduce of the
    stage's gradients per step. A data axis that does not divide `micro_batch_size`
    (when given) is impossible: infinite time.
    """
    dp, tp = logical_mesh
    if micro_batch_size is not None and micro_batch_size % dp:
        return StageCost(float("inf"))
    n_hosts, per_host = submesh
    sel = layers[layer_range[0]:layer_range[1]]
    flops = 3.0 * sum(l.flops for l in sel)
    params = sum(l.param_bytes for l in sel)
    acts = sum(l.activation_bytes for l in sel)
    tp_bw = device.intra_host_Bps if tp <= per_host else device.inter_host_Bps
    dp_bw = device.inter_host_Bps if n_hosts > 1 else device.intra_host_Bps
    compute = flops / (dp * tp * device.peak_flops) + 3 * acts / (dp * tp) / device.memory_bandwidth_Bps
    tp_comm = sum(all_reduce_s((4 * l.boundary_bytes if l.model_parallel_bytes is None
                                else l.model_parallel_bytes) / dp, tp, tp_bw, device.latency_s)
                  for l in sel)
    dp_comm = all_reduce_s(params / tp, dp, dp_bw, device.latency_s)
    return StageCost(micro_batch_s=compute + tp_comm, iteration_s=dp_comm,
                     weight_bytes=params / tp * device.state_bytes_per_param_byte,
                     activation_bytes=acts / (dp * tp))


StageCostFn = Callable[[tuple[int, int], tuple[int, int], tuple[int, int]], Any]


def as_stage_cost(value: Any, layers: Sequence[LayerProfile], layer_range: tuple[int, int],
                  logical_mesh: tuple[int, int]) -> StageCost:
    """Accept a `StageCost` or the ILP's `(time_s, memory_bytes)`: the latter is memory
    with one micro-batch in flight; extra in-flight micro-batches add this range's
    activation bytes (split over the mesh)."""
    if isinstance(value, StageCost):
        return value
    try:
        time_s, memory_bytes = value
    except (TypeError, ValueError):
        raise TypeError(f"stage_cost_fn must return a StageCost or (time_s, memory_bytes), "
                        f"got {value!r}") from None
    acts = sum(l.activation_bytes for l in layers[layer_range[0]:layer_range[1]])
    acts /= logical_mesh[0] * logical_mesh[1]
    return StageCost(float(time_s), 0.0, float(memory_bytes) - acts, acts)
