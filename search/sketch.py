"""Sketch generation (Ansor's derivation rules) and random annotation.

A sketch is a list of steps whose split factors are still open (`"factors": [None, ...]`).
Rules, applied from the output stage backwards: always-inline element-wise stages,
multi-level "SSRSRS" tiling for stages with data reuse (fused with an element-wise consumer,
or behind a cache-write stage, optionally with a read cache that packs an operand into
panels), rfactor for plain reductions. Annotation fills tile sizes
from factorisations, parallelises fused outer loops, vectorises inner loops, picks unroll
depth and compute locations."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Callable

from .compute import ComputeDAG, Stage
from .expr import Var, variables
from .lower import lower
from .schedule import ScheduleError, State, Step, StageState, apply_step, initial_state, replay

UNROLL_STEPS = (0, 16, 64)  # 512 (Ansor's largest) makes gcc compile for >10 s
MAX_INNER_TILE = 64          # innermost spatial tile: it becomes a vector/register tile
MAX_INNER_REDUCE_TILE = 512  # innermost reduction tile: how long a register tile accumulates
SPATIAL_LEVELS, REDUCE_LEVELS = 4, 2


@dataclass(frozen=True)
class Sketch:
    name: str
    steps: tuple[Step, ...]


# ---------------------------------------------------------------- rule conditions

def has_data_reuse(stage: Stage) -> bool:
    """A reduction in which some operand is indexed by only part of the spatial axes."""
    if not stage.reduce_op:
        return False
    sp = {a.name for a in stage.axes}
    from .expr import loads
    return any(not sp <= variables(ld) for ld in loads(stage.body))


def packable_inputs(state: State, stage: Stage) -> list[str]:
    """Inputs a reduction reads along a reduction axis with rows of the innermost spatial axis
    (B[k, j] of a matmul): worth a read cache, which packs the rows a tile reads into a panel."""
    if not stage.reduce_op or not stage.axes:
        return []
    from .expr import loads
    last, red = stage.axes[-1].name, {a.name for a in stage.reduce_axes}
    inputs = dict(state.inputs)
    out = []
    for ld in loads(stage.body):
        if ld.tensor in inputs and ld.tensor not in out and variables(ld.index[-1]) == {last} \
                and any(variables(ix) & red for ix in ld.index[:-1]):
            out.append(ld.tensor)
    return out


def fusible_consumer(state: State, name: str) -> str | None:
    """The single element-wise consumer that reads `name` point-wise over the same axes, if any."""
    cons = state.consumers(name)
    if len(cons) != 1:
        return None
    c = state.stage(cons[0])
    s = state.stage(name).stage
    if c.stage.reduce_op or c.stage.shape != s.shape or c.transformed:
        return None
    ident = tuple(Var(a.name) for a in c.stage.axes)
    from .expr import loads
    if any(ld.tensor == name and ld.index != ident for ld in loads(c.stage.body)):
        return None
    return c.name


def _has_math(e) -> bool:
    from .expr import Call, children
    return isinstance(e, Call) or any(_has_math(c) for c in children(e))


def _is_inlinable(state: State, st: StageState) -> bool:
    return st.stage.reduce_op is None and st.name != state.output and bool(state.consumers(st.name))


# ---------------------------------------------------------------- sketch rules

def _tiling_steps(st: StageState) -> list[Step]:
    """Multi-level tiling SSRSRS: split every spatial axis in 4, every reduction axis in 2."""
    s = st.stage
    steps: list[Step] = []
    for a in s.axes:
        steps.append({"kind": "split", "stage": s.name, "iter": a.name, "factors": [None] * (SPATIAL_LEVELS - 1)})
    for a in s.reduce_axes:
        steps.append({"kind": "split", "stage": s.name, "iter": a.name, "factors": [None] * (REDUCE_LEVELS - 1)})
    sp = lambda lvl: [f"{a.name}.{lvl}" for a in s.axes]
    rd = lambda lvl: [f"{a.name}.{lvl}" for a in s.reduce_axes]
    order = sp(0) + sp(1) + rd(0) + sp(2) + rd(1) + sp(3)
    steps.append({"kind": "reorder", "stage": s.name, "order": order})
    return steps


def _fusion_steps(producer: StageState, consumer: str, level: int) -> list[Step]:
    """Tile the consumer like the producer's outer `level` spatial levels; compute the producer there."""
    steps: list[Step] = []
    names = [a.name for a in producer.stage.axes]
    for a in names:
        steps.append({"kind": "follow_split", "stage": consumer, "iter": a, "src": [producer.name, a], "n": level})
    order = [f"{a}.{lvl}" for lvl in range(level + 1) for a in names]
    steps.append({"kind": "reorder", "stage": consumer, "order": order})
    steps.append({"kind": "compute_at", "stage": producer.name, "target": consumer, "iter": f"{names[-1]}.{level - 1}"})
    return steps


def generate_sketches(dag: ComputeDAG) -> list[Sketch]:
    """All sketches of a compute DAG (a few per stage with data reuse or reduction)."""
    out: list[Sketch] = []

    def rec(state: State, steps: list[Step], names: list[str], tag: str) -> None:
        if not names:
            out.append(Sketch(tag.strip("+") or "plain", tuple(steps + _vector_splits(state))))
            return
        name, rest = names[0], names[1:]
        st = state.stage(name)
        branches: list[tuple[str, list[Step]]] = []
        if _is_inlinable(state, st):
            branches.append(("inline", [{"kind": "compute_inline", "stage": name}]))
            if _has_math(st.stage.body):  # inlining would recompute exp/tanh in every consumer
                branches.append(("", []))
        elif has_data_reuse(st.stage):
            cons = fusible_consumer(state, name)
            packs = packable_inputs(state, st.stage)
            if cons is not None:
                for level in (1, 2):
                    branches.append((f"tile-fuse{level}", _tiling_steps(st) + _fusion_steps(st, cons, level)))
                reads = [{"kind": "cache_read", "stage": name, "tensor": t} for t in packs]
                if reads:
                    branches.append(("pack-tile-fuse1", reads + _tiling_steps(st) + _fusion_steps(st, cons, 1)))
            else:
                branches.append(("tile", _tiling_steps(st)))
                local = StageState(replace(st.stage, name=f"{name}.local"), (), ())
                reads = [{"kind": "cache_read", "stage": local.name, "tensor": t} for t in packs]
                for level in (1, 2):
                    branches.append((f"cachewrite{level}", [{"kind": "cache_write", "stage": name}]
                                     + _tiling_steps(local) + _fusion_steps(local, name, level)))
                if reads:
                    branches.append(("pack-cachewrite1", [{"kind": "cache_write", "stage": name}] + reads
                                     + _tiling_steps(local) + _fusion_steps(local, name, 1)))
        elif st.stage.reduce_op and len(st.stage.reduce_axes) == 1 and st.stage.reduce_axes[0].extent >= 4:
            k = st.stage.reduce_axes[0].name
            sp = [a.name for a in st.stage.axes]
            branches.append(("", []))
            branches.append(("rfactor", [
                {"kind": "split", "stage": name, "iter": k, "factors": [None]},
                {"kind": "rfactor", "stage": name, "iter": f"{k}.1"},
                {"kind": "reorder", "stage": f"{name}.rf", "order": sp + [f"{k}_o", f"{k}_f"]}]))
        else:
            branches.append(("", []))
        for label, br in branches:
            s2 = state
            for i, step in enumerate(br):
                s2 = apply_step(s2, _with_ones(step), [_with_ones(h) for h in steps + br[:i]])
            rec(s2, steps + br, rest, tag + "+" + label if label else tag)

    rec(initial_state(dag), [], [s.name for s in reversed(dag.stages)], "")
    return out


def _with_ones(step: Step) -> Step:
    """Placeholder factors as 1s, so a sketch can be replayed to see its loop structure."""
    if step["kind"] == "split" and None in step["factors"]:
        return {**step, "factors": [1] * len(step["factors"])}
    return step


def _vector_splits(state: State) -> list[Step]:
    """Element-wise root stages that no rule touched: split the innermost axis for vectors."""
    steps = []
    for st in state.stages:
        if st.attach is None and not st.stage.reduce_op and not st.transformed and st.stage.axes:
            steps.append({"kind": "split", "stage": st.name, "iter": st.stage.axes[-1].name, "factors": [None]})
    return steps


# ---------------------------------------------------------------- annotation

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def inner_tile_cap(st: StageState, axis: str) -> int:
    """Largest innermost tile of an axis: spatial tiles live in registers, reduction tiles do not."""
    return MAX_INNER_REDUCE_TILE if any(a.name == axis for a in st.stage.reduce_axes) else MAX_INNER_TILE


VECTOR_LANES = 16       # fp32 lanes of a 512-bit vector
VECTOR_TILE_PROB = 0.5  # how often the innermost tile of a stage's last axis is a whole number of vectors
PADDED_TILES = range(3, 9)  # register-tile rows that need not divide the extent (6 x 64 fills 24 registers)
PADDED_TILE_PROB = 0.3      # how often such an axis gets one, when the extent has a non-divisor there
DEGENERATE_PROB = 0.5       # how often an outer tile level is 1 or takes all that is left


def may_pad(st: StageState, axis: str) -> bool:
    """Padded inner tiles are sampled for the row axes of register-tiled stages (data reuse): a
    spatial axis that is not the innermost (vector) one."""
    sp = [a.name for a in st.stage.axes]
    return has_data_reuse(st.stage) and axis in sp[:-1]


def padded_tile_options(extent: int) -> list[int]:
    return [d for d in PADDED_TILES if extent % d]


def sample_factors(extent: int, n: int, rng: random.Random, max_inner: int = MAX_INNER_TILE,
                   lanes: int = 0, pad: bool = False, inner: int | None = None) -> list[int]:
    """n inner tile lengths whose product divides `extent` (innermost at most `max_inner`; with
    `lanes`, a multiple of it half of the time when the extent has one). With `pad`, sometimes
    an innermost tile that does not divide it; the others then divide ceil(extent / tile).

    A tile level above the innermost is *degenerate* (length 1, or all that is left) with
    probability DEGENERATE_PROB, else a uniform divisor: the loop orders of hand-written
    kernels (BLIS: column panel, k block, row blocks, register tile) are multi-level tilings
    with collapsed levels, which uniform sampling draws with probability about 1/50 per axis.
    `inner` fixes the innermost tile (a register-tile shape chosen for the whole stage)."""
    rest, out = extent, []
    for i in range(n):
        if i == 0 and inner is not None:
            out.append(inner)
            rest = -(-rest // inner)
            continue
        if i > 0 and rest > 1 and rng.random() < DEGENERATE_PROB:
            f = rng.choice((1, rest))
            out.append(f)
            rest //= f
            continue
        ds = divisors(rest)
        if i == 0 and pad and padded_tile_options(rest) and rng.random() < PADDED_TILE_PROB:
            f = rng.choice(padded_tile_options(rest))
            out.append(f)
            rest = -(-rest // f)
            continue
        if i == 0:
            ds = [d for d in ds if d <= max_inner]
            whole = [d for d in ds if lanes and d % lanes == 0]
            if whole and rng.random() < VECTOR_TILE_PROB:
                ds = whole
        f = rng.choice(ds)
        out.append(f)
        rest //= f
    return out[::-1]


REGISTER_TILE_PROB = 0.5        # how often a stage with data reuse gets a register-filling tile
REGISTER_TILE_VECTORS = (12, 28)  # accumulator vectors of such a tile (AVX-512 has 32 registers,
                                  # a few stay free for the broadcast row and the loaded column)


def register_tile_options(st: StageState) -> list[tuple[int, int]]:
    """(rows, columns) innermost tiles of a stage with data reuse whose accumulators fill
    REGISTER_TILE_VECTORS vector registers: columns a whole number of vectors that divides
    the last axis, rows a divisor or a padded tile of the axis before it (BLIS picks its
    micro-kernel the same way)."""
    sp = st.stage.axes
    if len(sp) < 2 or not has_data_reuse(st.stage):
        return []
    row, col = sp[-2].extent, sp[-1].extent
    lo, hi = REGISTER_TILE_VECTORS
    rows = sorted(set(d for d in divisors(row) if d <= MAX_INNER_TILE) | set(padded_tile_options(row)))
    return [(r, c) for c in divisors(col) if c % VECTOR_LANES == 0 and c <= MAX_INNER_TILE
            for r in rows if lo <= r * c // VECTOR_LANES <= hi]


def _register_tile(st: StageState, rng: random.Random) -> dict[str, int]:
    """Innermost tiles by axis for one stage: a register-filling shape REGISTER_TILE_PROB of the
    time (other row axes 1), else nothing (each axis sampled on its own)."""
    opts = register_tile_options(st)
    if not opts or rng.random() >= REGISTER_TILE_PROB:
        return {}
    r, c = rng.choice(opts)
    sp = st.stage.axes
    return {**{a.name: 1 for a in sp[:-2]}, sp[-2].name: r, sp[-1].name: c}


def _outer_spatial(st: StageState, state: State) -> list[str]:
    """Leading spatial loops that may be fused for parallelism, down to the first compute-at
    target (included: the attached stage is then computed in the fused loop, so a panel loop
    j.0 under a row-block loop i.0 of extent 3 can still give two cores 192 tiles)."""
    targets = {s.attach[1] for s in state.stages if isinstance(s.attach, tuple) and s.attach[0] == st.name}
    out = []
    for lp in st.loops:
        if st.is_reduce_loop(lp):
            break
        out.append(lp.name)
        if lp.name in targets:
            break
    return out


def compute_location_options(state: State, name: str) -> list[tuple[str, str] | None]:
    """Root, or a spatial loop of the consumer where every other consumer is computed too."""
    cons = state.consumers(name)
    if not cons or name == state.output:
        return [None]
    opts: list[tuple[str, str] | None] = [None]
    for c in cons:
        cst = state.stage(c)
        others = [state.stage(o) for o in cons if o != c]
        for lp in cst.loops:
            if cst.is_reduce_loop(lp):
                break
            if all(o.attach == (c, lp.name) for o in others):
                opts.append((c, lp.name))
    return opts


def annotate(sketch: Sketch, dag: ComputeDAG, rng: random.Random, tries: int = 20) -> list[Step] | None:
    """A random complete schedule of a sketch that lowers; None after `tries` failures."""
    for _ in range(tries):
        try:
            steps = _annotate_once(sketch, dag, rng)
            lower(replay(dag, steps))
            return steps
        except ScheduleError:
            continue
    return None


def _annotate_once(sketch: Sketch, dag: ComputeDAG, rng: random.Random) -> list[Step]:
    state = initial_state(dag)
    steps: list[Step] = []
    attaches: list[Step] = []
    tiles: dict[str, dict[str, int]] = {}
    for step in sketch.steps:
        if step["kind"] == "split" and None in step["factors"]:
            st = state.stage(step["stage"])
            p = st.prim(st.loop(step["iter"]).prims[0])
            last_axis = bool(st.stage.axes) and p.axis == st.stage.axes[-1].name
            if st.name not in tiles:
                tiles[st.name] = _register_tile(st, rng)
            inner = tiles[st.name].get(p.axis) if len(step["factors"]) == SPATIAL_LEVELS - 1 else None
            step = {**step, "factors": sample_factors(p.extent, len(step["factors"]), rng,
                                                      inner_tile_cap(st, p.axis), VECTOR_LANES if last_axis else 0,
                                                      pad=may_pad(st, p.axis), inner=inner)}
        if step["kind"] == "compute_at":
            attaches.append(step)
        state = apply_step(state, step, steps)
        steps.append(step)
    fixed = {s["stage"] for s in attaches}
    for st in reversed(state.stages):
        if st.attach == "inline":
            continue
        if st.name not in fixed and st.name != state.output and not has_data_reuse(st.stage):
            loc = rng.choice(compute_location_options(state, st.name))
            if loc is not None:
                step = {"kind": "compute_at", "stage": st.name, "target": loc[0], "iter": loc[1]}
                state = apply_step(state, step, steps)
                attaches.append(step)
        st = state.stage(st.name)
        ann = _annotation_steps(st, state, rng)
        for step in ann:
            state = apply_step(state, step, steps)
            steps.append(step)
    # compute locations go last, so mutations can change them without touching loop steps; a
    # target loop fused for parallelism since is named by its fused loop
    body = [s for s in steps if s["kind"] != "compute_at"]
    return body + [{**a, "iter": state.stage(a["stage"]).attach[1]} for a in attaches]


def _annotation_steps(st: StageState, state: State, rng: random.Random) -> list[Step]:
    steps: list[Step] = []
    if st.attach is None:
        outer = _outer_spatial(st, state)
        if outer:
            n = rng.randint(1, min(len(outer), 3))
            if n > 1:
                steps.append({"kind": "fuse", "stage": st.name, "iters": outer[:n]})
            steps.append({"kind": "annotate", "stage": st.name, "iter": "@".join(outer[:n]), "ann": "parallel"})
    last = st.loops[-1]
    if not st.is_reduce_loop(last) and len(st.loops) > 1 and rng.random() < 0.9 \
            and not (st.attach is None and last.name in _outer_spatial(st, state)[:1]):
        steps.append({"kind": "annotate", "stage": st.name, "iter": last.name, "ann": "vectorize"})
    if st.stage.reduce_op or len(st.loops) > 3:
        steps.append({"kind": "pragma", "stage": st.name, "auto_unroll_max_step": rng.choice(UNROLL_STEPS)})
    return steps


def sample_schedules(sketches: list[Sketch], dag: ComputeDAG, n: int, rng: random.Random,
                     annotate_fn: Callable[[Sketch, ComputeDAG, random.Random], list[Step] | None] | None = None
                     ) -> list[list[Step]]:
    """Up to n random valid schedules drawn from random sketches (annotated by `annotate_fn`,
    default the CPU rules' `annotate`)."""
    out = []
    for _ in range(n * 3):
        if len(out) >= n:
            break
        steps = (annotate_fn or annotate)(rng.choice(sketches), dag, rng)
        if steps is not None:
            out.append(steps)
    return out
