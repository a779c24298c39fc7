"""Inter-operator planning of a traced loss: layers (markers or clustering), per-stage
costs on every submesh, and the stage DP. Plain data in, a `PipelinePlan` out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from jax.extend import core as jcore

from autopar.boundary import is_stage_boundary
from autopar.pipeline.layer_clustering import cluster_layers, op_sequence_from_jaxpr
from autopar.pipeline.method import PipeshardParallel
from autopar.pipeline.op_costs import aval_bytes, eqn_flops
from autopar.pipeline.stage_cost import (DeviceModel, LayerProfile, StageCost, as_stage_cost,
                                         roofline_stage_cost)
from autopar.pipeline.stage_dp import stage_dp
from autopar.pipeline.submesh import assign_devices, logical_mesh_shapes, submesh_shapes


@dataclass(frozen=True)
class PipelinePlan:
    """Where each stage runs and what it computes, with predicted costs."""

    layer_cuts: tuple[int, ...]                       # equation index where each layer starts (+ end)
    stage_layers: tuple[tuple[int, int], ...]         # per stage: layers [start, end)
    submeshes: tuple[tuple[int, int], ...]            # per stage: (hosts, devices per host)
    logical_meshes: tuple[tuple[int, int], ...]       # per stage: (data, model) view
    device_ids: tuple[tuple[int, ...], ...]           # per stage: indices into the device list
    stage_costs: tuple[StageCost, ...]
    layer_profiles: tuple[LayerProfile, ...]
    num_micro_batches: int
    schedule: str
    predicted_latency_s: float
    planning_s: float = 0.0

    @property
    def stage_eqn_cuts(self) -> list[int]:
        """Equation index where each stage starts, plus the end."""
        return [self.layer_cuts[a] for a, _ in self.stage_layers] + [self.layer_cuts[-1]]


def marker_cuts(jaxpr: Any) -> list[int] | None:
    """Layer cuts right after each `mark_stage_boundary` marker; None without markers."""
    marks = [k + 1 for k, e in enumerate(jaxpr.eqns) if is_stage_boundary(e)]
    if not marks:
        return None
    cuts = sorted({0, len(jaxpr.eqns), *marks})
    return [c for i, c in enumerate(cuts) if i == 0 or c > cuts[i - 1]]


def layer_profiles(jaxpr: Any, cuts: Sequence[int], diff_mask: Sequence[bool]) -> list[LayerProfile]:
    """FLOPs, parameter bytes, kept activation bytes and outgoing bytes of each layer."""
    params = {v for v, d in zip(jaxpr.invars, diff_mask) if d}
    layer_of = {}
    for li in range(len(cuts) - 1):
        for k in range(cuts[li], cuts[li + 1]):
            layer_of[k] = li
    producer = {}
    for k, e in enumerate(jaxpr.eqns):
        for v in e.outvars:
            producer[v] = k
    sent = [0.0] * (len(cuts) - 1)
    seen_sent = set()
    for k, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if isinstance(v, jcore.Var) and v in producer:
                src = layer_of[producer[v]]
                if src < layer_of[k] and (v, src) not in seen_sent:
                    seen_sent.add((v, src))
                    sent[src] += aval_bytes(v.aval)
    out = []
    for li in range(len(cuts) - 1):
        eqns = jaxpr.eqns[cuts[li]:cuts[li + 1]]
        read = {v for e in eqns for v in e.invars if isinstance(v, jcore.Var) and v in params}
        out.append(LayerProfile(
            flops=sum(eqn_flops(e) for e in eqns),
            param_bytes=float(sum(aval_bytes(v.aval) for v in read)),
            activation_bytes=float(sum(aval_bytes(v.aval) for e in eqns for v in e.outvars)),
            boundary_bytes=float(sent[li])))
    return out


def micro_batch_size(jaxpr: Any, diff_mask: Sequence[bool]) -> int | None:
    """Leading dimension of the loss's first batched (non-parameter) input."""
    for v, d in zip(jaxpr.invars, diff_mask):
        if not d and len(v.aval.shape) > 0:
            return int(v.aval.shape[0])
    return None


def in_flight(schedule: str, stages_from_here: int, num_micro_batches: int) -> int:
    """Micro-batches whose activations a stage keeps: 1F1B min(s, B), GPipe B."""
    return min(stages_from_here, num_micro_batches) if schedule == "1f1b" else num_micro_batches


def cost_tensors(layers: Sequence[LayerProfile], submeshes: Sequence[tuple[int, int]],
                 max_stages: int, method: PipeshardParallel,
                 cost_fn: Callable[[tuple[int, int], tuple[int, int], tuple[int, int]], StageCost],
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """time, once-per-step time and memory [L, L, M, S, K] for the stage DP: layers i..j on
    submesh m as its k-th logical mesh, with the micro-batches in flight when s stages
    (this one included) run from layer i on. Missing logical meshes are infinite."""
    L, M, S, B = len(layers), len(submeshes), max_stages, method.num_micro_batches
    K = max(len(logical_mesh_shapes(sub)) for sub in submeshes)
    time = np.full((L, L, M, 1, K), np.inf)
    it = np.zeros((L, L, M, 1, K))
    weight = np.zeros((L, L, M, 1, K))
    act = np.zeros((L, L, M, 1, K))
    for i in range(L):
        for j in range(i, L):
            for m, sub in enumerate(submeshes):
                for k, lm in enumerate(logical_mesh_shapes(sub)):
                    c = cost_fn((i, j + 1), sub, lm)
                    time[i, j, m, 0, k] = c.micro_batch_s
                    it[i, j, m, 0, k] = c.iteration_s
                    weight[i, j, m, 0, k] = c.weight_bytes
                    act[i, j, m, 0, k] = c.activation_bytes
    flight = np.array([in_flight(method.schedule, s, B) for s in range(1, S + 1)], dtype=np.float64)
    mem = weight + act * flight[None, None, None, :, None]
    reps = (1, 1, 1, S, 1)
    return np.tile(time, reps), np.tile(it, reps), mem


def plan_layers(layers: Sequence[LayerProfile], method: PipeshardParallel, num_hosts: int,
                devices_per_host: int, device: DeviceModel,
                cost_fn: Callable[[tuple[int, int], tuple[int, int], tuple[int, int]], StageCost] | None = None,
                micro_batch_size: int | None = None) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]], list[StageCost], float]:
    """Stage DP over given layers: (stage layer ranges, submeshes, logical meshes,
    stage costs, predicted latency)."""
    L = len(layers)
    N = num_hosts * devices_per_host
    if cost_fn is None:
        cost_fn = lambda r, sub, lm: roofline_stage_cost(layers, r, sub, lm, device, micro_batch_size)
    cache: dict = {}

    def cached(r, sub, lm):
        key = (r, sub, lm)
        if key not in cache:
            cache[key] = as_stage_cost(cost_fn(r, sub, lm), layers, r, lm)
        return cache[key]

    if method.submeshes != "auto":
        fixed = list(method.submeshes)
        S = len(fixed)
        used = sum(n * m for n, m in fixed)
        if used != N:
            raise ValueError(f"submeshes {fixed} use {used} devices but there are {N} "
                             f"({num_hosts} x {devices_per_host}); give shapes that cover all devices")
        if S > L:
            raise ValueError(f"{S} submeshes given but the loss has only {L} layers; "
                             "add mark_stage_boundary() markers or raise `layers`")
        time, it, mem = cost_tensors(layers, fixed, S, method, cached)
        for s in range(1, S + 1):       # s stages from here: this is stage S - s
            mask = np.ones(S, bool)
            mask[S - s] = False
            time[:, :, mask, s - 1] = np.inf
        shapes, num_stages = fixed, S
    else:
        shapes = submesh_shapes(num_hosts, devices_per_host)
        S = method.num_stages or min(L, N)
        if S > L:
            raise ValueError(f"num_stages={S} but the loss has only {L} layers; add "
                             "mark_stage_boundary() markers or raise `layers`")
        time, it, mem = cost_tensors(layers, shapes, S, method, cached)
        num_stages = method.num_stages
    res = stage_dp(time, [n * m for n, m in shapes], N, method.num_micro_batches,
                   iteration_s=it, memory_bytes=mem, memory_limit_bytes=device.memory_bytes,
                   num_stages=num_stages, imbalance_tolerance=method.imbalance_tolerance)
    ranges, subs, lms, costs = [], [], [], []
    for st in res.stages:
        sub = shapes[st.submesh]
        lm = logical_mesh_shapes(sub)[st.option]
        ranges.append((st.start, st.end))
        subs.append(sub)
        lms.append(lm)
        costs.append(cached((st.start, st.end), sub, lm))
    return ranges, subs, lms, costs, res.latency_s


def plan_pipeline(jaxpr: Any, diff_mask: Sequence[bool], method: PipeshardParallel,
                  hosts: int, dph: int, device: DeviceModel,
                  stage_cost_fn: Callable | None = None) -> PipelinePlan:
    """Layers (markers, or clustering searched over L), then the stage DP, for `hosts`
    hosts of `dph` devices. stage_cost_fn(equation range, submesh, logical mesh)."""
    import time as _time

    t0 = _time.perf_counter()
    n = len(jaxpr.eqns)
    marks = marker_cuts(jaxpr) if method.layers == "auto" else None
    if marks is not None:
        candidates = [marks]
    else:
        Ls = [method.layers] if method.layers != "auto" else sorted(
            {L for L in (2, 4, 8, 16, method.num_stages or 2) if L <= n
             and L >= (method.num_stages or 1)})
        if not Ls:
            raise ValueError(f"the loss has {n} operations, too few for {method.num_stages} stages")
        seq = op_sequence_from_jaxpr(jaxpr)
        candidates = [list(cluster_layers(seq, L).cuts) for L in Ls]
    best = None
    for cuts in candidates:
        profiles = layer_profiles(jaxpr, cuts, diff_mask)
        cost_fn = None
        if stage_cost_fn is not None:
            cost_fn = lambda r, sub, lm, _c=cuts: stage_cost_fn((_c[r[0]], _c[r[1]]), sub, lm)
        try:
            out = plan_layers(profiles, method, hosts, dph, device, cost_fn, micro_batch_size(jaxpr, diff_mask))
        except ValueError:
            if len(candidates) == 1:
                raise
            continue
        if best is None or out[-1] < best[0][-1]:
            best = (out, cuts, profiles)
    if best is None:
        raise ValueError("no pipeline plan fits the devices' memory for any layer count")
    (ranges, subs, lms, costs, latency), cuts, profiles = best
    ids = assign_devices(subs, hosts, dph)
    return PipelinePlan(tuple(cuts), tuple(ranges), tuple(subs), tuple(lms),
                        tuple(tuple(x) for x in ids), tuple(costs), tuple(profiles),
                        method.num_micro_batches, method.schedule, latency,
                        _time.perf_counter() - t0)
