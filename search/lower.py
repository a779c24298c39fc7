"""Lower a program state to a loop-level program: bound inference for attached stages,
buffers (arguments, root temporaries, per-tile locals), loops with annotations, stores.
The result is what the C printer prints and what cost-model features are read from."""
from __future__ import annotations

from dataclasses import dataclass, field

from .expr import Bin, Const, Expr, Load, Var, affine, op_counts, rebuild, simplify, substitute, variables
from .schedule import Loop, ScheduleError, State, StageState

MAX_LOCAL_ELEMS = 1 << 20  # per-tile buffers: 4 MiB of fp32 at most (over 64 KiB they go on the heap)


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int, ...]
    scope: str  # "input" | "output" | "global" | "local"

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class For:
    var: str
    extent: int
    ann: str
    body: list = field(default_factory=list)
    stage: str = ""


@dataclass
class Alloc:
    buffer: Buffer


@dataclass
class Store:
    buffer: Buffer
    index: Expr  # flat element index
    value: Expr  # loads carry one flat index each
    reduce_op: str | None
    stage: str
    guard: tuple[tuple[Expr, int], ...] = ()  # store only where every `expr < bound` (padded output tiles)


def trip_count(loops: list[For]) -> int:
    """Iterations of the innermost body of `loops`."""
    n = 1
    for lp in loops:
        n *= lp.extent
    return n


def store_op_counts(st: Store) -> dict[str, int]:
    """Floating-point operations of one execution of `st`, by kind, its reduction's combine included."""
    ops = op_counts(st.value)
    if st.reduce_op:
        ops["add" if st.reduce_op == "sum" else "cmp"] += 1
    return ops


@dataclass
class Program:
    args: list[Buffer]
    temps: list[Buffer]
    body: list


IDENTITY = {"sum": Const(0.0), "max": Const(-3.4028234663852886e38)}


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, s = [], 1
    for d in reversed(shape):
        out.append(s)
        s *= d
    return out[::-1]


class _Lowering:
    def __init__(self, state: State):
        self.state = state
        self.live = [s for s in state.stages if s.attach != "inline"]
        self.names = {s.name for s in self.live}
        self.children: dict[tuple[str, str], list[StageState]] = {}
        self.base: dict[str, dict[str, Expr]] = {}     # stage -> axis -> region start
        self.region: dict[str, dict[str, int]] = {}    # stage -> axis -> region extent
        self.extent: dict[str, dict[str, int]] = {}    # stage -> prim -> adjusted extent
        self.var: dict[tuple[str, str], str] = {}      # (stage, loop) -> C variable
        self.buffers: dict[str, Buffer] = {}
        self.unsafe: dict[str, set[str]] = {}          # stage -> axes whose values may pass their extent
        for n, shp in state.inputs:
            self.buffers[n] = Buffer(n, shp, "input")
        for s in self.live:
            if s.attach is not None:
                tgt, lp = s.attach
                if tgt not in self.names:
                    raise ScheduleError(f"{s.name!r} is attached to {tgt!r}, which is inlined or missing")
                self.state.stage(tgt).loop(lp)
                self.children.setdefault((tgt, lp), []).append(s)
        for k, s in enumerate(self.live):
            for lp in s.loops:
                self.var[(s.name, lp.name)] = f"v{k}_{''.join(c if c.isalnum() else '_' for c in lp.name)}"

    # ---- iterator values ----
    def prim_value(self, s: StageState, lp: Loop, prim: str) -> Expr:
        v: Expr = Var(self.var[(s.name, lp.name)])
        ext = self.extent[s.name]
        i = lp.prims.index(prim)
        inner = 1
        for p in lp.prims[i + 1:]:
            inner *= ext[p]
        if inner > 1:
            v = Bin("idiv", v, Const(inner, True))
        if i > 0:
            v = Bin("mod", v, Const(ext[prim], True))
        return v

    def axis_parts(self, s: StageState, fixed_upto: int) -> tuple[dict[str, Expr], dict[str, int]]:
        """Per axis: value of the loops [0, fixed_upto) plus region start, and the span of the rest."""
        fixed: dict[str, Expr] = {a.name: self.base[s.name].get(a.name, Const(0, True))
                                  for a in s.stage.axes + s.stage.reduce_axes}
        span = dict.fromkeys(fixed, 0)
        for li, lp in enumerate(s.loops):
            for pn in lp.prims:
                p = s.prim(pn)
                if li < fixed_upto:
                    fixed[p.axis] = Bin("+", fixed[p.axis], Bin("*", self.prim_value(s, lp, pn), Const(p.stride, True)))
                else:
                    span[p.axis] += (self.extent[s.name][pn] - 1) * p.stride
        return {a: simplify(e) for a, e in fixed.items()}, span

    # ---- bound inference ----
    def infer(self, s: StageState) -> None:
        axes = s.stage.axes
        unsafe: set[str] = set()
        if s.attach is None:
            self.base[s.name] = {}
            self.region[s.name] = {a.name: a.extent for a in axes}
        else:
            tgt, lpname = s.attach
            lo: list[Expr | None] = [None] * len(axes)
            ext = [0] * len(axes)
            over: set[int] = set()  # dims a padded consumer may read past the end of
            for q in self.live:
                if s.name not in q.stage.reads():
                    continue
                if q.name == tgt:
                    upto = [l.name for l in q.loops].index(lpname) + 1
                elif q.attach == s.attach:
                    upto = 0
                else:
                    raise ScheduleError(f"{s.name!r} is attached to {tgt!r} but also read by {q.name!r}, "
                                        f"which is computed elsewhere")
                fixed, span = self.axis_parts(q, upto)
                for ld in _loads_of(q.stage.body, s.name):
                    for d, ix in enumerate(ld.index):
                        if variables(ix) & self.unsafe[q.name]:
                            over.add(d)
                        coeffs, const = affine(ix)
                        start: Expr = Const(const, True)
                        width = 0
                        for v, c in coeffs.items():
                            start = Bin("+", start, Bin("*", fixed[v], Const(c, True)))
                            if c < 0:
                                start = Bin("+", start, Const(c * span[v], True))
                            width += abs(c) * span[v]
                        start = simplify(start)
                        if lo[d] is not None and lo[d] != start:
                            raise ScheduleError(f"regions of {s.name!r} read by its consumers at "
                                                f"{tgt}.{lpname} do not line up")
                        lo[d] = start
                        ext[d] = max(ext[d], width + 1)
            self.base[s.name] = {a.name: lo[d] for d, a in enumerate(axes)}
            self.region[s.name] = {a.name: min(ext[d], a.extent) for d, a in enumerate(axes)}
            unsafe = {axes[d].name for d in over}
        # propagate region extents to the outermost split of each axis
        ext: dict[str, int] = {}
        covered: dict[str, int] = {}
        for a in s.stage.axes + s.stage.reduce_axes:
            r = self.region[s.name].get(a.name, a.extent)
            # innermost splits keep their extents while they fit in the region, the next one
            # covers the rest (padded past it when the inner tiles do not divide it), outer
            # ones shrink to 1 (the consumer's loops iterate them)
            prims = sorted(((n, p) for n, p in s.prims if p.axis == a.name), key=lambda x: x[1].stride)
            cum = 1
            for k, (n, p) in enumerate(prims):
                if k == len(prims) - 1 or cum * p.extent > r:
                    ext[n] = min(p.extent, -(-r // cum)) if k < len(prims) - 1 else -(-r // cum)
                    cum *= ext[n]
                else:
                    ext[n] = p.extent
                    cum *= p.extent
            if cum < r:
                raise ScheduleError(f"stage {s.name!r}: tiles of axis {a.name!r} do not cover its region {r}")
            if cum > r:  # a spatial axis: splits refuse to pad reduction axes
                unsafe.add(a.name)
            covered[a.name] = cum
        self.extent[s.name] = ext
        self.unsafe[s.name] = unsafe
        shape = tuple(covered[a.name] for a in axes)
        if s.attach is not None:
            scope = "local"
            n = 1
            for d in shape:
                n *= d
            if n > MAX_LOCAL_ELEMS:
                raise ScheduleError(f"stage {s.name!r}: tile buffer of {n} elements at its compute location "
                                    f"exceeds {MAX_LOCAL_ELEMS}; attach it deeper")
        elif s.name == self.state.output:
            shape, scope = s.stage.shape, "output"  # padded iterations are not stored (guards)
        else:
            scope = "global"
        self.buffers[s.name] = Buffer(s.name, shape, scope)

    # ---- expressions ----
    def flat(self, tensor: str, index: tuple[Expr, ...]) -> Expr:
        buf = self.buffers[tensor]
        base = self.base.get(tensor, {}) if buf.scope == "local" else {}
        axes = self.state.stage(tensor).stage.axes if tensor in self.names else ()
        out: Expr = Const(0, True)
        for d, (ix, st) in enumerate(zip(index, _strides(buf.shape))):
            if buf.scope == "local":
                ix = Bin("-", ix, base[axes[d].name])
            out = Bin("+", out, Bin("*", ix, Const(st, True)))
        return _fold_affine(out)

    def lower_value(self, s: StageState, values: dict[str, Expr]) -> Expr:
        body = s.stage.body
        if self.unsafe[s.name]:  # padded iterations read the last element instead of past the end
            def clamp(n: Expr) -> Expr:
                if not isinstance(n, Load):
                    return n
                shape = self.state.shape_of(n.tensor)
                return Load(n.tensor, tuple(Bin("imin", ix, Const(shape[d] - 1, True))
                                            if variables(ix) & self.unsafe[s.name] else ix
                                            for d, ix in enumerate(n.index)))
            body = rebuild(body, clamp)
        body = substitute(body, values)
        return rebuild(body, lambda n: Load(n.tensor, (self.flat(n.tensor, n.index),)) if isinstance(n, Load) else n)

    # ---- loop nests ----
    def check_annotations(self, s: StageState) -> None:
        for li, lp in enumerate(s.loops):
            red = s.is_reduce_loop(lp)
            if lp.ann == "parallel" and (li != 0 or s.attach is not None or red):
                raise ScheduleError(f"stage {s.name!r}: only the outermost spatial loop of a root stage can be "
                                    f"parallel (got {lp.name!r})")
            if lp.ann == "vectorize" and (li != len(s.loops) - 1 or red):
                raise ScheduleError(f"stage {s.name!r}: only the innermost spatial loop can be vectorized "
                                    f"(got {lp.name!r})")

    def emit(self, s: StageState) -> list:
        self.check_annotations(s)
        loops = s.loops
        ext = self.extent[s.name]
        extents = []
        for lp in loops:
            n = 1
            for p in lp.prims:
                n *= ext[p]
            extents.append(n)
        anns = [lp.ann for lp in loops]
        if s.auto_unroll_max_step:
            prod = 1
            for li in range(len(loops) - 1, -1, -1):
                prod *= extents[li]
                if prod > s.auto_unroll_max_step or anns[li] == "parallel":
                    break
                if anns[li] == "none":
                    anns[li] = "unroll"
        values, _ = self.axis_parts(s, len(loops))
        buf = self.buffers[s.name]
        index = self.flat(s.name, tuple(values[a.name] for a in s.stage.axes))
        guard = tuple((values[a.name], a.extent) for a in s.stage.axes
                      if a.name in self.unsafe[s.name]) if buf.scope == "output" else ()
        store = Store(buf, index, self.lower_value(s, values), s.stage.reduce_op, s.name, guard)
        first_red = next((i for i, lp in enumerate(loops) if s.is_reduce_loop(lp)), None)

        def init_nest(level: int) -> list:
            node = [Store(buf, index, IDENTITY[s.stage.reduce_op], None, s.name, guard)]
            for li in range(len(loops) - 1, level - 1, -1):
                if not s.is_reduce_loop(loops[li]):
                    a = anns[li] if anns[li] in ("vectorize", "unroll") else "none"
                    node = [For(self.var[(s.name, loops[li].name)], extents[li], a, node, s.name)]
            return node

        def build(level: int) -> list:
            nodes = init_nest(level) if level == first_red else []
            if level == len(loops):
                return nodes + [store]
            lp = loops[level]
            body = []
            for child in self.children.get((s.name, lp.name), []):
                body += [Alloc(self.buffers[child.name])] + self.emit(child)
            body += build(level + 1)
            return nodes + [For(self.var[(s.name, lp.name)], extents[level], anns[level], body, s.name)]

        return build(0)

    def run(self) -> Program:
        for s in reversed(self.live):
            self.infer(s)
        body = []
        for s in self.live:
            if s.attach is None:
                body += self.emit(s)
        args = [self.buffers[n] for n, _ in self.state.inputs] + [self.buffers[self.state.output]]
        temps = [b for b in self.buffers.values() if b.scope == "global"]
        return Program(args, temps, body)


def _loads_of(e: Expr, tensor: str) -> list[Load]:
    from .expr import loads
    return [ld for ld in loads(e) if ld.tensor == tensor]


def _linear(e: Expr) -> tuple[dict[Expr, int], int]:
    """`e` as sum(coeff * atom) + const; variables and integer div/mod nodes are atoms."""
    if isinstance(e, Const) and e.is_int:
        return {}, int(e.value)
    if isinstance(e, Bin) and e.op in "+-":
        ca, ka = _linear(e.a)
        cb, kb = _linear(e.b)
        sgn = 1 if e.op == "+" else -1
        for t, c in cb.items():
            ca[t] = ca.get(t, 0) + sgn * c
        return {t: c for t, c in ca.items() if c}, ka + sgn * kb
    if isinstance(e, Bin) and e.op == "*":
        ca, ka = _linear(e.a)
        cb, kb = _linear(e.b)
        if not ca:
            return {t: ka * c for t, c in cb.items() if ka * c}, ka * kb
        if not cb:
            return {t: kb * c for t, c in ca.items() if kb * c}, ka * kb
    return {e: 1}, 0


def _fold_affine(e: Expr) -> Expr:
    """Collect an index into `sum(coeff * atom) + const` so equal terms cancel."""
    coeffs, const = _linear(e)
    out: Expr | None = None
    for t, c in coeffs.items():
        term = t if c == 1 else Bin("*", t, Const(c, True))
        out = term if out is None else Bin("+", out, term)
    if out is None:
        return Const(const, True)
    return Bin("+", out, Const(const, True)) if const else out


def lower(state: State) -> Program:
    """Loop-level program of a state; ScheduleError when the schedule is not valid."""
    return _Lowering(state).run()
