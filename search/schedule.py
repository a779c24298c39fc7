"""Program states (one loop nest per stage) and the replayable transform steps that change
them. A schedule is its list of steps, each a JSON-able dict (as in Ansor's records)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from .compute import Axis, ComputeDAG, Stage
from .expr import Load, Var, rebuild, substitute

Step = dict[str, Any]
ANNOTATIONS = ("none", "parallel", "vectorize", "unroll")


class ScheduleError(ValueError):
    """A transform step does not apply to the state it was given."""


@dataclass(frozen=True)
class Prim:
    """A primitive iterator from splitting an axis: contributes `value * stride` to `axis`."""

    axis: str
    stride: int
    extent: int


@dataclass(frozen=True)
class Loop:
    name: str
    prims: tuple[str, ...]  # more than one when fused (outermost first)
    ann: str = "none"


@dataclass(frozen=True)
class StageState:
    stage: Stage
    loops: tuple[Loop, ...]
    prims: tuple[tuple[str, Prim], ...]
    attach: tuple[str, str] | str | None = None  # None = root, "inline", or (target stage, loop)
    auto_unroll_max_step: int = 0

    @property
    def name(self) -> str:
        return self.stage.name

    def prim(self, name: str) -> Prim:
        return dict(self.prims)[name]

    def loop(self, name: str) -> Loop:
        for lp in self.loops:
            if lp.name == name:
                return lp
        raise ScheduleError(f"stage {self.name!r} has no loop {name!r}; loops are {[l.name for l in self.loops]}")

    def is_reduce_loop(self, lp: Loop) -> bool:
        red = {a.name for a in self.stage.reduce_axes}
        return self.prim(lp.prims[0]).axis in red

    @property
    def transformed(self) -> bool:
        return self != initial_stage_state(self.stage)


def initial_stage_state(stage: Stage) -> StageState:
    all_axes = stage.axes + stage.reduce_axes
    return StageState(stage, tuple(Loop(a.name, (a.name,)) for a in all_axes),
                      tuple((a.name, Prim(a.name, 1, a.extent)) for a in all_axes))


@dataclass(frozen=True)
class State:
    """Inputs, stages in topological order (with their loop nests) and the output name."""

    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    stages: tuple[StageState, ...]
    output: str

    def stage(self, name: str) -> StageState:
        for s in self.stages:
            if s.name == name:
                return s
        raise ScheduleError(f"no stage {name!r}; stages are {[s.name for s in self.stages]}")

    def consumers(self, name: str) -> list[str]:
        return [s.name for s in self.stages if s.attach != "inline" and name in s.stage.reads()]

    def shape_of(self, tensor: str) -> tuple[int, ...]:
        for n, shp in self.inputs:
            if n == tensor:
                return shp
        return self.stage(tensor).stage.shape

    def with_stage(self, st: StageState) -> "State":
        return replace(self, stages=tuple(st if s.name == st.name else s for s in self.stages))


def initial_state(dag: ComputeDAG) -> State:
    return State(dag.inputs, tuple(initial_stage_state(s) for s in dag.stages), dag.output)


# ---------------------------------------------------------------- steps

def split_lengths(extent: int, factors: list[int], padding: bool = True) -> list[int]:
    """Loop lengths (outermost first) of splitting `extent` by inner `factors`.

    The factors' product divides the extent, or (with `padding`, for spatial axes) only the
    innermost factor f does not: the loop then covers ceil(extent / f) * f iterations, fewer than
    extent + f, and the other factors divide ceil(extent / f). This gives register tiles such as
    6 rows of a 1024-row matmul; lowering pads the stage's buffer or guards its stores and
    clamps its loads, so the extra iterations compute values that are never stored."""
    if any(f <= 0 for f in factors):
        raise ScheduleError(f"split factors must be positive, got {factors}")
    inner = math.prod(factors)
    if extent % inner == 0:
        return [extent // inner] + list(factors)
    if not padding:
        raise ScheduleError(f"factors {factors} (product {inner}) do not divide extent {extent} "
                            f"(a reduction axis cannot be padded)")
    rows = -(-extent // factors[-1])
    if rows % (inner // factors[-1]):
        raise ScheduleError(f"factors {factors} do not divide extent {extent}, and with the innermost "
                            f"tile {factors[-1]} padded the others must divide {rows}")
    return [rows // (inner // factors[-1])] + list(factors)


def _split(state: State, st: StageState, step: Step) -> State:
    lp = st.loop(step["iter"])
    if len(lp.prims) != 1:
        raise ScheduleError(f"split: loop {lp.name!r} of {st.name!r} is fused; split before fusing")
    p = st.prim(lp.prims[0])
    factors = [int(f) for f in step["factors"]]
    reduce = any(a.name == p.axis for a in st.stage.reduce_axes)
    try:
        lengths = split_lengths(p.extent, factors, padding=not reduce)
    except ScheduleError as e:
        raise ScheduleError(f"split of loop {lp.name!r} in stage {st.name!r}: {e}") from None
    new_prims, new_loops, stride = [], [], p.stride * math.prod(factors)
    for k, ext in enumerate(lengths):
        name = f"{lp.name}.{k}"
        new_prims.append((name, Prim(p.axis, stride, ext)))
        new_loops.append(Loop(name, (name,)))
        if k + 1 < len(lengths):
            stride //= lengths[k + 1]
    idx = st.loops.index(lp)
    prims = tuple(x for x in st.prims if x[0] != lp.prims[0]) + tuple(new_prims)
    loops = st.loops[:idx] + tuple(new_loops) + st.loops[idx + 1:]
    return state.with_stage(replace(st, loops=loops, prims=prims))


def _follow_split(state: State, st: StageState, step: Step, history: list[Step]) -> State:
    """Split like an earlier split of another stage: its first n-1 factors, then the product of the rest."""
    src_stage, src_iter = step["src"]
    src = next((h for h in reversed(history) if h["kind"] == "split" and h["stage"] == src_stage
                and h["iter"] == src_iter), None)
    if src is None:
        raise ScheduleError(f"follow_split: no earlier split of {src_stage}.{src_iter}")
    f = [int(x) for x in src["factors"]]
    n = int(step["n"])
    if not 1 <= n <= len(f):
        raise ScheduleError(f"follow_split: n={n} outside 1..{len(f)}")
    rest = 1
    for x in f[n - 1:]:
        rest *= x
    return _split(state, st, {"iter": step["iter"], "factors": f[:n - 1] + [rest]})


def _reorder(state: State, st: StageState, step: Step) -> State:
    order = list(step["order"])
    if sorted(order) != sorted(l.name for l in st.loops):
        raise ScheduleError(f"reorder: {order} is not a permutation of the loops of {st.name!r}: "
                            f"{[l.name for l in st.loops]}")
    return state.with_stage(replace(st, loops=tuple(st.loop(n) for n in order)))


def _fuse(state: State, st: StageState, step: Step) -> State:
    names = list(step["iters"])
    loops = [st.loop(n) for n in names]
    idx = [st.loops.index(l) for l in loops]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ScheduleError(f"fuse: loops {names} of {st.name!r} are not adjacent in that order")
    if len({st.is_reduce_loop(l) for l in loops}) > 1:
        raise ScheduleError(f"fuse: cannot fuse spatial and reduction loops {names} of {st.name!r}")
    fused = Loop("@".join(names), tuple(p for l in loops for p in l.prims))
    state = state.with_stage(replace(st, loops=st.loops[:idx[0]] + (fused,) + st.loops[idx[-1] + 1:]))
    # stages computed inside one of the fused loops are now computed inside the fused loop
    moved = [replace(o, attach=(st.name, fused.name)) for o in state.stages
             if isinstance(o.attach, tuple) and o.attach[0] == st.name and o.attach[1] in names]
    for o in moved:
        state = state.with_stage(o)
    return state


def _annotate(state: State, st: StageState, step: Step) -> State:
    ann = step["ann"]  # one of ANNOTATIONS (step_problem)
    lp = st.loop(step["iter"])
    return state.with_stage(replace(st, loops=tuple(replace(l, ann=ann) if l is lp else l for l in st.loops)))


def _compute_at(state: State, st: StageState, step: Step) -> State:
    target = state.stage(step["target"])
    target.loop(step["iter"])
    if st.name == state.output:
        raise ScheduleError("compute_at: the output stage cannot be attached to another stage")
    if target.name not in state.consumers(st.name):
        raise ScheduleError(f"compute_at: {target.name!r} does not read {st.name!r}")
    return state.with_stage(replace(st, attach=(target.name, step["iter"])))


def _compute_root(state: State, st: StageState, step: Step) -> State:
    return state.with_stage(replace(st, attach=None))


def _compute_inline(state: State, st: StageState, step: Step) -> State:
    s = st.stage
    if s.reduce_op or st.name == state.output:
        raise ScheduleError(f"compute_inline: {st.name!r} is a reduction or the output; only element-wise "
                            f"intermediate stages can be inlined")
    names = [a.name for a in s.axes]

    def repl(n):
        if isinstance(n, Load) and n.tensor == st.name:
            return substitute(s.body, dict(zip(names, n.index)))
        return n

    stages = []
    for other in state.stages:
        if other.name == st.name:
            stages.append(replace(other, attach="inline"))
        elif st.name in other.stage.reads():
            stages.append(replace(other, stage=replace(other.stage, body=rebuild(other.stage.body, repl))))
        else:
            stages.append(other)
    return replace(state, stages=tuple(stages))


def _cache_write(state: State, st: StageState, step: Step) -> State:
    if st.transformed:
        raise ScheduleError(f"cache_write: apply it to {st.name!r} before any other step on that stage")
    s = st.stage
    local = replace(s, name=f"{s.name}.local")
    copy = Stage(s.name, s.axes, Load(local.name, tuple(Var(a.name) for a in s.axes)))
    i = state.stages.index(st)
    new = (initial_stage_state(local), initial_stage_state(copy))
    return replace(state, stages=state.stages[:i] + new + state.stages[i + 1:])


def _cache_read(state: State, st: StageState, step: Step) -> State:
    """`T.read` copies input T and `st` reads the copy instead; computed at a loop of `st`, the
    copy holds just the region `st` reads below that loop, packed contiguously (a panel)."""
    tensor = step["tensor"]
    if tensor not in dict(state.inputs):
        raise ScheduleError(f"cache_read: {tensor!r} is not an input; inputs are {[n for n, _ in state.inputs]}")
    if tensor not in st.stage.reads():
        raise ScheduleError(f"cache_read: {st.name!r} does not read {tensor!r}")
    name = f"{tensor}.read"
    if any(o.name == name for o in state.stages):
        raise ScheduleError(f"cache_read: {tensor!r} already has a read cache")
    if st.transformed:
        raise ScheduleError(f"cache_read: apply it to {st.name!r} before its loops are changed")
    axes = tuple(Axis(f"{tensor}_{d}", n) for d, n in enumerate(dict(state.inputs)[tensor]))
    copy = Stage(name, axes, Load(tensor, tuple(Var(a.name) for a in axes)))
    body = rebuild(st.stage.body, lambda n: Load(name, n.index) if isinstance(n, Load) and n.tensor == tensor else n)
    reader = replace(st, stage=replace(st.stage, body=body))
    i = state.stages.index(st)
    return replace(state, stages=state.stages[:i] + (initial_stage_state(copy), reader) + state.stages[i + 1:])


def _rfactor(state: State, st: StageState, step: Step) -> State:
    s = st.stage
    lp = st.loop(step["iter"])
    if len(lp.prims) != 1 or not st.is_reduce_loop(lp):
        raise ScheduleError(f"rfactor: {lp.name!r} of {st.name!r} is not a plain reduction loop")
    p = st.prim(lp.prims[0])
    others = [(n, q) for n, q in st.prims if q.axis == p.axis and n != lp.prims[0]]
    if len(s.reduce_axes) != 1 or len(others) != 1:
        raise ScheduleError(f"rfactor: needs a stage with one reduction axis split in exactly two; "
                            f"{st.name!r} has {len(others) + 1} loops over {p.axis!r}")
    o = others[0][1]
    kf, ko = f"{p.axis}_f", f"{p.axis}_o"
    body = substitute(s.body, {p.axis: Var(kf) * p.stride + Var(ko) * o.stride})
    rf = Stage(f"{s.name}.rf", s.axes + (Axis(kf, p.extent),), body, (Axis(ko, o.extent),), s.reduce_op)
    red = Stage(s.name, s.axes, Load(rf.name, tuple(Var(a.name) for a in s.axes) + (Var(kf),)),
                (Axis(kf, p.extent),), s.reduce_op)
    i = state.stages.index(st)
    new = (initial_stage_state(rf), replace(initial_stage_state(red), attach=st.attach))
    return replace(state, stages=state.stages[:i] + new + state.stages[i + 1:])


def _pragma(state: State, st: StageState, step: Step) -> State:
    return state.with_stage(replace(st, auto_unroll_max_step=int(step["auto_unroll_max_step"])))


_STEPS = {"split": _split, "reorder": _reorder, "fuse": _fuse, "annotate": _annotate,
          "compute_at": _compute_at, "compute_root": _compute_root, "compute_inline": _compute_inline,
          "cache_write": _cache_write, "cache_read": _cache_read, "rfactor": _rfactor, "pragma": _pragma}



def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_name(x: Any) -> bool:
    return isinstance(x, str) and x != ""


def _are_names(x: Any) -> bool:
    return isinstance(x, list) and all(_is_name(n) for n in x)


def _expect(test: Callable[[Any], bool], description: str) -> Callable[[Any], str | None]:
    return lambda x: None if test(x) else f"must be {description}, got {json.dumps(x, default=repr)}"


# what each field of a step must be: value -> problem, or None
_NAME = _expect(_is_name, "a loop, stage or tensor name")
_NAMES = _expect(_are_names, "a list of names")
_COUNT = _expect(lambda x: _is_int(x) and x >= 0, "a non-negative integer")
_FACTORS = _expect(lambda x: isinstance(x, list) and all(_is_int(f) and f > 0 for f in x),
                   "a list of positive integers")
_SOURCE = _expect(lambda x: _are_names(x) and len(x) == 2, "[stage, loop]")


def _annotation(x: Any) -> str | None:
    return None if x in ANNOTATIONS else f"unknown annotation {json.dumps(x, default=repr)}; use one of {ANNOTATIONS}"


# step kind -> its required fields; `stage` is the stage the step transforms
STEP_FIELDS: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "split": {"stage": _NAME, "iter": _NAME, "factors": _FACTORS},
    "follow_split": {"stage": _NAME, "iter": _NAME, "src": _SOURCE, "n": _COUNT},
    "reorder": {"stage": _NAME, "order": _NAMES},
    "fuse": {"stage": _NAME, "iters": _NAMES},
    "annotate": {"stage": _NAME, "iter": _NAME, "ann": _annotation},
    "compute_at": {"stage": _NAME, "target": _NAME, "iter": _NAME},
    "compute_root": {"stage": _NAME},
    "compute_inline": {"stage": _NAME},
    "cache_write": {"stage": _NAME},
    "cache_read": {"stage": _NAME, "tensor": _NAME},
    "rfactor": {"stage": _NAME, "iter": _NAME},
    "pragma": {"stage": _NAME, "auto_unroll_max_step": _COUNT},
}


def step_problem(step: Any) -> str | None:
    """Why `step` is not a step this version can apply (not an object, unknown kind, a missing
    or mistyped field), or None; a step's meaning in a given state is checked by replaying it."""
    if not isinstance(step, dict):
        return f"a step must be a JSON object, got {json.dumps(step, default=repr)}"
    kind = step.get("kind")
    if kind not in STEP_FIELDS:
        return (f"unknown step kind {kind!r} (written by a newer autopar?); this version knows "
                f"{sorted(STEP_FIELDS)}")
    for name, check in STEP_FIELDS[kind].items():
        if name not in step:
            return f"{kind} step lacks field {name!r}"
        problem = check(step[name])
        if problem:
            return f"{kind} step field {name!r}: {problem}"
    return None


def schedule_problem(steps: Any) -> str | None:
    """Why `steps` is not a schedule this version can apply step by step, or None."""
    if not isinstance(steps, (list, tuple)):
        return f"a schedule must be a list of steps, got {type(steps).__name__}"
    for i, step in enumerate(steps):
        problem = step_problem(step)
        if problem:
            return f"schedule step {i}: {problem}"
    return None


def apply_step(state: State, step: Step, history: list[Step] = ()) -> State:
    """Apply one step; `history` (the steps before it) is needed by follow_split only."""
    problem = step_problem(step)
    if problem:
        raise ScheduleError(problem)
    st = state.stage(step["stage"])
    if step["kind"] == "follow_split":
        return _follow_split(state, st, step, list(history))
    return _STEPS[step["kind"]](state, st, step)


def replay(dag: ComputeDAG, steps: list[Step]) -> State:
    """The state reached by applying `steps` in order to the untransformed DAG."""
    state = initial_state(dag)
    for i, step in enumerate(steps):
        state = apply_step(state, step, steps[:i])
    return state


def steps_to_json(steps: list[Step]) -> str:
    return json.dumps(steps, sort_keys=True)


def steps_from_json(s: str) -> list[Step]:
    steps = json.loads(s)
    problem = schedule_problem(steps) if isinstance(steps, list) else "a schedule is a JSON list of steps"
    if problem:
        raise ScheduleError(problem)
    return steps
