"""Analytic per-primitive costs: FLOPs and bytes accessed, from shapes alone.

Conventions (documented in docs/graph.md): a multiply-add is 2 FLOPs; every elementwise
op, transcendental ones included (exp, log, tanh, logistic, erf, ...), is 1 FLOP per
output element; a reduction is 1 FLOP per input element; a conv's taps on the holes of an
lhs-dilated input are not counted (see `conv_flops`); data movement (reshape,
transpose, slice, gather, convert, broadcast, ...) is 0 FLOPs. Bytes accessed are the
bytes of all inputs plus all outputs, as if nothing were fused.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rockmate.graph.op_graph import TensorSpec

ELEMENTWISE = frozenset(
    """
    add sub mul div rem max min neg sign floor ceil round abs pow integer_pow square
    sqrt rsqrt cbrt exp exp2 log log1p expm1 tanh logistic sin cos tan asin acos atan
    atan2 sinh cosh asinh acosh atanh erf erfc erf_inv lgamma digamma igamma igammac
    random_gamma_grad bessel_i0e bessel_i1e polygamma zeta regularized_incomplete_beta
    nextafter select_n clamp and or xor not eq ne lt le gt ge is_finite
    shift_left shift_right_logical shift_right_arithmetic population_count clz
    reduce_precision real imag conj complex add_any
    """.split()
)

REDUCTIONS = frozenset(
    """
    reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor
    argmax argmin cumsum cumprod cummax cummin cumlogsumexp reduce reduce_window_sum
    reduce_window_max reduce_window_min reduce_window
    """.split()
)


def dot_general_flops(params: Mapping[str, Any], lhs: TensorSpec, out: TensorSpec) -> float:
    """2 x batch x M x N x K: each output element is a K-long multiply-add."""
    (lhs_contract, _), _ = params["dimension_numbers"]
    k = int(np.prod([lhs.shape[d] for d in lhs_contract], dtype=np.int64))
    return 2.0 * out.size * k


def conv_flops(params: Mapping[str, Any], rhs: TensorSpec, out: TensorSpec) -> float:
    """2 x output elements x (kernel spatial size x input features per group) / lhs dilation.

    An lhs-dilated conv (the input gradient of a strided conv) slides its window over an
    input with holes; taps that land on a hole multiply a zero that no kernel computes, so
    only 1 / prod(lhs_dilation) of the window counts, which makes a strided conv's input
    gradient cost what its forward pass does.
    """
    dn = params["dimension_numbers"]
    out_feature_dim = dn.rhs_spec[0]  # ConvDimensionNumbers: rhs_spec = (O, I, spatial...)
    per_output = rhs.size // max(rhs.shape[out_feature_dim], 1)
    holes = float(np.prod(params.get("lhs_dilation") or (1,)))
    return 2.0 * out.size * per_output / holes


def op_flops(
    name: str, params: Mapping[str, Any], inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> float:
    """FLOPs of one application of primitive `name` (0 for data movement and unknown ops)."""
    if name == "dot_general":
        return dot_general_flops(params, inputs[0], outputs[0])
    if name == "conv_general_dilated":
        return conv_flops(params, inputs[1], outputs[0])
    if name in ELEMENTWISE:
        return float(sum(o.size for o in outputs))
    if name in REDUCTIONS:
        return float(sum(i.size for i in inputs))
    return 0.0


def op_bytes(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> float:
    """Bytes read plus bytes written, unfused."""
    return float(sum(s.nbytes for s in inputs) + sum(s.nbytes for s in outputs))
