"""The sequence of blocks of a program's op graph and the memory flowing between them.

Blocks come, in order of preference, from `rockmate.block` marks, from repeated layers
(tandem repeats of op signatures, `rockmate.repeats`), or from cuts where few
activations are live; a `scan` over layers is one block whose body is solved once.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .graph.op_graph import OpGraph
from .graph.signature import op_signature, range_signature
from .op_costs import op_cost
from .repeats import tandem_repeats

BLOCK_PREFIX = "rockmate_block"  # name prefix of the jit calls `rockmate.block` makes


@dataclass(frozen=True)
class Block:
    """Ops [start, stop) of the program; `scan` blocks hold exactly one scan op."""

    start: int
    stop: int
    is_scan: bool
    signature: str  # equal signatures = identical structure, shapes and dataflow


@dataclass(frozen=True)
class Chain:
    """Blocks in program order plus the memory that flows between them.

    cut_bytes[i] is the activation memory live between block i-1 and block i
    (cut_bytes[0] = program inputs, not counted as temp); side_bytes is memory held for
    the whole step whatever the schedule: values live across several cuts, and the
    partial gradient sums of values several blocks read.
    """

    blocks: tuple[Block, ...]
    cut_bytes: tuple[int, ...]
    side_bytes: int


def abstract(graph: OpGraph, vid: int):
    """A jax.ShapeDtypeStruct for value `vid` (TypeError for PRNG keys and tokens)."""
    import jax

    return jax.ShapeDtypeStruct(graph.vars[vid].shape, np.dtype(graph.vars[vid].dtype))


def _last_use(program: OpGraph) -> dict[int, int]:
    """Value id -> index of its last consumer (len(ops) for program outputs)."""
    last: dict[int, int] = {}
    for k, op in enumerate(program.ops):
        for a in op.inputs:
            if a not in program.literals:
                last[a] = k
    for a in program.outvars:
        if a not in program.literals:
            last[a] = len(program.ops)
    return last


def block_io(program: OpGraph, start: int, stop: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """External values read by ops [start, stop) and values they define that are used later."""
    defined = {vid for op in program.ops[start:stop] for vid in op.outputs}
    ins: list[int] = []
    seen: set[int] = set()
    for op in program.ops[start:stop]:
        for a in op.inputs:
            if a not in program.literals and a not in defined and a not in seen:
                seen.add(a)
                ins.append(a)
    last = _last_use(program)
    outs = tuple(v for op in program.ops[start:stop] for v in op.outputs if last.get(v, -1) >= stop)
    return tuple(ins), outs


def _live_at_cuts(program: OpGraph) -> list[list[int]]:
    """For each cut position c (before op c, c = 0..n), the non-input values live across it."""
    n = len(program.ops)
    last = _last_use(program)
    live: list[list[int]] = [[] for _ in range(n + 1)]
    for vid, p in program.producer().items():
        for c in range(p + 1, min(last.get(vid, -1), n) + 1):
            live[c].append(vid)
    return live


def side_values(live: Sequence[Sequence[int]], cuts: Sequence[int]) -> set[int]:
    """Values live across more than one of `cuts`: a shared mask or position table read by
    every layer, held for the whole step whatever the schedule, so it neither counts
    against a cut nor stops one."""
    counts: dict[int, int] = {}
    for c in cuts:
        for v in live[c]:
            counts[v] = counts.get(v, 0) + 1
    return {v for v, k in counts.items() if k > 1}


def find_chain(program: OpGraph, max_blocks: int = 32) -> Chain:
    """Cut the program into a chain of blocks (see module docstring)."""
    n = len(program.ops)
    producers = program.producer()
    live = _live_at_cuts(program)
    op_sigs = [op_signature(program, op) for op in program.ops]
    cuts = _marked_cuts(program)
    if cuts is None:
        cuts = _repeat_cuts(program, op_sigs, live)
    if cuts is None:
        cuts = _narrow_cuts(program, live, max_blocks)
    # scans over layers get their own block
    for k, op in enumerate(program.ops):
        if op.name == "scan" and op.trip_count > 1:
            cuts.update({k, k + 1})
    cuts = sorted(c for c in cuts if 0 < c < n)
    bounds = [0] + cuts + [n]
    blocks = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        is_scan = b - a == 1 and program.ops[a].name == "scan"
        blocks.append(Block(a, b, is_scan, range_signature(program, a, b, op_sigs, producers)))
    side = side_values(live, bounds[1:-1])
    side_bytes = sum(program.vars[v].nbytes for v in side) + _summed_gradient_bytes(program, blocks)
    cut_bytes = [0] + [sum(program.vars[v].nbytes for v in live[c] if v not in side) for c in bounds[1:-1]]
    out_bytes = sum(program.vars[v].nbytes for v in program.outvars if v not in program.literals
                    and v in producers)
    cut_bytes.append(out_bytes)
    return Chain(tuple(blocks), tuple(cut_bytes), side_bytes)


def _summed_gradient_bytes(program: OpGraph, blocks: Sequence[Block]) -> int:
    """Bytes of the gradients of differentiable values that several blocks read (a tied
    embedding, stacked weights a scan and the head both use, a learned table every layer
    reads): each reader's backward adds to a partial sum held from the last reader's
    backward to the first's (measured: +0.8 MB on a scan whose weights the epilogue reads)."""
    grad = {v for v in program.invars if program.vars[v].is_float}
    for op in program.ops:
        if op.name != "stop_gradient" and any(a in grad for a in op.inputs):
            grad.update(o for o in op.outputs if program.vars[o].is_float)
    readers: dict[int, set[int]] = {}
    for b, blk in enumerate(blocks):
        for op in program.ops[blk.start:blk.stop]:
            for a in op.inputs:
                if a in grad:
                    readers.setdefault(a, set()).add(b)
    return sum(program.vars[v].nbytes for v, bs in readers.items() if len(bs) > 1)


def _marked_cuts(program: OpGraph) -> set[int] | None:
    cuts: set[int] = set()
    prev = None
    for k, op in enumerate(program.ops):
        if op.mark != prev:
            cuts.add(k)
        prev = op.mark
    if all(op.mark is None for op in program.ops):
        return None
    return cuts


MIN_PERIOD = 4  # ops in the shortest layer worth a block of its own
MIN_COVER = 0.25  # share of the program a stack of layers must cover to be cut by layer


def _repeat_cuts(program: OpGraph, op_sigs: Sequence[str], live) -> set[int] | None:
    """Cuts between the copies of each repeated layer (a tandem repeat of structural op
    signatures, `rockmate.repeats`) that covers a good share of the program. Signatures
    carry no data flow, so the first layer (reading the embedding or the arguments) and
    two-layer stacks repeat too, and a value every layer reads does not break the repeat."""
    n = len(program.ops)
    repeats = [r for r in tandem_repeats(op_sigs, min_period=MIN_PERIOD) if r[1] * r[2] >= MIN_COVER * n]
    if not repeats:
        return None
    uses = program.consumers()
    cuts: set[int] = set()
    for start, period, copies in repeats:
        cuts |= _layer_cuts(program, live, uses, start, period, copies)
    return cuts


def _layer_cuts(program: OpGraph, live, uses, start: int, period: int, copies: int) -> set[int]:
    """The cuts of one repeat at its best phase. Phase: where cuts carry the fewest live
    bytes, side values left out, compared on the cuts after the first copy (the same
    number for every phase, each preceded by a whole layer; the first copy may read
    program inputs, which are not temp, and favoured a phase cutting inside it). Among
    phases within 1 % of the fewest, prefer cuts whose values feed a
    matmul/conv/reduction (a buffer XLA materialises anyway, e.g. after a residual relu
    rather than before it). A phase > 0 leaves one block fewer inside the repeat."""
    def phase_cuts(ph):
        return [start + ph + j * period for j in range(copies + 1 if ph == 0 else copies)]

    def mean_bytes(ph):
        side = side_values(live, phase_cuts(ph))
        cs = [start + ph + j * period for j in range(1, copies)]
        return sum(program.vars[v].nbytes for c in cs for v in live[c] if v not in side) / len(cs)

    def feeds_heavy(ph):
        c = start + ph
        vals = program.ops[c - 1].outputs if c > 0 else ()
        return sum(any(program.ops[k].name in _MATERIALISING for k in uses.get(v, ())) for v in vals)

    means = {ph: mean_bytes(ph) for ph in range(period)}
    low = min(means.values())
    near = [ph for ph in range(period) if means[ph] <= 1.01 * low + 64]
    return set(phase_cuts(min(near, key=lambda ph: (-feeds_heavy(ph), ph))))


def _narrow_cuts(program: OpGraph, live, max_blocks: int) -> set[int]:
    """Cuts where the number of large live activations is minimal, merged to <= max_blocks."""
    n = len(program.ops)
    if n < 2:
        return set()
    big = max((a.nbytes for a in program.vars.values()), default=0)
    counts = [sum(1 for v in live[c] if program.vars[v].nbytes >= 0.1 * big) for c in range(n + 1)]
    inner = counts[1:n]
    low = min(inner)
    cand = [c for c in range(1, n) if counts[c] == low and program.ops[c - 1].name not in ("scan",)]
    if len(cand) + 1 <= max_blocks:
        return set(cand)
    # keep cuts that balance op time
    times = np.cumsum([op_cost(program, op).time_s for op in program.ops])
    total = times[-1]
    chosen: set[int] = set()
    for j in range(1, max_blocks):
        target = total * j / max_blocks
        chosen.add(min(cand, key=lambda c: abs(times[c - 1] - target)))
    return chosen


_MATERIALISING = {"dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min"}
