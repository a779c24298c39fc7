"""JAX front end: a jaxpr flattened into a numbered op list that rockmate can cut, cost and re-run.

Nested `jit` calls are inlined (so identical layers look identical), calls made through
`rockmate.block` are tagged with the block they belong to, and everything else (scan,
custom_jvp/vjp, cond, remat) stays one opaque op that is re-bound unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import jax
from jax.extend import core as jcore

BLOCK_PREFIX = "rockmate_block"
_INLINED = ("jit", "pjit", "closed_call", "core_call")


@dataclass(frozen=True)
class Lit:
    """A literal operand of an op (a Python scalar or small constant)."""

    val: Any


@dataclass(frozen=True)
class FlatOp:
    """One primitive application: operand value ids (or `Lit`), result value ids."""

    prim: Any
    params: Mapping[str, Any]
    in_ids: tuple
    out_ids: tuple[int, ...]
    marker: int | None  # occurrence id of the enclosing rockmate.block call, if any


@dataclass(frozen=True)
class FlatProgram:
    """A flattened jaxpr: avals of every value, inputs, constants, ops and outputs."""

    avals: tuple  # value id -> ShapedArray
    invars: tuple[int, ...]
    consts: Mapping[int, Any] = field(hash=False)
    ops: tuple[FlatOp, ...]
    outvars: tuple  # value ids or Lit

    def value_bytes(self, vid: int) -> int:
        return aval_bytes(self.avals[vid])


def aval_bytes(aval) -> int:
    """Bytes of an array value (0 for tokens and other non-arrays)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        return 0
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def is_float(aval) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.inexact)


def flatten(closed: jcore.ClosedJaxpr) -> FlatProgram:
    """Flatten a closed jaxpr, inlining nested jit calls and tagging rockmate.block calls."""
    avals: list = []
    consts: dict[int, Any] = {}
    ops: list[FlatOp] = []
    marker_count = [0]

    def new_id(aval) -> int:
        avals.append(aval)
        return len(avals) - 1

    def walk(jaxpr, env: dict, marker: int | None) -> None:
        def read(v):
            if isinstance(v, jcore.Literal):
                return Lit(v.val)
            return env[v]

        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in _INLINED and "jaxpr" in eqn.params or name == "closed_call":
                inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
                inner_closed = inner if isinstance(inner, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(inner, ())
                inner_env: dict = {}
                for cv, c in zip(inner_closed.jaxpr.constvars, inner_closed.consts):
                    cid = new_id(cv.aval)
                    consts[cid] = c
                    inner_env[cv] = cid
                args = [read(v) for v in eqn.invars]
                for iv, a in zip(inner_closed.jaxpr.invars, args):
                    if isinstance(a, Lit):
                        cid = new_id(iv.aval)
                        consts[cid] = a.val
                        a = cid
                    inner_env[iv] = a
                inner_marker = marker
                if marker is None and str(eqn.params.get("name", "")).startswith(BLOCK_PREFIX):
                    marker_count[0] += 1
                    inner_marker = marker_count[0]
                walk(inner_closed.jaxpr, inner_env, inner_marker)
                for ov, iv in zip(eqn.outvars, inner_closed.jaxpr.outvars):
                    r = read_inner(inner_env, iv)
                    if isinstance(r, Lit):
                        cid = new_id(ov.aval)
                        consts[cid] = r.val
                        r = cid
                    env[ov] = r
                continue
            in_ids = tuple(read(v) for v in eqn.invars)
            out_ids = tuple(new_id(v.aval) for v in eqn.outvars)
            for v, i in zip(eqn.outvars, out_ids):
                env[v] = i
            ops.append(FlatOp(eqn.primitive, dict(eqn.params), in_ids, out_ids, marker))

    def read_inner(env, v):
        if isinstance(v, jcore.Literal):
            return Lit(v.val)
        return env[v]

    jaxpr = closed.jaxpr
    env: dict = {}
    for cv, c in zip(jaxpr.constvars, closed.consts):
        cid = new_id(cv.aval)
        consts[cid] = c
        env[cv] = cid
    invars = tuple(new_id(v.aval) for v in jaxpr.invars)
    for v, i in zip(jaxpr.invars, invars):
        env[v] = i
    walk(jaxpr, env, None)
    outvars = tuple(read_inner(env, v) for v in jaxpr.outvars)
    return FlatProgram(tuple(avals), invars, consts, tuple(ops), outvars)


def eval_ops(program: FlatProgram, start: int, stop: int, env: dict,
             names: Mapping[int, str] | None = None) -> None:
    """Evaluate ops [start, stop) in order, reading and writing `env` (value id -> array).

    `names` maps an op index to a checkpoint name attached to its floating outputs.
    """
    from jax.ad_checkpoint import checkpoint_name

    names = names or {}
    for k in range(start, stop):
        op = program.ops[k]
        invals = [lookup(program, env, a) for a in op.in_ids]
        out = op.prim.bind(*invals, **op.prim.get_bind_params(op.params))
        outs = out if op.prim.multiple_results else [out]
        name = names.get(k)
        for vid, val in zip(op.out_ids, outs):
            if name is not None and is_float(program.avals[vid]):
                val = checkpoint_name(val, name)
            env[vid] = val


def lookup(program: FlatProgram, env: dict, vid) -> Any:
    """The value of an operand: from env, a constant, or a literal."""
    if isinstance(vid, Lit):
        return vid.val
    if vid in env:
        return env[vid]
    return program.consts[vid]
