"""Evolutionary operators on schedules (step lists): Ansor's mutations (tile size, parallel
granularity, unroll depth, compute location) and per-stage crossover. Every result is
replayed and lowered; an operator returns None when it cannot produce a valid schedule."""
from __future__ import annotations

import json
import math
import random
from dataclasses import replace

from .compute import ComputeDAG
from .lower import Program, lower
from .schedule import ScheduleError, State, Step, apply_step, initial_state, replay, split_lengths
from .sketch import (UNROLL_STEPS, _outer_spatial, compute_location_options, divisors, has_data_reuse,
                     inner_tile_cap, may_pad, padded_tile_options)

STRUCTURE_KINDS = ("split", "follow_split", "reorder", "cache_write", "cache_read", "rfactor", "compute_inline")


_PROGRAMS: dict[tuple[int, str], tuple[ComputeDAG, Program | None]] = {}


def checked_program(dag: ComputeDAG, steps: list[Step]) -> Program | None:
    """The lowered program of a schedule, or None when it is invalid (memoised: evolution
    validates a candidate and then extracts its features from the same program)."""
    key = (id(dag), json.dumps(steps, sort_keys=True))
    hit = _PROGRAMS.get(key)
    if hit is not None and hit[0] is dag:
        return hit[1]
    try:
        prog: Program | None = lower(replay(dag, steps))
    except (ScheduleError, ValueError):
        prog = None
    if len(_PROGRAMS) > 4096:
        _PROGRAMS.clear()
    _PROGRAMS[key] = (dag, prog)
    return prog


def _valid(dag: ComputeDAG, steps: list[Step]) -> list[Step] | None:
    return steps if checked_program(dag, steps) is not None else None


def _state_before(dag: ComputeDAG, steps: list[Step], idx: int) -> State:
    state = initial_state(dag)
    for i in range(idx):
        state = apply_step(state, steps[i], steps[:i])
    return state


def innermost_loop(iter_name: str) -> str:
    """The innermost of the loops a (possibly fused) loop name joins: `i.0@j.0` -> `j.0`."""
    return iter_name.split("@")[-1]


def retarget_attaches(dag: ComputeDAG, steps: list[Step]) -> list[Step]:
    """Compute-at steps (kept last) renamed to the loop that now holds their target loop: after a
    parallel mutation fused or unfused the target's outer loops, `j.0` may be `i.0@j.0` or the
    other way round."""
    body = [s for s in steps if s["kind"] != "compute_at"]
    try:
        state = replay(dag, body)
    except (ScheduleError, ValueError):
        return steps
    names = {st.name for st in state.stages}
    out = []
    for s in steps:
        if s["kind"] == "compute_at" and s["target"] in names:
            last = innermost_loop(s["iter"])
            hold = [lp.name for lp in state.stage(s["target"]).loops if last in lp.prims]
            if hold:
                s = {**s, "iter": hold[0]}
        out.append(s)
    return [s for s in out if s["kind"] != "compute_at"] + [s for s in out if s["kind"] == "compute_at"]


def mutate_tile_size(dag: ComputeDAG, steps: list[Step], rng: random.Random) -> list[Step] | None:
    """Move a factor of one tile length to another level of the same split; for row axes of
    register-tiled stages, sometimes change the innermost tile to one that pads the axis (or back)."""
    idx = [i for i, s in enumerate(steps) if s["kind"] == "split"]
    if not idx:
        return None
    i = rng.choice(idx)
    st = _state_before(dag, steps, i).stage(steps[i]["stage"])
    prim = st.prim(st.loop(steps[i]["iter"]).prims[0])
    extent = prim.extent
    f = list(steps[i]["factors"])
    try:
        lengths = split_lengths(extent, f)
    except ScheduleError:
        return None
    if f and may_pad(st, prim.axis) and rng.random() < 0.25:
        new = _retile_innermost(extent, f, inner_tile_cap(st, prim.axis), rng)
        if new is None:
            return None
        out = list(steps)
        out[i] = {**steps[i], "factors": new}
        return _valid(dag, out)
    padded = extent % lengths[-1] != 0
    movable = range(len(lengths) - 1) if padded else range(len(lengths))  # a padded innermost tile stays
    src = [k for k in movable if lengths[k] > 1]
    if not src or len(movable) < 2:
        return None
    a = rng.choice(src)
    b = rng.choice([k for k in movable if k != a])
    d = rng.choice(divisors(lengths[a])[1:])  # any factor, as in Ansor: a level can empty in one move
    lengths[a] //= d
    lengths[b] *= d
    if lengths[-1] > inner_tile_cap(st, prim.axis):
        return None
    out = list(steps)
    out[i] = {**steps[i], "factors": lengths[1:]}
    return _valid(dag, out)


def _retile_innermost(extent: int, factors: list[int], cap: int, rng: random.Random) -> list[int] | None:
    """`factors` with a new innermost tile (padded or a divisor); each middle factor becomes the
    divisor of what is left closest to it (the one next to the innermost scaled by old / new
    innermost), so the tile keeps about its size: 8 x 16 rows of 1024 become 6 x 19 of 1026."""
    options = [d for d in padded_tile_options(extent) + divisors(extent) if d <= cap and d != factors[-1]]
    if not options:
        return None
    v = rng.choice(options)
    rest = -(-extent // v)
    middle = []
    for k, x in enumerate(factors[:-1][::-1]):  # innermost middle factor first
        want = x * factors[-1] / v if k == 0 else x
        d = min(divisors(rest), key=lambda d: abs(math.log(d) - math.log(max(want, 1.0))))
        middle.append(d)
        rest //= d
    return middle[::-1] + [v]


def mutate_parallel(dag: ComputeDAG, steps: list[Step], rng: random.Random) -> list[Step] | None:
    """Fuse one more or one fewer outer loop into a stage's parallel loop."""
    idx = [i for i, s in enumerate(steps) if s["kind"] == "annotate" and s["ann"] == "parallel"]
    if not idx:
        return None
    i = rng.choice(idx)
    stage = steps[i]["stage"]
    j = i - 1 if i > 0 and steps[i - 1]["kind"] == "fuse" and steps[i - 1]["stage"] == stage else i
    state = _state_before(dag, steps, j)
    for s in steps[i + 1:]:  # compute locations (kept last) limit which loops may be fused
        if s["kind"] == "compute_at" and s["target"] == stage:
            state = state.with_stage(replace(state.stage(s["stage"]), attach=(stage, innermost_loop(s["iter"]))))
    outer = _outer_spatial(state.stage(stage), state)
    n_old = len(steps[i]["iter"].split("@"))
    choices = [n for n in range(1, len(outer) + 1) if n != n_old]
    if not choices:
        return None
    n = rng.choice(choices)
    new = ([{"kind": "fuse", "stage": stage, "iters": outer[:n]}] if n > 1 else []) + \
          [{"kind": "annotate", "stage": stage, "iter": "@".join(outer[:n]), "ann": "parallel"}]
    return _valid(dag, retarget_attaches(dag, list(steps[:j]) + new + list(steps[i + 1:])))


def mutate_unroll(dag: ComputeDAG, steps: list[Step], rng: random.Random) -> list[Step] | None:
    idx = [i for i, s in enumerate(steps) if s["kind"] == "pragma"]
    if not idx:
        return None
    i = rng.choice(idx)
    vals = [v for v in UNROLL_STEPS if v != steps[i]["auto_unroll_max_step"]]
    out = list(steps)
    out[i] = {**steps[i], "auto_unroll_max_step": rng.choice(vals)}
    return _valid(dag, out)


def mutate_compute_location(dag: ComputeDAG, steps: list[Step], rng: random.Random) -> list[Step] | None:
    """Move a reduction without data reuse to the root or to another loop of its consumer."""
    body = [s for s in steps if s["kind"] != "compute_at"]
    ats = [s for s in steps if s["kind"] == "compute_at"]
    state = replay(dag, body)
    free = [st.name for st in state.stages if st.attach != "inline" and st.name != state.output
            and not has_data_reuse(st.stage) and not st.name.endswith(".local")]
    if not free:
        return None
    name = rng.choice(free)
    rest = [a for a in ats if a["stage"] != name]
    for a in rest:
        state = apply_step(state, a)
    loc = rng.choice(compute_location_options(state, name))
    new = [] if loc is None else [{"kind": "compute_at", "stage": name, "target": loc[0], "iter": loc[1]}]
    # producers are attached after their consumers so that sibling checks see them
    return _valid(dag, body + new + rest)


MUTATIONS = (mutate_tile_size, mutate_tile_size, mutate_parallel, mutate_unroll, mutate_compute_location)


def mutate(dag: ComputeDAG, steps: list[Step], rng: random.Random, tries: int = 8) -> list[Step] | None:
    """One random mutation (tile sizes are picked twice as often, as they matter most)."""
    for _ in range(tries):
        out = rng.choice(MUTATIONS)(dag, steps, rng)
        if out is not None and out != steps:
            return out
    return None


def structure(steps: list[Step]) -> tuple:
    """What a schedule shares with every other schedule of its sketch."""
    return tuple((s["kind"], s["stage"], s.get("iter")) for s in steps if s["kind"] in STRUCTURE_KINDS)


def tiling(steps: list[Step]) -> tuple:
    """A schedule less its annotations (parallel, vectorize, unroll): its sketch, tile sizes and
    compute locations. Schedules with one tiling differ by a few percent at most, which a cost
    model trained on a few dozen records cannot rank."""
    keep = STRUCTURE_KINDS + ("compute_at",)
    # a compute location by its innermost loop: `i.0@j.0` (fused for parallelism) is `j.0`
    return tuple(json.dumps({**s, "iter": innermost_loop(s["iter"])} if s["kind"] == "compute_at" else s,
                            sort_keys=True) for s in steps if s["kind"] in keep)


def crossover(dag: ComputeDAG, a: list[Step], b: list[Step], rng: random.Random) -> list[Step] | None:
    """Child of two schedules of the same sketch: each stage takes its tile sizes, unroll depth
    and compute location from a randomly chosen parent."""
    if structure(a) != structure(b):
        return None
    stages = sorted({s["stage"] for s in a})
    from_b = {s for s in stages if rng.random() < 0.5}
    if not from_b or len(from_b) == len(stages):
        return None
    bsteps = {(s["kind"], s["stage"], s.get("iter")): s for s in b if s["kind"] in ("split", "pragma")}
    child = []
    for s in a:
        if s["stage"] in from_b and s["kind"] == "compute_at":
            continue
        key = (s["kind"], s["stage"], s.get("iter"))
        child.append(bsteps.get(key, s) if s["stage"] in from_b else s)
    child += [s for s in b if s["kind"] == "compute_at" and s["stage"] in from_b]
    # keep compute_at steps last, consumers' before producers' as annotation emits them
    order = {s["stage"]: k for k, s in enumerate(x for x in a if x["kind"] == "compute_at")}
    body = [s for s in child if s["kind"] != "compute_at"]
    ats = sorted((s for s in child if s["kind"] == "compute_at"), key=lambda s: order.get(s["stage"], -1))
    return _valid(dag, retarget_attaches(dag, body + ats))
