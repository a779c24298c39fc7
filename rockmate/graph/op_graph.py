"""The op graph: a flat, evaluable list of primitive ops traced from a train step.

Every value is a numbered variable with a static shape and dtype. Ops keep the jaxpr
primitive and params so that the lowering can re-bind them one by one (and insert
sharding constraints between them). A `scan` over layers stays one op whose `body` is
a graph of its own, planned once.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@functools.lru_cache(maxsize=None)
def jax_dtype(dtype: str) -> Any:
    """The dtype object of a dtype name, PRNG key dtypes ("key<fry>") included."""
    import jax
    import jax.numpy as jnp  # bfloat16 is only known to numpy through ml_dtypes

    try:
        return jnp.dtype(dtype)
    except TypeError:
        pass
    for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
        key_dtype = jax.random.key(0, impl=impl).dtype
        if str(key_dtype) == dtype:
            return key_dtype
    raise TypeError(f"unknown dtype {dtype!r}: not a numpy dtype or a known PRNG key dtype")


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name; a PRNG key holds its implementation's key data
    (threefry: 2 x uint32 = 8 bytes)."""
    return jax_dtype(dtype).itemsize


@functools.lru_cache(maxsize=None)
def _is_float(dtype: str) -> bool:
    import jax.numpy as jnp

    try:
        return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.inexact))
    except TypeError:  # extended dtypes (PRNG keys), tokens
        return False


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one value."""

    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32", "bfloat16", "int32", "bool"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_float(self) -> bool:
        """A floating (or complex) array: one that can carry a gradient."""
        return _is_float(self.dtype)

    def abstract(self) -> Any:
        """A `jax.ShapeDtypeStruct` of this value (to trace or lower without data)."""
        import jax

        return jax.ShapeDtypeStruct(self.shape, jax_dtype(self.dtype))


@dataclass
class Op:
    """One primitive application.

    `inputs`/`outputs` are variable ids into `OpGraph.vars`. An input id may name a
    literal, whose value is in `OpGraph.literals`. `primitive` is the jax Primitive
    object (bindable); `name` its string name. For `scan`, `body` is the body graph and
    `trip_count` the number of iterations; `flops`/`bytes_accessed` already include the
    trip count. `mark` is the occurrence number (1, 2, ...) of the outermost inlined jit
    call whose name starts with the prefix given to `trace_graph(mark_calls=...)` that
    the op came from (None outside such calls), e.g. the layer calls a user marked.
    """

    index: int
    name: str
    primitive: Any
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: dict[str, Any]
    flops: float = 0.0
    bytes_accessed: float = 0.0
    source: str = ""
    body: "OpGraph | None" = None
    trip_count: int = 1
    mark: int | None = None


@dataclass
class OpGraph:
    """A traced function as flat ops over numbered variables."""

    vars: dict[int, TensorSpec]
    ops: list[Op]
    invars: list[int]            # flattened function arguments, in order
    outvars: list[int]           # flattened function outputs, in order (may repeat, may be invars or literals)
    literals: dict[int, Any] = field(default_factory=dict)  # var id -> python/numpy scalar or array
    in_tree: Any = None          # pytree structure of the (args, kwargs) that were traced
    out_tree: Any = None         # pytree structure of the outputs
    # marked calls (`trace_graph(mark_calls=...)`): mark -> (input var ids, output var ids)
    call_io: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)

    def producer(self) -> dict[int, int]:
        """Map var id -> index of the op that produces it."""
        return {v: op.index for op in self.ops for v in op.outputs}

    def consumers(self) -> dict[int, list[int]]:
        """Map var id -> indices of the ops that read it (in op order)."""
        out: dict[int, list[int]] = {}
        for op in self.ops:
            for v in op.inputs:
                out.setdefault(v, []).append(op.index)
        return out

    @property
    def total_flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    def flops_by_name(self) -> dict[str, float]:
        """Total FLOPs per primitive name, looking inside scan bodies (times their trip count)."""
        out: dict[str, float] = {}
        for op in self.ops:
            if op.body is not None:
                for name, flops in op.body.flops_by_name().items():
                    out[name] = out.get(name, 0.0) + flops * op.trip_count
            else:
                out[op.name] = out.get(op.name, 0.0) + op.flops
        return out

    def op_names(self) -> set[str]:
        """Names of all primitives in the graph, scan bodies included."""
        names = {op.name for op in self.ops}
        for op in self.ops:
            if op.body is not None:
                names |= op.body.op_names()
        return names
