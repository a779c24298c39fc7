"""Measured memory of one block, from XLA's own buffer assignment.

The analytic model knows which values a block keeps and recomputes, but not how much
scratch XLA's fusions and schedule add around them. Compiling the block alone, lowered
exactly as the schedule lowers it, and reading `memory_analysis().temp_size_in_bytes`
gives its forward working memory and, per option, the peak of its forward+backward.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterable

import jax
import numpy as np

from .blocks import Block, abstract, block_io
from .graph.evaluate import eval_ops
from .graph.op_graph import OpGraph
from .lowering import block_function, named_outputs


def _block_fn(program: OpGraph, start: int, stop: int, names=None):
    ins, outs = block_io(program, start, stop)

    def fn(*vals):
        env = dict(zip(ins, vals))
        eval_ops(program, env, range(start, stop), named_outputs(program, names))
        return tuple(env[o] for o in outs)
    return fn, ins, outs


# Calibration compiles only need XLA's buffer assignment, which LLVM's optimisation level
# does not change (same temp bytes measured on GPT and ResNet blocks; ~35 % faster).
_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0}
_TEMP_CACHE: dict[str, int] = {}


def temp_bytes(lowered) -> int:
    """XLA's temp bytes of a lowered program, memoised on its text (identical blocks of
    another function, or a re-trace of the same one, compile once)."""
    key = hashlib.sha1(lowered.as_text().encode()).hexdigest()
    if key not in _TEMP_CACHE:
        if len(_TEMP_CACHE) > 4096:
            _TEMP_CACHE.clear()
        compiled = lowered.compile(compiler_options=_COMPILE_OPTIONS)
        _TEMP_CACHE[key] = int(compiled.memory_analysis().temp_size_in_bytes)
    return _TEMP_CACHE[key]


def measured_forward(program: OpGraph, start: int, stop: int) -> int | None:
    """Temp bytes of the block's forward alone (inputs and outputs excluded)."""
    fn, ins, outs = _block_fn(program, start, stop)
    if not outs:
        return None
    try:
        return temp_bytes(jax.jit(fn).lower(*[abstract(program, v) for v in ins]))
    except Exception:  # e.g. a block that cannot be compiled alone
        return None


def measured_option(program: OpGraph, blk: Block, option) -> int | None:
    """Temp bytes of one block's forward+backward, lowered exactly as the schedule runs it
    with `option` (see `lowering.block_function`; a scan block whole, its loops included).
    Inputs, output cotangents and input cotangents are arguments/outputs, not temp."""
    fn, ins, outs = block_function(program, blk, option)
    if not outs or not ins:
        return None
    float_out = [program.vars[v].is_float for v in outs]

    def fwd_bwd(vals, cts):
        _, vjp_fn = jax.vjp(fn, *vals)
        it = iter(cts)
        full = tuple(next(it) if f else jax.numpy.zeros(program.vars[v].shape, jax.dtypes.float0)
                     for v, f in zip(outs, float_out))
        return vjp_fn(full)

    try:
        cts = [abstract(program, v) for v, f in zip(outs, float_out) if f]
        return temp_bytes(jax.jit(fwd_bwd).lower([abstract(program, v) for v in ins], cts))
    except Exception:  # integer-only or otherwise non-differentiable block
        return None


def program_temp_bytes(fn: Callable, args: tuple) -> int:
    """XLA's temp bytes of the compiled forward+backward of `fn(*args)`: `jax.grad` in the
    first argument for a scalar output (how a memory budget is defined), a VJP in every
    argument otherwise."""
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jax.numpy.result_type(a)), args)
    out = jax.eval_shape(fn, *specs)
    if isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and jax.numpy.issubdtype(out.dtype, jax.numpy.floating):
        return temp_bytes(jax.jit(jax.grad(fn)).lower(*specs))

    def ones(y):
        if jax.numpy.issubdtype(y.dtype, jax.numpy.inexact):
            return jax.numpy.ones_like(y)
        return np.zeros(y.shape, jax.dtypes.float0)

    def fwd_bwd(*a):
        y, vjp_fn = jax.vjp(fn, *a)
        return vjp_fn(jax.tree.map(ones, y))
    return temp_bytes(jax.jit(fwd_bwd).lower(*specs))


def saved_bytes(program: OpGraph, start: int, stop: int, kept: Iterable[int]) -> int | None:
    """Bytes JAX actually saves between forward and backward when the block runs with
    `kept` (local op indices) saved by name (block inputs excluded)."""
    names = {start + i: f"cal_{start + i}" for i in kept}
    fn, ins, outs = _block_fn(program, start, stop, names)
    if not outs:
        return None
    policy = jax.checkpoint_policies.save_only_these_names(*names.values())
    total = []

    def probe(*vals):
        _, vjp_fn = jax.vjp(jax.checkpoint(fn, policy=policy), *vals)
        total.append(sum(int(l.size) * l.dtype.itemsize for l in jax.tree.leaves(vjp_fn)
                         if not any(l is v for v in vals)))
        return 0

    try:
        jax.make_jaxpr(probe)(*[abstract(program, v) for v in ins])
    except Exception:  # non-differentiable block
        return None
    return total[0]
