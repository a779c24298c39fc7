"""`value_and_grad` / `grad` that a pipeline runtime can see inside a traced train step.

Outside `PipeshardParallel` they are `jax.value_and_grad` / `jax.grad`. While the
pipeline runtime traces a step (`capture_grads()`), each call becomes one opaque
`autopar_pipeline_grad` equation whose `call_id` names the recorded loss function, so
the runtime can cut the loss into stages and run its backward pass per stage.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jax
from jax.extend.core import Primitive

pipeline_grad_p = Primitive("autopar_pipeline_grad")
pipeline_grad_p.multiple_results = True


@dataclass(frozen=True)
class GradCall:
    """One recorded `value_and_grad(loss_fn)(*args)` call inside a traced step."""

    loss_fn: Callable[..., Any]
    argnums: tuple[int, ...]
    args_tree: Any                  # treedef of the positional args tuple
    num_args_leaves: int
    diff_leaf_mask: tuple[bool, ...]  # per flattened arg leaf: is it differentiated?
    grads_tree: Any                 # treedef of the gradient output (matches argnums)
    out_avals: tuple[Any, ...]      # (loss, *grad leaves)
    single_argnum: bool


_state = threading.local()


def _calls() -> list[GradCall] | None:
    return getattr(_state, "calls", None)


@contextlib.contextmanager
def capture_grads() -> Iterator[list[GradCall]]:
    """While active, `value_and_grad` calls are recorded instead of differentiated."""
    previous = _calls()
    _state.calls = []
    try:
        yield _state.calls
    finally:
        _state.calls = previous


@contextlib.contextmanager
def transform_losses(transform: Callable[[Callable, tuple], Callable]) -> Iterator[None]:
    """While active, `value_and_grad(loss_fn)(*args)` differentiates `transform(loss_fn, args)`
    instead (used by `parallelize(remat=...)` to put a rockmate schedule on the loss)."""
    previous = getattr(_state, "loss_transform", None)
    _state.loss_transform = transform
    try:
        yield
    finally:
        _state.loss_transform = previous


def _abstract_eval(*avals, call_id: int):
    return list(_calls()[call_id].out_avals)


pipeline_grad_p.def_abstract_eval(_abstract_eval)


def _impl(*args, call_id: int):
    raise RuntimeError(
        "autopar_pipeline_grad can only be run by the PipeshardParallel runtime; "
        "call the train step through autopar.parallelize(..., method=PipeshardParallel(...))."
    )


pipeline_grad_p.def_impl(_impl)


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0,
                   has_aux: bool = False) -> Callable[..., tuple[Any, Any]]:
    """Like `jax.value_and_grad`; inside `PipeshardParallel` the loss is pipelined."""
    jax_fn = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)

    def wrapped(*args):
        calls = _calls()
        if calls is None:
            transform = getattr(_state, "loss_transform", None)
            if transform is not None:
                return jax.value_and_grad(transform(fun, args), argnums=argnums, has_aux=has_aux)(*args)
            return jax_fn(*args)
        if has_aux:
            raise NotImplementedError(
                "autopar.value_and_grad(..., has_aux=True) is not supported inside "
                "PipeshardParallel yet; return only the scalar loss from the loss function.")
        for n in nums:
            if not 0 <= n < len(args):
                raise ValueError(f"argnums {nums} out of range for {len(args)} arguments")
        leaves, tree = jax.tree_util.tree_flatten(args)
        mask = []
        for i, a in enumerate(args):
            mask += [i in nums] * len(jax.tree_util.tree_leaves(a))
        loss_shape, grads_shape = jax.eval_shape(jax_fn, *args)
        if getattr(loss_shape, "shape", None) != ():
            raise ValueError(f"the loss function must return a scalar; it returned {loss_shape}")
        g_leaves, g_tree = jax.tree_util.tree_flatten(grads_shape)
        to_aval = lambda s: jax.core.ShapedArray(s.shape, s.dtype)
        call = GradCall(fun, nums, tree, len(leaves), tuple(mask), g_tree,
                        tuple(to_aval(s) for s in [loss_shape, *g_leaves]), single)
        calls.append(call)
        out = pipeline_grad_p.bind(*leaves, call_id=len(calls) - 1)
        return out[0], jax.tree_util.tree_unflatten(g_tree, out[1:])

    return wrapped


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0,
         has_aux: bool = False) -> Callable[..., Any]:
    """Like `jax.grad`; inside `PipeshardParallel` the loss is pipelined."""
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux)
    return lambda *args: vg(*args)[1]
