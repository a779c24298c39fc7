"""An analytic latency estimate of a lowered program on a CPU: per statement, the largest of
its vector compute, load/store, L2 and memory-traffic times, divided by its parallel speed-up.
A register-tiled reduction is costed per reduction step (FMAs of all its accumulators, bounded
by their add latency when they are few, against the loads and broadcasts feeding them) plus the
copy of its output tile in and out of registers.

The search uses it as the cost model's prior: before the model has measurements of a region
of the schedule space it ranks by this estimate, and measurements correct it (see
`cost_model.XGBoostCostModel`, which takes it as a base margin). It needs only the loop nest,
so it also ranks the first batch of a task nothing was measured for yet."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .codegen_c import MAX_UNROLL, register_tile
from .expr import Expr, Var, loads, variables
from .lower import Alloc, For, Program, Store, _linear, store_op_counts, trip_count


@dataclass(frozen=True)
class CpuModel:
    """Per-core throughputs in cycles, cache sizes per core, and the OpenMP fork-join cost
    (defaults: an AVX-512 server core; the cores are this machine's)."""

    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    lanes: int = 16                 # fp32 lanes of a vector register (AVX-512)
    registers: int = 32             # vector registers
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
# share of the smaller of a register tile's FMA and load times that the larger does not hide
# (FMAs with broadcast operands and loads compete for the same ports)
PORT_OVERLAP_LOSS = 0.5
OPERAND_REGISTERS = 4  # registers a register tile's loop needs besides its accumulators


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
    reused; the next loop out moves its whole footprint (consecutive iterations share the
    lines they both touch, since one iteration's data fits), and each iteration of the loops
    outside it moves that again."""
    n = len(loops)
    fit = 0
    for k in range(1, n + 1):
        if sum(_bytes(a, loops[n - k:]) for a in accs) <= capacity:
            fit = k
        else:
            break
    level = max(n - fit - 1, 0)
    return trip_count(loops[:level]) * sum(_bytes(a, loops[level:]) for a in accs)


def _vector_ops(st: Store) -> float:
    """Weighted vector instructions per iteration of `st`; a multiply feeding an add is one
    fused multiply-add instruction (-march=native, fast-math)."""
    counts = store_op_counts(st)
    return sum(OP_WEIGHT.get(k, 1.0) * v for k, v in counts.items()) - min(counts["mul"], counts["add"])


def _cache_cycles(accs: list[_Access], loops: list[For], m: CpuModel) -> float:
    """The larger of the L1<-L2 and L2<-memory traffic times of `accs` over `loops`."""
    return max(_traffic(accs, loops, m.l1_bytes) / m.l2_bytes_per_cycle,
               _traffic(accs, loops, m.l2_bytes) / m.mem_bytes_per_cycle)


def _tile_cycles(st: Store, loops: list[For], red: For, inner: list[For], m: CpuModel) -> float:
    """Cycles of a register-tiled reduction: per step of the reduction loop every accumulator
    vector gets one update (bounded by the FMA ports and by the add latency when there are few
    accumulators) and each input vector or broadcast is loaded once; before and after the
    reduction loop the output tile is copied in and out of the registers."""
    trips = trip_count(loops)
    tile = trip_count(inner)
    ops = _vector_ops(st)
    out_acc = _access(st.index, True)
    ins = [_access(ld.index[0], False) for ld in loads(st.value)]
    vec = inner[-1]
    # the printer fully unrolls every tile loop but the vectorised one (up to 64 iterations);
    # gcc leaves such a straight-line tile scalar (W1 8 x 32: 41 ms instead of 0.88)
    unrolled = vec.ann != "vectorize" and vec.extent <= MAX_UNROLL
    vl = min(m.lanes, vec.extent) if not unrolled and out_acc.coeffs.get(vec.var) == 1 else 1
    acc_vectors = tile / vl
    steps = trips / tile
    compute = steps * max(acc_vectors * max(ops, 1.0) / m.vector_ops_per_cycle, ADD_LATENCY)
    spilled = max(0.0, acc_vectors - m.registers + OPERAND_REGISTERS)  # loaded and stored every step
    n_loads = 0.0
    for a in ins:
        n = 1.0
        for lp in inner:
            c = a.coeffs.get(lp.var, 0)
            if c:
                n *= lp.extent / vl if (lp is vec and c == 1) else lp.extent
        n_loads += n
    load = steps * max((n_loads + spilled) / m.loads_per_cycle, spilled / m.stores_per_cycle)
    body = max(compute, load) + PORT_OVERLAP_LOSS * min(compute, load)
    instances = trips / (tile * red.extent)
    line_bytes = min(LINE, vl * 4)
    # the output tile's lines are copied in and out once per tile, from L2 when its block is large
    copy = instances * acc_vectors * 2 * line_bytes / m.l2_bytes_per_cycle
    return max(body, _cache_cycles(ins, loops, m)) + copy


def _statement_cycles(st: Store, loops: list[For], m: CpuModel) -> float:
    trips = trip_count(loops)
    ops = _vector_ops(st)
    accs = [_access(st.index, True)] + [_access(ld.index[0], False) for ld in loads(st.value)]
    inner = loops[-1] if loops else None
    strides = [a.coeffs.get(inner.var, 0) for a in accs] if inner else []
    if inner is not None and all(s <= 1 for s in strides):
        lanes = min(m.lanes, inner.extent)
    else:
        lanes = 1
    vec_iters = trips / lanes
    compute = vec_iters * max(ops, 1.0) / m.vector_ops_per_cycle
    if st.reduce_op and inner is not None and not strides[0]:
        compute = max(compute, vec_iters * ADD_LATENCY)  # one accumulator carried along the loop
    varying = [a for a, s in zip(accs, strides) if s] if inner else accs
    n_loads = sum(1 for a in varying if not a.is_store) + (1 if st.reduce_op and
                                                           any(a.is_store for a in varying) else 0)
    n_stores = sum(1 for a in varying if a.is_store)
    load_store = vec_iters * max(n_loads / m.loads_per_cycle, n_stores / m.stores_per_cycle)
    return max(compute, load_store, _cache_cycles(accs, loops, m))


def statement_estimates(prog: Program, model: CpuModel | None = None) -> list[float]:
    """Estimated seconds of each store statement, in program order; a parallel loop's fork-join
    cost goes to the first statement inside it. Their sum is `estimate_s`."""
    m = model or CpuModel()
    out: list[float] = []
    pending = [0.0]

    def walk(nodes, loops: list[For], speedup: float) -> None:
        for n in nodes:
            if isinstance(n, Alloc):
                continue
            if isinstance(n, For):
                sp = speedup
                if n.ann == "parallel" and speedup == 1.0:
                    sp = n.extent / -(-n.extent // m.cores)
                    pending[0] += trip_count(loops) * m.fork_join_s
                found = register_tile(n) if n.ann != "parallel" else None
                if found is not None:
                    inner, st = found
                    out.append(_tile_cycles(st, loops + [n] + inner, n, inner, m) / m.hz / sp + pending[0])
                    pending[0] = 0.0
                    continue
                walk(n.body, loops + [n], sp)
            elif isinstance(n, Store):
                out.append(_statement_cycles(n, loops, m) / m.hz / speedup + pending[0])
                pending[0] = 0.0

    walk(prog.body, [], 1.0)
    return out


def estimate_s(prog: Program, model: CpuModel | None = None) -> float:
    """Estimated latency of `prog` in seconds (a ranking prior, not a prediction to report)."""
    return sum(statement_estimates(prog, model))
