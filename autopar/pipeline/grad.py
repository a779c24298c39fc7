"""`value_and_grad` / `grad` that a pipeline runtime can see inside a traced train step.

Outside `PipeshardParallel` they are `jax.value_and_grad` / `jax.grad`. While the
pipeline runtime traces a step (`capture_grads()`), each call becomes one opaque
`autopar_pipeline_grad` equation whose `call_id` names the recorded loss, so the runtime
can cut the loss into stages and run its backward pass per stage. The loss is recorded as
a jaxpr whose leading inputs are the values it closes over (a batch captured by a
`lambda p: loss(p, batch)` is such a value): they become inputs of the equation, so the
runtime can split them into micro-batches like explicit arguments.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jax
from jax._src.interpreters import partial_eval as pe
from jax.extend.core import Primitive

pipeline_grad_p = Primitive("autopar_pipeline_grad")
pipeline_grad_p.multiple_results = True


@dataclass(frozen=True)
class GradCall:
    """One recorded `value_and_grad(loss_fn)(*args)` call inside a traced step.

    The equation's inputs are the loss's closed-over values (`num_consts` of them), then
    the flattened args; `loss_jaxpr` computes the scalar loss from exactly these inputs."""

    loss_fn: Callable[..., Any]
    argnums: tuple[int, ...]
    args_tree: Any                  # treedef of the positional args tuple
    num_args_leaves: int
    diff_leaf_mask: tuple[bool, ...]  # per equation input (consts, then arg leaves): differentiated?
    grads_tree: Any                 # treedef of the gradient output (matches argnums)
    out_avals: tuple[Any, ...]      # (loss, *grad leaves)
    single_argnum: bool
    loss_jaxpr: Any = None          # open Jaxpr: (consts..., arg leaves...) -> loss
    num_consts: int = 0


_state = threading.local()


def _calls() -> list[GradCall] | None:
    return getattr(_state, "calls", None)


class LossCaptured(Exception):
    """Raised by a gradient call under `capture_grads(stop=True)` once it is recorded."""


@contextlib.contextmanager
def capture_grads(stop: bool = False) -> Iterator[list[GradCall]]:
    """While active, `value_and_grad` calls are recorded instead of differentiated. With
    `stop`, the first call raises `LossCaptured` after recording (tracing the rest of the
    step is not needed to get its loss)."""
    previous, previous_stop = _calls(), getattr(_state, "stop", False)
    _state.calls, _state.stop = [], stop
    try:
        yield _state.calls
    finally:
        _state.calls, _state.stop = previous, previous_stop


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
        closed = jax.make_jaxpr(lambda *l: fun(*jax.tree_util.tree_unflatten(tree, l)))(*leaves)
        loss_aval = closed.out_avals[0]
        if getattr(loss_aval, "shape", None) != ():
            raise ValueError(f"the loss function must return a scalar; it returned {loss_aval}")
        diff_args = [args[n] for n in nums]
        grads_shape = diff_args[0] if single else tuple(diff_args)
        g_leaves, g_tree = jax.tree_util.tree_flatten(grads_shape)
        to_aval = lambda s: jax.core.ShapedArray(jax.numpy.shape(s), jax.numpy.result_type(s))
        consts = list(closed.consts)
        call = GradCall(fun, nums, tree, len(leaves), (False,) * len(consts) + tuple(mask), g_tree,
                        (loss_aval, *(to_aval(s) for s in g_leaves)), single,
                        pe.convert_constvars_jaxpr(closed.jaxpr), len(consts))
        calls.append(call)
        if getattr(_state, "stop", False):
            raise LossCaptured()
        out = pipeline_grad_p.bind(*consts, *leaves, call_id=len(calls) - 1)
        return out[0], jax.tree_util.tree_unflatten(g_tree, out[1:])

    return wrapped


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0,
         has_aux: bool = False) -> Callable[..., Any]:
    """Like `jax.grad`; inside `PipeshardParallel` the loss is pipelined."""
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux)
    return lambda *args: vg(*args)[1]
