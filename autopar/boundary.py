"""`mark_stage_boundary`: a no-op marker in the traced program where a pipeline may cut.

Outside a pipeline it does nothing (identity on its arguments, lowered to nothing).
`PipeshardParallel` finds the markers in the traced loss and cuts layers there.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

stage_boundary_p = Primitive("autopar_stage_boundary")
stage_boundary_p.multiple_results = True
stage_boundary_p.def_impl(lambda *xs: list(xs))
stage_boundary_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(stage_boundary_p, lambda ctx, *xs: list(xs))


def _boundary_jvp(primals, tangents):
    return stage_boundary_p.bind(*primals), list(tangents)


ad.primitive_jvps[stage_boundary_p] = _boundary_jvp
batching.primitive_batchers[stage_boundary_p] = lambda xs, dims: (stage_boundary_p.bind(*xs), dims)


def mark_stage_boundary(*values: Any) -> Any:
    """Mark a place where a pipeline stage may end; returns its arguments unchanged.

    Call it with no arguments between layers (`autopar.mark_stage_boundary()`), or pass
    the values that cross the cut (`x = autopar.mark_stage_boundary(x)`).
    """
    leaves, tree = jax.tree_util.tree_flatten(values)
    out = stage_boundary_p.bind(*leaves)
    result = jax.tree_util.tree_unflatten(tree, out)
    if len(values) == 0:
        return None
    return result[0] if len(values) == 1 else result


def is_stage_boundary(eqn: Any) -> bool:
    """True if a jaxpr equation is a `mark_stage_boundary` marker."""
    return eqn.primitive is stage_boundary_p
