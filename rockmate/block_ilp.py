"""Checkmate-style ILP for one block: which forward values to keep for the backward pass and
which to recompute there, minimising recomputation time under a peak-memory limit.

The schedule space is the one the JAX lowering realises exactly: values with a checkpoint
name are kept after the forward; at the start of the block's backward every residual that
was not kept is recomputed from kept values and block inputs, then the backward runs.

Variables per node i: keep_i (result saved after the forward) and rec_i (recomputed in the
backward). Constraints: every residual is kept or recomputed; a recomputed node's
in-block producers are kept or recomputed; the backward peak
  sum_i keep_i * size_i + rec_i * live_i + bwd_ws <= limit.
Objective: min sum_i rec_i * time_i (ties broken towards fewer kept bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pulp
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from .block_graph import BlockGraph


@dataclass(frozen=True)
class BlockOption:
    """One Pareto-optimal way to run a block (times in seconds, memory in bytes)."""

    kept: frozenset[int]  # nodes whose results are saved after the forward
    recomputed: frozenset[int]
    fwd_time_s: float
    bwd_time_s: float  # backward including recomputation
    kept_bytes: int  # held from the forward until the block's backward
    fwd_peak_bytes: int  # transient peak of the forward beyond its input and output
    bwd_peak_bytes: int  # transient peak of the backward beyond its input and output cotangent
    keep_all: bool = False  # plain autodiff (JAX's own residuals), no checkpoint
    calibrated: bool = False  # bwd_peak_bytes measured by XLA (not modelled or interpolated)


def option_costs(g: BlockGraph, kept: frozenset[int], recomputed: frozenset[int],
                 keep_all: bool = False) -> BlockOption:
    """Times and memory of running block `g` with the given kept/recomputed sets."""
    kept_bytes = sum(g.sizes_bytes[i] for i in kept)
    rec_bytes = sum(g.live_bytes[i] for i in recomputed)
    rec_s = sum(g.times_s[i] for i in recomputed)
    fwd_s = sum(g.times_s)
    return BlockOption(
        kept=kept, recomputed=recomputed, fwd_time_s=fwd_s,
        bwd_time_s=sum(g.bwd_times_s) + rec_s, kept_bytes=kept_bytes,
        fwd_peak_bytes=kept_bytes + g.fwd_ws_bytes,
        bwd_peak_bytes=kept_bytes + rec_bytes + g.bwd_ws_bytes, keep_all=keep_all)


def recompute_closure(g: BlockGraph, kept: frozenset[int]) -> frozenset[int]:
    """Nodes that must be recomputed when only `kept` (and block inputs) survive the forward."""
    need = [i for i in g.residuals if i not in kept]
    rec: set[int] = set()
    while need:
        i = need.pop()
        if i in rec:
            continue
        rec.add(i)
        need.extend(j for j in g.deps[i] if j not in kept and j not in rec)
    return frozenset(rec)


def keep_all_option(g: BlockGraph) -> BlockOption:
    """Store every residual: no recomputation (what plain autodiff does)."""
    kept = frozenset(g.residuals)
    o = option_costs(g, kept, frozenset(), keep_all=True)
    kept_bytes = sum(g.live_bytes[i] for i in kept) + g.autodiff_extra_bytes
    return BlockOption(kept, frozenset(), o.fwd_time_s, o.bwd_time_s, kept_bytes,
                       kept_bytes + g.fwd_ws_bytes, kept_bytes + g.bwd_ws_bytes, keep_all=True)


def solve_block(g: BlockGraph, peak_limit_bytes: float | None,
                time_limit_s: float = 5.0, minimise_memory: bool = False,
                kept_limit_bytes: float | None = None) -> BlockOption | None:
    """Solve the block ILP for one peak limit (and optionally a limit on kept bytes);
    None if infeasible.

    With `minimise_memory`, minimise the backward peak instead (ties: less recomputation).
    """
    n = len(g.sizes_bytes)
    prob = pulp.LpProblem("rockmate_block", pulp.LpMinimize)
    keep = {i: prob.add_variable(f"k{i}", cat=pulp.LpBinary) for i in g.keepable}
    rec = {i: prob.add_variable(f"r{i}", cat=pulp.LpBinary) for i in range(n)}
    k = lambda i: keep.get(i, 0)  # noqa: E731
    for i in g.residuals:
        prob += k(i) + rec[i] >= 1
    for i in range(n):
        for j in g.deps[i]:
            prob += rec[i] <= k(j) + rec[j]
    for v, src in g.views:
        if v in keep:
            prob += keep[v] <= k(src)
    peak = (pulp.lpSum(g.sizes_bytes[i] * keep[i] for i in keep)
            + pulp.lpSum(g.live_bytes[i] * rec[i] for i in range(n)) + g.bwd_ws_bytes)
    if peak_limit_bytes is not None:
        prob += peak <= peak_limit_bytes
    if kept_limit_bytes is not None:
        prob += pulp.lpSum(g.sizes_bytes[i] * keep[i] for i in keep) <= kept_limit_bytes
    time_scale = max(sum(g.times_s), 1e-12)
    mem_scale = max(sum(g.sizes_bytes) + g.bwd_ws_bytes, 1)
    rec_time = pulp.lpSum((g.times_s[i] / time_scale) * rec[i] for i in range(n))
    kept_mem = pulp.lpSum((g.sizes_bytes[i] / mem_scale) * keep[i] for i in keep)
    if minimise_memory:
        prob += peak / mem_scale + 1e-4 * rec_time
    else:
        prob += rec_time + 1e-4 * kept_mem + 1e-6 * pulp.lpSum(rec.values())
    if not solve_binary(prob, time_limit_s):
        return None
    kept = frozenset(i for i in keep if (keep[i].value() or 0) > 0.5)
    # only recompute what is needed (removes harmless extra ones)
    return option_costs(g, kept, recompute_closure(g, kept))


def solve_binary(prob: "pulp.LpProblem", time_limit_s: float) -> bool:
    """Solve a PuLP model over binary variables; True (values set on the variables) if optimal.

    PuLP only builds the model; it is solved in-process by HiGHS (scipy.optimize.milp): a
    block's ILP has a few hundred binaries and solves in milliseconds, where starting CBC as
    a subprocess costs about 0.25 s per solve.
    """
    variables = prob.variables()
    col = {v.name: j for j, v in enumerate(variables)}
    c = np.zeros(len(variables))
    for v, a in prob.objective.items():
        c[col[v.name]] = a
    rows, cols, vals, lb, ub = [], [], [], [], []
    for r, con in enumerate(prob.constraints()):
        for v, a in con.items():
            rows.append(r)
            cols.append(col[v.name])
            vals.append(a)
        # pulp: sum(a*x) + constant (sense) 0, sense -1 is <=, 1 is >=, 0 is ==
        lb.append(-np.inf if con.sense < 0 else -con.constant)
        ub.append(np.inf if con.sense > 0 else -con.constant)
    cons = ()
    if rows:
        A = coo_matrix((vals, (rows, cols)), shape=(len(lb), len(variables))).tocsr()
        cons = LinearConstraint(A, np.array(lb), np.array(ub))
    res = milp(c, integrality=np.ones(len(variables)), bounds=Bounds(0, 1), constraints=cons,
               options={"time_limit": time_limit_s})
    if res.status != 0 or res.x is None:
        return False
    for v, x in zip(variables, res.x):
        v.varValue = float(round(x))
    return True


def pareto_options(g: BlockGraph, levels: int = 4, time_limit_s: float = 5.0) -> tuple[BlockOption, ...]:
    """A few Pareto-optimal options (bwd time, kept bytes, peaks) across limits on the
    backward peak and on the bytes kept between forward and backward."""
    # plain autodiff's residual memory is XLA's business (it fuses some away), so the
    # no-recompute option keeps JAX's residuals by name, which costs exactly what it says
    full = solve_block(g, None, time_limit_s) or keep_all_option(g)
    cands = [full]
    low = solve_block(g, None, time_limit_s, minimise_memory=True)
    if low is not None:
        cands.append(low)
        lo, hi = low.bwd_peak_bytes, full.bwd_peak_bytes
        for j in range(1, levels):
            opt = solve_block(g, lo + (hi - lo) * j / levels, time_limit_s)
            if opt is not None:
                cands.append(opt)
    for j in range(levels):
        opt = solve_block(g, None, time_limit_s, kept_limit_bytes=full.kept_bytes * j / levels)
        if opt is not None:
            cands.append(opt)
    return pareto_front(cands)


def pareto_front(cands) -> tuple[BlockOption, ...]:
    """Drop options dominated in (bwd time, kept bytes, bwd peak); keep one per triple."""
    uniq = {}
    for c in cands:
        key = (round(c.bwd_time_s, 15), c.kept_bytes, c.bwd_peak_bytes)
        if key not in uniq or (c.keep_all and not uniq[key].keep_all):
            uniq[key] = c
    items = list(uniq.values())

    def dominated(a, b):
        return (b.bwd_time_s <= a.bwd_time_s and b.kept_bytes <= a.kept_bytes
                and b.bwd_peak_bytes <= a.bwd_peak_bytes and b.fwd_peak_bytes <= a.fwd_peak_bytes
                and (b.bwd_time_s, b.kept_bytes, b.bwd_peak_bytes) != (a.bwd_time_s, a.kept_bytes, a.bwd_peak_bytes))
    front = [a for a in items if not any(dominated(a, b) for b in items)]
    front.sort(key=lambda o: (o.kept_bytes, o.bwd_time_s))
    return tuple(front)
