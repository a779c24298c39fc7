"""The pipeline planner: layers, stages, submeshes, intra-stage shardings, remat and the
number of micro-batches, decided together.

For each candidate number of micro-batches B and layer count L, the stage DP (Alpa) runs
over (layer range, submesh, option) candidates whose option is a logical mesh of the
submesh and a remat choice. A candidate's cost comes from the intra-op ILP of each of its
layers on that logical mesh (`layer_cost`), composed into a stage (`stage.compose`).
ILPs are only solved where the DP needs them: every candidate starts at a roofline lower
bound, the DP runs, and the logical meshes its solution uses are priced exactly; this
repeats until the solution uses only exactly priced candidates, which makes it optimal
(every other candidate costs at least its bound). Across B and L the same bound prunes:
a (B, L) whose lower-bound pipeline is no faster than the best exact one is skipped.
Identical layers on one logical mesh are one ILP solve.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from autopar.attention import ATTENTION_CALL, attention_calls
from autopar.cluster import Cluster, LogicalMesh
from autopar.pipeline.layer_cost import LayerCost, LayerSolver, global_working_bytes, shrinks_evenly
from autopar.pipeline.layer_graph import LayerGraph, content_key, trace_layer
from autopar.pipeline.layers import LayerSpec, clustered_cuts, cut_layers, marker_cuts, repeat_cuts
from autopar.pipeline.method import PipeshardParallel
from autopar.pipeline.stage import PlacedStage, StageCost, StageLayers, compose, stage_layers, working_bytes
from autopar.pipeline.best_first import Refinement, best_first
from autopar.pipeline.stage_dp import StageDPResult, lazy_stage_dp, lazy_stage_dp_steps, stage_dp
from autopar.pipeline.submesh import assign_devices, logical_mesh_shapes
from autopar.pipeline.trace import StepTracer, TracedStep
from rockmate.graph import graph_from_jaxpr

REMAT_OPTIONS = ("none", "rockmate", "full")   # per stage: keep all, a rockmate schedule, checkpoint each layer
PARAM_MODES = ("fast", "sharded")   # the layer ILP free, or with every parameter most sharded
MAX_LAYERS = 16     # repeated blocks are grouped into at most this many layers


@dataclass(frozen=True)
class StageDecision:
    """One chosen stage: its layers, where it runs, its layer layouts and its cost."""

    layers: StageLayers
    costs: tuple[LayerCost, ...]
    submesh: tuple[int, int]
    logical_mesh: tuple[int, int]
    device_ids: tuple[int, ...]
    cost: StageCost
    remat: str
    in_flight: int
    param_mode: str = "fast"

    def working_bytes_at(self, share: float) -> float:
        """The stage's working memory per device on token slices of `share` of its tokens."""
        return working_bytes(self.layers.layers, self.costs, share, self.cost.context_bytes)

    def placed(self) -> PlacedStage:
        return PlacedStage(layers=self.layers, layouts=self.costs, device_indices=self.device_ids,
                           logical_mesh=self.logical_mesh)


@dataclass(frozen=True)
class PipelineDecision:
    """The planner's result for one train step."""

    traced: TracedStep
    layer_cuts: tuple[int, ...]
    stages: tuple[StageDecision, ...]
    num_micro_batches: int
    latency_s: float
    search: dict[str, Any] = field(default_factory=dict)


def in_flight(schedule: str, stages_from_here: int, num_micro_batches: int) -> int:
    """Micro-batches whose activations a stage keeps: 1F1B min(s, B), GPipe B."""
    return min(stages_from_here, num_micro_batches) if schedule == "1f1b" else num_micro_batches


@dataclass(frozen=True)
class LayerBounds:
    """What the roofline bounds of a layering need, per layer: the device-seconds of its
    forward + backward at peak (for this cluster's device), and the global bytes of its
    residuals and parameters."""

    device_s: tuple[float, ...]
    residual_bytes: tuple[float, ...]
    param_bytes: tuple[float, ...]


def op_roofline_terms(lg: LayerGraph, device: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per live op of the layer's train graph: FLOPs, bytes kept in memory, peak FLOP/s."""
    from autopar.intra_op import IDENTITY_PRIMITIVES, live_ops
    from rockmate.graph.fusion import materialized

    g = lg.graph
    kept = materialized(g)
    flops, nbytes, peak = [], [], []
    for i in sorted(live_ops(g)):
        op = g.ops[i]
        if op.name in IDENTITY_PRIMITIVES:
            continue
        vs = [v for v in (*op.inputs, *op.outputs) if v not in g.literals]
        flops.append(op.flops)
        nbytes.append(sum(g.vars[v].nbytes for v in vs if v in kept))
        peak.append(max((device.peak_flops_for(g.vars[v].dtype) for v in vs), default=device.peak_flops_for("float32")))
    return np.array(flops, float), np.array(nbytes, float), np.array(peak, float)


class _Candidates:
    """The stage DP's candidate costs for one (B, L): tensors [L, L, M, S, K] over (layer
    range, submesh, stage count, option), option = (logical mesh, parameter mode, remat).
    A candidate starts at its roofline lower bound; once the ILP has solved all its
    layers' contents for that option it holds its exact cost (layers solved so far
    tighten the bound). The layers are traced only when a candidate is priced: bounds
    come from `LayerBounds`, which the planner can interpolate between micro-batch sizes."""

    def __init__(self, planner: "PipelinePlanner", B: int, c: int, shapes, num_stages_max: int):
        self.planner, self.B, self.c = planner, B, c
        self.cuts = planner.cut_options()[c]
        self.bounds = planner.layer_bounds(B, c)
        self.shapes = list(shapes)
        self.logical = [logical_mesh_shapes(sub) for sub in self.shapes]
        L, M, S = len(self.cuts) - 1, len(self.shapes), num_stages_max
        self.R, self.P = len(REMAT_OPTIONS), len(PARAM_MODES)
        self.remats = [r for r, remat in enumerate(REMAT_OPTIONS) if remat in planner.remat_options]
        self.K = max(len(x) for x in self.logical) * self.P * self.R
        self.S = S
        self.flight = np.array([in_flight(planner.method.schedule, s, B) for s in range(1, S + 1)], dtype=np.float64)
        shape = (L, L, M, 1, self.K)
        self.time = np.full(shape, np.inf)
        self.iteration = np.zeros(shape)
        self.weight = np.zeros(shape)
        self.act = np.zeros(shape)
        self.working = np.zeros(shape)
        self.update = np.zeros(shape)
        self.priced = np.zeros(shape, bool)
        self.solved: dict[tuple[int, int, int, int], dict[str, LayerCost]] = {}   # (m, k, p, r) -> key -> solution
        self.costs: dict[tuple, StageCost] = {}
        self._absorbed: dict[tuple, int] = {}    # (B, option) of another problem -> its layers solved when last refilled
        self._stale: set[tuple[int, int, int, int]] = set()     # options to refill (`flush`)
        self._layers: dict[int, list[LayerGraph]] = {}
        self._working: dict[int, list[float]] = {}
        self.context = np.asarray(planner.context_bytes(c, self.B))
        self.smaller = {(m, k): scaled_down_meshes(self.mesh(m, k), [(mm, kk, self.mesh(mm, kk)) for mm in range(M)
                                                                     for kk in range(len(self.logical[mm]))])
                        for m in range(M) for k in range(len(self.logical[m]))}
        self.larger: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for big, smalls in self.smaller.items():
            for mm, kk, _ in smalls:
                self.larger.setdefault((mm, kk), []).append(big)
        for m in range(M):
            for k in range(len(self.logical[m])):
                for p in range(self.P):
                    for r in self.remats:
                        self._fill(m, k, p, r)

    @property
    def traced(self) -> TracedStep:
        return self.planner.tracer.at(self.B)

    def layers(self, r: int) -> list[LayerGraph]:
        """The layers' train graphs with remat option r (traced on first use)."""
        if r not in self._layers:
            self._layers[r] = self.planner.layer_graphs(self.traced, self.cuts, REMAT_OPTIONS[r])
        return self._layers[r]

    def keys(self, r: int) -> list[str]:
        return [lg.key for lg in self.layers(r)]

    def mesh(self, m: int, k: int) -> LogicalMesh:
        return self.planner.logical_mesh(self.logical[m][k])

    def is_exact(self, i: int, j: int, m: int, k: int, p: int, r: int) -> bool:
        done = self.solved.get((m, k, p, r))
        return done is not None and all(key in done for key in self.keys(r)[i:j + 1])

    def _fill(self, m: int, k: int, p: int, r: int) -> None:
        """(Re)compute the entries of one option on one submesh: exact where every layer of
        the range is solved, else layer costs and bounds summed (a bound: reshards,
        transfers, the update and working memory only add)."""
        mesh = self.mesh(m, k)
        n = mesh.num_devices
        done = self.solved.get((m, k, p, r), {})
        L = len(self.cuts) - 1
        keys = self.keys(r) if done else [None] * L
        # identical layers (the same content in every problem the bound reads) share it
        related = [(o, q) for o in (self, *self._fewer(), *self._more()) for q in sorted({0, r}) if q in o._layers]
        bounds: dict[tuple, float] = {}

        def bound(l: int) -> float:
            same = (self.bounds.device_s[l], tuple(o.keys(q)[l] for o, q in related))
            if same not in bounds:
                bounds[same] = self._layer_bound(m, k, p, r, l)
            return bounds[same]

        per_time = np.array([done[key].time_s if key in done else bound(l) for l, key in enumerate(keys)])
        residual = self._residual_bytes(r)
        per_act = np.array([done[key].residual_bytes if key in done else b / n for key, b in zip(keys, residual)])
        per_act = per_act + self.context / n
        per_weight = np.array(self.bounds.param_bytes) * (2 + self.planner.state_factor) / n
        c_time, c_act, c_w = (np.concatenate([[0.0], np.cumsum(x)]) for x in (per_time, per_act, per_weight))
        per_working = np.array(self._working_bytes(r)) / n
        if self.planner.slice_share < 1:      # each layer's keys and values over the context, and their cotangents
            per_working = per_working + 2 * self.context / n
        o = self.index(k, p, r)
        # bounds of every range at once ([i, j]: layers i..j), then the exact entries over them
        seg = lambda c: c[None, 1:] - c[:-1, None]
        working = np.array([np.maximum.accumulate(np.concatenate([np.zeros(i), per_working[i:]]))
                            for i in range(L)]) if L else np.zeros((0, 0))
        unsolved = np.concatenate([[0], np.cumsum([key not in done for key in keys])])
        upper = np.triu(np.ones((L, L), bool))
        self.time[:, :, m, 0, o] = np.where(upper, seg(c_time), self.time[:, :, m, 0, o])
        self.weight[:, :, m, 0, o] = np.where(upper, seg(c_w), self.weight[:, :, m, 0, o])
        self.act[:, :, m, 0, o] = np.where(upper, seg(c_act), self.act[:, :, m, 0, o])
        self.working[:, :, m, 0, o] = np.where(upper, working, self.working[:, :, m, 0, o])
        self.iteration[:, :, m, 0, o] = np.where(upper, 0.0, self.iteration[:, :, m, 0, o])
        self.update[:, :, m, 0, o] = np.where(upper, 0.0, self.update[:, :, m, 0, o])
        exact = upper & (seg(unsolved) == 0) if done else np.zeros((L, L), bool)
        send = self.planner.send_s_per_byte(self.shapes[m])
        for i, j in zip(*np.nonzero(exact)):
            c = self.costs.get((i, j, m, k, p, r))
            if c is None:
                layers = self.layers(r)
                c = self.costs[(i, j, m, k, p, r)] = compose(
                    stage_layers(layers[i:j + 1], layers), [done[key] for key in keys[i:j + 1]], mesh,
                    state_bytes_per_param_byte=self.planner.state_factor, send_s_per_byte=send,
                    reshard=self.planner.solver.costs.reshard, share=self.planner.slice_share,
                    context_bytes=tuple(self.context[i:j + 1] / n))
            (self.time[i, j, m, 0, o], self.iteration[i, j, m, 0, o], self.weight[i, j, m, 0, o],
             self.act[i, j, m, 0, o], self.working[i, j, m, 0, o], self.update[i, j, m, 0, o]) = (
                c.micro_batch_s, c.iteration_s, c.weight_bytes, c.activation_bytes, c.working_bytes, c.update_bytes)
            self.priced[i, j, m, 0, o] = True
        if (p, r) != (0, 0):
            # a memory option (parameters restricted, forward recomputed) is never faster
            # than the free plain one: its priced per-step time bounds too
            for i, j in zip(*np.nonzero(~exact & self.priced[:, :, m, 0, self.index(k, 0, 0)])):
                free = self.costs[(i, j, m, k, 0, 0)]
                self.time[i, j, m, 0, o] = max(self.time[i, j, m, 0, o], free.micro_batch_s)
                self.iteration[i, j, m, 0, o] = free.iteration_s

    def _residual_bytes(self, r: int) -> list[float]:
        """Per layer, the global bytes of what its forward keeps with remat option r (spread
        over the mesh, a lower bound of what a device keeps): known for the plain option
        from the bounds, for a remat option once its layers are traced, else 0."""
        if r in self._layers:
            return [lg.residual_nbytes for lg in self._layers[r]]
        return list(self.bounds.residual_bytes) if r == 0 else [0.0] * (len(self.cuts) - 1)

    def _working_bytes(self, r: int) -> list[float]:
        """Per layer, its working memory at unsharded sizes (on the planned token slices)
        once traced with option r, else 0."""
        if r not in self._layers:
            return [0.0] * (len(self.cuts) - 1)
        if r not in self._working:
            self._working[r] = [global_working_bytes(lg, self.planner.slice_share) for lg in self._layers[r]]
        return self._working[r]

    def _layer_bound(self, m: int, k: int, p: int, r: int, l: int) -> float:
        """A lower bound of layer l's ILP objective in an option: its roofline, or what a
        less constrained option already costs. Parameters restricted to their most
        sharded layouts only restrict the free ILP; a checkpointed forward adds its
        recomputation to the same forward and backward ops. (So these are options for
        memory: the DP prices them only where the plain option does not fit or they
        could still be faster.)"""
        bound = self.bounds.device_s[l] / self.mesh(m, k).num_devices
        if r != 0 and r in self._layers:      # the recomputation's FLOPs count too
            bound = max(bound, self.planner.solver.lower_bound(self._layers[r][l], self.mesh(m, k)))
        # what this or a problem with fewer, larger micro-batches solved: the same layer in
        # a less constrained option (here), in this option there (B'/B times its time,
        # `_scaled_bound`), or on a mesh this one scales up (parallel efficiency is at most 1)
        for other in (self, *self._fewer()):
            scale = other.B / self.B
            for q, s in {(p, r), (0, r), (p, 0), (0, 0)} - ({(p, r)} if other is self else set()):
                hit = other.solved.get((m, k, q, s)) if q <= p and s <= r and s in other._layers else None
                solution = hit.get(other.keys(s)[l]) if hit else None
                if solution is not None:
                    bound = max(bound, solution.time_s * scale)
            for mm, kk, factor in self.smaller[(m, k)]:
                for s in {0, r}:
                    hit = other.solved.get((mm, kk, 0, s)) if s in other._layers else None
                    solution = hit.get(other.keys(s)[l]) if hit else None
                    if solution is not None:
                        bound = max(bound, solution.time_s * scale / factor)
        # ... or what a problem with more, smaller micro-batches solved, unscaled, where the
        # layer's layouts survive the shrinking on the mesh solved (`shrinks_evenly`): here,
        # or on a mesh this one scales up
        for other in self._more():
            for mm, kk, q, s, factor in ([(m, k, q, s, 1) for q, s in {(p, r), (0, r), (p, 0), (0, 0)}]
                                         + [(mm, kk, 0, s, f) for mm, kk, f in self.smaller[(m, k)] for s in {0, r}]):
                hit = other.solved.get((mm, kk, q, s)) if s in other._layers and s in self._layers else None
                solution = hit.get(other.keys(s)[l]) if hit else None
                if solution is not None and solution.time_s / factor > bound and self.planner.shrinks_evenly(
                        self.layers(s)[l], other.layers(s)[l], self.logical[mm][kk]):
                    bound = solution.time_s / factor
        return bound

    def _fewer(self) -> list["_Candidates"]:
        """The candidate sets of the same layers and submeshes for a number of micro-batches
        dividing B: their layers are these on micro-batches an integer factor larger."""
        return [o for o in self.planner.problems_like(self) if o.B < self.B and self.B % o.B == 0]

    def _more(self) -> list["_Candidates"]:
        """The candidate sets of the same layers and submeshes for a multiple of B micro-batches."""
        return [o for o in self.planner.problems_like(self) if o.B > self.B and o.B % self.B == 0]

    def _absorb(self) -> None:
        """Mark stale the options for which a problem with fewer or more micro-batches solved
        layers since the last look: their solutions bound these layers (`_layer_bound`)."""
        for other in (*self._fewer(), *self._more()):
            for option, done in other.solved.items():
                seen = self._absorbed.get((other.B, option), 0)
                if len(done) > seen:
                    self._absorbed[(other.B, option)] = len(done)
                    self._stale |= self._bounded_by(*option)

    def price(self, i: int, j: int, m: int, k: int, p: int, r: int, flush: bool = True) -> None:
        """Solve the ILP of every layer content of range i..j not yet solved for this
        option, then refresh its candidates (with flush=False, at the next `flush`: the
        lazy DP prices several stages before it reads the tensors again)."""
        mesh = self.mesh(m, k)
        done = self.solved.setdefault((m, k, p, r), {})
        for key, lg in zip(self.keys(r)[i:j + 1], self.layers(r)[i:j + 1]):
            if key not in done:
                done[key] = self.planner.solver(lg, mesh, PARAM_MODES[p])
        self._stale |= self._bounded_by(m, k, p, r)
        if flush:
            self.flush()

    def trace_option(self, r: int) -> bool:
        """Trace the layers with remat option r if not yet done, and tighten the bounds of
        every candidate with that option by what the traced layers keep, hold while they
        run and recompute. True if it traced (the lazy DP then re-solves before pricing:
        the tighter bounds may rule the candidate out without an ILP)."""
        if r in self._layers:
            return False
        self.layers(r)
        self._stale.update((m, k, q, r) for m in range(len(self.shapes))
                           for k in range(len(self.logical[m])) for q in range(self.P))
        return True

    def flush(self) -> None:
        """Refill each option that solves or traces made stale, once; on each mesh the free
        option first (the others read its prices)."""
        for option in sorted(self._stale):
            self._fill(*option)
        self._stale.clear()

    def _bounded_by(self, m: int, k: int, p: int, r: int) -> set[tuple[int, int, int, int]]:
        """The options whose entries a solve of option (p, r) on mesh (m, k) prices or bounds:
        it and the more constrained options on that mesh, and with the free parameter mode
        the same options on meshes scaled up from it."""
        out = set()
        for q in range(self.P):
            for s in self.remats:
                if q >= p and s >= r:
                    out.add((m, k, q, s))
                    if p == 0:
                        out.update((mm, kk, q, s) for mm, kk in self.larger.get((m, k), ()))
        return out

    def tensors(self):
        """(time, once-per-step time, memory) [L, L, M, S, K] for the stage DP. A bound is
        nudged up by 1e-9 of itself so that, between a priced candidate and a bound of the
        same value, the DP takes the priced one instead of pricing the other."""
        self._absorb()
        self.flush()
        reps = (1, 1, 1, self.S, 1)
        f = self.flight[None, None, None, :, None]
        mem = self.weight + np.maximum(self.act * f + self.working, self.update)
        time_s = np.where(self.priced, self.time, np.maximum(self.time, self._scaled_bound()) * (1 + 1e-9))
        return np.tile(time_s, reps), np.tile(self.iteration, reps), mem

    def _scaled_bound(self) -> np.ndarray:
        """Bounds from fewer, larger micro-batches: a candidate's time per micro-batch divided
        by its micro-batch size never grows when the micro-batch shrinks by an integer factor
        (every cost term is a maximum or minimum of affine functions of the size with
        non-negative intercepts, and a layout valid for b samples is valid for k*b), so a
        candidate priced at B' micro-batches bounds the same one at B = k B' by B'/B times
        its time."""
        out = np.zeros_like(self.time)
        for other in self._fewer():
            other.flush()
            out = np.maximum(out, np.where(other.priced, other.time * other.B / self.B, 0.0))
        return out

    def index(self, k: int, p: int, r: int) -> int:
        return (k * self.P + p) * self.R + r

    def option(self, o: int) -> tuple[int, int, int]:
        """(logical mesh, parameter mode, remat) of option index o."""
        kp, r = divmod(o, self.R)
        k, p = divmod(kp, self.P)
        return k, p, r

    @property
    def meshes_priced(self) -> int:
        return len({(m, k) for m, k, _, _ in self.solved})


class PipelinePlanner:
    """One planning run of PipeshardParallel on a cluster: its caches (traces, layer
    graphs, ILP solves) live as long as it does."""

    def __init__(self, tracer: StepTracer, method: PipeshardParallel, cluster: Cluster,
                 memory_limit_bytes: float, time_limit_s: float = 30.0, remat: str = "auto",
                 solver: LayerSolver | None = None):
        self.tracer, self.method, self.cluster = tracer, method, cluster
        if remat not in ("auto", *REMAT_OPTIONS):
            raise ValueError(f"remat={remat!r}; use 'auto', 'none', 'rockmate' or 'full'")
        self.remat_options = REMAT_OPTIONS if remat == "auto" else (remat,)
        self.memory_limit_bytes = memory_limit_bytes
        # the layer ILPs depend on layer content and mesh only: a solver kept by the method
        # serves every planning run it makes (another budget, cluster or batch)
        self.solver = solver if solver is not None else LayerSolver(time_limit_s=time_limit_s, solver=method.solver)
        self._solves_before = self.solver.solves
        self._layer_graphs: dict[tuple[int, str, str], Any] = {}
        self._shrinks: dict[tuple[str, str, tuple[int, int]], bool] = {}
        self.state_factor = optimizer_state_factor(tracer)
        self.dp_runs = 0
        self._meshes: dict[tuple[int, int], LogicalMesh] = {}
        self._problems: dict[tuple, _Candidates] = {}
        self._bounds: dict[tuple[int, int], LayerBounds] = {}
        self._terms: dict[tuple[int, int], list] = {}
        self._cut_options: list[list[int]] | None = None
        # token slices (TeraPipe): stage memory is planned with the working memory of the
        # longest slice, this share of the sequence's positions (1: whole sequences)
        self.slice_share = 1.0
        # ... and the stage DP's latency counts this many work items per micro-batch, each
        # 1/k of its time: sum of stage times + (B k - 1) x the slowest, k times TeraPipe's
        # latency of equal slices (a sliced pipeline fills with items, so the stages are
        # chosen for the slowest one more than for their sum)
        self.items_per_micro_batch = 1
        self._context: dict[int, list[float]] = {}

    # --- layers ---------------------------------------------------------------------
    def layer_graphs(self, traced: TracedStep, cuts: Sequence[int], remat: str = "none") -> list[LayerGraph]:
        """Train graphs of the layers at `cuts`; identical layers are traced once."""
        specs = cut_layers(traced.loss, cuts, traced.diff_mask)
        out = []
        for spec in specs:
            key = content_key(traced.loss, spec, remat)
            hit = self._layer_graphs.get((traced.num_micro_batches, key, remat))
            if hit is None:
                lg = trace_layer(traced.loss, spec, remat)
                self._layer_graphs[(traced.num_micro_batches, key, remat)] = lg
            else:
                lg = _rebind(hit, spec)
            out.append(lg)
        return out

    def layer_bounds(self, B: int, c: int) -> LayerBounds:
        """Roofline terms of the c-th layering at B micro-batches. Traced at B when the
        step is (or B is one of the first two candidates); otherwise interpolated from
        those two: every op's FLOPs and bytes are affine in the micro-batch size, so the
        bound is exact without tracing at every B."""
        key = (B, c)
        if key in self._bounds:
            return self._bounds[key]
        Bs = self.micro_batch_candidates()
        refs = Bs[:2]
        device = self.cluster.device
        if B in refs or len(refs) < 2 or B in self.tracer.traced_counts:
            lgs = self.layer_graphs(self.tracer.at(B), self.cut_options()[c])
            terms = [op_roofline_terms(lg, device) for lg in lgs]
            residual = [lg.residual_nbytes for lg in lgs]
            params = [float(sum(lg.graph.vars[v].nbytes for v in lg.param_vars)) for lg in lgs]
            out = LayerBounds(tuple(float(np.sum(np.maximum(f / pk, b / device.memory_bandwidth_Bps)))
                                    for f, b, pk in terms), tuple(residual), tuple(params))
            self._terms[key] = terms
        else:
            (a, b) = refs
            ta, tb = self.layer_bounds(a, c), self.layer_bounds(b, c)      # traces the references
            ma, mb = self.tracer.at(a).micro_batch_size or 1, self.tracer.at(b).micro_batch_size or 1
            m = ma * a / B
            w = (m - ma) / (mb - ma)
            device_s = []
            for (fa, ba, pk), (fb, bb, _) in zip(self._terms[(a, c)], self._terms[(b, c)]):
                f = np.maximum(fa + w * (fb - fa), 0.0)
                nb = np.maximum(ba + w * (bb - ba), 0.0)
                device_s.append(float(np.sum(np.maximum(f / pk, nb / device.memory_bandwidth_Bps))))
            out = LayerBounds(tuple(device_s), tuple(max(x + w * (y - x), 0.0) for x, y in
                                                     zip(ta.residual_bytes, tb.residual_bytes)), ta.param_bytes)
        self._bounds[key] = out
        return out

    def layer_cut_candidates(self, traced: TracedStep) -> list[list[int]]:
        """With layers="auto": the loss's markers, else its repeated blocks, else Alpa's
        clustering for several L; with an int L, clustering into L layers."""
        n = len(traced.loss.ops)
        stages = self._shapes()[1] or 1
        if self.method.layers == "auto":
            marks = marker_cuts(traced.loss)
            if marks is not None:
                return [marks]
            blocks = repeat_cuts(traced.loss, max_layers=max(MAX_LAYERS, stages))
            if blocks is not None and len(blocks) - 1 >= stages:
                return [blocks]
            Ls = sorted({L for L in (2, 4, 8, 16, stages) if stages <= L <= n})
        else:
            Ls = [self.method.layers]
        if not Ls or max(Ls) > n:
            raise ValueError(f"the loss has {n} operations, too few for {max(Ls, default=self.method.num_stages)} layers")
        return [clustered_cuts(traced.loss, L) for L in Ls]

    def shrinks_evenly(self, big: LayerGraph, small: LayerGraph, mesh_shape: tuple[int, int]) -> bool:
        """`layer_cost.shrinks_evenly`, once per pair of layer contents and mesh shape."""
        key = (big.key, small.key, mesh_shape)
        if key not in self._shrinks:
            self._shrinks[key] = shrinks_evenly(big, small, mesh_shape)
        return self._shrinks[key]

    def logical_mesh(self, shape: tuple[int, int]) -> LogicalMesh:
        if shape not in self._meshes:
            self._meshes[shape] = self.cluster.logical_mesh(shape)
        return self._meshes[shape]

    def send_s_per_byte(self, submesh: tuple[int, int]) -> float:
        """Seconds per byte to hand an activation to the next stage: across hosts when the
        submesh fills whole hosts of a multi-host cluster, else inside one."""
        c = self.cluster
        link = c.inter_host if c.num_hosts > 1 and submesh[1] == c.devices_per_host else c.intra_host
        return link.beta_s_per_byte

    # --- the search -----------------------------------------------------------------
    def _shapes(self) -> tuple[list[tuple[int, int]], int | None, tuple[int, ...] | None]:
        """The submesh shapes the DP may use, the number of stages (None: free) and, with
        given submeshes, the index into those shapes of each stage's submesh (identical
        shapes appear once, so 48 given (1, 8) submeshes are one candidate shape)."""
        c = self.cluster
        if self.method.submeshes != "auto":
            fixed = [tuple(s) for s in self.method.submeshes]
            used = sum(n * m for n, m in fixed)
            if used != c.num_devices:
                raise ValueError(f"submeshes {fixed} use {used} devices but there are {c.num_devices} "
                                 f"({c.num_hosts} x {c.devices_per_host}); give shapes that cover all devices")
            shapes = list(dict.fromkeys(fixed))
            return shapes, len(fixed), tuple(shapes.index(s) for s in fixed)
        return c.submesh_shapes(), self.method.num_stages, None

    def _dp(self, cand: _Candidates, time_s, it, mem, num_stages, fixed, limit: float | None = None) -> StageDPResult:
        if fixed is not None:
            time_s = _restrict_to_given(cand, time_s, fixed)
        self.dp_runs += 1
        return stage_dp(time_s, [n * m for n, m in cand.shapes], self.cluster.num_devices,
                        cand.B * self.items_per_micro_batch, iteration_s=it, memory_bytes=mem,
                        **self._dp_kwargs(num_stages, limit))

    def _solve_exact(self, cand: _Candidates, num_stages, fixed, limit: float | None = None) -> StageDPResult:
        """The lazy DP (`stage_dp.lazy_stage_dp`) over these candidates."""
        return lazy_stage_dp(*self._lazy_args(cand, num_stages, fixed), priced=self._priced(cand),
                             tolerance=self.method.planning_tolerance, **self._dp_kwargs(num_stages, limit))

    def _refine(self, cand: _Candidates, num_stages, fixed) -> Iterator[Refinement]:
        """The candidates' bound pipeline (one DP), then the lazy DP's steps (`best_first`).
        The first step solves the DP again when this (B, L) is next refined, on bounds other
        counts' solves have tightened meanwhile: pricing from the first, stale solution costs
        more ILPs (GPT-39B: 410 instead of 390)."""
        yield Refinement(lower_s=self._dp(cand, *cand.tensors(), num_stages, fixed).latency_s)
        yield from lazy_stage_dp_steps(
            *self._lazy_args(cand, num_stages, fixed), **self._dp_kwargs(num_stages, None),
            priced=self._priced(cand) if self.method.planning_tolerance > 0 else None)

    def _dp_kwargs(self, num_stages, limit: float | None) -> dict[str, Any]:
        return dict(num_stages=num_stages, imbalance_tolerance=self.method.imbalance_tolerance,
                    memory_limit_bytes=self.memory_limit_bytes if limit is None else limit)

    @staticmethod
    def _priced(cand: _Candidates) -> Callable[[], np.ndarray]:
        return lambda: np.tile(cand.priced, (1, 1, 1, cand.S, 1))

    def _lazy_args(self, cand: _Candidates, num_stages, fixed) -> tuple:
        """(tensors, is_exact, price, submesh sizes, devices, work items) of the lazy DP."""
        def tensors():      # one per DP run
            self.dp_runs += 1
            time_s, it, mem = cand.tensors()
            return _restrict_to_given(cand, time_s, fixed) if fixed is not None else time_s, it, mem

        def exact(st, _s):
            return cand.is_exact(st.start, st.end - 1, st.submesh, *cand.option(st.option))

        def price(st, _s):
            k, p, r = cand.option(st.option)
            if not cand.trace_option(r):
                cand.price(st.start, st.end - 1, st.submesh, k, p, r, flush=False)

        return (tensors, exact, price, [n * m for n, m in cand.shapes], self.cluster.num_devices,
                cand.B * self.items_per_micro_batch)

    def problems_like(self, cand: _Candidates) -> list[_Candidates]:
        """The candidate sets for other numbers of micro-batches with the same layers and submeshes."""
        return [p for (B, c, shapes), p in self._problems.items()
                if p is not cand and c == cand.c and list(shapes) == cand.shapes]

    def micro_batch_candidates(self) -> list[int]:
        B = self.method.num_micro_batches
        return self.tracer.micro_batch_counts() if B == "auto" else [B]

    def cut_options(self) -> list[list[int]]:
        """Layer cuts to try (op indices of the micro-batch loss), checked against num_stages."""
        if self._cut_options is None:
            cuts = self.layer_cut_candidates(self.tracer.at(self.micro_batch_candidates()[0]))
            stages = self._shapes()[1]
            if stages is not None:
                longest = max(len(c) - 1 for c in cuts)
                if stages > longest:
                    raise ValueError(f"{stages} stages but the loss has only {longest} layers; add "
                                     f"mark_stage_boundary() markers, raise `layers`, or use fewer stages")
                cuts = [c for c in cuts if len(c) - 1 >= stages]
            self._cut_options = cuts
        return self._cut_options

    def problem(self, B: int, c: int, shapes: Sequence[tuple[int, int]] | None = None,
                num_stages: int | None = None) -> _Candidates:
        """The candidates for B micro-batches and the c-th layer cuts (cached)."""
        shapes = self._shapes()[0] if shapes is None else list(shapes)
        key = (B, c, tuple(shapes))
        if key not in self._problems:
            cuts = self.cut_options()[c]
            S = num_stages or self._shapes()[1] or min(len(cuts) - 1, self.cluster.num_devices)
            self._problems[key] = _Candidates(self, B, c, shapes, S)
        return self._problems[key]

    def context_bytes(self, c: int, B: int) -> list[float]:
        """Per layer of the c-th layering, the global bytes of the keys and values its
        `causal_attention` calls keep per micro-batch (of B) as the later token slices'
        context; zeros without token slices."""
        cuts = self.cut_options()[c]
        if self.method.token_slices == 1:
            return [0.0] * (len(cuts) - 1)
        traced = self.tracer.at(self.micro_batch_candidates()[0])
        if c not in self._context:
            marked = graph_from_jaxpr(traced.loss_jaxpr, keep_custom_rules=True, mark_calls=ATTENTION_CALL)
            layer = [0.0] * (len(cuts) - 1)
            for m, (inputs, _) in marked.call_io.items():
                first = min(op.index for op in marked.ops if op.mark == m)
                layer[bisect.bisect_right(cuts, first) - 1] += sum(marked.vars[v].nbytes for v in inputs[1:3])
            self._context[c] = [b / traced.micro_batch_size for b in layer]     # per sequence
        size = traced.micro_batch_size * traced.num_micro_batches / B
        return [b * size for b in self._context[c]]

    def token_lengths(self) -> tuple[int, tuple[int, ...] | None]:
        """The sequence length of the loss's `causal_attention` calls and the slice lengths
        asked for (None: "auto")."""
        from autopar.pipeline.token_plan import requested_lengths, sequence_length

        traced = self.tracer.at(self.micro_batch_candidates()[0])
        T = sequence_length(attention_calls(traced.loss_jaxpr), self.method.token_slices)
        ts = self.method.token_slices
        return T, None if ts == "auto" else requested_lengths(ts, T)

    def plan(self) -> PipelineDecision:
        """The best pipeline. With token slices, stage memory is planned for the longest
        slice asked for; with token_slices="auto" for whole sequences first and, if no
        plan fits, for the shortest slices the token DP may cut (which it then keeps to
        what fits, `token_plan.slice_caps`). The stage DP's latency counts the slices asked
        for, or with "auto" the most the token DP may cut, as work items."""
        from autopar.intra_op import MemoryBudgetError

        if self.method.token_slices == 1:
            return self._plan()
        from autopar.pipeline.token_plan import MAX_UNITS
        from autopar.pipeline.token_dp import granularity_for

        T, lengths = self.token_lengths()
        g = granularity_for(T, MAX_UNITS)
        self.slice_share = 1.0 if lengths is None else max(lengths) / T
        self.items_per_micro_batch = T // g if lengths is None else len(lengths)
        try:
            return self._plan()
        except MemoryBudgetError:
            if lengths is not None:
                raise
        self.slice_share = g / T
        self._problems.clear()
        return self._plan()

    def _plan(self) -> PipelineDecision:
        Bs = self.micro_batch_candidates()
        cut_options = self.cut_options()
        _, num_stages, fixed = self._shapes()
        keys = [(B, c) for B in Bs for c in range(len(cut_options))]
        try:
            found = best_first(keys, lambda key: self._refine(self.problem(*key), num_stages, fixed),
                               self.method.planning_tolerance)
        except ValueError:
            need = min((self._min_memory(self.problem(*k), num_stages, fixed) for k in keys), default=math.inf)
            if not math.isfinite(need):
                raise ValueError("no pipeline fits the devices at any memory budget: the submeshes cannot "
                                 "cover the devices with these stages; change num_stages or submeshes") from None
            from autopar.intra_op import MemoryBudgetError

            sliced = None
            if self.method.token_slices != 1:
                T, _ = self.token_lengths()
                sliced = (f"Stage memory is planned for token slices of {round(self.slice_share * T)} of the "
                          f"{T} tokens (their working memory) and whole sequences' residuals and keys and values "
                          f"in flight: raise memory_budget, use more devices, shorter slices or shorter sequences "
                          f"(rematerialization is already on)")
            raise MemoryBudgetError(self.memory_limit_bytes, need, (1, self.cluster.num_devices), remat_on=True,
                                    what=f"no pipeline plan ({self.method.schedule}, micro-batches "
                                         f"{'/'.join(map(str, Bs))}) with sharded parameters or remat",
                                    advice=sliced) from None
        key, res = found.candidate, found.result
        cand = self.problem(*key)
        decision = self._decide(cand, res)
        search = {"micro_batch_candidates": tuple(Bs), "micro_batch_evaluated": tuple(sorted({k[0] for k in found.refined})),
                  "layer_counts": tuple(len(c) - 1 for c in cut_options), "ilp_solves": self.solver.solves - self._solves_before,
                  "dp_runs": self.dp_runs, "meshes_priced": sum(p.meshes_priced for p in self._problems.values())}
        latency = res.latency_s
        if self.items_per_micro_batch > 1:     # the DP's objective counted slices: the step with whole ones
            times = [d.cost.micro_batch_s for d in decision]
            latency = sum(times) + sum(d.cost.iteration_s for d in decision) + (cand.B - 1) * max(times)
        return PipelineDecision(cand.traced, tuple(cand.cuts), decision, cand.B, latency, search)

    def _min_memory(self, cand: _Candidates, num_stages, fixed, rel_tol: float = 0.02) -> float:
        """The smallest per-device memory limit under which a plan of these candidates
        exists (to within rel_tol): bisection on the limit, each step the lazy DP."""
        def feasible(limit: float, exact: bool) -> bool:
            try:
                (self._solve_exact if exact else lambda *a: self._dp(cand, *cand.tensors(), *a))(
                    *((cand, num_stages, fixed, limit) if exact else (num_stages, fixed, limit)))
                return True
            except ValueError:
                return False

        if not feasible(math.inf, False):
            return math.inf
        values = np.unique(cand.tensors()[2][np.isfinite(cand.time)[..., :1, :].repeat(cand.S, 3)])
        lo_i, hi_i = 0, len(values) - 1
        while lo_i < hi_i:       # the bound's minimum: no plan needs less
            mid = (lo_i + hi_i) // 2
            lo_i, hi_i = (lo_i, mid) if feasible(values[mid], False) else (mid + 1, hi_i)
        lo = hi = float(values[lo_i])
        while not feasible(hi, True):
            lo, hi = hi, hi * 1.5
        while hi > lo * (1 + rel_tol):
            mid = (lo * hi) ** 0.5
            lo, hi = (lo, mid) if feasible(mid, True) else (mid, hi)
        return hi

    def _decide(self, cand: _Candidates, res: StageDPResult) -> tuple[StageDecision, ...]:
        c = self.cluster
        subs = [cand.shapes[st.submesh] for st in res.stages]
        ids = assign_devices(subs, c.num_hosts, c.devices_per_host)
        out = []
        S = len(res.stages)
        for n, (st, dev) in enumerate(zip(res.stages, ids)):
            k, p, r = cand.option(st.option)
            layers = cand.layers(r)
            done = cand.solved[(st.submesh, k, p, r)]
            out.append(StageDecision(
                stage_layers(layers[st.start:st.end], layers),
                tuple(done[key] for key in cand.keys(r)[st.start:st.end]), cand.shapes[st.submesh],
                cand.logical[st.submesh][k], tuple(dev), cand.costs[(st.start, st.end - 1, st.submesh, k, p, r)],
                REMAT_OPTIONS[r], in_flight(self.method.schedule, S - n, cand.traced.num_micro_batches),
                PARAM_MODES[p]))
        return tuple(out)


def scaled_down_meshes(mesh: LogicalMesh, others: Sequence[tuple[int, int, LogicalMesh]]
                       ) -> list[tuple[int, int, int]]:
    """The meshes among `others` (index pairs with their mesh) that are `mesh` with one axis
    divided by an integer factor f >= 2 and links no slower: any layouts on `mesh` run on
    such a mesh with every compute, memory and collective time at most f times larger
    (the pieces are at most f times bigger, a ring over fewer devices moves no more per
    byte), so a layer's ILP objective on `mesh` is at least 1/f of its objective there.
    Returns (index, index, f)."""
    out = []
    a, b = mesh.shape
    for mm, kk, o in others:
        x, y = o.shape
        if o.device != mesh.device or (x, y) == (a, b):
            continue
        for axis, (big, small, keep_big, keep_small) in enumerate(((a, x, b, y), (b, y, a, x))):
            other = 1 - axis
            if keep_big != keep_small or big % small:
                continue
            if keep_small > 1 and (o.alpha_s[other] > mesh.alpha_s[other]
                                   or o.beta_s_per_byte[other] > mesh.beta_s_per_byte[other]):
                continue
            if small > 1 and (o.alpha_s[axis] > mesh.alpha_s[axis]
                              or o.beta_s_per_byte[axis] > mesh.beta_s_per_byte[axis]):
                continue
            out.append((mm, kk, big // small))
            break
    return out


def _restrict_to_given(cand: _Candidates, time_s: np.ndarray, order: Sequence[int]) -> np.ndarray:
    """With given submeshes, the k-th stage (S - k stages from the end) must use shape
    order[k]."""
    S = cand.S
    time_s = time_s.copy()
    for s in range(1, S + 1):
        mask = np.ones(len(cand.shapes), bool)
        mask[order[S - s]] = False
        time_s[:, :, mask, s - 1] = np.inf
    return time_s


def _rebind(lg: LayerGraph, spec: LayerSpec) -> LayerGraph:
    """The same train graph for another layer with identical content."""
    from dataclasses import replace

    return replace(lg, spec=spec)


def optimizer_state_factor(tracer: StepTracer) -> float:
    """Bytes of optimizer state per byte of parameters: step inputs the update reads that
    are neither parameters nor batch, against the differentiated parameters."""
    step, g = tracer.step, tracer.step.ops[tracer.grad_op]
    params = {v for v, d in zip(g.inputs, tracer.call.diff_leaf_mask) if d}
    param_bytes = sum(step.vars[v].nbytes for v in params)
    read_after = {v for op in step.ops[tracer.grad_op + 1:] for v in op.inputs}
    before = {v for op in step.ops[:tracer.grad_op] for v in op.inputs} | set(g.inputs)
    state = [v for v in step.invars if v in read_after and v not in params and v not in before
             and step.vars[v].ndim > 0]
    return sum(step.vars[v].nbytes for v in state) / param_bytes if param_bytes else 0.0
