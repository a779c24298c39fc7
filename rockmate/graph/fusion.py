"""Which values of an op graph XLA materialises in memory, and the liveness peak they make.

XLA fuses chains of elementwise and shape ops into their consumers, so their results
never occupy a buffer of their own. A value is materialised when an op that XLA keeps as
a kernel of its own produces or reads it (matmuls, convolutions, reductions, gathers,
loops, ...), when several ops read it (a fusion output shared by consumers), or when the
program returns it. Memory estimates that count every op result overstate XLA's temp
memory by the fused intermediates (measured on the test GPTs: 1.2-1.35x XLA's total;
with this rule 0.88-0.93x, see docs/pipeline.md).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from rockmate.graph.op_graph import OpGraph

# Ops XLA runs as kernels of their own: their operands and results are buffers.
MATERIALIZING = frozenset("""
dot_general conv_general_dilated reduce_max reduce_min reduce_sum reduce_prod reduce_and reduce_or
argmax argmin cumsum cumlogsumexp cummax cummin cumprod sort gather scatter scatter-add scatter_add
scatter-mul scatter_mul scatter-min scatter-max scan while cond custom_jvp_call custom_vjp_call
custom_vjp_call_jaxpr remat checkpoint reduce_window_sum reduce_window_max reduce_window_min
reduce_window select_and_scatter_add select_and_gather_add fft dynamic_slice dynamic_update_slice
concatenate transpose top_k rng_bit_generator threefry2x32 random_bits all_gather psum
""".split())


def materialized(graph: OpGraph, keep: Iterable[int] = ()) -> set[int]:
    """Vars of `graph` that occupy buffers: produced or read by a materialising op, graph
    outputs, and the vars in `keep` (e.g. values another program reads)."""
    out = set(graph.outvars) | set(keep)
    readers: dict[int, int] = {}
    for op in graph.ops:
        if op.name in MATERIALIZING:
            out.update(op.outputs)
            out.update(op.inputs)
        for v in set(op.inputs):
            readers[v] = readers.get(v, 0) + 1
    out.update(v for v, n in readers.items() if n > 1)
    return out - set(graph.literals)


def liveness_levels(graph: OpGraph, ops: Sequence[int], nbytes: Callable[[int], float],
                    live_out: Iterable[int] = (), count: Callable[[int], bool] = lambda v: True,
                    transient: dict[int, float] | None = None) -> list[float]:
    """Total `nbytes` of the vars defined by `ops` (in that order) that are alive while
    each op runs: from their producer until their last reader among `ops`, or to the end
    for vars in `live_out`. Only vars for which `count(v)` holds are summed. `transient[i]`
    bytes are alive while op i runs (e.g. an operand copied into another layout for it).
    One level per op, then the level after the last op."""
    position = {i: k for k, i in enumerate(ops)}
    last: dict[int, int] = {}
    for k, i in enumerate(ops):
        for v in graph.ops[i].inputs:
            last[v] = k
    end = len(ops)
    for v in live_out:
        last[v] = end
    delta = [0.0] * (end + 2)
    for i in ops:
        for v in graph.ops[i].outputs:
            if not count(v):
                continue
            b = position[i]
            delta[b] += nbytes(v)
            delta[max(last.get(v, b), b) + 1] -= nbytes(v)
    extra = [0.0] * (end + 2)
    for i, b in (transient or {}).items():
        if i in position:
            extra[position[i]] += b
    levels, running = [], 0.0
    for d, e in zip(delta[:end + 1], extra):
        running += d
        levels.append(running + e)
    return levels


def liveness_peak(graph: OpGraph, ops: Sequence[int], nbytes: Callable[[int], float],
                  live_out: Iterable[int] = (), count: Callable[[int], bool] = lambda v: True,
                  transient: dict[int, float] | None = None) -> float:
    """The largest of `liveness_levels` (0 for no ops)."""
    return max([0.0, *liveness_levels(graph, ops, nbytes, live_out, count, transient)])
