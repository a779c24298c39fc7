"""The sequence of blocks of a flattened program and each block's op graph for the ILP.

Blocks come, in order of preference, from `rockmate.block` marks, from repeated identical
op sub-sequences (unrolled layers), or from cuts where few activations are live; a
`scan` over layers is one block whose body is solved once.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .graph.evaluate import eval_ops
from .graph.flops import spec_nbytes
from .graph.op_graph import Op, OpGraph
from .op_costs import is_heavy, op_cost

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
    (cut_bytes[0] = program inputs, not counted as temp); side_bytes is memory of
    values live across several cuts (held for the whole step).
    """

    blocks: tuple[Block, ...]
    cut_bytes: tuple[int, ...]
    side_bytes: int


@dataclass(frozen=True)
class BlockGraph:
    """Forward ops of one block as ILP nodes (one node per op)."""

    sizes_bytes: tuple[int, ...]  # bytes of the node's result if it is kept
    live_bytes: tuple[int, ...]  # bytes it occupies when recomputed (0 if XLA fuses it away)
    times_s: tuple[float, ...]
    bwd_times_s: tuple[float, ...]
    deps: tuple[tuple[int, ...], ...]  # producer nodes inside the block
    residuals: frozenset[int]  # nodes whose result the backward pass reads
    keepable: frozenset[int]  # nodes with a floating result (can carry a checkpoint name)
    input_bytes: int
    output_bytes: int
    fwd_ws_bytes: int  # transient working memory of the forward (beyond kept values)
    bwd_ws_bytes: int  # transient working memory of the backward (beyond kept/recomputed)
    autodiff_extra_bytes: int = 0  # residuals plain autodiff saves that are not op results
    views: tuple[tuple[int, int], ...] = ()  # (view node, source node): kept only with its source


def abstract(graph: OpGraph, vid: int):
    """A jax.ShapeDtypeStruct for value `vid` (TypeError for PRNG keys and tokens)."""
    import jax

    return jax.ShapeDtypeStruct(graph.vars[vid].shape, np.dtype(graph.vars[vid].dtype))


def _uses(program: OpGraph) -> dict[int, list[int]]:
    uses: dict[int, list[int]] = {}
    for k, op in enumerate(program.ops):
        for a in op.inputs:
            if a not in program.literals:
                uses.setdefault(a, []).append(k)
    return uses


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


def _producers(program: OpGraph) -> dict[int, int]:
    return {vid: k for k, op in enumerate(program.ops) for vid in op.outputs}


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


def _op_signature(program: OpGraph, k: int, producers: Mapping[int, int], start: int) -> str:
    op = program.ops[k]
    parts = [op.name, repr(sorted((n, repr(v)) for n, v in op.params.items()))]
    for a in op.inputs:
        if a in program.literals:
            parts.append(f"L{program.literals[a]!r}")
        else:
            p = producers.get(a)
            src = f"@{k - p}" if p is not None and p >= start else "ext"
            parts.append(f"{program.vars[a]}{src}")
    parts.extend(str(program.vars[v]) for v in op.outputs)
    return "|".join(parts)


def _signature(program: OpGraph, start: int, stop: int, producers) -> str:
    h = hashlib.sha1()
    for k in range(start, stop):
        h.update(_op_signature(program, k, producers, start).encode())
        h.update(b";")
    return h.hexdigest()[:16]


def _live_at_cuts(program: OpGraph) -> list[list[int]]:
    """For each cut position c (before op c, c = 0..n), the non-input values live across it."""
    n = len(program.ops)
    producers = _producers(program)
    last = _last_use(program)
    starts = np.zeros(n + 2, dtype=np.int64)
    live: list[list[int]] = [[] for _ in range(n + 1)]
    for vid, p in producers.items():
        end = last.get(vid, -1)
        for c in range(p + 1, min(end, n) + 1):
            live[c].append(vid)
    del starts
    return live


def _periodic_region(program: OpGraph, producers) -> tuple[int, int, int] | None:
    """(start, period, repeats) of the longest run of identical consecutive op sequences."""
    n = len(program.ops)
    if n < 4:
        return None
    local = [_op_signature(program, k, producers, 0) for k in range(n)]
    # relative-producer signatures do not depend on start; map to ints for fast compares
    ids = {s: i for i, s in enumerate(dict.fromkeys(local))}
    sig = np.array([ids[s] for s in local])
    best = None
    for p in range(2, n // 2 + 1):
        eq = sig[:-p] == sig[p:]
        if not eq.any():
            continue
        # longest run of True
        padded = np.concatenate([[False], eq, [False]])
        d = np.diff(padded.astype(np.int8))
        run_starts = np.flatnonzero(d == 1)
        run_ends = np.flatnonzero(d == -1)
        lengths = run_ends - run_starts
        j = int(np.argmax(lengths))
        reps = (int(lengths[j]) + p) // p
        if reps < 2:
            continue
        covered = reps * p
        if best is None or covered > best[0]:
            best = (covered, int(run_starts[j]), p, reps)
    if best is None:
        return None
    return best[1], best[2], best[3]


def find_chain(program: OpGraph, max_blocks: int = 32) -> Chain:
    """Cut the program into a chain of blocks (see module docstring)."""
    n = len(program.ops)
    producers = _producers(program)
    live = _live_at_cuts(program)
    cut_bytes_all = [sum(spec_nbytes(program.vars[v]) for v in vs) for vs in live]
    cuts = _marked_cuts(program)
    if cuts is None:
        cuts = _periodic_cuts(program, producers, cut_bytes_all)
    if cuts is None:
        cuts = _narrow_cuts(program, live, max_blocks)
    # scans over layers get their own block
    for k, op in enumerate(program.ops):
        if op.name == "scan" and op.params.get("length", 1) > 1:
            cuts.update({k, k + 1})
    cuts = sorted(c for c in cuts if 0 < c < n)
    bounds = [0] + cuts + [n]
    blocks = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        is_scan = b - a == 1 and program.ops[a].name == "scan"
        blocks.append(Block(a, b, is_scan, _signature(program, a, b, producers)))
    # values live across more than one cut are "side" values held for the whole step
    cut_sets = [set(live[c]) for c in bounds[1:-1]]
    counts: dict[int, int] = {}
    for s in cut_sets:
        for v in s:
            counts[v] = counts.get(v, 0) + 1
    side = {v for v, c in counts.items() if c > 1}
    side_bytes = sum(spec_nbytes(program.vars[v]) for v in side)
    cut_bytes = [0] + [sum(spec_nbytes(program.vars[v]) for v in s - side) for s in cut_sets]
    out_bytes = sum(spec_nbytes(program.vars[v]) for v in program.outvars if v not in program.literals
                    and v in producers)
    cut_bytes.append(out_bytes)
    return Chain(tuple(blocks), tuple(cut_bytes), side_bytes)


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


def _periodic_cuts(program: OpGraph, producers, cut_bytes_all) -> set[int] | None:
    region = _periodic_region(program, producers)
    if region is None:
        return None
    start, period, reps = region
    if reps * period < 0.5 * len(program.ops) or period < 4:
        return None
    # phase: where cuts carry the fewest live bytes on average (a phase > 0 has one cut
    # fewer inside the region; comparing sums favoured it and merged the last layer into
    # the epilogue, a block of its own signature to solve and calibrate). Among phases
    # within 1 % of the fewest, prefer cuts whose values feed a matmul/conv/reduction (a
    # buffer XLA materialises anyway, e.g. after a residual relu rather than before it).
    def mean_bytes(ph):
        cs = [start + ph + j * period for j in range(reps - (1 if ph else 0))]
        return sum(cut_bytes_all[c] for c in cs) / len(cs)
    means = {ph: mean_bytes(ph) for ph in range(period)}
    low = min(means.values())
    near = [ph for ph in range(period) if means[ph] <= 1.01 * low + 64]
    uses = _uses(program)

    def feeds_heavy(ph):
        c = start + ph
        vals = [v for v in program.ops[c - 1].outputs] if c > 0 else []
        return sum(any(program.ops[k].name in _MATERIALISING for k in uses.get(v, ())) for v in vals)
    best_phase = min(near, key=lambda ph: (-feeds_heavy(ph), ph))
    first = start + best_phase
    nblocks = reps if best_phase == 0 else reps - 1
    return {first + j * period for j in range(nblocks + 1)}


def _narrow_cuts(program: OpGraph, live, max_blocks: int) -> set[int]:
    """Cuts where the number of large live activations is minimal, merged to <= max_blocks."""
    n = len(program.ops)
    if n < 2:
        return set()
    big = max((spec_nbytes(a) for a in program.vars.values()), default=0)
    counts = [sum(1 for v in live[c] if spec_nbytes(program.vars[v]) >= 0.1 * big) for c in range(n + 1)]
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


def block_graph(program: OpGraph, start: int, stop: int,
                profile: Mapping[str, float] | None = None) -> BlockGraph:
    """ILP nodes of ops [start, stop): sizes, times, dependencies and residual needs."""
    ops = program.ops[start:stop]
    local = {vid: j for j, op in enumerate(ops) for vid in op.outputs}
    ins, outs = block_io(program, start, stop)
    out_set = set(outs)
    consumers: dict[int, list[Op]] = {}
    for op in ops:
        for a in op.inputs:
            if a not in program.literals and a in local:
                consumers.setdefault(local[a], []).append(op)
    sizes, live, times, bwd, deps, keepable = [], [], [], [], [], set()
    residuals: set[int] = set()
    for j, op in enumerate(ops):
        cost = op_cost(program, op, profile)
        size = sum(spec_nbytes(program.vars[v]) for v in op.outputs)
        materialized = (is_heavy(op) or any(is_heavy(c) for c in consumers.get(j, ()))
                        or any(v in out_set for v in op.outputs))
        sizes.append(size)
        live.append(size if materialized else 0)
        times.append(cost.time_s)
        bwd.append(cost.bwd_time_s)
        d = tuple(sorted({local[a] for a in op.inputs if a not in program.literals and a in local}))
        deps.append(d)
        if all(program.vars[v].is_float for v in op.outputs) and op.outputs:
            keepable.add(j)
        if cost.needs_output:
            residuals.add(j)
        if cost.needs_inputs:
            residuals.update(d)
    probed = autodiff_residuals(program, start, stop)
    extra = 0
    if probed is not None:
        residuals, extra = set(probed[0]), probed[1]
    # reshapes are bitcasts in XLA: keeping one costs nothing beyond its (kept) source
    views = {}
    for j, op in enumerate(ops):
        if op.name in _VIEWS and deps[j] and len(op.inputs) == 1:
            views[j] = deps[j][0]
            sizes[j] = 0
    # a residual XLA would otherwise fuse away still occupies memory when kept/recomputed,
    # except broadcasts and scalar converts, which XLA re-fuses into their consumers
    live = [sizes[j] if j in residuals and ops[j].name not in _FREE else live[j]
            for j in range(len(ops))]
    in_bytes = sum(spec_nbytes(program.vars[v]) for v in ins if v not in program.literals)
    out_bytes = sum(spec_nbytes(program.vars[v]) for v in outs)
    big = max(live, default=0)
    return BlockGraph(tuple(sizes), tuple(live), tuple(times), tuple(bwd), tuple(deps),
                      frozenset(residuals), frozenset(keepable), in_bytes, out_bytes,
                      fwd_ws_bytes=big, bwd_ws_bytes=2 * big, autodiff_extra_bytes=extra,
                      views=tuple(sorted(views.items())))


_VIEWS = {"reshape", "squeeze", "expand_dims"}
_MATERIALISING = {"dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min"}
_FREE = {"broadcast_in_dim", "iota", "convert_element_type", "reshape", "squeeze", "expand_dims"}


def autodiff_residuals(program: OpGraph, start: int, stop: int) -> tuple[frozenset[int], int] | None:
    """Which ops' results JAX's own VJP of ops [start, stop) saves (local indices), and the
    bytes of saved values that are not op results (linearization intermediates)."""
    import jax

    ins, outs = block_io(program, start, stop)
    if not outs:
        return None
    captured: dict = {}

    def fn(*vals):
        env = dict(zip(ins, vals))
        eval_ops(program, env, start, stop)
        captured.clear()
        captured.update(env)
        return tuple(env[o] for o in outs)

    found: list = []

    def probe(*vals):
        out, vjp_fn = jax.vjp(fn, *vals)
        by_id = {id(getattr(v, "primal", v)): vid for vid, v in captured.items()}
        producer = {vid: j for j, op in enumerate(program.ops[start:stop]) for vid in op.outputs}
        res, extra = set(), 0
        for leaf in jax.tree.leaves(vjp_fn):
            vid = by_id.get(id(leaf))
            if vid is not None and vid in producer:
                res.add(producer[vid])
            elif vid is None:
                extra += int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize
        found.append((frozenset(res), extra))
        return out

    try:
        jax.make_jaxpr(probe)(*[abstract(program, v) for v in ins])
    except Exception:  # non-differentiable blocks (e.g. integer-only): fall back to rules
        return None
    return found[0]


