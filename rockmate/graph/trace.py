"""Trace a function into an OpGraph: jaxpr on abstract inputs, call primitives inlined.

`trace_graph` runs `jax.make_jaxpr` (no FLOPs spent), numbers every jaxpr variable,
inlines nested jit/pjit, custom_jvp/custom_vjp, checkpoint/remat and closed_call/core_call
bodies, and keeps each `scan` as one op whose `body` is a graph of its own. A graph that
will be differentiated after tracing (a loss cut into pipeline stages, a function rockmate
reschedules) keeps custom_jvp/custom_vjp calls whole (`keep_custom_rules=True`), so that
their rules still apply: inlining the primal body would differentiate it instead.
`mark_calls="prefix"` tags the ops of each inlined jit call whose name starts with
`prefix` with that call's occurrence number (`op.mark`), so a planner can tell calls of
one marked function apart after inlining (rockmate's user-marked blocks).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore

from jax._src.lax.lax import optimization_barrier_p

from rockmate.graph.flops import op_bytes, op_flops
from rockmate.graph.op_graph import Op, OpGraph, TensorSpec

# Primitive name -> param holding the body that is inlined in place of the call.
INLINED = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",  # jax 0.10: the primal body; fwd/bwd stay unused
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}
CUSTOM_RULES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def trace_graph(fun: Callable[..., Any], *args: Any, keep_custom_rules: bool = False,
                mark_calls: str | None = None, **kwargs: Any) -> OpGraph:
    """Trace `fun(*args, **kwargs)` abstractly into a flat OpGraph.

    Leaves of `args`/`kwargs` may be arrays or `jax.ShapeDtypeStruct`s. `in_tree` is the
    treedef of `(args, kwargs)` and `out_tree` that of the output. `keep_custom_rules`:
    custom_jvp/custom_vjp calls stay one op; `mark_calls`: a jit name prefix whose calls
    set `op.mark` (see the module docstring).
    """
    flat_args, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        if not (hasattr(leaf, "shape") or isinstance(leaf, (bool, int, float, complex))):
            raise TypeError(
                f"trace_graph: argument leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, "
                "not an array; bind non-array arguments with functools.partial before tracing."
            )
    out_tree_box: list[Any] = []

    def flat_fun(*leaves: Any) -> list[Any]:
        call_args, call_kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        out_leaves, out_tree = jax.tree_util.tree_flatten(fun(*call_args, **call_kwargs))
        out_tree_box.append(out_tree)
        return out_leaves

    closed = jax.make_jaxpr(flat_fun)(*flat_args)
    graph = graph_from_jaxpr(closed, keep_custom_rules=keep_custom_rules, mark_calls=mark_calls)
    graph.in_tree = in_tree
    graph.out_tree = out_tree_box[0]
    return graph


def graph_from_jaxpr(closed_jaxpr: Any, keep_custom_rules: bool = False, mark_calls: str | None = None) -> OpGraph:
    """Turn a ClosedJaxpr (or open Jaxpr) into an OpGraph with its own var numbering."""
    builder = _Builder(keep_custom_rules, mark_calls)
    jaxpr, consts = _open(closed_jaxpr)
    invars = [builder.new_var(v) for v in jaxpr.invars]
    outvars = builder.emit(jaxpr, consts, invars)
    return OpGraph(vars=builder.vars, ops=builder.ops, invars=invars, outvars=outvars, literals=builder.literals,
                   call_io=builder.call_io)


def _open(j: Any) -> tuple[Any, Sequence[Any]]:
    """(jaxpr, consts) of a ClosedJaxpr or a plain Jaxpr."""
    return (j.jaxpr, j.consts) if isinstance(j, jcore.ClosedJaxpr) else (j, ())


def _sub_jaxprs(params: dict[str, Any]) -> list[Any]:
    """The (closed or open) jaxprs among an eqn's params, e.g. cond branches, while bodies."""
    vals = [x for v in params.values() for x in (v if isinstance(v, (tuple, list)) else (v,))]
    return [v for v in vals if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr))]


def _spec(aval: Any) -> TensorSpec:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        name = type(aval).__name__  # e.g. AbstractToken
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)  # extended dtypes such as key<fry>
    return TensorSpec(tuple(int(d) for d in getattr(aval, "shape", ())), name)


def _source(eqn: Any) -> str:
    """file:line of the innermost user frame outside installed libraries; best effort."""
    try:
        frames = list(source_info_util.user_frames(eqn.source_info.traceback))
        mine = [f for f in frames if "-packages" not in f.file_name] or frames
        return f"{mine[0].file_name}:{mine[0].start_line}" if mine else ""
    except Exception:  # source info is a debugging aid; never fail a trace over it
        return ""


class _Builder:
    """Accumulates vars, literals and ops while walking (possibly nested) jaxprs."""

    def __init__(self, keep_custom_rules: bool = False, mark_calls: str | None = None) -> None:
        self.keep_custom_rules = keep_custom_rules
        self.mark_calls = mark_calls
        self.marks = 0     # marked calls seen so far
        self.mark = None   # occurrence number of the marked call being inlined
        self.vars: dict[int, TensorSpec] = {}
        self.literals: dict[int, Any] = {}
        self.ops: list[Op] = []
        self.env: dict[Any, int] = {}
        self.call_io: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def new_var(self, v: Any) -> int:
        vid = len(self.vars)
        self.vars[vid] = _spec(v.aval)
        if not isinstance(v, jcore.DropVar):
            self.env[v] = vid
        return vid

    def new_literal(self, aval: Any, value: Any) -> int:
        vid = len(self.vars)
        self.vars[vid] = _spec(aval)
        self.literals[vid] = value
        return vid

    def read(self, v: Any) -> int:
        if isinstance(v, jcore.Literal):
            return self.new_literal(v.aval, v.val)
        return self.env[v]

    def emit(self, jaxpr: Any, consts: Sequence[Any], in_ids: Sequence[int]) -> list[int]:
        """Add the eqns of `jaxpr` with invars bound to `in_ids`; return its outvar ids."""
        if len(consts) == len(jaxpr.constvars):
            for v, c in zip(jaxpr.constvars, consts):
                self.env[v] = self.new_literal(v.aval, c)
        else:  # an open jaxpr with free constvars (cost-only sub-bodies): values unknown
            for v in jaxpr.constvars:
                self.new_var(v)
        for v, vid in zip(jaxpr.invars, in_ids):
            self.env[v] = vid
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            inputs = [self.read(v) for v in eqn.invars]
            if name in INLINED and INLINED[name] in eqn.params and not (
                    self.keep_custom_rules and name in CUSTOM_RULES):
                inner, inner_consts = _open(eqn.params[INLINED[name]])
                if name in ("remat2", "checkpoint") and eqn.params.get("prevent_cse", False):
                    inputs = self._barrier(inputs)
                outer_mark = self.mark
                if (self.mark is None and self.mark_calls is not None
                        and str(eqn.params.get("name", "")).startswith(self.mark_calls)):
                    self.marks += 1
                    self.mark = self.marks
                outs = self.emit(inner, inner_consts, inputs)
                if self.mark is not None and outer_mark is None:
                    self.call_io[self.mark] = (tuple(inputs), tuple(outs))
                self.mark = outer_mark
                for outer, vid in zip(eqn.outvars, outs):
                    if not isinstance(outer, jcore.DropVar):
                        self.env[outer] = vid  # the call's output is the body's output
                continue
            outputs = [self.new_var(v) for v in eqn.outvars]
            self.ops.append(self._op(eqn, inputs, outputs))
        return [self.read(v) for v in jaxpr.outvars]

    def _barrier(self, inputs: list[int]) -> list[int]:
        """Keep a checkpointed region's recomputation from being merged with the forward
        pass (what jax.checkpoint's prevent_cse does): route its inputs through one
        optimization_barrier op, which the planner treats as per-operand identity."""
        live = [i for i in inputs if i not in self.literals]
        if not live:
            return inputs
        outs = []
        for i in live:
            vid = len(self.vars)
            self.vars[vid] = self.vars[i]
            outs.append(vid)
        specs = [self.vars[i] for i in live]
        self.ops.append(Op(index=len(self.ops), name="optimization_barrier", primitive=optimization_barrier_p,
                           inputs=tuple(live), outputs=tuple(outs), params={}, flops=0.0,
                           bytes_accessed=op_bytes(specs, specs), source="", mark=self.mark))
        renamed = dict(zip(live, outs))
        return [renamed.get(i, i) for i in inputs]

    def _op(self, eqn: Any, inputs: list[int], outputs: list[int]) -> Op:
        name = eqn.primitive.name
        in_specs = [self.vars[i] for i in inputs]
        out_specs = [self.vars[o] for o in outputs]
        body, trip_count = None, 1
        if name == "scan":
            body = graph_from_jaxpr(eqn.params["jaxpr"], self.keep_custom_rules)
            trip_count = int(eqn.params["length"])
            flops, nbytes = body.total_flops * trip_count, _total_bytes(body) * trip_count
        elif name in CUSTOM_RULES:  # kept whole: costs are its primal body's
            body = graph_from_jaxpr(eqn.params[INLINED[name]], self.keep_custom_rules)
            flops, nbytes = body.total_flops, _total_bytes(body)
        elif subs := _sub_jaxprs(eqn.params):
            # while/cond/other control flow: one op; cost = the costliest sub-body, run once
            graphs = [graph_from_jaxpr(s) for s in subs]
            if name == "while":  # cond and body both run (once, as counted here)
                flops, nbytes = sum(g.total_flops for g in graphs), sum(_total_bytes(g) for g in graphs)
            else:
                flops, nbytes = max(g.total_flops for g in graphs), max(_total_bytes(g) for g in graphs)
        else:
            flops, nbytes = op_flops(name, eqn.params, in_specs, out_specs), op_bytes(in_specs, out_specs)
        return Op(
            index=len(self.ops), name=name, primitive=eqn.primitive, inputs=tuple(inputs),
            outputs=tuple(outputs), params=dict(eqn.params), flops=flops, bytes_accessed=nbytes,
            source=_source(eqn), body=body, trip_count=trip_count, mark=self.mark,
        )


def _total_bytes(graph: OpGraph) -> float:
    return float(sum(op.bytes_accessed for op in graph.ops))
