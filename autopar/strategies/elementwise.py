"""Elementwise ops: the result may take any valid layout; same-shape operands follow it,
rank-0 operands stay whole and literals are ignored."""
from __future__ import annotations

from typing import Any

from rockmate.graph.op_graph import Op, TensorSpec
from autopar.sharding_spec import Strategy
from autopar.strategies.layouts import candidate_specs, make_strategy, mesh_shape_of

ELEMENTWISE_PRIMITIVES = frozenset("""
add add_any sub mul div rem pow integer_pow max min neg exp exp2 expm1 log log1p tanh logistic
erf erfc erf_inv rsqrt sqrt cbrt square abs sign floor ceil round is_finite nextafter atan2
sin cos tan asin acos atan sinh cosh asinh acosh atanh lgamma digamma igamma igammac
igamma_grad_a random_gamma_grad bessel_i0e bessel_i1e regularized_incomplete_beta polygamma zeta
select_n clamp convert_element_type bitcast_convert_type reduce_precision copy copy_p
eq ne lt le gt ge and or not xor shift_left shift_right_logical shift_right_arithmetic
population_count clz real imag conj complex stop_gradient device_put sharding_constraint
threefry2x32 imag real
""".split())

UNARY_FOLLOWERS = frozenset("""
neg exp exp2 expm1 log log1p tanh logistic erf erfc erf_inv rsqrt sqrt cbrt square abs sign
floor ceil round is_finite sin cos tan asin acos atan sinh cosh asinh acosh atanh lgamma
digamma integer_pow convert_element_type bitcast_convert_type reduce_precision copy copy_p
not population_count clz real imag conj stop_gradient device_put sharding_constraint
""".split())


def elementwise_strategies(op: Op, ins: tuple[TensorSpec | None, ...], outs: tuple[TensorSpec, ...],
                           mesh: Any) -> list[Strategy]:
    ms = mesh_shape_of(mesh)
    out = outs[0]
    flops = float(op.flops) if op.flops else float(out.size)
    result = []
    for spec in candidate_specs(out.shape, ms):
        in_specs = [_operand_spec(t, out, spec) for t in ins]
        out_specs = [_operand_spec(o, out, spec) or () for o in outs]
        result.append(make_strategy(mesh, ins, outs, in_specs, out_specs, flops))
    return result


def _operand_spec(t: TensorSpec | None, out: TensorSpec, spec):
    """An operand of the result's shape follows it; rank-0 stays whole; other shapes
    (broadcast-compatible size-1 dims) keep only splits where the sizes agree."""
    if t is None:
        return None
    if t.shape == out.shape:
        return spec
    if len(t.shape) != len(out.shape):
        return tuple(() for _ in t.shape)
    return tuple(axes if n == m else () for axes, n, m in zip(spec, t.shape, out.shape))
