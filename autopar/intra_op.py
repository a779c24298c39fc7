"""Alpa's intra-op pass: pick one sharding strategy per op by an ILP on a 2-D mesh.

Objective = per-device compute time + communication inside ops + resharding on edges
(replicated compute is therefore penalised). Ops that can only follow their operand are
merged into the operand's node before solving. Per-device memory at the liveness peaks
(arguments, i.e. parameters and optimizer state, plus live activations) stays under the
budget. See `assignment_ilp` for the solver.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from autopar import assignment_ilp as ilp
from autopar.cluster import LogicalMesh
from rockmate.graph.op_graph import Op, OpGraph, TensorSpec
from rockmate.graph.fusion import materialized
from rockmate.repeats import representatives, tandem_repeats
from autopar.sharding_spec import Collective, DimSharding, Strategy, all_layouts, replicated, shard_factor
from autopar.sharding_costs import ShardingCosts
from autopar.strategies import is_follower
from autopar.strategies.elementwise import ELEMENTWISE_PRIMITIVES

NUM_MEMORY_CHECKPOINTS = 6
# Ops that return their operands unchanged (barriers and autopar's own markers): each result
# takes its operand's layout, at no cost.
IDENTITY_PRIMITIVES = frozenset({"optimization_barrier", "autopar_phase_boundary", "autopar_stage_boundary"})


class MemoryBudgetError(ValueError):
    """No sharding fits the per-device memory budget."""

    def __init__(self, budget_bytes: float, min_bytes: float, mesh_shape: tuple[int, int], remat_on: bool = False,
                 what: str | None = None, advice: str | None = None):
        self.budget_bytes, self.min_bytes = budget_bytes, min_bytes
        where = what or f"no sharding on mesh {mesh_shape[0]}x{mesh_shape[1]}"
        advice = advice or ("Raise memory_budget or use more devices (rematerialization is already on)" if remat_on
                            else "Raise memory_budget, use more devices, or turn rematerialization on (remat='auto')")
        super().__init__(
            f"{where} fits the memory budget of {budget_bytes / 2**20:.1f} MiB per device; the smallest budget "
            f"that fits is about {min_bytes / 2**20:.1f} MiB ({int(math.ceil(min_bytes))} bytes). {advice}.")


@dataclass(frozen=True)
class ShardingPlan:
    """The ILP's decision for one program on one mesh, plus its predicted costs."""

    mesh_shape: tuple[int, int]
    var_specs: dict[int, DimSharding]      # every graph invar and op output
    op_strategies: dict[int, str]          # op index -> strategy name
    out_specs: tuple[DimSharding, ...]     # layout of each graph output as returned
    objective_s: float
    compute_s: float
    comm_s: float
    reshard_s: float
    peak_memory_bytes: float               # per device, at the liveness checkpoints
    argument_bytes: float                  # per device
    collectives: tuple[Collective, ...]
    solver_status: str
    solve_time_s: float
    num_nodes: int
    num_variables: int
    op_time_s: dict[int, float] = field(default_factory=dict)   # first op of each ILP node -> its time
    resharded: tuple[tuple[int, int, DimSharding], ...] = ()      # (reading op, var, layout it is read in)

    @property
    def comm_bytes(self) -> float:
        return float(sum(c.nbytes for c in self.collectives))


@dataclass
class _Choice:
    cost_s: float
    comm_s: float
    reshard_s: float
    out: dict[int, DimSharding]
    req: list[DimSharding]                 # aligned with _Group.req_vars
    names: dict[int, str]
    colls: list[Collective]


@dataclass
class _Group:
    choices: list[_Choice]
    req_vars: list[int] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)


class _Reshard:
    """Reshard costs on one mesh, from the planning run's memo."""

    def __init__(self, mesh: LogicalMesh, costs: ShardingCosts):
        self.mesh, self.costs = mesh, costs

    def __call__(self, src: DimSharding, dst: DimSharding, spec: TensorSpec) -> tuple[float, tuple[Collective, ...]]:
        return self.costs.reshard(src, dst, spec, self.mesh)

    def matrix(self, src: Sequence[DimSharding], dst: Sequence[DimSharding], spec: TensorSpec) -> np.ndarray:
        """Seconds from each layout of `src` (rows) into each of `dst` (columns)."""
        return self.costs.reshard_matrix(src, dst, spec, self.mesh)


def _scan_strategies(op: Op, mesh: LogicalMesh, time_limit_s: float, solver: str, costs: ShardingCosts
                     ) -> list[Strategy]:
    """A scan keeps one body plan (solved once, carry layouts tied) plus the replicated fallback."""
    body = op.body
    nc, nk = op.params["num_consts"], op.params["num_carry"]
    n = op.trip_count
    sub = plan_sharding(body, mesh, tie_outputs={i: nc + i for i in range(nk)}, time_limit_s=time_limit_s, solver=solver,
                        costs=costs)
    ins = [sub.var_specs[v] for v in body.invars]
    in_specs = tuple(s if i < nc + nk else ((),) + s for i, s in enumerate(ins))
    outs = [sub.out_specs[i] if i < nk else ((),) + sub.out_specs[i] for i in range(len(body.outvars))]
    colls = tuple(c for c in sub.collectives for _ in range(n))
    planned = Strategy("scan(body planned)", in_specs, tuple(outs), (sub.compute_s + sub.reshard_s) * n, sub.comm_s * n, colls)
    rep_compute = sum(mesh.compute_s(o.flops, body.vars[o.outputs[0]].dtype if o.outputs else "float32") for o in body.ops) * n
    rep = Strategy("scan(replicated)", tuple(replicated(len(s)) for s in in_specs), tuple(replicated(len(s)) for s in outs), rep_compute)
    return [planned, rep]


def _strategies(op: Op, graph: OpGraph, mesh: LogicalMesh, time_limit_s: float, solver: str,
                kept: set[int], costs: ShardingCosts) -> list[Strategy]:
    """The op's strategies, with memory time counting only the operands and results XLA
    keeps in memory (`kept`): an elementwise op fused into its neighbours reads and writes
    registers, not memory."""
    if op.name == "scan" and op.body is not None:
        return _scan_strategies(op, mesh, time_limit_s, solver, costs)
    counted = tuple(v in kept for v in op.inputs) + tuple(v in kept for v in op.outputs)
    return costs.strategies(op, graph, mesh, None if all(counted) else counted)


def live_ops(graph: OpGraph) -> set[int]:
    """Ops whose results reach an output (XLA drops the rest, e.g. an unused loss value)."""
    needed = set(graph.outvars)
    live: set[int] = set()
    for op in reversed(graph.ops):
        if any(v in needed for v in op.outputs) or getattr(op.primitive, "effects", None):
            live.add(op.index)
            needed.update(op.inputs)
    return live


def _follows(op: Op, graph: OpGraph) -> bool:
    """Alpa merges every op that can take its main operand's layout: unary and binary
    elementwise ops (other operands reshard to it), converts, reshapes and the like."""
    return is_follower(op, graph) or op.name in ELEMENTWISE_PRIMITIVES


def _main_input(op: Op, graph: OpGraph) -> int | None:
    best, pos = -1, None
    for i, v in enumerate(op.inputs):
        if v in graph.literals:
            continue
        size = graph.vars[v].size
        if size > best:
            best, pos = size, i
    return pos


def _build_groups(graph: OpGraph, mesh: LogicalMesh, fixed: dict[int, DimSharding], allowed: dict[int, list[DimSharding]],
                  reshard: _Reshard, costs: ShardingCosts, time_limit_s: float, solver: str
                  ) -> tuple[list[_Group], dict[int, int]]:
    kept = materialized(graph)
    groups: list[_Group] = []
    group_of: dict[int, int] = {}
    for v in graph.invars:
        if v in group_of or v in graph.literals:
            continue
        spec = graph.vars[v]
        layouts = [fixed[v]] if v in fixed else allowed.get(v) or all_layouts(spec.shape, mesh.shape)
        groups.append(_Group([_Choice(0.0, 0.0, 0.0, {v: lay}, [], {}, []) for lay in layouts]))
        group_of[v] = len(groups) - 1

    live = live_ops(graph)
    for op in graph.ops:
        if op.index not in live:
            continue
        if op.name in IDENTITY_PRIMITIVES:  # identity per operand: each result takes its operand's layout
            for v, w in zip(op.inputs, op.outputs):
                gid = group_of[v]
                for ch in groups[gid].choices:
                    ch.out[w] = ch.out[v]
                group_of[w] = gid
            continue
        strats = _strategies(op, graph, mesh, time_limit_s, solver, kept, costs)
        if not strats:
            raise RuntimeError(f"no sharding strategy for op {op.index} ({op.name}) at {op.source}")
        live_inputs = [(i, v) for i, v in enumerate(op.inputs) if v not in graph.literals]
        if _follows(op, graph) and len(op.outputs) == 1 and _try_merge(op, graph, strats, groups, group_of, reshard):
            continue
        g = _Group([], req_vars=[v for _, v in live_inputs], ops=[op.index])
        for s in strats:
            g.choices.append(_Choice(s.compute_s + s.comm_s, s.comm_s, 0.0, dict(zip(op.outputs, s.out_specs)),
                                     [s.in_specs[i] for i, _ in live_inputs], {op.index: s.name}, list(s.collectives)))
        groups.append(g)
        for v in op.outputs:
            group_of[v] = len(groups) - 1
    return groups, group_of


def _try_merge(op: Op, graph: OpGraph, strats: list[Strategy], groups: list[_Group], group_of: dict[int, int],
               reshard: _Reshard) -> bool:
    pos = _main_input(op, graph)
    if pos is None:
        return False
    main = op.inputs[pos]
    if graph.vars[main].size != graph.vars[op.outputs[0]].size:
        return False  # a broadcast would inherit one layout of a smaller value: keep its own choice
    g = groups[group_of[main]]
    by_layout: dict[DimSharding, Strategy] = {}
    for s in strats:
        cur = by_layout.get(s.in_specs[pos])
        if cur is None or s.compute_s + s.comm_s < cur.compute_s + cur.comm_s:
            by_layout[s.in_specs[pos]] = s
    picked = [by_layout.get(ch.out[main]) for ch in g.choices]
    if any(s is None for s in picked):
        return False
    gid = group_of[main]
    external = [(i, v) for i, v in enumerate(op.inputs) if v not in graph.literals and i != pos and group_of[v] != gid]
    internal = [(i, v) for i, v in enumerate(op.inputs) if v not in graph.literals and i != pos and group_of[v] == gid]
    for ch, s in zip(g.choices, picked):
        extra = sum(reshard(ch.out[v], s.in_specs[i], graph.vars[v])[0] for i, v in internal)
        ch.cost_s += s.compute_s + s.comm_s + extra
        ch.comm_s += s.comm_s
        ch.reshard_s += extra
        ch.out.update(zip(op.outputs, s.out_specs))
        ch.req.extend(s.in_specs[i] for i, _ in external)
        ch.names[op.index] = s.name
        ch.colls.extend(s.collectives)
        for i, v in internal:
            ch.colls.extend(reshard(ch.out[v], s.in_specs[i], graph.vars[v])[1])
    g.req_vars.extend(v for _, v in external)
    g.ops.append(op.index)
    group_of[op.outputs[0]] = gid
    return True


def _keys(layouts: list[DimSharding]) -> tuple[np.ndarray, list[DimSharding]]:
    distinct: dict[DimSharding, int] = {}
    keys = np.array([distinct.setdefault(l, len(distinct)) for l in layouts], dtype=int)
    return keys, list(distinct)


def _edges(graph: OpGraph, groups: list[_Group], group_of: dict[int, int], reshard: _Reshard,
           tie_outputs: dict[int, int], tie_vars: Sequence[tuple[int, int]] = ()
           ) -> list[tuple[ilp.Edge, int, list[DimSharding], list[DimSharding]]]:
    """Edges with the var they carry and the distinct layouts at each end. A tie (v, w)
    charges the reshard of v from its layout into w's (an output returned in an input's
    layout, or a value another program hands back in a layout of its own)."""
    out = []
    for gid, g in enumerate(groups):
        for r, v in enumerate(g.req_vars):
            src = group_of[v]
            sk, sl = _keys([ch.out[v] for ch in groups[src].choices])
            dk, dl = _keys([ch.req[r] for ch in g.choices])
            out.append((ilp.Edge(src, gid, sk, dk, reshard.matrix(sl, dl, graph.vars[v])), v, sl, dl))
    pairs = [(graph.outvars[o], graph.invars[i]) for o, i in tie_outputs.items()] + list(tie_vars)
    for v, w in pairs:
        if v in graph.literals or w in graph.literals or v == w or v not in group_of or w not in group_of:
            continue
        src, dst = group_of[v], group_of[w]
        sk, sl = _keys([ch.out[v] for ch in groups[src].choices])
        dk, dl = _keys([ch.out[w] for ch in groups[dst].choices])
        out.append((ilp.Edge(src, dst, sk, dk, reshard.matrix(sl, dl, graph.vars[v])), v, sl, dl))
    return out


def _memory_rows(graph: OpGraph, groups: list[_Group], group_of: dict[int, int], mesh: LogicalMesh) -> tuple[list[ilp.MemoryRow], list[ilp.MemoryRow]]:
    """Rows for the liveness peaks (under replicated sizes) and the argument-only row:
    arguments plus the values live at the peak, outputs from where they are computed (XLA
    places earlier intermediates in output buffers). Only values XLA materialises count
    (fused elementwise intermediates take no buffer)."""
    n = len(graph.ops)
    kept = materialized(graph)
    last_use = {v: -1 for v in group_of}
    for op in graph.ops:
        for v in op.inputs:
            if v in last_use:
                last_use[v] = op.index
    for v in graph.outvars:
        if v in last_use:
            last_use[v] = n
    born = {v: -1 for v in graph.invars}
    for op in graph.ops:
        for v in op.outputs:
            born[v] = op.index
    inv = set(graph.invars)
    delta = np.zeros(n + 2)
    for v, b in born.items():
        if v in inv or v not in group_of or v not in kept:
            continue
        delta[b] += graph.vars[v].nbytes
        delta[max(last_use[v], b) + 1] -= graph.vars[v].nbytes
    live = np.cumsum(delta)[: max(n, 1)]
    order = np.argsort(-live, kind="stable")
    points: list[int] = []
    for t in order:
        if len(points) >= NUM_MEMORY_CHECKPOINTS:
            break
        if all(abs(int(t) - p) > max(1, n // (4 * NUM_MEMORY_CHECKPOINTS)) for p in points):
            points.append(int(t))

    def row(vars_: list[int]) -> ilp.MemoryRow:
        coeff: dict[int, np.ndarray] = {}
        for v in vars_:
            gid = group_of[v]
            spec = graph.vars[v]
            arr = np.array([spec.nbytes / shard_factor(ch.out[v], mesh.shape) for ch in groups[gid].choices])
            coeff[gid] = coeff.get(gid, 0) + arr
        return ilp.MemoryRow(coeff)

    args = [v for v in dict.fromkeys(graph.invars) if v in group_of]
    peak_rows = [row(args + [v for v, b in born.items() if v not in inv and v in group_of and v in kept
                             and b <= t <= last_use[v]]) for t in points]
    return peak_rows or [row(args)], [row(args)]


@dataclass
class BuiltProblem:
    """The ILP of a graph on a mesh, with what is needed to read a solution back."""

    problem: ilp.AssignmentProblem
    groups: list[_Group]
    group_of: dict[int, int]
    edges: list
    reshard: _Reshard
    arg_rows: list


def build_problem(graph: OpGraph, mesh: LogicalMesh, *, memory_budget_bytes: float = float("inf"),
                  fixed_specs: dict[int, DimSharding] | None = None,
                  allowed_specs: dict[int, list[DimSharding]] | None = None,
                  tie_outputs: dict[int, int] | None = None, time_limit_s: float = 30.0,
                  solver: str = "highs", tie_layers: bool = True, memory_scope: str = "peak",
                  tie_vars: Sequence[tuple[int, int]] = (), costs: ShardingCosts | None = None) -> BuiltProblem:
    """The intra-op ILP of `graph` on `mesh` (see `plan_sharding`); `costs` memoises
    strategies and reshard costs across calls of one planning run (a fresh memo if None)."""
    costs = costs or ShardingCosts()
    reshard = _Reshard(mesh, costs)
    groups, group_of = _build_groups(graph, mesh, fixed_specs or {}, allowed_specs or {}, reshard, costs, time_limit_s,
                                     solver)
    edges = _edges(graph, groups, group_of, reshard, tie_outputs or {}, tie_vars)
    peak_rows, arg_rows = _memory_rows(graph, groups, group_of, mesh)
    tie = _layer_ties(graph, groups, group_of, costs) if tie_layers else None
    rows = peak_rows if memory_scope == "peak" else arg_rows   # "arguments": activations budgeted elsewhere (remat)
    problem = ilp.AssignmentProblem([np.array([c.cost_s for c in g.choices]) for g in groups],
                                    [e for e, *_ in edges], rows, memory_budget_bytes, tie)
    return BuiltProblem(problem, groups, group_of, edges, reshard, arg_rows)


def op_signature(op: Op, graph: OpGraph) -> tuple:
    """What two ops must share to be copies of each other in repeated layers."""
    def simple(v):
        return v if isinstance(v, (int, float, str, bool, type(None), tuple)) else type(v).__name__
    ins = tuple(("lit", repr(graph.literals[v])[:32]) if v in graph.literals else (graph.vars[v].shape, graph.vars[v].dtype)
                for v in op.inputs)
    outs = tuple((graph.vars[v].shape, graph.vars[v].dtype) for v in op.outputs)
    return (op.name, ins, outs, tuple(sorted((k, simple(v)) for k, v in op.params.items())))


def _repeats_of(graph: OpGraph, costs: ShardingCosts) -> tuple[list, list[int]]:
    """Op signatures and layer representatives, computed once per graph (meshes share them)."""
    def compute():
        sigs = [op_signature(op, graph) for op in graph.ops]
        return sigs, representatives(len(graph.ops), tandem_repeats(sigs))
    return costs.of_graph(graph, "repeats", compute)


def _layer_ties(graph: OpGraph, groups: list[_Group], group_of: dict[int, int], costs: ShardingCosts
                ) -> tuple[int, ...] | None:
    """Tie each node of a repeated layer to its copy in the first layer (see `repeats`)."""
    sigs, rep_op = _repeats_of(graph, costs)
    if all(r == i for i, r in enumerate(rep_op)):
        return None
    root_group = {g.ops[0]: gid for gid, g in enumerate(groups) if g.ops}
    tie = list(range(len(groups)))

    def same_choices(g: _Group, h: _Group, g_vars: list[int], h_vars: list[int]) -> bool:
        return len(g.choices) == len(h.choices) and all(
            [a.out[v] for v in g_vars] == [b.out[w] for w in h_vars] for a, b in zip(g.choices, h.choices))

    for gid, g in enumerate(groups):
        if not g.ops or rep_op[g.ops[0]] == g.ops[0]:
            continue
        hid = root_group.get(rep_op[g.ops[0]])
        if hid is None or tie[hid] != hid:
            continue
        h = groups[hid]
        if len(h.ops) != len(g.ops) or any(sigs[a] != sigs[b] for a, b in zip(g.ops, h.ops)):
            continue
        g_vars = [v for i in g.ops for v in graph.ops[i].outputs]
        h_vars = [v for i in h.ops for v in graph.ops[i].outputs]
        if len(g.req_vars) == len(h.req_vars) and same_choices(g, h, g_vars, h_vars):
            tie[gid] = hid
    # a parameter read first by a tied op follows the parameter its copy reads
    first_use: dict[int, tuple[int, int]] = {}
    for op in graph.ops:
        for pos, v in enumerate(op.inputs):
            first_use.setdefault(v, (op.index, pos))
    for v in graph.invars:
        if v not in group_of or v not in first_use:
            continue
        i, pos = first_use[v]
        w = graph.ops[rep_op[i]].inputs[pos]
        gid, hid = group_of[v], group_of.get(w)
        if rep_op[i] == i or hid is None or hid == gid or tie[hid] != hid or groups[hid].ops:
            continue
        if same_choices(groups[gid], groups[hid], [v], [w]):
            tie[gid] = hid
    return tuple(tie)


def plan_sharding(graph: OpGraph, mesh: LogicalMesh, *, memory_budget_bytes: float = float("inf"),
                  fixed_specs: dict[int, DimSharding] | None = None,
                  allowed_specs: dict[int, list[DimSharding]] | None = None,
                  tie_outputs: dict[int, int] | None = None,
                  time_limit_s: float = 30.0, solver: str = "highs", tie_layers: bool = True,
                  memory_scope: str = "peak", tie_vars: Sequence[tuple[int, int]] = (),
                  costs: ShardingCosts | None = None) -> ShardingPlan:
    """Solve the intra-op ILP for `graph` on `mesh`.

    fixed_specs / allowed_specs constrain the layouts of graph inputs (by var id);
    tie_outputs maps an output position to an input position whose layout it must be
    returned in (e.g. the new train state in the old state's layout), paying the reshard;
    tie_vars (v, w) charge resharding var v into var w's layout (see `_edges`); costs is the
    planning run's memo of strategies and reshard costs (`ShardingCosts`).
    """
    t0 = time.perf_counter()
    tie_outputs = tie_outputs or {}
    built = build_problem(graph, mesh, memory_budget_bytes=memory_budget_bytes, fixed_specs=fixed_specs,
                          allowed_specs=allowed_specs, tie_outputs=tie_outputs, time_limit_s=time_limit_s, solver=solver,
                          tie_layers=tie_layers, memory_scope=memory_scope, tie_vars=tie_vars, costs=costs)
    problem, groups, edges, reshard = built.problem, built.groups, built.edges, built.reshard
    try:
        sol = ilp.solve(problem, time_limit_s=time_limit_s, solver=solver)
    except ilp.InfeasibleError:
        if math.isfinite(memory_budget_bytes):
            raise MemoryBudgetError(memory_budget_bytes, ilp.min_memory(problem, time_limit_s), mesh.shape) from None
        raise
    chosen = [g.choices[k] for g, k in zip(groups, sol.choice)]
    var_specs: dict[int, DimSharding] = {}
    op_strats: dict[int, str] = {}
    colls: list[Collective] = []
    for ch in chosen:
        var_specs.update(ch.out)
        op_strats.update(ch.names)
        colls.extend(ch.colls)
    # XLA computes one reshard of a value per target layout however many ops read it, so
    # the predicted collectives count each (value, target layout) once. The time keeps the
    # ILP's objective, which charges every reading op (a small overestimate), so that plans
    # are compared on the quantity the solver minimised.
    reshard_s = 0.0
    seen: set = set()
    resharded: list[tuple[int, int, DimSharding]] = []
    for e, v, sl, dl in edges:
        a, b = sl[e.src_key[sol.choice[e.src]]], dl[e.dst_key[sol.choice[e.dst]]]
        t, cs = reshard(a, b, graph.vars[v])
        reshard_s += t
        if (v, a, b) not in seen:
            seen.add((v, a, b))
            colls.extend(cs)
        if a != b and groups[e.dst].ops:
            reader = next((i for i in groups[e.dst].ops if v in graph.ops[i].inputs), groups[e.dst].ops[0])
            resharded.append((reader, v, b))
    out_specs = []
    for pos, v in enumerate(graph.outvars):
        if pos in tie_outputs:
            out_specs.append(var_specs[graph.invars[tie_outputs[pos]]])
        elif v in var_specs:
            out_specs.append(var_specs[v])
        else:  # a literal output
            out_specs.append(replicated(len(graph.vars[v].shape)) if v in graph.vars else ())
    mem = ilp.memory_of(problem, sol.choice)
    arg_mem = ilp.memory_of(ilp.AssignmentProblem(problem.node_cost_s, [], built.arg_rows), sol.choice)
    compute_s = sum(c.cost_s - c.comm_s - c.reshard_s for c in chosen)
    reshard_s += sum(c.reshard_s for c in chosen)
    comm_s = sum(c.comm_s for c in chosen)
    op_time = {g.ops[0]: ch.cost_s for g, ch in zip(groups, chosen) if g.ops}
    return ShardingPlan(mesh.shape, var_specs, op_strats, tuple(out_specs), compute_s + comm_s + reshard_s, compute_s, comm_s,
                        reshard_s, max(mem) if mem else 0.0, arg_mem[0] if arg_mem else 0.0, tuple(colls),
                        sol.status, time.perf_counter() - t0, len(groups), sol.num_variables, op_time,
                        tuple(resharded))
