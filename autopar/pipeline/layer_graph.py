"""One layer's forward and backward on one micro-batch, traced into one op graph.

The graph is what the intra-op ILP shards and what a stage runs: its first
`num_forward_ops` ops are the forward (run when the micro-batch arrives), the rest the
backward (run when its cotangents come back). Values the backward reads from the forward
are the residuals kept for every micro-batch in flight. A rematerialized layer (its
forward under `jax.checkpoint` or a rockmate schedule) recomputes in the backward part,
so its residuals shrink to what the schedule keeps.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive
from jax.interpreters import mlir

from autopar.pipeline.layers import LayerSpec, is_marker
from rockmate.graph import OpGraph, trace_graph
from rockmate.graph.evaluate import eval_ops

phase_boundary_p = Primitive("autopar_phase_boundary")
phase_boundary_p.multiple_results = True
phase_boundary_p.def_impl(lambda *xs: list(xs))
phase_boundary_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(phase_boundary_p, lambda ctx, *xs: list(xs))


@dataclass(frozen=True)
class LayerGraph:
    """The train graph of one layer and how its inputs and outputs line up.

    Inputs: params (spec.param_inputs order), batch (spec.batch_inputs), float in-acts,
    other in-acts, cotangents of the float out-acts. Outputs: out-acts (spec order), param
    gradients, float in-act gradients."""

    spec: LayerSpec
    graph: OpGraph
    num_forward_ops: int
    float_in: tuple[bool, ...]      # per in_act
    float_out: tuple[bool, ...]     # per out_act
    key: str                        # equal keys: identical graphs (same ILP problem)
    remat: str = "none"

    # --- input and output positions in the train graph -------------------------------
    @property
    def param_vars(self) -> tuple[int, ...]:
        return tuple(self.graph.invars[:len(self.spec.param_inputs)])

    @property
    def batch_vars(self) -> tuple[int, ...]:
        a = len(self.spec.param_inputs)
        return tuple(self.graph.invars[a:a + len(self.spec.batch_inputs)])

    @property
    def act_vars(self) -> tuple[int, ...]:
        """Train-graph var of each in_act (spec order)."""
        a = len(self.spec.param_inputs) + len(self.spec.batch_inputs)
        fl = iter(self.graph.invars[a:a + sum(self.float_in)])
        ot = iter(self.graph.invars[a + sum(self.float_in):a + len(self.float_in)])
        return tuple(next(fl) if f else next(ot) for f in self.float_in)

    @property
    def ct_vars(self) -> tuple[int | None, ...]:
        """Train-graph var of the cotangent of each out_act (None: not float)."""
        cts = iter(self.graph.invars[len(self.graph.invars) - sum(self.float_out):])
        return tuple(next(cts) if f else None for f in self.float_out)

    @property
    def out_vars(self) -> tuple[int, ...]:
        return tuple(self.graph.outvars[:len(self.spec.out_acts)])

    @property
    def param_grad_vars(self) -> tuple[int, ...]:
        a = len(self.spec.out_acts)
        return tuple(self.graph.outvars[a:a + len(self.spec.param_inputs)])

    @property
    def act_grad_vars(self) -> tuple[int | None, ...]:
        """Train-graph var of the gradient of each in_act (None: not float)."""
        g = iter(self.graph.outvars[len(self.spec.out_acts) + len(self.spec.param_inputs):])
        return tuple(next(g) if f else None for f in self.float_in)

    # --- the forward / backward split ------------------------------------------------
    @cached_property
    def residuals(self) -> tuple[int, ...]:
        """Vars the backward reads that the forward produced, or non-parameter inputs
        (batch, activations) it reads: what is kept per micro-batch in flight."""
        fwd_defined = {v for op in self.graph.ops[:self.num_forward_ops] for v in op.outputs}
        keep_inputs = set(self.graph.invars) - set(self.param_vars) - {v for v in self.ct_vars if v is not None}
        out = []
        for op in self.graph.ops[self.num_forward_ops:]:
            for v in op.inputs:
                if (v in fwd_defined or v in keep_inputs) and v not in out:
                    out.append(v)
        for v in self.graph.outvars[len(self.spec.out_acts):]:   # gradients computed in the forward
            if v in fwd_defined and v not in out:
                out.append(v)
        return tuple(out)

    @cached_property
    def residual_nbytes(self) -> float:
        """Unsharded bytes of the residuals (what one micro-batch in flight keeps)."""
        return float(sum(self.graph.vars[v].nbytes for v in self.residuals))

    @cached_property
    def per_position_vars(self) -> frozenset[int]:
        """Vars holding values per token position, which shrink on a token slice: computed
        from the batch, the activations or the cotangents, and not shaped like a parameter
        (up to axis order and unit axes; parameter gradients and their partial sums are
        sums over the positions). A per-position value shaped like a parameter (a [T, d]
        activation beside a [T, d] position table) counts as fixed: an overestimate."""
        g = self.graph

        def shape_key(v: int) -> tuple[int, ...]:
            return tuple(sorted(d for d in g.vars[v].shape if d != 1))

        params = {shape_key(v) for v in self.param_vars}
        reached = {*self.batch_vars, *self.act_vars, *(v for v in self.ct_vars if v is not None)}
        for op in g.ops:
            if any(v in reached for v in op.inputs):
                reached.update(op.outputs)
        return frozenset(v for v in reached if g.vars[v].shape and shape_key(v) not in params)

    @cached_property
    def backward_reads_params(self) -> tuple[int, ...]:
        """Param vars the backward reads (the backward program gets them as inputs)."""
        read = {v for op in self.graph.ops[self.num_forward_ops:] for v in op.inputs}
        read |= set(self.graph.outvars[len(self.spec.out_acts):])
        return tuple(v for v in self.param_vars if v in read)


def _stable(value: Any) -> str:
    """A description of an op parameter that is equal for equal layers (no object ids)."""
    if isinstance(value, (ClosedJaxpr, Jaxpr)):
        return str(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_stable(v) for v in value) + ")"
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__qualname__", type(value).__name__)
    return repr(value)


def content_key(loss: OpGraph, spec: LayerSpec, remat: str = "none") -> str:
    """Digest of a layer's ops, dataflow and input/output shapes: layers with equal keys
    trace to identical train graphs (repeated transformer blocks share one)."""
    where: dict[int, str] = {}
    for k, i in enumerate(spec.param_inputs):
        where[loss.invars[i]] = f"p{k}"
    for k, i in enumerate(spec.batch_inputs):
        where[loss.invars[i]] = f"b{k}"
    for k, v in enumerate(spec.in_acts):
        where[v] = f"a{k}"
    h = hashlib.sha1(remat.encode())
    for name, group in (("p", spec.param_inputs), ("b", spec.batch_inputs)):
        for i in group:
            t = loss.vars[loss.invars[i]]
            h.update(f"{name}{t.shape}{t.dtype};".encode())
    for v in spec.in_acts:
        h.update(f"a{loss.vars[v].shape}{loss.vars[v].dtype};".encode())
    for pos, i in enumerate(spec.ops):
        op = loss.ops[i]
        refs = []
        for v in op.inputs:
            if v in where:
                refs.append(where[v])
            elif v in loss.literals:
                refs.append(f"L{loss.vars[v]}{_stable(loss.literals[v])[:64]}")
            else:
                raise AssertionError(f"layer {spec.index}: op {i} reads var {v} from outside the layer")
        for k, v in enumerate(op.outputs):
            where[v] = f"o{pos}.{k}"
        params = ";".join(f"{k}={_stable(v)}" for k, v in sorted(op.params.items()))
        outs = ",".join(f"{loss.vars[v].shape}{loss.vars[v].dtype}" for v in op.outputs)
        h.update(f"{op.name}|{params}|{','.join(refs)}|{outs}\n".encode())
    h.update(("out:" + ",".join(where[v] for v in spec.out_acts)).encode())
    return h.hexdigest()[:20]


def layer_forward(loss: OpGraph, spec: LayerSpec) -> Callable[..., dict[int, Any]]:
    """`fwd(params, batch, acts) -> {loss var: value}`: the layer's ops evaluated on the
    loss graph (markers are identities)."""
    def fwd(params, batch, acts):
        env: dict[int, Any] = {}
        env.update(zip((loss.invars[i] for i in spec.param_inputs), params))
        env.update(zip((loss.invars[i] for i in spec.batch_inputs), batch))
        env.update(zip(spec.in_acts, acts))
        for i in spec.ops:
            if is_marker(loss, i):
                op = loss.ops[i]
                env.update(zip(op.outputs, (env[v] if v in env else loss.literals[v] for v in op.inputs)))
            else:
                eval_ops(loss, env, (i,))
        return env
    return fwd


def trace_layer(loss: OpGraph, spec: LayerSpec, remat: str = "none",
                transform: Callable[[Callable], Callable] | None = None) -> LayerGraph:
    """Trace the layer's forward + backward (`jax.vjp`) into a LayerGraph.

    remat: "none", "full" (the forward under `jax.checkpoint`: only the layer's inputs
    are kept) or "rockmate" (`rockmate_schedule`); `transform(forward) -> forward`, if
    given with remat "none", rewrites the forward instead."""
    fwd = layer_forward(loss, spec)
    float_in = tuple(loss.vars[v].is_float for v in spec.in_acts)
    float_out = tuple(loss.vars[v].is_float for v in spec.out_acts)

    def outputs(params, batch, acts_f, acts_o):
        fl, ot = iter(acts_f), iter(acts_o)
        env = fwd(params, batch, tuple(next(fl) if f else next(ot) for f in float_in))
        vals = [env[v] if v in env else loss.literals[v] for v in spec.out_acts]
        return (tuple(x for x, f in zip(vals, float_out) if f), tuple(x for x, f in zip(vals, float_out) if not f))

    sds = lambda v: loss.vars[v].abstract()
    args = (tuple(sds(loss.invars[i]) for i in spec.param_inputs),
            tuple(sds(loss.invars[i]) for i in spec.batch_inputs),
            tuple(sds(v) for v, f in zip(spec.in_acts, float_in) if f),
            tuple(sds(v) for v, f in zip(spec.in_acts, float_in) if not f),
            tuple(sds(v) for v, f in zip(spec.out_acts, float_out) if f))
    if remat == "full":
        outputs = jax.checkpoint(outputs, prevent_cse=False)
    elif remat == "rockmate":
        outputs = rockmate_schedule(outputs, args[:4])
    elif transform is not None:
        outputs = transform(outputs)

    def train(params, batch, acts_f, acts_o, cts):
        (out_f, out_o), vjp_fn = _vjp_with_aux(outputs, params, batch, acts_f, acts_o)
        out_f = tuple(phase_boundary_p.bind(*out_f)) if out_f else out_f
        g_params, g_acts = vjp_fn(tuple(cts))
        fl, ot = iter(out_f), iter(out_o)
        return tuple(next(fl) if f else next(ot) for f in float_out), tuple(g_params), tuple(g_acts)

    graph = trace_graph(train, *args)
    marks = [op.index for op in graph.ops if op.primitive is phase_boundary_p]
    num_forward = marks[0] + 1 if marks else len(graph.ops)   # the marker closes the forward
    return LayerGraph(spec, graph, num_forward, float_in, float_out, content_key(loss, spec, remat), remat)


ROCKMATE_BUDGET_SHARE = 0.5   # of the way from rockmate's least temp memory to keeping everything


def rockmate_schedule(forward: Callable, args: tuple) -> Callable:
    """`forward` under rockmate's schedule (block ILP + sequence DP over the blocks it finds
    in the layer) for a temp-memory budget halfway between the least any schedule reaches
    and what keeping every activation takes: the middle of the layer's time-memory curve,
    between no remat and "full". Deterministic, so a saved plan re-traces to the same graph."""
    import rockmate

    least = rockmate.min_budget(forward, *args, calibrate=False)
    keep_all = rockmate.plan_remat(forward, 2 ** 62, *args, calibrate=False).predicted_temp_bytes
    budget = int(least + ROCKMATE_BUDGET_SHARE * max(keep_all - least, 0))
    plan = rockmate.plan_remat(forward, budget, *args, calibrate=False)
    return rockmate.apply_plan(forward, plan, boundary_conds=False)


def _vjp_with_aux(outputs, params, batch, acts_f, acts_o):
    """vjp of the float outputs with respect to params and float acts; the other outputs
    come along as aux."""
    def f(p, af):
        out_f, out_o = outputs(p, batch, af, acts_o)
        return out_f, out_o
    out_f, vjp_fn, out_o = jax.vjp(f, params, acts_f, has_aux=True)
    return (out_f, out_o), vjp_fn
