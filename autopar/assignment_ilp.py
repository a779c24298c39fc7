"""The one-hot assignment ILP behind the intra-op planner, independent of JAX.

Each node picks exactly one choice; each node choice has a cost; each edge adds a cost
that depends on the choices at both ends; memory rows bound a weighted sum of choices.
Edge costs are linearised Alpa-style with pair variables e[a, b] whose row and column
sums equal the two nodes' one-hot vectors. Choices are grouped by a key per end (the
layout a value leaves or enters in), so an edge needs one pair variable per distinct
(key, key), not per (choice, choice); with binary node variables the pair variables are
integral by themselves and stay continuous. Before the matrices are built, the leaves and
chains of the graph outside the memory rows are solved out exactly (`eliminate`): on the
GPT-39B planner's layer ILPs that leaves about half the nodes and cuts the solves' time (build + HiGHS) by 40%.
"""
from __future__ import annotations

import itertools
import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse


@dataclass(frozen=True)
class Edge:
    """Cost `cost_s[src_key[i], dst_key[j]]` when node src picks i and node dst picks j."""

    src: int
    dst: int
    src_key: np.ndarray  # int per src choice
    dst_key: np.ndarray  # int per dst choice
    cost_s: np.ndarray   # (n_src_keys, n_dst_keys)

    def pair_cost(self, i: int, j: int) -> float:
        return float(self.cost_s[self.src_key[i], self.dst_key[j]])


@dataclass(frozen=True)
class MemoryRow:
    """sum over nodes n of coeff[n][choice of n] <= limit (bytes)."""

    coeff: dict[int, np.ndarray]
    constant_bytes: float = 0.0


@dataclass(frozen=True)
class AssignmentProblem:
    node_cost_s: list[np.ndarray]
    edges: list[Edge] = field(default_factory=list)
    memory_rows: list[MemoryRow] = field(default_factory=list)
    memory_limit_bytes: float = float("inf")
    tie: tuple[int, ...] | None = None   # tie[k]: node whose choice node k must copy (k itself if free)

    def rep(self, k: int) -> int:
        return k if self.tie is None else self.tie[k]


@dataclass(frozen=True)
class Assignment:
    choice: tuple[int, ...]
    objective_s: float
    status: str          # "optimal" | "feasible (time limit)" | "infeasible"
    solve_time_s: float
    solver: str
    num_variables: int


class InfeasibleError(ValueError):
    pass


def evaluate(problem: AssignmentProblem, choice: tuple[int, ...]) -> float:
    """Objective of a full assignment (the reference for tests and reports)."""
    total = sum(float(c[k]) for c, k in zip(problem.node_cost_s, choice))
    total += sum(e.pair_cost(choice[e.src], choice[e.dst]) for e in problem.edges)
    return total


def memory_of(problem: AssignmentProblem, choice: tuple[int, ...]) -> list[float]:
    return [row.constant_bytes + sum(float(c[choice[n]]) for n, c in row.coeff.items()) for row in problem.memory_rows]


def brute_force(problem: AssignmentProblem) -> tuple[tuple[int, ...], float] | None:
    """Enumerate every assignment; for tests on small problems."""
    best = None
    n = len(problem.node_cost_s)
    free = [k for k in range(n) if problem.rep(k) == k]
    for sub in itertools.product(*(range(len(problem.node_cost_s[k])) for k in free)):
        pick = dict(zip(free, sub))
        choice = tuple(pick[problem.rep(k)] for k in range(n))
        if any(m > problem.memory_limit_bytes * (1 + 1e-9) for m in memory_of(problem, choice)):
            continue
        val = evaluate(problem, choice)
        if best is None or val < best[1] - 1e-15:
            best = (choice, val)
    return best


@dataclass
class _Matrix:
    """min c.x  s.t.  A_eq x = b_eq, A_ub x <= b_ub, 0 <= x <= 1, x[:n_int] integral."""

    c: np.ndarray
    n_int: int
    eq_rows: list[np.ndarray]
    eq_cols: list[np.ndarray]
    eq_vals: list[np.ndarray]
    b_eq: list[float]
    ub: list[tuple[np.ndarray, np.ndarray, float]]


def _compress(e: Edge) -> Edge:
    """Merge keys whose cost rows (or columns) are identical: exact, and fewer pair variables.
    A cost that splits as u[src] + v[dst] needs no pair variables at all (handled by the caller
    as two one-sided edges)."""
    cost = np.asarray(e.cost_s, dtype=float)
    rows, rinv = _unique_rows(cost)
    cols_t, cinv = _unique_rows(rows.T)
    return Edge(e.src, e.dst, rinv[e.src_key], cinv[e.dst_key], cols_t.T)


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(a, axis=0, return_inverse=True) for a 2-D float array, same order (rows
    sorted lexicographically); on the planners' small cost matrices tuples are about 10x
    faster than numpy's structured-view sort, and the planners call this ~10^5 times."""
    rows = list(map(tuple, a.tolist()))
    uniq = sorted(set(rows))
    index = {r: i for i, r in enumerate(uniq)}
    return np.array(uniq, dtype=a.dtype).reshape(len(uniq), a.shape[1]), np.array([index[r] for r in rows], dtype=int)


@dataclass(frozen=True)
class _Eliminated:
    """A node solved out of the ILP before it is built: its choice is the argmin of its
    own cost plus its edges to the neighbours it had then, which are decided before it
    (solutions are read back in reverse order of elimination)."""

    node: int
    cost_s: np.ndarray
    edges: dict[int, np.ndarray]   # neighbour -> cost (this node's choices, the neighbour's choices)

    def choose(self, choice: dict[int, int]) -> int:
        total = self.cost_s.copy()
        for u, m in self.edges.items():
            total = total + m[:, choice[u]]
        return int(np.argmin(total))


def _separable(m: np.ndarray) -> bool:
    """Whether m[i, j] = a[i] + b[j]: such an edge adds to each end's cost, no pair needed."""
    rest = m - m[:, :1] - m[:1, :] + m[0, 0]
    return bool(np.all(np.abs(rest) <= 1e-12 * max(float(np.max(np.abs(m))), 1e-300)))


def eliminate(costs: dict[int, np.ndarray], pairs: dict[tuple[int, int], np.ndarray], protected: set[int]
              ) -> tuple[dict[int, np.ndarray], dict[tuple[int, int], np.ndarray], list[_Eliminated]]:
    """Exact variable elimination on the pairwise problem min sum_k costs[k][x_k] +
    sum_(a,b) pairs[a,b][x_a, x_b] (matrices over whole choices, a < b): separable edges
    are folded into node costs; a node with no edge takes its best choice, one with one
    neighbour u adds min_j (cost[j] + m[j, :]) to u's cost, one with two neighbours u, w
    becomes an edge (u, w) holding min_j (cost[j] + m_u[j, :, None] + m_w[j, None, :]) unless
    that has over 4x the entries of the two edges it replaces (measured on GPT layers: as
    fast as no limit; the limit only guards against a dense edge between two wide nodes).
    Chains of layers and the leaves of a computation graph leave the ILP this way;
    `protected` nodes (in memory rows) stay. Returns the remaining costs and pairs and the
    eliminations in order."""
    costs = dict(costs)
    adj: dict[int, dict[int, np.ndarray]] = {k: {} for k in costs}   # adj[a][b]: (choices of a, choices of b)
    for (a, b), m in pairs.items():
        if _separable(m):
            costs[a] = costs[a] + m[:, 0] - m[0, 0]
            costs[b] = costs[b] + m[0, :]
        else:
            adj[a][b], adj[b][a] = m, m.T
    done: list[_Eliminated] = []
    work = [k for k in costs if k not in protected]
    while work:
        v = work.pop()
        if v not in adj or v in protected:
            continue
        nbrs = adj[v]
        if len(nbrs) > 2:
            continue
        c = costs[v]
        if len(nbrs) == 2:
            (u, mu), (w, mw) = nbrs.items()
            if len(costs[u]) * len(costs[w]) > 4 * len(c) * (len(costs[u]) + len(costs[w])):
                continue
            joined = (c[:, None, None] + mu[:, :, None] + mw[:, None, :]).min(axis=0)
            del adj[u][v], adj[w][v]
            joined = adj[u][w] + joined if w in adj[u] else joined
            if _separable(joined):
                costs[u] = costs[u] + joined[:, 0] - joined[0, 0]
                costs[w] = costs[w] + joined[0, :]
                adj[u].pop(w, None), adj[w].pop(u, None)
            else:
                adj[u][w], adj[w][u] = joined, joined.T
            work.extend((u, w))
        elif len(nbrs) == 1:
            (u, mu), = nbrs.items()
            costs[u] = costs[u] + (c[:, None] + mu).min(axis=0)
            del adj[u][v]
            work.append(u)
        done.append(_Eliminated(node=v, cost_s=c, edges=dict(nbrs)))
        del adj[v], costs[v]
    left = {(a, b): m for a, nb in adj.items() for b, m in nb.items() if a < b}
    return costs, left, done


@dataclass
class _Reduced:
    """How to read a choice per original node back from the ILP's solution vector."""

    rep: list[int]
    offsets: dict[int, int]            # node left in the ILP -> its first variable
    sizes: dict[int, int]
    eliminated: list[_Eliminated]

    def decode(self, x: np.ndarray) -> tuple[int, ...]:
        choice = {k: int(np.argmax(x[o:o + self.sizes[k]])) for k, o in self.offsets.items()}
        for e in reversed(self.eliminated):
            choice[e.node] = e.choose(choice)
        return tuple(choice[r] for r in self.rep)


def _build(problem: AssignmentProblem, reduce: bool = True) -> tuple[_Matrix, _Reduced]:
    """The ILP's matrices. With `reduce`, nodes outside the memory rows that form chains or
    leaves are eliminated first (`eliminate`), which leaves the same optimum."""
    n_nodes = len(problem.node_cost_s)
    rep = [problem.rep(k) for k in range(n_nodes)]
    for k in range(n_nodes):
        if len(problem.node_cost_s[k]) != len(problem.node_cost_s[rep[k]]):
            raise ValueError(f"tied nodes {k} and {rep[k]} have different numbers of choices")
    costs: dict[int, np.ndarray] = {}
    for k in range(n_nodes):
        if rep[k] == k:
            costs[k] = np.array(problem.node_cost_s[k], dtype=float)
    for k in range(n_nodes):
        if rep[k] != k:
            costs[rep[k]] = costs[rep[k]] + np.asarray(problem.node_cost_s[k], dtype=float)
    # Edges between the same pair of representatives add up; an edge within one
    # representative is linear in its choice.
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        rs, rd = rep[e.src], rep[e.dst]
        full = np.asarray(e.cost_s, float)[np.ix_(e.src_key, e.dst_key)]
        if rs == rd:
            costs[rs] = costs[rs] + np.diag(full)
            continue
        key, m = ((rs, rd), full) if rs < rd else ((rd, rs), full.T)
        pairs[key] = pairs[key] + m if key in pairs else m
    in_rows = {rep[k] for row in problem.memory_rows for k in row.coeff} if math.isfinite(
        float(problem.memory_limit_bytes)) else set()
    eliminated: list[_Eliminated] = []
    if reduce:
        costs, pairs, eliminated = eliminate(costs, pairs, in_rows)
    offsets, n = {}, 0
    for k, c in costs.items():
        offsets[k] = n
        n += len(c)
    edges = [Edge(a, b, np.arange(m.shape[0]), np.arange(m.shape[1]), m) for (a, b), m in pairs.items()]
    n_int = n
    rows_r, rows_c, rows_v, b_eq = [], [], [], []
    eq = 0
    for k, c in costs.items():  # one-hot
        rows_r.append(np.full(len(c), eq)); rows_c.append(offsets[k] + np.arange(len(c))); rows_v.append(np.ones(len(c)))
        b_eq.append(1.0); eq += 1
    extra_cost: list[np.ndarray] = []
    next_var = n
    for e in map(_compress, edges):
        cost = e.cost_s
        if not np.any(cost):
            continue
        ns, nd = cost.shape
        if ns == 1 or nd == 1:  # the cost is linear in the other end's choice
            if ns == 1:
                costs[e.dst] = costs[e.dst] + cost[0, e.dst_key]
            else:
                costs[e.src] = costs[e.src] + cost[e.src_key, 0]
            continue
        pair = next_var + np.arange(ns * nd).reshape(ns, nd)
        next_var += ns * nd
        extra_cost.append(cost.ravel())
        for a in range(ns):  # sum_b e[a, b] = sum_{i: key i = a} x_src[i]
            src_idx = np.nonzero(e.src_key == a)[0]
            rows_r.append(np.full(nd + len(src_idx), eq))
            rows_c.append(np.concatenate([pair[a, :], offsets[e.src] + src_idx]))
            rows_v.append(np.concatenate([np.ones(nd), -np.ones(len(src_idx))]))
            b_eq.append(0.0); eq += 1
        for b in range(nd):
            dst_idx = np.nonzero(e.dst_key == b)[0]
            rows_r.append(np.full(ns + len(dst_idx), eq))
            rows_c.append(np.concatenate([pair[:, b], offsets[e.dst] + dst_idx]))
            rows_v.append(np.concatenate([np.ones(ns), -np.ones(len(dst_idx))]))
            b_eq.append(0.0); eq += 1
    node_c = np.zeros(n)
    for k, c in costs.items():
        node_c[offsets[k]: offsets[k] + len(c)] = c
    c = np.concatenate([node_c] + extra_cost)
    ub = []
    if math.isfinite(float(problem.memory_limit_bytes)):
        for row in problem.memory_rows:
            acc: dict[int, np.ndarray] = {}
            for k, v in row.coeff.items():
                acc[rep[k]] = acc.get(rep[k], 0) + np.asarray(v, float)
            cols = np.concatenate([offsets[k] + np.arange(len(v)) for k, v in acc.items()]) if acc else np.zeros(0, int)
            vals = np.concatenate(list(acc.values())) if acc else np.zeros(0)
            ub.append((cols, vals, problem.memory_limit_bytes - row.constant_bytes))
    reduced = _Reduced(rep=rep, offsets=offsets, sizes={k: len(c) for k, c in costs.items()}, eliminated=eliminated)
    return _Matrix(c, n_int, rows_r, rows_c, rows_v, b_eq, ub), reduced


def _solve_highs(m: _Matrix, time_limit_s: float, lp_first: bool = False):
    """HiGHS MIP. With `lp_first`, the LP relaxation (dual simplex) first: on these
    assignment problems it is usually integral, and then it is an optimum of the ILP
    (measured 6x faster than branch and bound), though not always the same optimum."""
    from scipy.optimize import Bounds, LinearConstraint, linprog, milp

    nvar = len(m.c)
    A_eq = sparse.csr_matrix((np.concatenate(m.eq_vals), (np.concatenate(m.eq_rows), np.concatenate(m.eq_cols))), shape=(len(m.b_eq), nvar))
    cons = [LinearConstraint(A_eq, np.array(m.b_eq), np.array(m.b_eq))]
    A_ub = b_ub = None
    if m.ub:
        r = np.concatenate([np.full(len(cols), i) for i, (cols, _, _) in enumerate(m.ub)])
        A_ub = sparse.csr_matrix((np.concatenate([v for _, v, _ in m.ub]), (r, np.concatenate([c for c, _, _ in m.ub]))), shape=(len(m.ub), nvar))
        b_ub = np.array([b for _, _, b in m.ub])
        cons.append(LinearConstraint(A_ub, -np.inf, b_ub))
    if lp_first:
        lp = linprog(m.c, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=np.array(m.b_eq), bounds=(0, 1), method="highs-ds",
                     options={"time_limit": time_limit_s})
        if lp.status == 2:
            return None, "infeasible"
        if lp.status == 0 and np.all(np.minimum(np.abs(lp.x[: m.n_int]), np.abs(lp.x[: m.n_int] - 1)) < 1e-9):
            return lp.x, "optimal"
    integrality = np.zeros(nvar)
    integrality[: m.n_int] = 1
    res = milp(m.c, integrality=integrality, bounds=Bounds(0, 1), constraints=cons,
               options={"time_limit": time_limit_s, "disp": False, "mip_rel_gap": 1e-7})
    if res.x is None:
        return None, "infeasible" if res.status == 2 else f"no solution ({res.message})"
    return res.x, "optimal" if res.status == 0 else "feasible (time limit)"


def _solve_cbc(m: _Matrix, time_limit_s: float):
    import pulp

    nvar = len(m.c)
    prob = pulp.LpProblem("autopar_intra_op", pulp.LpMinimize)
    xs = [prob.add_variable(f"x{i}", cat=pulp.LpBinary) if i < m.n_int else prob.add_variable(f"x{i}", 0, 1)
          for i in range(nvar)]
    prob += pulp.LpAffineExpression([(xs[i], float(m.c[i])) for i in np.nonzero(m.c)[0]])
    rows: dict[int, list] = {}
    for r, cidx, v in zip(m.eq_rows, m.eq_cols, m.eq_vals):
        rows.setdefault(int(r[0]), []).extend(zip(cidx.tolist(), v.tolist()))
    for r, terms in rows.items():
        prob += pulp.LpAffineExpression([(xs[i], a) for i, a in terms]) == m.b_eq[r]
    for cols, vals, b in m.ub:
        prob += pulp.LpAffineExpression([(xs[i], float(a)) for i, a in zip(cols.tolist(), vals.tolist())]) <= b
    with warnings.catch_warnings():     # PULP_CBC_CMD goes in PuLP 4; pyproject pins pulp<4
        warnings.filterwarnings("ignore", "PULP_CBC_CMD is deprecated", DeprecationWarning)
        cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(np.ceil(time_limit_s))), gapRel=1e-7)
    status = prob.solve(cmd)
    name = pulp.LpStatus[status]
    if name == "Infeasible":
        return None, "infeasible"
    if name != "Optimal" or any(x.varValue is None for x in xs[: m.n_int]):
        return None, f"no solution ({name})"
    x = np.array([x.varValue or 0.0 for x in xs])
    # PuLP reports "Optimal" also when CBC stopped at the time limit with a feasible point.
    sol_status = getattr(prob, "sol_status", pulp.LpSolutionOptimal)
    return x, "optimal" if sol_status == pulp.LpSolutionOptimal else "feasible (time limit)"


def solve(problem: AssignmentProblem, time_limit_s: float = 30.0, solver: str = "highs") -> Assignment:
    """Solve the assignment ILP; on a time-out returns the best feasible assignment found.

    solver: "highs" (scipy's HiGHS MIP, fast, default), "highs-lp" (the LP relaxation first,
    branch and bound only when it is fractional) or "cbc" (PuLP's bundled CBC).
    Raises InfeasibleError when no assignment satisfies the memory rows.
    """
    t0 = time.perf_counter()
    m, reduced = _build(problem)
    # Costs are seconds (often 1e-9 .. 1e-3): rescale so that the solvers' absolute
    # tolerances and gaps do not swallow differences between plans.
    top = float(np.max(np.abs(m.c))) if len(m.c) else 0.0
    if top > 0:
        m.c = m.c * (1e6 / top)
    if not len(m.c):    # everything was eliminated
        x, status = np.zeros(0), "optimal"
        if any(b < 0 for _, _, b in m.ub):
            x, status = None, "infeasible"
    elif solver in ("highs", "highs-lp"):
        x, status = _solve_highs(m, time_limit_s, lp_first=solver == "highs-lp")
    elif solver == "cbc":
        x, status = _solve_cbc(m, time_limit_s)
    else:
        raise ValueError(f"unknown ILP solver {solver!r}; use 'highs', 'highs-lp' or 'cbc'")
    if x is None:
        raise InfeasibleError(f"intra-op ILP: {status}")
    choice = reduced.decode(x)
    return Assignment(choice, evaluate(problem, choice), status, time.perf_counter() - t0, solver, len(m.c))


def min_memory(problem: AssignmentProblem, time_limit_s: float = 30.0) -> float:
    """Smallest achievable max over memory rows (bytes): the budget that would fit."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    no_limit = AssignmentProblem(problem.node_cost_s, [], [], float("inf"), problem.tie)
    m, reduced = _build(no_limit, reduce=False)
    offsets = reduced.offsets
    nvar = len(m.c) + 1  # last variable: the peak
    A_eq = sparse.csr_matrix((np.concatenate(m.eq_vals), (np.concatenate(m.eq_rows), np.concatenate(m.eq_cols))), shape=(len(m.b_eq), nvar))
    cons = [LinearConstraint(A_eq, np.array(m.b_eq), np.array(m.b_eq))]
    rows = []
    for row in problem.memory_rows:
        v = np.zeros(nvar)
        for k, coeff in row.coeff.items():
            o = offsets[reduced.rep[k]]
            v[o: o + len(coeff)] += coeff
        v[-1] = -1.0
        rows.append((v, -row.constant_bytes))
    if rows:
        cons.append(LinearConstraint(sparse.csr_matrix(np.array([r for r, _ in rows])), -np.inf, np.array([b for _, b in rows])))
    c = np.zeros(nvar); c[-1] = 1.0
    integrality = np.zeros(nvar); integrality[: m.n_int] = 1
    ub = np.ones(nvar); ub[-1] = np.inf
    res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(nvar), ub), constraints=cons,
               options={"time_limit": time_limit_s, "disp": False})
    if res.x is None:
        return float("nan")
    return float(res.x[-1])
