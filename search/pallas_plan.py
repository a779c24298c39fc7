"""How a program state maps onto Pallas kernels, as plain data: one `pallas_call` per root
stage, its grid, the region every stage it computes covers, and the BlockSpec and padding of
every global array it reads (`search.codegen_pallas` turns the plan into code).

The block of a spatial axis is its innermost tile (the innermost split part); the tile
loops outside it form the grid, cdiv(extent, block) programs along the axis. A reduction
axis's innermost tile is one step of a loop inside the kernel, so each program owns its output
block: GPU programs run concurrently, and a reduction spread over grid programs would race.
Stages attached (compute_at) to a root stage are computed inside its kernel for the region its
block reads, whichever of its loops they were attached at; inlined stages are already part of
their consumers' bodies. Arrays are padded so every read is in bounds and outputs are padded to
whole blocks, then cut back: tiles need not divide the shapes."""
from __future__ import annotations

from dataclasses import dataclass

from .compute import Stage
from .expr import Bin, Expr, affine, loads, variables
from .schedule import ScheduleError, State, StageState


@dataclass(frozen=True)
class Affine:
    """`const + sum(coeff * program_id(dim))`: where a region starts in one kernel program."""

    terms: tuple[tuple[int, int], ...] = ()  # (grid dim, coefficient), sorted by dim, no zeros
    const: int = 0

    def plus(self, other: "Affine") -> "Affine":
        acc = dict(self.terms)
        for d, c in other.terms:
            acc[d] = acc.get(d, 0) + c
        return Affine(tuple(sorted((d, c) for d, c in acc.items() if c)), self.const + other.const)

    def times(self, k: int) -> "Affine":
        return Affine(tuple((d, c * k) for d, c in self.terms if c * k), self.const * k)

    def bounds(self, grid: tuple[int, ...]) -> tuple[int, int]:
        """Smallest and largest value over all programs of `grid`."""
        lo = hi = self.const
        for d, c in self.terms:
            lo, hi = lo + min(0, c * (grid[d] - 1)), hi + max(0, c * (grid[d] - 1))
        return lo, hi


Region = tuple[Affine, int]  # start and width along one axis
MIN_DOT = 16  # a product reduced by a sum becomes tl.dot when every operand dim is at least this


def is_dot(stage: Stage, widths: dict[str, int]) -> bool:
    """Whether one step of `stage` is a 2-D matrix product of tiles at least MIN_DOT on a side:
    a sum over one axis of two operands that each vary along it and one spatial axis of their own."""
    body = stage.body
    if stage.reduce_op != "sum" or not isinstance(body, Bin) or body.op != "*":
        return False
    wide = {a for a, w in widths.items() if w > 1}
    xa, ya = variables(body.a) & wide, variables(body.b) & wide
    red = {a.name for a in stage.reduce_axes} & wide
    shared = xa & ya
    return (len(xa) == len(ya) == 2 and len(shared) == 1 and shared == red
            and min(widths[a] for a in xa | ya) >= MIN_DOT)


@dataclass(frozen=True)
class StagePlan:
    """One stage computed in a kernel: the region of each spatial axis and its reduction tiles."""

    name: str
    region: tuple[Region, ...]
    reduce_tiles: tuple[int, ...]  # elements of each reduction axis per step of the kernel's loop


@dataclass(frozen=True)
class ArrayPlan:
    """A global array a kernel reads: its padding (before, after) per dim and its BlockSpec; a
    dim with grid dim None is read whole."""

    name: str
    pad: tuple[tuple[int, int], ...]
    block: tuple[int, ...]
    grid_dims: tuple[int | None, ...]
    read: tuple[int, ...]  # per dim: the most elements one program reads along it


@dataclass(frozen=True)
class KernelPlan:
    """One `pallas_call`: it computes root stage `name`, block by block."""

    name: str
    grid: tuple[int, ...]
    stages: tuple[StagePlan, ...]       # attached producers in topological order, the root last
    reads: tuple[ArrayPlan, ...]
    out_grid_dims: tuple[int | None, ...]  # per output dim: the grid dim that picks its block

    @property
    def root(self) -> StagePlan:
        return self.stages[-1]

    @property
    def out_padded_shape(self) -> tuple[int, ...]:
        return tuple(w * (self.grid[d] if d is not None else 1)
                     for (_, w), d in zip(self.root.region, self.out_grid_dims))


@dataclass(frozen=True)
class PallasProgram:
    """The kernels of a schedule in launch order; `stages` holds every stage's definition."""

    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    kernels: tuple[KernelPlan, ...]
    output: str
    stages: tuple[Stage, ...]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def inner_tile(st: StageState, axis: str) -> int:
    """Extent of the innermost split part of `axis` (the last stride-1 part made; a split by
    [f, 1] ends in a part of 1): the block of a spatial axis, the step of a reduction."""
    return [p.extent for _, p in st.prims if p.axis == axis and p.stride == 1][-1]


def _kernel_root(state: State, st: StageState) -> str:
    seen = {st.name}
    while st.attach is not None:
        st = state.stage(st.attach[0])
        if st.attach == "inline" or st.name in seen:
            raise ScheduleError(f"pallas: stage {st.name!r} is attached to an inlined stage or in a cycle")
        seen.add(st.name)
    return st.name


def _box(index: Expr, ranges: dict[str, Region], where: str) -> Region:
    """Start and width of the values an affine index takes over `ranges`."""
    try:
        coeffs, const = affine(index)
    except ValueError as e:
        raise ScheduleError(f"pallas: {where}: {e}") from None
    start, width = Affine(const=const), 1
    for v, c in coeffs.items():
        s, w = ranges[v]
        start = start.plus(s.times(c)).plus(Affine(const=min(0, c) * (w - 1)))
        width += abs(c) * (w - 1)
    return start, width


def _ranges(stage: Stage, region: tuple[Region, ...]) -> dict[str, Region]:
    """Every axis of `stage` over its region: spatial axes as planned, reductions whole."""
    out = {a.name: r for a, r in zip(stage.axes, region)}
    out.update({a.name: (Affine(), a.extent) for a in stage.reduce_axes})
    return out


def _hull(a: Region, b: Region, grid: tuple[int, ...]) -> Region | None:
    """The smallest region holding `a` and `b` in every program, when one of them starts first
    in all programs (else None)."""
    (sa, wa), (sb, wb) = a, b
    lo, hi = sa.plus(sb.times(-1)).bounds(grid)  # how far a starts after b
    if lo >= 0:
        return sb, max(wb, hi + wa)
    if hi <= 0:
        return sa, max(wa, wb - lo)
    return None


def _producer_region(p: Stage, members: list[StageState], regions: dict[str, tuple[Region, ...]],
                     grid: tuple[int, ...], kernel: str) -> tuple[Region, ...]:
    """The region of `p` its consumers in the kernel read: the hull of their boxes (a row's
    statistics read whole and its tile read by the output give the whole row)."""
    hull: list[Region | None] = [None] * len(p.axes)
    for q in members:
        if q.name not in regions:
            continue
        ranges = _ranges(q.stage, regions[q.name])
        for ld in (ld for ld in loads(q.stage.body) if ld.tensor == p.name):
            for d, ix in enumerate(ld.index):
                box = _box(ix, ranges, f"{q.name} reads {p.name}")
                hull[d] = box if hull[d] is None else _hull(hull[d], box, grid)  # type: ignore[arg-type]
                if hull[d] is None:
                    raise ScheduleError(f"pallas: the regions of {p.name!r} read by its consumers in "
                                        f"kernel {kernel!r} do not line up")
    if None in hull:
        raise ScheduleError(f"pallas: {p.name!r} is computed in kernel {kernel!r} but nothing there reads it")
    return tuple(hull)  # type: ignore[arg-type]


def _array_plan(name: str, shape: tuple[int, ...], boxes: list[list[Region]], grid: tuple[int, ...]) -> ArrayPlan:
    """Padding that keeps every box of every program in bounds; a dim is blocked when all its
    boxes are the same `width * program_id(g)` block, else read whole."""
    pad, block, dims, read = [], [], [], []
    for d, n in enumerate(shape):
        read.append(max(w for _, w in boxes[d]))
        lows = [s.bounds(grid)[0] for s, _ in boxes[d]]
        highs = [s.bounds(grid)[1] + w for s, w in boxes[d]]
        before, after = max(0, -min(lows)), max(0, max(highs) - n)
        s, w = boxes[d][0]
        if all(b == boxes[d][0] for b in boxes[d]) and len(s.terms) == 1 and s.terms[0][1] == w and s.const == 0:
            block.append(w)
            dims.append(s.terms[0][0])
        else:
            block.append(before + n + after)
            dims.append(None)
        pad.append((before, after))
    return ArrayPlan(name, tuple(pad), tuple(block), tuple(dims), tuple(read))


def _kernel_plan(state: State, root: StageState, members: list[StageState]) -> KernelPlan:
    axes = root.stage.axes
    blocks = [inner_tile(root, a.name) for a in axes]
    counts = [_cdiv(a.extent, b) for a, b in zip(axes, blocks)]
    position = {p: k for k, lp in enumerate(root.loops) for p in lp.prims}

    def outermost(axis: str) -> int:  # loop position of the axis's largest-stride part
        top = max(p.stride for _, p in root.prims if p.axis == axis)
        return min(position[n] for n, p in root.prims if p.axis == axis and p.stride == top)

    gridded = sorted((d for d in range(len(axes)) if counts[d] > 1), key=lambda d: outermost(axes[d].name))
    grid_dim = {d: k for k, d in enumerate(gridded)}
    grid = tuple(counts[d] for d in gridded)
    regions: dict[str, tuple[Region, ...]] = {root.name: tuple(
        (Affine(((grid_dim[d], blocks[d]),)) if d in grid_dim else Affine(), blocks[d]) for d in range(len(axes)))}
    for p in reversed(members[:-1]):
        regions[p.name] = _producer_region(p.stage, members, regions, grid, root.name)
    names = {m.name for m in members}
    boxes: dict[str, list[list[Region]]] = {}
    for m in members:
        ranges = _ranges(m.stage, regions[m.name])
        for ld in loads(m.stage.body):
            if ld.tensor in names:
                continue
            per_dim = boxes.setdefault(ld.tensor, [[] for _ in ld.index])
            for d, ix in enumerate(ld.index):
                per_dim[d].append(_box(ix, ranges, f"{m.name} reads {ld.tensor}"))
    reads = tuple(_array_plan(t, state.shape_of(t), b, grid) for t, b in sorted(boxes.items()))
    stages = tuple(StagePlan(m.name, regions[m.name], tuple(inner_tile(m, a.name) for a in m.stage.reduce_axes))
                   for m in members)
    return KernelPlan(root.name, grid, stages, reads, tuple(grid_dim.get(d) for d in range(len(axes))))


def plan(state: State) -> PallasProgram:
    """The Pallas kernels of a program state (ScheduleError when it has no such form)."""
    live = [s for s in state.stages if s.attach != "inline"]
    for s in state.stages:
        for a, t in ((a, inner_tile(s, a.name)) for a in s.stage.reduce_axes):
            if a.extent % t:
                raise ScheduleError(f"pallas: reduction tile {t} of {s.name}.{a.name} does not divide {a.extent}")
    groups: dict[str, list[StageState]] = {}
    for s in live:
        groups.setdefault(_kernel_root(state, s), []).append(s)
    for root, members in groups.items():
        if members[-1].name != root:
            raise ScheduleError(f"pallas: a stage attached to {root!r} comes after it")
        inside = {m.name for m in members}
        for m in members[:-1]:
            outside = [c for c in state.consumers(m.name) if c not in inside]
            if outside:
                raise ScheduleError(f"pallas: {m.name!r} is computed in kernel {root!r} but also read by "
                                    f"{outside[0]!r}, which is computed elsewhere")
    kernels = tuple(_kernel_plan(state, state.stage(r), groups[r]) for r in (s.name for s in live if s.attach is None))
    return PallasProgram(state.inputs, kernels, state.output, tuple(s.stage for s in state.stages))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


MAX_STEP_ELEMS = 1 << 14  # elements of one reduction step's tile (region x reduction tile) per program


def gpu_problem(prog: PallasProgram) -> str | None:
    """Why `prog` breaks a rule of Pallas's Triton lowering, or None: every array in a kernel
    has a power-of-two size (blocks, stage regions, reduction steps), and a program's largest
    tile (a region times its reduction tile) stays within MAX_STEP_ELEMS, as it lives in registers."""
    for k in prog.kernels:
        for sp in k.stages:
            stage = prog.stage(sp.name)
            sizes = [(a.name, w) for a, (_, w) in zip(stage.axes, sp.region)]
            sizes += [(a.name, t) for a, t in zip(stage.reduce_axes, sp.reduce_tiles)]
            for axis, w in sizes:
                if not _is_pow2(w):
                    return (f"kernel {k.name!r}: stage {sp.name!r} covers {w} elements of axis {axis!r} per "
                            f"program; Triton needs power-of-two sizes")
            n = 1
            for _, w in sizes:
                n *= w
            if n > MAX_STEP_ELEMS:
                return f"kernel {k.name!r}: a step of stage {sp.name!r} holds {n} elements, over {MAX_STEP_ELEMS}"
    return None


def describe(prog: PallasProgram) -> str:
    """A readable listing of the kernels: grid, blocks, regions and reduction steps."""
    def start(a: Affine) -> str:
        parts = [f"{c}*g{d}" for d, c in a.terms] + ([str(a.const)] if a.const or not a.terms else [])
        return " + ".join(parts)

    lines = []
    for k in prog.kernels:
        lines.append(f"pallas_call {k.name}{list(k.out_padded_shape)} grid={list(k.grid)}")
        for r in k.reads:
            dims = ", ".join(f"g{d}" if d is not None else "0" for d in r.grid_dims)
            lines.append(f"  in {r.name}: block {list(r.block)} at ({dims}), pad {[list(p) for p in r.pad]}")
        for sp in k.stages:
            st = prog.stage(sp.name)
            reg = ", ".join(f"{a.name}: {start(s)} +{w}" for a, (s, w) in zip(st.axes, sp.region))
            red = ", ".join(f"{a.name}: {a.extent // t} x {t}" for a, t in zip(st.reduce_axes, sp.reduce_tiles))
            kind = "out" if sp is k.root else "local"
            lines.append(f"  {kind} {sp.name}[{reg}]" + (f" {st.reduce_op} over [{red}]" if red else ""))
    return "\n".join(lines) + "\n"
