"""Is a pipelined loss a mean over its batch? Warn when micro-batching changes it.

The pipeline runtime averages the losses and gradients of the B micro-batches. That is
the full batch's loss and gradient when the loss is a mean of per-example terms (or an
affine function of such means, e.g. plus a weight penalty); a sum over the batch is
divided by B, and a product of two batch means (an MoE load-balancing term: experts'
token fraction times mean router probability), a masked mean (a ratio of two sums), a
maximum over the batch or batch statistics inside per-example terms (batch norm) become
something else when computed per micro-batch.

The check interprets the loss's op graph on abstract values that follow the batch axis
from the loss inputs that are split into micro-batches (`TracedStep.split_mask`):

- `Free`: independent of the batch's content (parameters, unsplit inputs, constants;
  its value when the trace makes it a known number, e.g. a count).
- `PerExample`: one slice per unit along a tracked axis. A unit is an example, or a
  run of consecutive examples that a reshape put into one group (GShard's token groups),
  which is still a unit of micro-batching as long as micro-batches hold whole groups.
  Elementwise ops, reductions over other axes, matmuls with parameters, reshapes,
  transposes, gathers and convolutions keep it.
- `BatchSum`: linear in per-unit terms summed over the batch (a `reduce_sum` or a matmul
  contracting the batch axis); `normalized` once divided by a count proportional to the
  number of units, which makes it a mean. Sums and free scalings of means stay means.
- `NotAMean`: anything else that reaches the loss, with what it is.
- `Untracked`: an op the analysis does not follow (a scatter, a loop, control flow):
  no claim is made, and no warning given.

The loss is analysed at the full batch (its divisors are full-batch counts, and no
micro-batch of one example hides the batch axis) with the split mask of the chosen
number of micro-batches.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import numpy as np

from rockmate.graph import Op, OpGraph


@dataclass(frozen=True)
class Free:
    """Independent of the batch's content; `value`: the number every element holds, if known."""

    value: float | None = None


@dataclass(frozen=True)
class PerExample:
    """Computed one unit of the batch at a time: index i of dimension `axis` belongs to
    unit (i // inner) % units."""

    axis: int
    inner: int
    units: int


@dataclass(frozen=True)
class BatchSum:
    """Linear in per-unit terms summed over `units` units (`count` elements summed in
    all); `normalized` once divided by a count proportional to `units`: a batch mean.
    `op`: where the sum over the batch was taken."""

    units: int
    count: int
    normalized: bool = False
    op: str = field(default="", compare=False)


@dataclass(frozen=True)
class NotAMean:
    """A value that micro-batching changes: `kind` (see FIXES), `detail` in words, `op`
    where it was found."""

    kind: str
    detail: str
    op: str


@dataclass(frozen=True)
class Untracked:
    """The analysis does not follow the batch through `op`; no claim either way."""

    op: str


Value = Union[Free, PerExample, BatchSum, NotAMean, Untracked]


@dataclass(frozen=True)
class LossVerdict:
    """The outcome for one loss: `is_mean` True (a mean of per-example terms, or free of
    the batch), False (micro-batching changes it: `kind`, `detail`, `op`), or None (an op
    the analysis does not follow, `op`)."""

    is_mean: bool | None
    kind: str = ""
    detail: str = ""
    op: str = ""


FIXES = {
    "sum": "Divide it by the batch size (a mean over the batch), and scale the learning rate if the sum's size "
           "was intended.",
    "product": "Compute such a term per example or per group of tokens and average it over the batch (as GShard "
               "averages its load-balancing loss over groups of tokens); micro-batches then hold whole groups.",
    "ratio": "Micro-batches are weighted equally, not by their counts: normalise by a count that does not depend "
             "on the batch's content (e.g. the number of positions), or make every micro-batch hold the same count.",
    "nonlinear": "Apply nonlinear functions to per-example terms before averaging over the batch.",
    "statistic": "Statistics over the batch (batch normalization, in-batch negatives, pairs of examples) see only "
                 "one micro-batch; use per-example normalization (LayerNorm, GroupNorm) or pair examples within "
                 "a micro-batch on purpose.",
    "part": "Use the whole batch in the loss, or cut the batch outside the train step.",
}

_LINEAR_UNARY = frozenset({"neg", "convert_element_type", "copy", "copy_p", "reduce_precision", "stop_gradient",
                           "real", "conj", "sharding_constraint"})
_ELEMENTWISE = _LINEAR_UNARY | frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "integer_pow", "max", "min", "sign", "floor", "ceil",
    "round", "is_finite", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin",
    "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "square", "abs",
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "and",
    "or", "not", "xor", "nextafter", "imag", "complex"})
_FOLD: dict[str, Callable[..., float]] = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b if b else math.nan, "neg": lambda a: -a, "max": max, "min": min,
    "convert_element_type": float, "copy": float, "copy_p": float, "stop_gradient": float,
    "square": lambda a: a * a, "abs": abs, "sqrt": lambda a: math.sqrt(a) if a >= 0 else math.nan,
}
_BATCH_REDUCTIONS = {"reduce_max": "a maximum", "reduce_min": "a minimum", "reduce_prod": "a product",
                     "argmax": "an argmax", "argmin": "an argmin", "reduce_and": "an all()", "reduce_or": "an any()"}
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_STRUCTURAL = frozenset({"reshape", "broadcast_in_dim", "transpose", "squeeze", "rev", "slice", "dynamic_slice",
                         "pad", "concatenate", "split"})


def _where(op: Op) -> str:
    """An op as the warning names it: primitive and source line."""
    return f"{op.name} at {op.source}" if op.source else op.name


def _failure(values: Sequence[Value]) -> Value | None:
    """The first NotAMean among `values`, else the first Untracked, else None."""
    for kind in (NotAMean, Untracked):
        for v in values:
            if isinstance(v, kind):
                return v
    return None


def _literal_value(value: object) -> Free:
    """A Free value for a literal, with its number when every element holds the same one."""
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return Free()
    if a.size and np.all(a == a.flat[0]):
        return Free(float(a.flat[0]))
    return Free()


def _common_unit(values: Sequence[PerExample]) -> PerExample | None:
    """The coarsest unit layout that refines every one of `values` on one axis (values of
    examples and of groups of them may meet; the result is per group), None if they lay
    the batch out differently."""
    axes = {v.axis for v in values}
    tops = {v.inner * v.units for v in values}
    coarsest = max(values, key=lambda v: v.inner)
    if len(axes) != 1 or len(tops) != 1 or any(coarsest.inner % v.inner for v in values):
        return None
    return coarsest


def _scaled(s: BatchSum, divisor: float | None) -> BatchSum:
    """`s` divided by a batch-independent `divisor` (None: unknown): normalized when the
    divisor is units × k with k dividing the elements summed per unit."""
    if s.normalized or divisor is None or not math.isfinite(divisor) or divisor == 0:
        return s
    k = abs(divisor) / s.units
    n = round(k)
    if n >= 1 and abs(k - n) <= 1e-6 * k and (s.count // s.units) % n == 0:
        return BatchSum(s.units, s.count, True, s.op)
    return s


def _add_sums(sums: Sequence[BatchSum], op: Op) -> Value:
    """A sum of batch sums: a sum, or a mean, when all agree."""
    if len({s.units for s in sums}) != 1:
        return Untracked(_where(op))
    if len({s.normalized for s in sums}) != 1:
        return NotAMean("sum", "a sum over the batch, not divided by the batch size, added to a mean", _where(op))
    return BatchSum(sums[0].units, math.gcd(*(s.count for s in sums)), sums[0].normalized, sums[0].op)


def _linear(op: Op, ins: Sequence[Value], sums: Sequence[BatchSum]) -> Value:
    """An elementwise op on batch sums and free values."""
    name = op.name
    if name in ("add", "add_any", "sub") or (name == "select_n" and isinstance(ins[0], Free)):
        return _add_sums(sums, op)
    if name in _LINEAR_UNARY:
        return sums[0]
    if name == "mul":
        if len(sums) > 1:
            return NotAMean("product", "a product of two values reduced over the batch, such as an MoE "
                                       "load-balancing term (the fraction of tokens per expert times the mean "
                                       "router probability)", _where(op))
        factor = next(v for v in ins if isinstance(v, Free)).value
        return _scaled(sums[0], 1.0 / factor if factor else None)
    if name == "div":
        num, den = ins
        if isinstance(den, BatchSum):
            if isinstance(num, BatchSum):
                return NotAMean("ratio", "a ratio of two sums over the batch, such as a masked or weighted mean "
                                         "(sum of loss × mask / sum of mask)", _where(op))
            return NotAMean("nonlinear", "a division by a value reduced over the batch", _where(op))
        return _scaled(num, den.value)
    return NotAMean("nonlinear", f"a nonlinear function ({name}) of a value reduced over the batch", _where(op))


def _elementwise(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """Per-example values stay per example; mixed with batch sums they become batch
    statistics; batch sums alone follow `_linear`; free values fold."""
    if bad := _failure(ins):
        return [bad]
    per = [v for v in ins if isinstance(v, PerExample)]
    sums = [v for v in ins if isinstance(v, BatchSum)]
    if per and sums:
        return [NotAMean("statistic", "per-example values combined with a value reduced over the batch (as batch "
                                      "normalization does)", _where(op))]
    if per:
        return [_common_unit(per) or Untracked(_where(op))]
    if sums:
        return [_linear(op, ins, sums)]
    return [_folded(op, [v.value for v in ins], graph)]


def _folded(op: Op, values: Sequence[float | None], graph: OpGraph) -> Free:
    """An elementwise op on free values: its number, when the inputs' are known and the op
    is simple arithmetic (counts and divisors built from shapes); integers truncate."""
    fold = _FOLD.get(op.name)
    if fold is None or any(v is None for v in values):
        return Free()
    try:
        result = float(fold(*values))
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        return Free()
    if not graph.vars[op.outputs[0]].is_float and math.isfinite(result):
        result = float(math.trunc(result))
    return Free(result)


def _moved(value: Value, axis_map: Callable[[PerExample], Value]) -> Value:
    """A one-operand structural op: the batch axis moves as `axis_map` says; batch sums and
    free values pass through (a selection or layout of them is as linear as they are)."""
    return axis_map(value) if isinstance(value, PerExample) else value


def _reshape_layout(p: PerExample, in_shape: Sequence[int], out_shape: Sequence[int]) -> PerExample | None:
    """Where a reshape puts the batch: a row-major reshape keeps the flat order, so the
    batch index (stride `lo` over `units` values) lands in the output dimension whose
    strides contain it; split over two dimensions, the outer one holds groups of whole
    units (GShard's token groups of several examples), None otherwise."""
    lo = p.inner * math.prod(in_shape[p.axis + 1:])
    hi = lo * p.units
    for j, size in enumerate(out_shape):
        stride = math.prod(out_shape[j + 1:])
        if stride <= lo and hi <= stride * size and lo % stride == 0:
            return PerExample(j, lo // stride, p.units)
        if lo < stride < hi <= stride * size and stride % lo == 0 and hi % stride == 0 and hi // stride > 1:
            return PerExample(j, 1, hi // stride)
    return None


def _shape(graph: OpGraph, v: int) -> tuple[int, ...]:
    """The static shape of var `v`."""
    return graph.vars[v].shape


def _structural(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """Reshapes, broadcasts, transposes, slices, pads, concatenations and splits."""
    name, params = op.name, op.params
    if bad := _failure(ins):
        return [bad] * len(op.outputs)
    x, where = ins[0], _where(op)
    in_shape = _shape(graph, op.inputs[0]) if op.inputs else ()
    out_shape = _shape(graph, op.outputs[0])
    untracked = Untracked(where)
    part = NotAMean("part", "only part of the batch (a slice along it)", where)

    if name == "reshape":
        if params.get("dimensions") is not None:
            return [_moved(x, lambda p: untracked)]
        return [_moved(x, lambda p: _reshape_layout(p, in_shape, out_shape) or untracked)]
    if name == "broadcast_in_dim":
        dims = params["broadcast_dimensions"]
        return [_moved(x, lambda p: PerExample(dims[p.axis], p.inner, p.units)
                       if in_shape[p.axis] == out_shape[dims[p.axis]] else untracked)]
    if name == "transpose":
        perm = tuple(params["permutation"])
        return [_moved(x, lambda p: PerExample(perm.index(p.axis), p.inner, p.units))]
    if name == "squeeze":
        dims = tuple(d % len(in_shape) for d in params["dimensions"])
        return [_moved(x, lambda p: untracked if p.axis in dims else
                       PerExample(p.axis - sum(d < p.axis for d in dims), p.inner, p.units))]
    if name == "rev":
        return [_moved(x, lambda p: untracked if p.axis in params["dimensions"] else p)]
    if name == "slice":
        def sliced(p: PerExample) -> Value:
            a = p.axis
            strides = params.get("strides") or (1,) * len(in_shape)
            whole = params["start_indices"][a] == 0 and params["limit_indices"][a] == in_shape[a] and strides[a] == 1
            return p if whole else part
        return [_moved(x, sliced)]
    if name == "dynamic_slice":
        if any(not isinstance(v, Free) for v in ins[1:]):
            return [untracked]
        return [_moved(x, lambda p: p if params["slice_sizes"][p.axis] == in_shape[p.axis] else part)]
    if name == "pad":
        if isinstance(x, Free):
            return [Free()]         # no longer one number throughout
        return [_moved(x, lambda p: p if tuple(params["padding_config"][p.axis]) == (0, 0, 0) else untracked)]
    if name in ("concatenate", "split"):
        axis = params["dimension"] if name == "concatenate" else params["axis"]
        per = [v for v in ins if isinstance(v, PerExample)]
        sums = [v for v in ins if isinstance(v, BatchSum)]
        if per and (sums or len(set(per)) > 1):
            return [untracked] * len(op.outputs)
        if per and per[0].axis == axis:
            return [part if name == "split" else untracked] * len(op.outputs)
        if sums and name == "concatenate":
            return [_add_sums(sums, op)]
        return [(per or sums or [Free()])[0]] * len(op.outputs)
    raise AssertionError(f"{name} is not a structural op")


def _reduce(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """reduce_* and argmax/argmin over `axes`."""
    x, axes = ins[0], tuple(op.params["axes"])
    in_shape = _shape(graph, op.inputs[0])
    n = math.prod(in_shape[a] for a in axes)
    if isinstance(x, (NotAMean, Untracked)):
        return [x]
    if isinstance(x, Free):
        if op.name == "reduce_sum" and x.value is not None:
            return [Free(x.value * n)]
        return [Free(x.value if op.name in ("reduce_max", "reduce_min") else None)]
    if isinstance(x, BatchSum):
        if op.name == "reduce_sum":
            return [BatchSum(x.units, x.count * n, x.normalized, x.op)]
        return [NotAMean("nonlinear", f"{_BATCH_REDUCTIONS.get(op.name, op.name)} of values reduced over the batch",
                         _where(op))]
    if x.axis not in axes:
        return [PerExample(x.axis - sum(a < x.axis for a in axes), x.inner, x.units)]
    if op.name == "reduce_sum":
        return [BatchSum(x.units, n, op=_where(op))]
    return [NotAMean("nonlinear", f"{_BATCH_REDUCTIONS.get(op.name, op.name)} over the batch", _where(op))]


def _cumulative(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """cumsum and friends: along the batch they mix examples; elsewhere they keep them."""
    x = ins[0]
    if isinstance(x, PerExample) and x.axis == op.params["axis"]:
        return [NotAMean("statistic", f"a cumulative {op.name[3:]} along the batch", _where(op))]
    if isinstance(x, BatchSum) and op.name != "cumsum":
        return [NotAMean("nonlinear", f"a {op.name} of values reduced over the batch", _where(op))]
    return [x]


def _dot_role(axis: int, contract: Sequence[int], batch: Sequence[int], free_offset: int,
              free_dims: Sequence[int]) -> tuple[str, int]:
    """Where operand dimension `axis` goes in a dot_general: ("batch", output dim),
    ("contract", position in the contraction) or ("free", output dim)."""
    if axis in batch:
        return "batch", list(batch).index(axis)
    if axis in contract:
        return "contract", list(contract).index(axis)
    return "free", free_offset + list(free_dims).index(axis)


def _dot_general(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """A matmul keeps the batch where it is a batch or free dimension, sums over it where
    it is contracted (with parameters, or with the same example of another operand), and
    pairs examples otherwise."""
    if bad := _failure(ins):
        return [bad]
    lhs, rhs = ins
    where = _where(op)
    if isinstance(lhs, Free) and isinstance(rhs, Free):
        return [Free()]
    sums = [v for v in ins if isinstance(v, BatchSum)]
    if sums:
        if len(sums) == 2:
            return [NotAMean("product", "a product of two values reduced over the batch", where)]
        if any(isinstance(v, PerExample) for v in ins):
            return [NotAMean("statistic", "per-example values multiplied by a value reduced over the batch", where)]
        return [sums[0]]
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lshape, rshape = _shape(graph, op.inputs[0]), _shape(graph, op.inputs[1])
    lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]
    roles = []
    for v, c, b, offset, free in ((lhs, lc, lb, len(lb), lfree), (rhs, rc, rb, len(lb) + len(lfree), rfree)):
        if isinstance(v, PerExample):
            roles.append((v, _dot_role(v.axis, c, b, offset, free)))
    kinds = {role for _, (role, _) in roles}
    positions = {pos for _, (_, pos) in roles}
    units = _common_unit([PerExample(0, v.inner, v.units) for v, _ in roles])
    if len(roles) == 2 and (len(kinds) != 1 or len(positions) != 1 or "free" in kinds):
        return [NotAMean("statistic", "values of different examples multiplied with each other (a matrix over "
                                      "pairs of examples, as contrastive and in-batch losses build)", where)]
    if units is None:
        return [Untracked(where)]
    role, pos = roles[0][1]
    if role == "contract":
        return [BatchSum(units.units, math.prod(lshape[d] for d in lc), op=where)]
    return [PerExample(pos, units.inner, units.units)]


def _conv(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """A convolution of per-example images with free kernels keeps the batch dimension."""
    if bad := _failure(ins):
        return [bad]
    lhs, rhs = ins
    if isinstance(lhs, Free) and isinstance(rhs, Free):
        return [Free()]
    dn = op.params["dimension_numbers"]
    if (isinstance(lhs, PerExample) and isinstance(rhs, Free) and lhs.axis == dn.lhs_spec[0]
            and op.params.get("batch_group_count", 1) == 1):
        return [PerExample(dn.out_spec[0], lhs.inner, lhs.units)]
    return [Untracked(_where(op))]


def _gather(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """Embedding lookups (free table, per-example indices) and take_along_axis (operand
    and indices batched along their batching dimensions)."""
    if bad := _failure(ins):
        return [bad]
    operand, indices = ins
    where = _where(op)
    if isinstance(operand, Free) and isinstance(indices, Free):
        return [Free()]
    if isinstance(indices, BatchSum) or (isinstance(operand, BatchSum) and isinstance(indices, PerExample)):
        return [Untracked(where)]
    if isinstance(operand, BatchSum):
        return [operand]
    dn = op.params["dimension_numbers"]
    out_ndim = len(_shape(graph, op.outputs[0]))
    idx_ndim = len(_shape(graph, op.inputs[1]))
    batch_out = [d for d in range(out_ndim) if d not in dn.offset_dims]
    placed = []
    if isinstance(indices, PerExample):
        if indices.axis == idx_ndim - 1:
            return [Untracked(where)]
        placed.append(PerExample(batch_out[indices.axis], indices.inner, indices.units))
    if isinstance(operand, PerExample):
        a, shape = operand.axis, _shape(graph, op.inputs[0])
        if a in dn.operand_batching_dims:
            idx_dim = dn.start_indices_batching_dims[list(dn.operand_batching_dims).index(a)]
            placed.append(PerExample(batch_out[idx_dim], operand.inner, operand.units))
        elif a in dn.collapsed_slice_dims or a in dn.start_index_map or op.params["slice_sizes"][a] != shape[a]:
            return [Untracked(where)]
        else:
            kept = [d for d in range(len(shape)) if d not in dn.collapsed_slice_dims
                    and d not in dn.operand_batching_dims]
            placed.append(PerExample(dn.offset_dims[kept.index(a)], operand.inner, operand.units))
    return [_common_unit(placed) or Untracked(where)]


def _reduce_window(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """Pooling: fine when its window neither spans nor strides over the batch axis."""
    x, params = ins[0], op.params
    if isinstance(x, (Free, NotAMean, Untracked)) and all(isinstance(v, Free) for v in ins[1:]):
        return [Free() if isinstance(x, Free) else x]
    if not isinstance(x, PerExample) or any(not isinstance(v, Free) for v in ins[1:]):
        return [Untracked(_where(op))]
    a = x.axis
    alone = (params["window_dimensions"][a] == 1 and params["window_strides"][a] == 1
             and tuple(params["padding"][a]) == (0, 0)
             and all((params.get(k) or (1,) * (a + 1))[a] == 1 for k in ("base_dilation", "window_dilation")))
    return [x if alone else Untracked(_where(op))]


def _join(a: Value, b: Value) -> Value:
    """A loop carry that holds `a` on entry and `b` after an iteration."""
    if a == b:
        return a
    if bad := _failure([a, b]):
        return bad
    if isinstance(a, Free):
        return b
    if isinstance(b, Free):
        return a
    if isinstance(a, BatchSum) and isinstance(b, BatchSum) and a.units == b.units and a.normalized == b.normalized:
        return BatchSum(a.units, math.gcd(a.count, b.count), a.normalized, a.op)
    if isinstance(a, PerExample) and isinstance(b, PerExample):   # a layer that groups examples (GShard)
        return _common_unit([a, b]) or Untracked("scan carry")
    return Untracked("scan carry")


def _scan(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """A scan over layers: the body interpreted until its carry stops changing (a few
    rounds); scanning over the batch axis itself is not followed."""
    nc, ncarry = op.params["num_consts"], op.params["num_carry"]
    consts, carry, xs = list(ins[:nc]), list(ins[nc:nc + ncarry]), list(ins[nc + ncarry:])
    where = _where(op)
    sliced = [(Untracked(where) if v.axis == 0 else PerExample(v.axis - 1, v.inner, v.units))
              if isinstance(v, PerExample) else v for v in xs]
    for _ in range(4):
        outs = interpret(op.body, consts + carry + sliced)
        joined = [_join(c, o) for c, o in zip(carry, outs[:ncarry])]
        if joined == carry:
            break
        carry = joined
    else:
        carry = [Untracked(where)] * ncarry
    ys = [PerExample(v.axis + 1, v.inner, v.units) if isinstance(v, PerExample) else v for v in outs[ncarry:]]
    return carry + ys


def _custom_call(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """custom_jvp / custom_vjp calls, kept whole in a loss graph: their primal body."""
    if op.body is None or len(op.body.invars) != len(ins):
        return _opaque(op, ins, graph)
    return interpret(op.body, list(ins))


def _opaque(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """Any op not modelled: free when its inputs are, else not followed."""
    if bad := _failure(ins):
        return [bad] * len(op.outputs)
    if all(isinstance(v, Free) for v in ins):
        return [Free()] * len(op.outputs)
    return [Untracked(_where(op))] * len(op.outputs)


_RULES: dict[str, Callable[[Op, Sequence[Value], OpGraph], list[Value]]] = {
    "reduce_sum": _reduce, **{name: _reduce for name in _BATCH_REDUCTIONS},
    **{name: _cumulative for name in _CUMULATIVE},
    "dot_general": _dot_general, "conv_general_dilated": _conv, "gather": _gather, "scan": _scan,
    "custom_jvp_call": _custom_call, "custom_vjp_call": _custom_call, "custom_vjp_call_jaxpr": _custom_call,
    "reduce_window_max": _reduce_window, "reduce_window_min": _reduce_window, "reduce_window_sum": _reduce_window,
    "optimization_barrier": lambda op, ins, graph: list(ins),
    **{name: _structural for name in _STRUCTURAL},
}


def transfer(op: Op, ins: Sequence[Value], graph: OpGraph) -> list[Value]:
    """The abstract values of `op`'s outputs from those of its inputs; an op whose params
    a rule does not understand is not followed (a warning-only check never fails a plan)."""
    rule = _elementwise if op.name in _ELEMENTWISE and len(op.outputs) == 1 else _RULES.get(op.name, _opaque)
    try:
        return rule(op, ins, graph)
    except (KeyError, IndexError, ValueError, TypeError, AttributeError):
        return [Untracked(_where(op))] * len(op.outputs)


def interpret(graph: OpGraph, inputs: Sequence[Value]) -> list[Value]:
    """The abstract values of `graph`'s outputs given those of its inputs."""
    env: dict[int, Value] = dict(zip(graph.invars, inputs))

    def read(v: int) -> Value:
        if v in env:
            return env[v]
        return _literal_value(graph.literals[v]) if v in graph.literals else Free()

    for op in graph.ops:
        env.update(zip(op.outputs, transfer(op, [read(v) for v in op.inputs], graph)))
    return [read(v) for v in graph.outvars]


def batch_mean_verdict(loss: OpGraph, split_mask: Sequence[bool]) -> LossVerdict:
    """Whether the scalar `loss` (its first output) is a mean of per-example terms over
    the inputs that `split_mask` marks as split into micro-batches along axis 0."""
    inputs = [PerExample(0, 1, loss.vars[v].shape[0]) if split and loss.vars[v].ndim else Free()
              for v, split in zip(loss.invars, split_mask)]
    out = interpret(loss, inputs)[0]
    if isinstance(out, Free) or (isinstance(out, BatchSum) and out.normalized):
        return LossVerdict(True)
    if isinstance(out, BatchSum):
        return LossVerdict(False, "sum", "a sum over the batch that is not divided by the batch size", out.op)
    if isinstance(out, NotAMean):
        return LossVerdict(False, out.kind, out.detail, out.op)
    return LossVerdict(None, op=out.op if isinstance(out, Untracked) else "")


def warn_if_not_batch_mean(loss: OpGraph, split_mask: Sequence[bool], num_micro_batches: int) -> LossVerdict:
    """Warn when micro-batching changes the loss (see the module docstring); returns the
    verdict. One micro-batch changes nothing, so it is not checked."""
    if num_micro_batches <= 1:
        return LossVerdict(True)
    verdict = batch_mean_verdict(loss, split_mask)
    if verdict.is_mean is False:
        where = f" ({verdict.op})" if verdict.op else ""
        warnings.warn(
            f"autopar: the pipelined loss is not a mean over the batch: it holds {verdict.detail}{where}. The "
            f"pipeline averages the losses and gradients of its {num_micro_batches} micro-batches, which equals "
            f"the full batch only for a mean of per-example terms, so micro-batching changes this loss and its "
            f"gradient. {FIXES[verdict.kind]} With num_micro_batches=1 the loss is computed as written.",
            stacklevel=2)
    return verdict
