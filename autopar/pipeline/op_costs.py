"""FLOPs and bytes of jaxpr equations, for layer clustering and the default stage cost.

A small roofline view of one equation: dot_general/conv FLOPs exactly, one FLOP per
output element for everything else; nested jaxprs (pjit, custom_jvp/vjp, remat) summed.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from jax.extend import core as jcore


def aval_bytes(aval: Any) -> int:
    """Bytes of one abstract value (0 for tokens and other non-arrays)."""
    shape = getattr(aval, "shape", None)
    if shape is None:
        return 0
    try:
        itemsize = np.dtype(aval.dtype).itemsize
    except TypeError:                       # extended dtypes, e.g. PRNG keys
        itemsize = getattr(aval.dtype, "itemsize", 8)
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def _size(aval: Any) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def eqn_flops(eqn: Any) -> float:
    """Forward FLOPs of one equation."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        contracted = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64)) if lc else 1
        return 2.0 * _size(eqn.outvars[0].aval) * contracted
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        per_out = int(np.prod(rhs.shape, dtype=np.int64)) // max(rhs.shape[0], 1)
        return 2.0 * _size(eqn.outvars[0].aval) * per_out
    subs = [j.jaxpr if hasattr(j, "jaxpr") else j for j in jcore.jaxprs_in_params(eqn.params)]
    if subs:
        inner = sum(eqn_flops(e) for j in subs for e in j.eqns)
        trips = eqn.params.get("length", 1) if name == "scan" else 1
        return float(inner * trips)
    return float(sum(_size(v.aval) for v in eqn.outvars))


def eqn_output_bytes(eqn: Any) -> int:
    """Bytes of the values an equation produces (what a backward pass may keep)."""
    return sum(aval_bytes(v.aval) for v in eqn.outvars)
