"""Pallas code generation: a `PallasProgram` (search.pallas_plan) becomes a jitted JAX function
of the task's inputs that launches one `pl.pallas_call` per kernel.

Inside a kernel every stage is evaluated on its whole region at once: each value carries the
names of the axes it varies along (an axis one element wide is a scalar), so a load reads a
slice of its block when each index dim follows one axis contiguously and gathers otherwise, a
product reduced by a sum becomes a dot when both operands are 2-D tiles Triton's `tl.dot` takes
(`pallas_plan.is_dot`), and reductions loop over their steps with `fori_loop`."""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .compute import Stage
from .expr import Bin, Call, Const, Expr, Load, Select, Var, affine
from .pallas_plan import Affine, ArrayPlan, KernelPlan, PallasProgram, StagePlan, is_dot
IDENTITY = {"sum": 0.0, "max": -3.4028234663852886e38}
_FUNCS: dict[str, Callable] = {"exp": jnp.exp, "tanh": jnp.tanh, "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt,
                               "erf": jax.scipy.special.erf, "log": jnp.log}
_BINS: dict[str, Callable] = {"+": jnp.add, "-": jnp.subtract, "*": jnp.multiply, "/": jnp.divide,
                              "max": jnp.maximum, "min": jnp.minimum}

Val = tuple[Any, tuple[str, ...]]      # an array (or scalar) and the axis each of its dims follows
Ranges = dict[str, tuple[Any, int]]    # axis -> (start, width) in this program


def _affine_value(a: Affine, pids: list) -> Any:
    v: Any = a.const
    for d, c in a.terms:
        v = v + c * pids[d]
    return v


def _aligned(v: Val, axes: list[str]) -> Any:
    """`v`'s array with its dims in the order of `axes` and size-1 dims for the others."""
    arr, own = v
    if not own:
        return arr
    present = sorted(own, key=axes.index)
    if present != list(own):
        arr = jnp.transpose(arr, [own.index(a) for a in present])
    return arr.reshape([arr.shape[present.index(a)] if a in own else 1 for a in axes])


def _union(order: list[str], *vals: Val) -> list[str]:
    names = {a for _, axes in vals for a in axes}
    return [a for a in order if a in names]


class _Evaluator:
    """Evaluates stage bodies on regions inside one kernel program."""

    def __init__(self, prog: PallasProgram, kp: KernelPlan, refs: dict[str, Any]):
        self.prog, self.kp, self.refs = prog, kp, refs
        self.pids = [pl.program_id(d) for d in range(len(kp.grid))]
        self.plans: dict[str, ArrayPlan] = {r.name: r for r in kp.reads}
        self.local: dict[str, tuple[Any, list]] = {}  # stage computed here -> values, region starts

    # ---- expressions ----
    def expr(self, e: Expr, ranges: Ranges, order: list[str]) -> Val:
        if isinstance(e, Var):
            start, width = ranges[e.name]
            if width == 1:
                return start, ()
            return start + lax.broadcasted_iota(jnp.int32, (width,), 0), (e.name,)
        if isinstance(e, Const):
            return (int(e.value) if e.is_int else float(e.value)), ()
        if isinstance(e, Bin):
            a, b = self.expr(e.a, ranges, order), self.expr(e.b, ranges, order)
            axes = _union(order, a, b)
            return _BINS[e.op](_aligned(a, axes), _aligned(b, axes)), tuple(axes)
        if isinstance(e, Call):
            (arr, axes), = [self.expr(x, ranges, order) for x in e.args]
            return _FUNCS[e.func](arr), axes
        if isinstance(e, Select):
            conds = []
            for x, lo, hi in e.checks:
                arr, axes = self.expr(x, ranges, order)
                conds.append(((arr >= lo) & (arr < hi), axes))
            a, b = self.expr(e.a, ranges, order), self.expr(e.b, ranges, order)
            axes = _union(order, a, b, *conds)
            cond = True
            for c in conds:
                cond = cond & _aligned(c, axes)
            return jnp.where(cond, _aligned(a, axes), _aligned(b, axes)), tuple(axes)
        if isinstance(e, Load):
            return self.load(e, ranges, order)
        raise TypeError(e)

    def load(self, ld: Load, ranges: Ranges, order: list[str]) -> Val:
        idx = [self.expr(ix, ranges, order) for ix in ld.index]
        if ld.tensor in self.local:
            values, starts = self.local[ld.tensor]
            offsets = [-s for s in starts]
        else:
            ap = self.plans[ld.tensor]
            values = self.refs[ld.tensor]
            offsets = [before - (self.pids[g] * w if g is not None else 0)
                       for (before, _), w, g in zip(ap.pad, ap.block, ap.grid_dims)]
        wide = [axes for _, axes in idx]
        if all(len(a) <= 1 for a in wide) and len({a for axes in wide for a in axes}) == sum(map(len, wide)) \
                and all(not axes or affine(ix)[0].get(axes[0]) == 1 for ix, axes in zip(ld.index, wide)):
            return self._slice(ld, values, offsets, wide, ranges, order)
        axes = _union(order, *idx)
        shape = [ranges[a][1] for a in axes]
        local = tuple(jnp.broadcast_to(_aligned(v, axes) + off, shape) for v, off in zip(idx, offsets))
        return values[local], tuple(axes)

    def _slice(self, ld: Load, values: Any, offsets: list, wide: list, ranges: Ranges, order: list[str]) -> Val:
        """Each index dim follows at most one axis, contiguously: a (dynamic) slice of the block."""
        at_start = {a: (s, 1) for a, (s, _) in ranges.items()}
        starts = [self.expr(ix, at_start, order)[0] + off for ix, off in zip(ld.index, offsets)]
        sizes = [ranges[a[0]][1] if a else 1 for a in wide]
        if ld.tensor in self.local:
            # a read as large as the region is all of it (regions hold every read): no slice,
            # which Triton could not do on values in registers
            arr = values if list(sizes) == list(values.shape) else lax.dynamic_slice(values, starts, sizes)
            arr = arr.reshape([n for n, a in zip(sizes, wide) if a])
        else:
            arr = values[tuple(pl.ds(s, n) if a else s for s, n, a in zip(starts, sizes, wide))]
        return arr, tuple(a[0] for a in wide if a)

    # ---- stages ----
    def stage(self, sp: StagePlan) -> tuple[Any, list]:
        """Values of one stage over its region (an array of the region's widths), and where the
        region starts along each axis."""
        st = self.prog.stage(sp.name)
        names = [a.name for a in st.axes]
        shape = tuple(w for _, w in sp.region)
        spatial = {a: (_affine_value(s, self.pids), w) for a, (s, w) in zip(names, sp.region)}
        starts = [spatial[a][0] for a in names]
        if not st.reduce_op:
            return jnp.broadcast_to(_aligned(self.expr(st.body, spatial, names), names), shape), starts
        steps = [a.extent // t for a, t in zip(st.reduce_axes, sp.reduce_tiles)]
        order = names + [a.name for a in st.reduce_axes]
        combine = jnp.add if st.reduce_op == "sum" else jnp.maximum

        def partial(step: Any) -> Any:
            ranges = dict(spatial)
            for a, t, n in reversed(list(zip(st.reduce_axes, sp.reduce_tiles, steps))):
                ranges[a.name] = ((step % n) * t, t)
                step = step // n
            return jnp.broadcast_to(_aligned(self._reduced(st, ranges, order), names), shape)

        init = jnp.full(shape, IDENTITY[st.reduce_op], jnp.float32)
        total = math.prod(steps)
        if total == 1:
            return combine(init, partial(0)), starts
        return lax.fori_loop(0, total, lambda s, acc: combine(acc, partial(s)), init), starts

    def _reduced(self, st: Stage, ranges: Ranges, order: list[str]) -> Val:
        """One step of a reduction: the body over this step's tile, reduced over its axes."""
        red = [a.name for a in st.reduce_axes if ranges[a.name][1] > 1]
        body = st.body
        if is_dot(st, {a: w for a, (_, w) in ranges.items()}):
            return self._dot(self.expr(body.a, ranges, order), self.expr(body.b, ranges, order), red[0])
        arr, axes = self.expr(body, ranges, order)
        if axes:
            arr = jnp.broadcast_to(arr, [ranges[x][1] for x in axes])
        summed = [k for k, x in enumerate(axes) if x in red]
        out = (jnp.sum if st.reduce_op == "sum" else jnp.max)(arr, axis=tuple(summed)) if summed else arr
        if st.reduce_op == "sum":  # axes the body does not vary along add up the same value
            out = out * math.prod(ranges[x][1] for x in red if x not in axes)
        return out, tuple(x for x in axes if x not in red)

    @staticmethod
    def _dot(a: Val, b: Val, k: str) -> Val:
        """`sum over k of a * b` for 2-D tiles: one matrix product, in full fp32 (not TF32)."""
        (x, xa), (y, ya) = a, b
        if xa[0] == k:
            x = x.T
        if ya[1] == k:
            y = y.T
        out = jnp.dot(x, y, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return out, (next(n for n in xa if n != k), next(n for n in ya if n != k))

    def run(self, out_ref: Any) -> None:
        for sp in self.kp.stages[:-1]:
            self.local[sp.name] = self.stage(sp)
        out_ref[...] = self.stage(self.kp.root)[0].astype(out_ref.dtype)


def _index_map(dims: tuple[int | None, ...]) -> Callable:
    return lambda *g: tuple(g[d] if d is not None else 0 for d in dims)


def _launch(prog: PallasProgram, kp: KernelPlan, env: dict[str, Any], interpret: bool) -> Any:
    """Run one kernel on padded arrays; its output is cut back to the stage's shape."""
    args = [jnp.pad(env[r.name], r.pad) if any(a or b for a, b in r.pad) else env[r.name] for r in kp.reads]
    names = [r.name for r in kp.reads]

    def kernel(*refs: Any) -> None:
        _Evaluator(prog, kp, dict(zip(names, refs[:-1]))).run(refs[-1])

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(kp.out_padded_shape, jnp.float32),
        grid=kp.grid,
        in_specs=[pl.BlockSpec(r.block, _index_map(r.grid_dims)) for r in kp.reads],
        out_specs=pl.BlockSpec(tuple(w for _, w in kp.root.region), _index_map(kp.out_grid_dims)),
        interpret=interpret,
    )(*args)
    shape = prog.stage(kp.name).shape
    return out[tuple(slice(0, n) for n in shape)] if out.shape != shape else out


def program_function(prog: PallasProgram, interpret: bool) -> Callable[..., Any]:
    """A jitted function of the inputs (in `prog.inputs` order) returning the output array."""
    names = [n for n, _ in prog.inputs]

    def run(*inputs: Any) -> Any:
        env = dict(zip(names, inputs))
        for kp in prog.kernels:
            env[kp.name] = _launch(prog, kp, env, interpret)
        return env[prog.output]

    return jax.jit(run)
