"""Per-op cost estimates: roofline time (or a measured profile), backward time, and which
values an op's backward pass reads (its residuals). FLOPs and bytes are the op graph's
(`rockmate/graph/flops.py`), the project's one counter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .graph.op_graph import Op, OpGraph

# Default roofline machine: a 2-core CPU (measured: 512^3 fp32 matmul in XLA ~ 73 GFLOP/s).
PEAK_FLOPS_PER_S = 7.0e10
MEMORY_BW_BYTES_PER_S = 1.0e10
OP_OVERHEAD_S = 2.0e-7

# Backward reads nothing from the forward (linear, shape ops).
_NEEDS_NOTHING = {
    "add", "sub", "neg", "add_any", "reshape", "squeeze", "expand_dims", "broadcast_in_dim",
    "transpose", "reduce_sum", "convert_element_type", "slice", "concatenate", "pad", "copy",
    "copy_p", "rev", "cumsum", "stop_gradient", "reduce_precision", "real", "imag", "conj",
    "optimization_barrier",
}
# Backward reads only the op's own output.
_NEEDS_OUTPUT = {"exp", "tanh", "logistic", "sqrt", "exp2"}
# Non-differentiable or integer-valued ops: backward reads nothing.
_NON_DIFF = {
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "iota", "argmax", "argmin",
    "floor", "ceil", "round", "sign", "shift_left", "shift_right_logical", "random_bits",
    "random_wrap", "random_unwrap", "random_seed", "threefry2x32", "is_finite",
}
# Ops XLA keeps as separate kernels (their operands and results are materialized buffers).
_HEAVY = {
    "dot_general", "conv_general_dilated", "reduce_max", "reduce_min", "reduce_sum", "argmax",
    "argmin", "cumsum", "cumlogsumexp", "cummax", "sort", "gather", "scatter", "scatter-add",
    "scatter_add", "scan", "while", "cond", "custom_jvp_call", "custom_vjp_call",
    "custom_vjp_call_jaxpr", "remat", "checkpoint", "reduce_window_sum", "reduce_window_max",
    "select_and_scatter_add", "fft", "dynamic_slice", "dynamic_update_slice", "concatenate",
    "transpose",
}


@dataclass(frozen=True)
class OpCost:
    """Estimated cost of one forward op and of its part of the backward pass."""

    flops: float
    bytes_accessed: float
    time_s: float
    bwd_time_s: float
    needs_inputs: bool  # backward reads the op's array operands
    needs_output: bool  # backward reads the op's result


def op_key(graph: OpGraph, op: Op) -> str:
    """A profile key: primitive plus operand and result shapes/dtypes."""
    def sig(ids):
        return ",".join("lit" if i in graph.literals else f"{graph.vars[i].dtype}{list(graph.vars[i].shape)}"
                        for i in ids)
    return f"{op.name}({sig(op.inputs)})->({sig(op.outputs)})"


def op_cost(graph: OpGraph, op: Op, profile: Mapping[str, float] | None = None) -> OpCost:
    """Roofline (or profiled) time of `op` from the graph's FLOPs and bytes, its backward
    time and its residual needs."""
    name = op.name
    flops, nbytes = op.flops, op.bytes_accessed
    time_s = max(flops / PEAK_FLOPS_PER_S, nbytes / MEMORY_BW_BYTES_PER_S) + OP_OVERHEAD_S
    if profile is not None:
        time_s = float(profile.get(op_key(graph, op), time_s))
    if name in _NON_DIFF:
        return OpCost(flops, nbytes, time_s, 0.0, False, False)
    if name in _NEEDS_NOTHING:
        return OpCost(flops, nbytes, time_s, time_s, False, False)
    if name in _NEEDS_OUTPUT:
        return OpCost(flops, nbytes, time_s, time_s, False, True)
    if name in ("dot_general", "conv_general_dilated", "mul", "div"):
        return OpCost(flops, nbytes, time_s, 2.0 * time_s, True, False)
    if name in ("scan", "while", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
                "remat", "checkpoint", "cond"):
        return OpCost(flops, nbytes, time_s, 2.0 * time_s, True, True)
    # max/min, log, pow, integer_pow, rsqrt, erf, select_n, reduce_max, ...
    return OpCost(flops, nbytes, time_s, time_s, True, name in ("rsqrt", "reduce_max", "reduce_min"))


def is_heavy(op: Op) -> bool:
    """Whether XLA keeps this op as its own kernel (not fused into neighbours)."""
    return op.name in _HEAVY
