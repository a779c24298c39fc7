"""A layer's intra-op ILP solution on one logical mesh, and what it costs per device.

The ILP shards the layer's train graph (forward + backward of one micro-batch). Its
activation output is returned in the layout of the matching activation input, so a
stack of identical layers hands activations on without resharding (the ILP pays the
reshard when one is needed), parameter gradients come back in their parameters' layouts
(the accumulators and the optimizer update use them) and the cotangent arriving for an
output is charged its reshard from the layout the next layer returns it in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Container, Sequence

from autopar.cluster import LogicalMesh
from autopar.intra_op import IDENTITY_PRIMITIVES, MemoryBudgetError, ShardingPlan, live_ops, plan_sharding
from autopar.pipeline.layer_graph import LayerGraph
from autopar.sharding_costs import ShardingCosts
from autopar.sharding_spec import Collective, DimSharding, all_layouts, shard_factor
from rockmate.graph.fusion import liveness_levels, materialized


@dataclass(frozen=True)
class WorkingMemory:
    """A program's working memory on a share of the sequence's positions (a token slice):
    max over the program's points k of fixed[k] + share * per_position[k]. Points that
    another point exceeds at every share are dropped."""

    fixed: tuple[float, ...]
    per_position: tuple[float, ...]

    def bytes_at(self, share: float = 1.0) -> float:
        return max((f + share * p for f, p in zip(self.fixed, self.per_position)), default=0.0)

    @property
    def whole(self) -> float:
        """On whole sequences."""
        return self.bytes_at(1.0)

    @staticmethod
    def from_levels(fixed: Sequence[float], per_position: Sequence[float]) -> "WorkingMemory":
        """From the fixed and per-position bytes alive at each point of a program."""
        kept: list[tuple[float, float]] = []
        for f, p in sorted(zip(fixed, per_position), key=lambda x: (-x[1], -x[0])):
            if not kept or f > kept[-1][0]:     # beats every point with more per-position bytes at share 0
                kept.append((f, p))
        return WorkingMemory(fixed=tuple(f for f, _ in kept), per_position=tuple(p for _, p in kept))


@dataclass(frozen=True)
class LayerCost:
    """Layer on a logical mesh: its layouts and per-device costs for one micro-batch."""

    mesh_shape: tuple[int, int]
    plan: ShardingPlan                  # on the layer's train graph
    time_s: float                       # forward + backward (the ILP objective)
    forward_s: float                    # the part of it spent in forward ops
    residual_bytes: float               # kept per micro-batch in flight
    param_bytes: tuple[float, ...]      # per param input, in its layout
    forward_working: "WorkingMemory"    # transient working memory of the forward
    backward_working: "WorkingMemory"   # ... and of the backward

    @property
    def forward_peak_bytes(self) -> float:
        return self.forward_working.whole

    @property
    def backward_peak_bytes(self) -> float:
        return self.backward_working.whole

    @property
    def var_specs(self) -> dict[int, DimSharding]:
        return self.plan.var_specs

    @property
    def out_specs(self) -> tuple[DimSharding, ...]:
        return self.plan.out_specs

    @property
    def collectives(self) -> tuple[Collective, ...]:
        return self.plan.collectives


def _pairs(lg: LayerGraph) -> dict[int, int]:
    """out_act index -> in_act index of the same shape and dtype (in order)."""
    free = list(range(len(lg.spec.in_acts)))
    out = {}
    specs = lg.graph.vars
    for k, v in enumerate(lg.out_vars):
        for j in free:
            if specs[lg.act_vars[j]] == specs[v]:
                out[k] = j
                free.remove(j)
                break
    return out


def layer_ties(lg: LayerGraph) -> tuple[dict[int, int], list[tuple[int, int]]]:
    """tie_outputs (output position -> input position) and tie_vars for the layer ILP."""
    g = lg.graph
    pos = {v: i for i, v in enumerate(g.invars)}
    ties: dict[int, int] = {}
    pairs = _pairs(lg)
    for k, j in pairs.items():
        ties[k] = pos[lg.act_vars[j]]
    n_out = len(lg.spec.out_acts)
    for i, v in enumerate(lg.param_vars):
        ties[n_out + i] = pos[v]
    for j, v in enumerate(lg.act_grad_vars):
        if v is not None:
            ties[g.outvars.index(v, n_out)] = pos[lg.act_vars[j]]
    tie_vars = []
    for k, ct in enumerate(lg.ct_vars):
        if ct is not None:
            tie_vars.append((lg.act_vars[pairs[k]] if k in pairs else lg.out_vars[k], ct))
    return ties, tie_vars


def per_device_bytes(lg: LayerGraph, specs: dict[int, DimSharding], mesh_shape: tuple[int, int], v: int) -> float:
    spec = specs.get(v)
    return lg.graph.vars[v].nbytes / (shard_factor(spec, mesh_shape) if spec else 1)


def roofline_device_s(lg: LayerGraph, device: Any) -> float:
    """Seconds one device would spend on the layer's live ops at peak speed (FLOPs at the
    fastest peak of the op's dtypes, or the bytes it keeps in memory at full bandwidth).
    Divided by a mesh's device count it bounds the ILP objective from below: the ILP
    charges every op at least its FLOPs and bytes split evenly over the mesh."""
    return roofline_s(lg.graph, device)


def roofline_s(g: Any, device: Any, skip: Container[int] = ()) -> float:
    """`roofline_device_s` of any op graph (its live ops but `skip`, on one device)."""
    kept = materialized(g)
    total = 0.0
    for i in live_ops(g):
        op = g.ops[i]
        if op.name in IDENTITY_PRIMITIVES or i in skip:
            continue
        vs = [v for v in (*op.inputs, *op.outputs) if v not in g.literals]
        peak = max((device.peak_flops_for(g.vars[v].dtype) for v in vs), default=device.peak_flops_for("float32"))
        total += max(op.flops / peak, device.memory_s(sum(g.vars[v].nbytes for v in vs if v in kept)))
    return total


PARAM_MODES = ("fast", "sharded")


def most_sharded(shape: tuple[int, ...], mesh_shape: tuple[int, int]) -> list[DimSharding]:
    """The layouts of a tensor that cut it into the most pieces on the mesh."""
    layouts = all_layouts(shape, mesh_shape)
    top = max(shard_factor(l, mesh_shape) for l in layouts)
    return [l for l in layouts if shard_factor(l, mesh_shape) == top]


def solve_layer(lg: LayerGraph, mesh: LogicalMesh, *, params: str = "fast", time_limit_s: float = 30.0,
                solver: str = "highs", costs: ShardingCosts | None = None) -> LayerCost:
    """The layer's ILP on `mesh` (no memory bound: the stage DP checks memory).
    params="sharded" restricts every parameter to its most sharded layouts (ZeRO-3 or
    tensor parallel, as the ILP prefers): the least parameter memory at the best time."""
    ties, tie_vars = layer_ties(lg)
    allowed = {v: most_sharded(lg.graph.vars[v].shape, mesh.shape) for v in lg.param_vars} if params == "sharded" else None
    plan = plan_sharding(lg.graph, mesh, tie_outputs=ties, tie_vars=tie_vars, allowed_specs=allowed,
                         time_limit_s=time_limit_s, solver=solver, costs=costs)
    return layer_cost(lg, mesh, plan)


def layer_cost(lg: LayerGraph, mesh: LogicalMesh, plan: ShardingPlan) -> LayerCost:
    """Per-device costs of a layer under given layouts."""
    g, ms, specs = lg.graph, mesh.shape, plan.var_specs
    size = lambda v: per_device_bytes(lg, specs, ms, v)
    # an operand read in another layout than it lives in is copied for its reader (e.g. a
    # sharded parameter gathered whole): that copy is alive while the reader runs
    copies: dict[int, float] = {}
    position_copies: dict[int, float] = {}
    for op, v, spec in plan.resharded:
        into = position_copies if v in lg.per_position_vars else copies
        into[op] = into.get(op, 0.0) + g.vars[v].nbytes / shard_factor(spec, ms)
    fwd, bwd = working_memory(lg, size, copies, position_copies)
    fwd_s = sum(_op_time(plan, i) for i in range(lg.num_forward_ops))
    return LayerCost(mesh_shape=ms, plan=plan, time_s=plan.objective_s, forward_s=min(fwd_s, plan.objective_s),
                     residual_bytes=sum(size(v) for v in lg.residuals),
                     param_bytes=tuple(size(v) for v in lg.param_vars), forward_working=fwd, backward_working=bwd)


def working_memory(lg: LayerGraph, size: Callable[[int], float], transient: dict[int, float] | None = None,
                   transient_per_position: dict[int, float] | None = None) -> tuple[WorkingMemory, WorkingMemory]:
    """Working memory of the layer's forward and of its backward, values sized by `size`,
    split into what is fixed and what shrinks with a token slice (`per_position_vars`).
    The forward's residuals leave it (counted per micro-batch in flight); its activation
    outputs and the backward's gradients are working memory until the next layer takes
    them or they are added into the accumulators. `transient`: extra bytes alive while
    an op runs (copies of operands), fixed or `transient_per_position`."""
    g = lg.graph
    residual = set(lg.residuals)
    keep = materialized(g, residual)
    outs = set(g.outvars)
    nf = lg.num_forward_ops
    tok = lg.per_position_vars
    out = []
    for ops, live_out, counted in ((range(nf), residual | outs, lambda v: v in keep and v not in residual),
                                   (range(nf, len(g.ops)), outs, lambda v: v in keep)):
        fixed, per_position = (liveness_levels(g, ops, size, live_out=live_out,
                                               count=lambda v, t=t: counted(v) and (v in tok) == t,
                                               transient=transient_per_position if t else transient)
                                for t in (False, True))
        out.append(WorkingMemory.from_levels(fixed, per_position))
    return out[0], out[1]


def global_working_bytes(lg: LayerGraph, share: float = 1.0) -> float:
    """The layer's working memory (the larger of `working_memory`) at unsharded sizes, on
    `share` of the sequence's positions: over a mesh of n devices, at least this / n is
    live on some device whatever the layouts."""
    return float(max(w.bytes_at(share) for w in working_memory(lg, lambda v: lg.graph.vars[v].nbytes)))


def _op_time(plan: ShardingPlan, index: int) -> float:
    return plan.op_time_s.get(index, 0.0)


def shrinks_evenly(big: LayerGraph, small: LayerGraph, mesh_shape: tuple[int, int]) -> bool:
    """True when `small` is `big`'s train graph on fewer samples and every layout valid for
    `big` on the mesh is valid for `small`: the same ops in the same order over the same
    vars, and every dim that differs divisible at its smaller size by each product of
    mesh axes that divides it at the larger. Then the ILP of `small` chooses among (at
    least) the same layouts with every cost term no larger (compute, memory traffic and
    collectives grow with the bytes), so its optimum bounds `big`'s from below."""
    g, h = big.graph, small.graph
    if len(g.ops) != len(h.ops) or g.vars.keys() != h.vars.keys() or g.invars != h.invars:
        return False
    if any(a.name != b.name or a.inputs != b.inputs or a.outputs != b.outputs for a, b in zip(g.ops, h.ops)):
        return False
    a, b = mesh_shape
    factors = {f for f in (a, b, a * b) if f > 1}
    for v, spec in g.vars.items():
        other = h.vars[v].shape
        if len(spec.shape) != len(other) or spec.dtype != h.vars[v].dtype:
            return False
        for x, y in zip(spec.shape, other):
            if x != y and (y > x or any(x % f == 0 and y % f for f in factors)):
                return False
    return True


class LayerSolver:
    """Layer ILP solutions cached by layer content and logical mesh (identical layers on
    the same mesh are one solve), their roofline bounds, and the strategies and reshard
    costs the ILPs and stage compositions share (`costs`). Everything is keyed by content,
    so it lives as long as the `PipeshardParallel` that owns it and serves all of that
    method's planning runs."""

    def __init__(self, time_limit_s: float = 30.0, solver: str = "highs"):
        self.time_limit_s, self.solver = time_limit_s, solver
        self.costs = ShardingCosts()
        self._solved: dict[tuple[str, Any], LayerCost] = {}
        self._roofline: dict[tuple[str, Any], float] = {}
        self.solves = 0

    def __call__(self, lg: LayerGraph, mesh: LogicalMesh, params: str = "fast") -> LayerCost:
        key = (lg.key, mesh, params)
        free = self._solved.get((lg.key, mesh, "fast"))
        if params == "sharded" and key not in self._solved and free is not None and all(
                shard_factor(free.var_specs.get(v, ()), mesh.shape) ==
                shard_factor(most_sharded(lg.graph.vars[v].shape, mesh.shape)[0], mesh.shape)
                for v in lg.param_vars):
            self._solved[key] = free      # the free optimum already shards every parameter most
        if key not in self._solved:
            self.solves += 1
            try:
                self._solved[key] = solve_layer(lg, mesh, params=params, time_limit_s=self.time_limit_s,
                                                solver=self.solver, costs=self.costs)
            except MemoryBudgetError:
                raise AssertionError("layer ILPs have no memory bound") from None
        return self._solved[key]

    def lower_bound(self, lg: LayerGraph, mesh: LogicalMesh) -> float:
        """A lower bound of the layer's ILP objective on `mesh` (no solve)."""
        key = (lg.key, mesh.device)
        if key not in self._roofline:
            self._roofline[key] = roofline_device_s(lg, mesh.device)
        return self._roofline[key] / mesh.num_devices
