"""Find the loss of a train step's gradient call while the step is traced.

The pipeline runtime and the remat planner need the loss function, not only its
gradient. Two ways lead to it:

- `jax.value_and_grad` / `jax.grad`, and everything built on them (`nnx.value_and_grad`,
  `eqx.filter_value_and_grad`, `optax` helpers), all call `jax._src.api.vjp` from
  `value_and_grad_f`. While `capture_grads()` or `transform_losses()` is active that module
  global is swapped for a wrapper that sees the loss and its arguments; nothing changes
  outside these contexts, and a `jax.vjp` / `jax.jacrev` called by the user is left alone.
- `autopar.value_and_grad` / `autopar.grad`, the explicit marker for steps that compute
  their gradient another way.

Under `capture_grads()` each gradient call becomes one opaque `autopar_pipeline_grad`
equation whose `call_id` names the recorded loss, so the runtime can cut the loss into
stages and run its backward pass per stage. The loss is recorded as a jaxpr whose leading
inputs are the values it closes over (a batch captured by `lambda p: loss(p, batch)`, or
the non-differentiated arguments that `jax.value_and_grad` binds into the loss): they
become inputs of the equation, so the runtime can split them into micro-batches like
explicit arguments.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jax
from jax._src import api as jax_api
from jax._src import core as jax_core
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
        with _jax_vjp_hooked():
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
        with _jax_vjp_hooked():
            yield
    finally:
        _state.loss_transform = previous


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    """Neither record nor transform: gradient calls inside a loss being traced are part of
    that loss (a gradient penalty), not the step's gradient."""
    saved = (_calls(), getattr(_state, "stop", False), getattr(_state, "loss_transform", None))
    _state.calls, _state.stop, _state.loss_transform = None, False, None
    try:
        yield
    finally:
        _state.calls, _state.stop, _state.loss_transform = saved


_jax_vjp = jax_api.vjp
_hook_lock = threading.Lock()
_hook_depth = 0


def _hooked_vjp(fun, *primals, has_aux: bool = False, **kwargs):
    """`jax._src.api.vjp` as `value_and_grad_f` sees it inside our contexts."""
    caller = sys._getframe(1)
    active = _calls() is not None or getattr(_state, "loss_transform", None) is not None
    if (not active or kwargs or caller.f_code.co_name != "value_and_grad_f"
            or caller.f_globals.get("__name__") != jax_api.__name__):
        return _jax_vjp(fun, *primals, has_aux=has_aux, **kwargs)
    nums = tuple(range(len(primals)))
    loss, grads, *aux = _gradient_call(fun, primals, nums, single=False, has_aux=has_aux,
                                       api="jax.value_and_grad")
    # value_and_grad_f calls this with a cotangent of one, by construction
    return (loss, lambda ct: grads, *aux)


@contextlib.contextmanager
def _jax_vjp_hooked() -> Iterator[None]:
    global _hook_depth
    with _hook_lock:
        if _hook_depth == 0:
            jax_api.vjp = _hooked_vjp
        _hook_depth += 1
    try:
        yield
    finally:
        with _hook_lock:
            _hook_depth -= 1
            if _hook_depth == 0:
                jax_api.vjp = _jax_vjp


def _abstract_eval(*avals, call_id: int):
    return list(_calls()[call_id].out_avals)


pipeline_grad_p.def_abstract_eval(_abstract_eval)


def _impl(*args, call_id: int):
    raise RuntimeError(
        "autopar_pipeline_grad can only be run by the PipeshardParallel runtime; "
        "call the train step through autopar.parallelize(..., method=PipeshardParallel(...))."
    )


pipeline_grad_p.def_impl(_impl)


def _gradient_call(fun: Callable[..., Any], args: tuple, nums: tuple[int, ...], single: bool,
                   has_aux: bool, api: str) -> tuple:
    """(loss, grads[, aux]) of `fun(*args)` with respect to `args[nums]`, inside an active
    context: recorded as one `autopar_pipeline_grad` equation, or differentiated through the
    loss transform. `grads` is a tuple over `nums` (or one tree when `single`).

    With `has_aux` the auxiliary outputs are computed beside the gradient call, at the full
    batch, from the loss's own inputs: they equal what one device computes, and the loss
    that is pipelined or rematerialized is the scalar alone."""
    for n in nums:
        if not 0 <= n < len(args):
            raise ValueError(f"argnums {nums} out of range for {len(args)} arguments")
    calls, transform = _calls(), getattr(_state, "loss_transform", None)
    if calls is None and not has_aux:
        with _suspended():
            new_fun = transform(fun, args)
        return _differentiate(new_fun, args, nums, single)
    leaves, tree = jax.tree_util.tree_flatten(args)
    with _suspended():
        closed, out_shape = jax.make_jaxpr(lambda *l: fun(*jax.tree_util.tree_unflatten(tree, l)),
                                           return_shape=True)(*leaves)
    loss_shape = out_shape[0] if has_aux else out_shape
    if getattr(loss_shape, "shape", None) != ():
        raise ValueError(f"{api}: the loss function must return a scalar"
                         f"{' as the first element of its (loss, aux) pair' if has_aux else ''}; it returned {loss_shape}")
    consts = list(closed.consts)
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    n_out = len(jaxpr.outvars)
    loss_jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] + [False] * (n_out - 1), instantiate=True)
    aux = []
    if has_aux:
        aux_jaxpr, _ = pe.dce_jaxpr(jaxpr, [False] + [True] * (n_out - 1), instantiate=True)
        _warn_if_aux_recomputes(aux_jaxpr, loss_jaxpr, api)
        if not getattr(_state, "stop", False):
            aux_leaves = jax_core.eval_jaxpr(aux_jaxpr, [], *consts, *leaves)
            aux = [jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape[1]), aux_leaves)]
    if calls is None:
        with _suspended():
            new_fun = transform(lambda *a: fun(*a)[0], args)
        return (*_differentiate(new_fun, args, nums, single), *aux)
    mask = []
    for i, a in enumerate(args):
        mask += [i in nums] * len(jax.tree_util.tree_leaves(a))
    diff_args = [args[n] for n in nums]
    grads_shape = diff_args[0] if single else tuple(diff_args)
    g_leaves, g_tree = jax.tree_util.tree_flatten(grads_shape)
    to_aval = lambda s: jax.core.ShapedArray(jax.numpy.shape(s), jax.numpy.result_type(s))
    call = GradCall(fun, nums, tree, len(leaves), (False,) * len(consts) + tuple(mask), g_tree,
                    (closed.out_avals[0], *(to_aval(s) for s in g_leaves)), single,
                    loss_jaxpr, len(consts))
    calls.append(call)
    if getattr(_state, "stop", False):
        raise LossCaptured()
    out = pipeline_grad_p.bind(*consts, *leaves, call_id=len(calls) - 1)
    return (out[0], jax.tree_util.tree_unflatten(g_tree, out[1:]), *aux)


_HEAVY = {"dot_general", "conv_general_dilated"}


def _warn_if_aux_recomputes(aux_jaxpr, loss_jaxpr, api: str) -> None:
    """Auxiliary outputs built from the model's activations (logits, accuracy) repeat the
    loss's own matmuls beside the gradient call; say so, since it costs a forward pass."""
    def heavy(e) -> int:
        return (e.primitive.name in _HEAVY) + sum(heavy(q) for sub in jax_core.jaxprs_in_params(e.params)
                                                  for q in sub.eqns)

    in_loss = {id(v) for e in loss_jaxpr.eqns for v in e.outvars}
    repeated = sum(heavy(e) for e in aux_jaxpr.eqns if any(id(v) in in_loss for v in e.outvars))
    if repeated:
        warnings.warn(
            f"autopar: the auxiliary outputs of {api}(..., has_aux=True) repeat {repeated} matmul/convolution "
            f"equation(s) of the loss; they are recomputed at the full batch beside the "
            f"pipelined (or rematerialized) gradient. Return only cheap values (parameters, counters, the "
            f"inputs) as aux, or compute metrics outside the train step, to avoid the extra forward work.",
            stacklevel=4)


def _differentiate(fun: Callable[..., Any], args: tuple, nums: tuple[int, ...], single: bool) -> tuple:
    """(loss, grads) of `fun(*args)` by jax itself, the step's gradient call suspended."""
    with _suspended():
        loss, grads = jax.value_and_grad(lambda *d: fun(*_with(args, nums, d)), argnums=tuple(range(len(nums))))(
            *(args[n] for n in nums))
    return loss, grads[0] if single else grads


def _with(args: tuple, nums: tuple[int, ...], diff: tuple) -> tuple:
    """`args` with the entries at `nums` replaced by `diff`, in order."""
    out = list(args)
    for n, d in zip(nums, diff):
        out[n] = d
    return tuple(out)


def value_and_grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0,
                   has_aux: bool = False) -> Callable[..., tuple[Any, Any]]:
    """`jax.value_and_grad` that marks the loss explicitly for pipelines and remat.

    `jax.value_and_grad` is found in a traced step too; this marker is for steps whose
    gradient call the tracer cannot see."""
    jax_fn = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)

    def wrapped(*args):
        if _calls() is None and getattr(_state, "loss_transform", None) is None:
            return jax_fn(*args)
        loss, grads, *aux = _gradient_call(fun, args, nums, single, has_aux, api="autopar.value_and_grad")
        return ((loss, *aux) if has_aux else loss), grads

    return wrapped


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0,
         has_aux: bool = False) -> Callable[..., Any]:
    """Like `jax.grad`; inside `PipeshardParallel` the loss is pipelined."""
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux)
    return lambda *args: vg(*args)[1]
