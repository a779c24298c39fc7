"""An analytic latency estimate of a lowered program on a CPU: per statement, the largest of
its vector compute, load/store, L2 and memory-traffic times, divided by its parallel speed-up.

The search uses it as the cost model's prior: before the model has measurements of a region
of the schedule space it ranks by this estimate, and measurements correct it (see
`cost_model.XGBoostCostModel`, which takes it as a base margin). It needs only the loop nest,
so it also ranks the first batch of a task nothing was measured for yet."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .codegen_c import register_tile
from .expr import Expr, Var, loads, variables
from .lower import Alloc, For, Program, Store, _linear, store_op_counts, trip_count


@dataclass(frozen=True)
class CpuModel:
    """Per-core throughputs in cycles, cache sizes per core, and the OpenMP fork-join cost
    (defaults: an AVX-512 server core; the cores are this machine's)."""

    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    lanes: int = 16                 # fp32 lanes of a vector register (AVX-512)
    vector_ops_per_cycle: float = 2.0
    loads_per_cycle: float = 2.0
    stores_per_cycle: float = 1.0
    l1_bytes: int = 48 * 1024
    l2_bytes: int = 2 * 1024 * 1024
    l2_bytes_per_cycle: float = 32.0
    mem_bytes_per_cycle: float = 4.5
    hz: float = 3.5e9
    fork_join_s: float = 2e-6


# weight of one operation in vector-instruction slots: libmvec's expf/tanhf cost about ten
OP_WEIGHT = {"add": 1.0, "mul": 1.0, "cmp": 1.0, "div": 4.0, "math": 10.0}
LINE = 64
ADD_LATENCY = 4  # cycles: one accumulator register's reduction chain adds once per latency


@dataclass(frozen=True)
class _Access:
    coeffs: dict          # loop variable -> stride in elements (1 when used through div/mod)
    is_store: bool


def _access(index: Expr, is_store: bool) -> _Access:
    coeffs, _ = _linear(index)
    out: dict[str, int] = {}
    for atom, c in coeffs.items():
        if isinstance(atom, Var):
            out[atom.name] = max(out.get(atom.name, 0), abs(c))
        else:  # fused loops reach the index through div/mod: treat as unit stride
            for v in variables(atom):
                out[v] = out.get(v, 0) or 1
    return _Access(out, is_store)


def _bytes(acc: _Access, loops: list[For]) -> float:
    """Bytes of cache lines `acc` touches over `loops` (footprint, counting partial lines)."""
    elems, unit_run = 1, 1
    dep = [(lp, acc.coeffs[lp.var]) for lp in loops if acc.coeffs.get(lp.var)]
    for lp, _ in dep:
        elems *= lp.extent
    if not dep:
        return LINE
    smallest = min(c for _, c in dep)
    if smallest == 1:
        unit_run = max(lp.extent for lp, c in dep if c == 1)
        lines = elems / min(LINE // 4, unit_run)
    else:
        lines = elems * min(1.0, smallest * 4 / LINE)
    return lines * LINE


def _traffic(accs: list[_Access], loops: list[For], capacity: int) -> float:
    """Bytes moved into a cache of `capacity`: the innermost loops whose footprint fits are
    reused, every iteration of the loops outside them reloads that footprint."""
    n = len(loops)
    fit = 0
    for k in range(1, n + 1):
        if sum(_bytes(a, loops[n - k:]) for a in accs) <= capacity:
            fit = k
        else:
            break
    return trip_count(loops[:n - fit]) * sum(_bytes(a, loops[n - fit:]) for a in accs)


def _statement_cycles(st: Store, loops: list[For], in_register_tile: bool, m: CpuModel) -> float:
    trips = trip_count(loops)
    counts = store_op_counts(st)
    # a multiply feeding an add is one fused multiply-add instruction (-march=native, fast-math)
    ops = sum(OP_WEIGHT.get(k, 1.0) * v for k, v in counts.items()) - min(counts["mul"], counts["add"])
    accs = [_access(st.index, True)] + [_access(ld.index[0], False) for ld in loads(st.value)]
    inner = loops[-1] if loops else None
    strides = [a.coeffs.get(inner.var, 0) for a in accs] if inner else []
    if in_register_tile:
        lanes = m.lanes
    elif inner is not None and all(s <= 1 for s in strides):
        lanes = min(m.lanes, inner.extent)
    else:
        lanes = 1
    vec_iters = trips / lanes
    compute = vec_iters * max(ops, 1.0) / m.vector_ops_per_cycle
    if st.reduce_op and not in_register_tile and inner is not None and not strides[0]:
        compute = max(compute, vec_iters * ADD_LATENCY)  # one accumulator carried along the loop
    varying = [a for a, s in zip(accs, strides) if s] if inner else accs
    n_loads = sum(1 for a in varying if not a.is_store) + (1 if st.reduce_op and not in_register_tile and
                                                           any(a.is_store for a in varying) else 0)
    n_stores = 0 if in_register_tile else sum(1 for a in varying if a.is_store)
    if in_register_tile:  # one broadcast or vector load feeds several accumulators
        n_loads = n_loads / 4
    load_store = vec_iters * max(n_loads / m.loads_per_cycle, n_stores / m.stores_per_cycle)
    l2 = _traffic(accs, loops, m.l1_bytes) / m.l2_bytes_per_cycle
    mem = _traffic(accs, loops, m.l2_bytes) / m.mem_bytes_per_cycle
    return max(compute, load_store, l2, mem)


def statement_estimates(prog: Program, model: CpuModel | None = None) -> list[float]:
    """Estimated seconds of each store statement, in program order; a parallel loop's fork-join
    cost goes to the first statement inside it. Their sum is `estimate_s`."""
    m = model or CpuModel()
    out: list[float] = []
    pending = [0.0]

    def walk(nodes, loops: list[For], speedup: float, in_tile: bool) -> None:
        for n in nodes:
            if isinstance(n, Alloc):
                continue
            if isinstance(n, For):
                sp = speedup
                if n.ann == "parallel" and speedup == 1.0:
                    sp = n.extent / -(-n.extent // m.cores)
                    pending[0] += trip_count(loops) * m.fork_join_s
                tile = in_tile or (n.ann != "parallel" and register_tile(n) is not None)
                walk(n.body, loops + [n], sp, tile)
            elif isinstance(n, Store):
                out.append(_statement_cycles(n, loops, in_tile, m) / m.hz / speedup + pending[0])
                pending[0] = 0.0

    walk(prog.body, [], 1.0, False)
    return out


def estimate_s(prog: Program, model: CpuModel | None = None) -> float:
    """Estimated latency of `prog` in seconds (a ranking prior, not a prediction to report)."""
    return sum(statement_estimates(prog, model))
