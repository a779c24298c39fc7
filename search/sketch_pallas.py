"""Sketch rules and annotation for Pallas kernels, where they differ from the CPU's.

A stage with data reuse (matmul, conv) is tiled in two levels per axis, grid then block, and
its reductions in two, steps then tile; an element-wise consumer either follows its tiling and
computes it in its own kernel (the dense epilogue) or runs as a kernel of its own. Every other
stage gets one split per axis (its block, or its reduction's tile). Annotation draws power-of-
two blocks and reduction tiles (Triton's arrays have power-of-two sizes; a block may overhang
the extent, the kernel pads) and the compute location of each stage without data reuse: a
kernel of its own, or inside a consumer's. There are no parallel, vectorize or unroll
annotations and no register tiles or packing: the grid is the parallelism, and Triton picks
vector widths, unrolling and what stays in registers."""
from __future__ import annotations

import json
import random

from .compute import ComputeDAG
from .mutation import checked_program
from .pallas_plan import PallasProgram, gpu_problem, plan
from .schedule import ScheduleError, State, StageState, Step, apply_step, initial_state, replay
from .sketch import (Sketch, _fusion_steps, _has_math, _is_inlinable, _with_ones, compute_location_options,
                     fusible_consumer, has_data_reuse)

MAX_BLOCK_SIDE = 128   # largest block along one axis
MAX_REDUCE_TILE = 64   # largest reduction step


def _block_steps(st: StageState) -> list[Step]:
    """Split each axis once (grid x block, steps x tile); with data reuse, order the grid and the
    reduction steps outside the block: grid, steps, block, tile."""
    s = st.stage
    steps: list[Step] = [{"kind": "split", "stage": s.name, "iter": a.name, "factors": [None]}
                         for a in s.axes + s.reduce_axes]
    if has_data_reuse(s):
        order = [f"{a.name}.0" for a in s.axes] + [f"{a.name}.0" for a in s.reduce_axes] \
            + [f"{a.name}.1" for a in s.axes] + [f"{a.name}.1" for a in s.reduce_axes]
        steps.append({"kind": "reorder", "stage": s.name, "order": order})
    return steps


def pallas_sketches(dag: ComputeDAG) -> list[Sketch]:
    """All Pallas sketches of a compute DAG."""
    out: list[Sketch] = []

    def rec(state: State, steps: list[Step], names: list[str], tag: str) -> None:
        if not names:
            rest = [s for st in state.stages if st.attach != "inline" and not st.transformed
                    for s in _block_steps(st)]
            out.append(Sketch(tag.strip("+") or "plain", tuple(steps + rest)))
            return
        st = state.stage(names[0])
        branches: list[tuple[str, list[Step]]] = []
        if _is_inlinable(state, st):
            branches.append(("inline", [{"kind": "compute_inline", "stage": st.name}]))
            if _has_math(st.stage.body):  # inlining recomputes exp/tanh in every consumer
                branches.append(("", []))
        elif has_data_reuse(st.stage):
            cons = fusible_consumer(state, st.name)
            branches.append(("tile", _block_steps(st)))
            if cons is not None:
                branches.append(("tile-fuse", _block_steps(st) + _fusion_steps(st, cons, 1)))
        elif st.stage.reduce_op:
            branches.append(("", _block_steps(st)))
        else:
            branches.append(("", []))  # element-wise: its block split comes last, if nothing tiled it
        for label, br in branches:
            s2 = state
            for i, step in enumerate(br):
                s2 = apply_step(s2, _with_ones(step), [_with_ones(h) for h in steps + br[:i]])
            rec(s2, steps + br, names[1:], tag + "+" + label if label else tag)

    rec(initial_state(dag), [], [s.name for s in reversed(dag.stages)], "")
    return out


def powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def block_options(extent: int) -> list[int]:
    """Power-of-two blocks of a spatial axis: up to the first that covers it (the last one pads)."""
    cover = 1
    while cover < extent:
        cover *= 2
    return powers_of_two(min(cover, MAX_BLOCK_SIDE))


def tile_options(extent: int) -> list[int]:
    """Power-of-two reduction tiles that divide the extent (a reduction is never padded)."""
    return [p for p in powers_of_two(MAX_REDUCE_TILE) if extent % p == 0]


_CHECKED: dict[tuple[int, str], tuple[ComputeDAG, PallasProgram | None]] = {}


def pallas_program(dag: ComputeDAG, steps: list[Step]) -> PallasProgram | None:
    """The kernel plan of a schedule, or None when it is not a valid Pallas schedule: it must
    lower (as every schedule must), have a plan, and keep Triton's rules (`gpu_problem`)."""
    key = (id(dag), json.dumps(steps, sort_keys=True))
    hit = _CHECKED.get(key)
    if hit is not None and hit[0] is dag:
        return hit[1]
    prog: PallasProgram | None = None
    if checked_program(dag, steps) is not None:
        try:
            prog = plan(replay(dag, steps))
        except (ScheduleError, ValueError):
            prog = None
        if prog is not None and gpu_problem(prog):
            prog = None
    if len(_CHECKED) > 4096:
        _CHECKED.clear()
    _CHECKED[key] = (dag, prog)
    return prog


def annotate_pallas(sketch: Sketch, dag: ComputeDAG, rng: random.Random, tries: int = 20) -> list[Step] | None:
    """A random complete Pallas schedule of a sketch; None after `tries` invalid draws."""
    for _ in range(tries):
        try:
            steps = _annotate_once(sketch, dag, rng)
        except ScheduleError:
            continue
        if pallas_program(dag, steps) is not None:
            return steps
    return None


def _annotate_once(sketch: Sketch, dag: ComputeDAG, rng: random.Random) -> list[Step]:
    state = initial_state(dag)
    steps: list[Step] = []
    for step in sketch.steps:
        if step["kind"] == "split" and None in step["factors"]:
            st = state.stage(step["stage"])
            p = st.prim(st.loop(step["iter"]).prims[0])
            reduce = any(a.name == p.axis for a in st.stage.reduce_axes)
            step = {**step, "factors": [rng.choice(tile_options(p.extent) if reduce else block_options(p.extent))]}
        state = apply_step(state, step, steps)
        steps.append(step)
    body = [s for s in steps if s["kind"] != "compute_at"]
    attaches = [s for s in steps if s["kind"] == "compute_at"]
    fixed = {s["stage"] for s in attaches}
    for st in reversed(state.stages):
        if st.attach == "inline" or st.name in fixed or st.name == state.output or has_data_reuse(st.stage):
            continue
        loc = rng.choice(compute_location_options(state, st.name))
        if loc is not None:
            step = {"kind": "compute_at", "stage": st.name, "target": loc[0], "iter": loc[1]}
            state = apply_step(state, step, steps)
            attaches.append(step)
    return body + attaches
