"""Structural identity of ops and graphs: equal for equal programs, whatever the trace.

Params can hold objects made afresh on every trace (the `bwd` and `out_trees` functions
of a `custom_vjp_call`, the callback of a `pure_callback`); hashing them by identity or
by a repr with an address would make two traces of one function differ. Functions are
described by their qualified name, sub-jaxprs by their text, arrays by shape and dtype
(and value when tiny), everything else by its repr with addresses removed.
"""
from __future__ import annotations

import functools
import hashlib
import re
import types
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

from rockmate.graph.op_graph import Op, OpGraph

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")
_SMALL = 16  # arrays up to this many elements are described by value


def param_key(value: Any) -> Hashable:
    """A stable, hashable description of an op parameter (see the module docstring)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(param_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), param_key(v)) for k, v in value.items()))
    if isinstance(value, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        return _ADDRESS.sub("", str(value))
    if isinstance(value, functools.partial):
        return ("partial", param_key(value.func), param_key(value.args), param_key(value.keywords))
    if isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return array_key(value)
    return _ADDRESS.sub("", repr(value))


def array_key(value: Any) -> Hashable:
    """Shape, dtype and (for tiny arrays) the values of an array or scalar literal."""
    shape, dtype = tuple(np.shape(value)), str(getattr(value, "dtype", type(value).__name__))
    if int(np.prod(shape, dtype=np.int64)) > _SMALL:
        return (shape, dtype)
    try:
        return (shape, dtype, np.asarray(value).tobytes())
    except Exception:  # values numpy cannot hold (PRNG key arrays): structure only
        return (shape, dtype)


def op_signature(graph: OpGraph, op: Op) -> str:
    """Primitive, params, operand and result shapes/dtypes, and literal operands of one
    op; no data flow (tandem-repeat finding compares ops of different layers)."""
    ins = [("lit", array_key(graph.literals[i])) if i in graph.literals else graph.vars[i] for i in op.inputs]
    outs = [graph.vars[o] for o in op.outputs]
    params = sorted((k, param_key(v)) for k, v in op.params.items())
    return repr((op.name, params, ins, outs))


def range_signature(graph: OpGraph, start: int, stop: int, op_sigs: Sequence[str] | None = None,
                    producer: Mapping[int, int] | None = None) -> str:
    """Hash of ops [start, stop) with their data flow relative to the range: an operand made
    inside is named by how many ops back its producer is, one from outside as external.
    Equal for identical layers wherever they sit in the program. `op_sigs` (per op of the
    graph) and `producer` (`graph.producer()`) save recomputing them for many ranges."""
    producer = graph.producer() if producer is None else producer
    h = hashlib.sha1()
    for k in range(start, stop):
        op = graph.ops[k]
        refs = []
        for a in op.inputs:
            p = producer.get(a)
            refs.append(f"@{k - p}" if p is not None and p >= start else "ext")
        sig = op_sigs[k] if op_sigs is not None else op_signature(graph, op)
        h.update(f"{sig}|{','.join(refs)};".encode())
    return h.hexdigest()[:16]


def fingerprint(graph: OpGraph) -> str:
    """Hash of the whole graph's structure and data flow (inputs, ops, outputs)."""
    producer = {v: (op.index, j) for op in graph.ops for j, v in enumerate(op.outputs)}
    position = {v: i for i, v in enumerate(graph.invars)}

    def ref(v: int) -> str:
        if v in position:
            return f"in{position[v]}"
        if v in graph.literals:
            return f"lit{array_key(graph.literals[v])}"
        return f"op{producer[v]}"

    h = hashlib.sha1(repr([graph.vars[v] for v in graph.invars]).encode())
    for op in graph.ops:
        h.update(op_signature(graph, op).encode())
        h.update(repr([ref(a) for a in op.inputs]).encode())
    h.update(repr([ref(v) for v in graph.outvars]).encode())
    return h.hexdigest()[:20]
