"""Cut a traced loss into layers: contiguous op ranges with what flows between them.

A layer is the unit the pipeline planner prices and places: stages are ranges of layers.
Values computed from constants alone (an iota, a causal mask, a position table built with
broadcasts) are recomputed by every layer that reads them instead of crossing layer and
stage boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autopar.boundary import stage_boundary_p
from autopar.pipeline.layer_clustering import OpSequence, cluster_layers
from rockmate.graph import OpGraph


@dataclass(frozen=True)
class LayerSpec:
    """Layer `index` of a loss graph: ops [start, end) plus the constant ops they need.

    `param_inputs`/`batch_inputs` are positions in the loss's inputs (differentiated or
    not) in order of first use, so that layers with the same ops list their inputs alike
    whatever the order of the loss's inputs (pytree order puts "h_10" before "h_9");
    `in_acts` are loss-graph vars produced by earlier layers, `out_acts` vars read by
    later layers (for the last layer: the loss)."""

    index: int
    start: int
    end: int
    ops: tuple[int, ...]            # constant ops first, then start..end-1
    param_inputs: tuple[int, ...]
    batch_inputs: tuple[int, ...]
    in_acts: tuple[int, ...]
    out_acts: tuple[int, ...]


def is_marker(graph: OpGraph, index: int) -> bool:
    """Whether op `index` is a `mark_stage_boundary` marker (an identity)."""
    return graph.ops[index].primitive is stage_boundary_p


def constant_vars(graph: OpGraph) -> set[int]:
    """Vars computed from literals alone (no graph input reaches them)."""
    const = set(graph.literals)
    for op in graph.ops:
        if all(v in const for v in op.inputs):   # an op without inputs (iota) is a constant too
            const.update(op.outputs)
    return const - set(graph.literals)


def marker_cuts(graph: OpGraph) -> list[int] | None:
    """Layer cuts right after each `mark_stage_boundary` marker; None without markers."""
    marks = [op.index + 1 for op in graph.ops if op.primitive is stage_boundary_p]
    if not marks:
        return None
    return sorted({0, len(graph.ops), *marks})


def op_sequence(graph: OpGraph) -> OpSequence:
    """Per-op FLOPs and the activations flowing between ops, for layer clustering
    (inputs and constants excluded: they never cross a cut)."""
    const = constant_vars(graph)
    producer = {v: op.index for op in graph.ops for v in op.outputs}
    readers: dict[int, list[int]] = {}
    for op in graph.ops:
        for v in op.inputs:
            if v in producer and v not in const:
                readers.setdefault(v, []).append(op.index)
    values = tuple((producer[v], float(graph.vars[v].nbytes), tuple(cs)) for v, cs in readers.items())
    return OpSequence(tuple(op.flops for op in graph.ops), values)


def live_bytes_at_cuts(graph: OpGraph) -> list[float]:
    """bytes[c]: activations produced before op c and read at or after it (c = 0..n)."""
    seq = op_sequence(graph)
    delta = [0.0] * (len(graph.ops) + 2)
    for producer, nbytes, consumers in seq.values:
        delta[producer + 1] += nbytes
        delta[max(consumers) + 1] -= nbytes
    out, running = [], 0.0
    for d in delta[:len(graph.ops) + 1]:
        running += d
        out.append(running)
    return out


def repeat_cuts(graph: OpGraph, max_layers: int = 16) -> list[int] | None:
    """Layers aligned with the model's repeated blocks (an unrolled stack of identical
    layers): one layer per group of consecutive blocks, at most `max_layers` groups, plus
    the ops before and after the stack as layers of their own. Cut at the earliest phase of
    the period where the fewest activation bytes cross (to within 1%). None when no repeat
    covers half the ops."""
    from autopar.intra_op import op_signature
    from rockmate.repeats import tandem_repeats

    n = len(graph.ops)
    sigs = [op_signature(op, graph) for op in graph.ops]
    repeats = tandem_repeats(sigs)
    if not repeats:
        return None
    start, period, copies = max(repeats, key=lambda r: r[1] * r[2])
    if period * copies < n / 2:
        return None
    live = live_bytes_at_cuts(graph)
    crossing = [sum(live[start + p + j * period] for j in range(copies - (p > 0))) for p in range(period)]
    # near-ties (a few small tensors) go to the earliest phase: the blocks then stay whole
    # layers whatever the micro-batch size the graph was traced at
    phase = min(p for p in range(period) if crossing[p] <= min(crossing) * 1.01)
    bounds = [start + phase + j * period for j in range(copies + 1 - (phase > 0))]
    blocks = len(bounds) - 1
    group = -(-blocks // max_layers)
    cuts = {0, n, *bounds[::group], bounds[-1]}
    return sorted(c for c in cuts if 0 <= c <= n)


def clustered_cuts(graph: OpGraph, num_layers: int) -> list[int]:
    """Alpa's operator clustering of the graph's ops into `num_layers` layers."""
    return list(cluster_layers(op_sequence(graph), num_layers).cuts)


def cut_layers(graph: OpGraph, cuts: Sequence[int], diff_mask: Sequence[bool]) -> tuple[LayerSpec, ...]:
    """Layers of `graph` at op indices `cuts` = [0, c1, ..., n] (strictly increasing)."""
    cuts = list(cuts)
    n = len(graph.ops)
    if cuts[0] != 0 or cuts[-1] != n or any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"bad layer cuts {cuts} for a loss of {n} ops")
    loss = graph.outvars[0]
    if loss in graph.literals or loss in graph.invars:
        raise ValueError("the loss must be computed from its inputs by at least one operation")
    const = constant_vars(graph)
    producer = {v: op.index for op in graph.ops for v in op.outputs}
    position = {v: i for i, v in enumerate(graph.invars)}
    layer_of = [0] * n
    for l, (a, b) in enumerate(zip(cuts, cuts[1:])):
        layer_of[a:b] = [l] * (b - a)
    reads: list[list[int]] = [[] for _ in cuts[1:]]
    for op in graph.ops:
        reads[layer_of[op.index]].extend(op.inputs)
    reads[-1].append(loss)
    specs = []
    out_acts: list[list[int]] = [[] for _ in cuts[1:]]
    in_acts: list[list[int]] = [[] for _ in cuts[1:]]
    inputs: list[dict[int, None]] = [{} for _ in cuts[1:]]     # in order of first use
    const_ops: list[set[int]] = [set() for _ in cuts[1:]]
    for l, read in enumerate(reads):
        for v in dict.fromkeys(read):
            if v in position:
                inputs[l].setdefault(position[v])
            elif v in const and layer_of[producer[v]] != l:
                const_ops[l] |= _producers_of(graph, v, producer, const)
            elif v in producer and layer_of[producer[v]] < l:
                in_acts[l].append(v)
                src = out_acts[layer_of[producer[v]]]
                if v not in src:
                    src.append(v)
    # constant ops of a layer read graph inputs only through other constants: none
    for l, (a, b) in enumerate(zip(cuts, cuts[1:])):
        own = [i for i in sorted(const_ops[l]) if not a <= i < b]
        specs.append(LayerSpec(
            index=l, start=a, end=b, ops=tuple(own) + tuple(range(a, b)),
            param_inputs=tuple(i for i in inputs[l] if diff_mask[i]),
            batch_inputs=tuple(i for i in inputs[l] if not diff_mask[i]),
            in_acts=tuple(in_acts[l]), out_acts=tuple([loss] if l == len(cuts) - 2 else out_acts[l])))
    return tuple(specs)


def _producers_of(graph: OpGraph, v: int, producer: dict[int, int], const: set[int]) -> set[int]:
    """The ops computing constant var `v` (it and its constant ancestors)."""
    out, stack = set(), [v]
    while stack:
        w = stack.pop()
        if w not in producer or producer[w] in out:
            continue
        out.add(producer[w])
        stack.extend(x for x in graph.ops[producer[w]].inputs if x in const)
    return out
