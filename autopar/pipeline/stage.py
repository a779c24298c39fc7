"""A pipeline stage: a range of layers on one submesh with the layouts of their ILP
solutions, its per-device cost, and its forward and backward programs.

Forward: each layer's forward ops in order; returns the activations later stages read and
the residuals its backward reads. Backward: each layer's backward ops in reverse order;
adds the parameter gradients into accumulators (in the parameters' layouts) and returns
the cotangents of the stage's input activations. Every planned value carries a sharding
constraint with its layout, so XLA runs the stage as the ILP decided.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from autopar.cluster import LogicalMesh
from autopar.pipeline.layer_cost import LayerCost, per_device_bytes
from autopar.pipeline.layer_graph import LayerGraph
from autopar.resharding import reshard_cost
from autopar.sharding_spec import Collective, DimSharding, replicated, shard_factor, to_partition_spec
from rockmate.graph import OpGraph
from rockmate.graph.evaluate import eval_ops


@dataclass(frozen=True)
class StageCost:
    """Per-device cost of one stage: time of one micro-batch (forward + backward), time
    once per step (the optimizer update), and memory with k micro-batches in flight."""

    micro_batch_s: float
    iteration_s: float = 0.0
    weight_bytes: float = 0.0           # parameters, gradient accumulators, optimizer state
    activation_bytes: float = 0.0       # kept per micro-batch in flight
    working_bytes: float = 0.0          # transient memory of the running program
    update_bytes: float = 0.0           # extra memory while the update runs (its new state)
    forward_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    reshard_s: float = 0.0
    send_s: float = 0.0                 # activations and cotangents to and from other stages
    collectives: tuple[Collective, ...] = ()
    context_bytes: tuple[float, ...] = ()   # token slices: per layer, keys and values kept per micro-batch

    def memory_bytes(self, in_flight: int) -> float:
        return self.weight_bytes + max(in_flight * self.activation_bytes + self.working_bytes, self.update_bytes)

    @property
    def backward_s(self) -> float:
        return self.micro_batch_s - self.forward_s


@dataclass(frozen=True)
class StageLayers:
    """What flows in and out of a range of layers (loss-input positions and loss vars)."""

    layers: tuple[LayerGraph, ...]
    param_inputs: tuple[int, ...]       # in order of first use
    batch_inputs: tuple[int, ...]
    in_acts: tuple[int, ...]            # loss vars produced by earlier stages
    out_acts: tuple[int, ...]           # loss vars read by later stages (last stage: the loss)
    is_last: bool


def stage_layers(layers: Sequence[LayerGraph], all_layers: Sequence[LayerGraph]) -> StageLayers:
    """The interface of a stage made of `layers` within the whole list `all_layers`."""
    mine = {lg.spec.index for lg in layers}
    produced = {v for lg in layers for v in lg.spec.out_acts}
    later = {v for lg in all_layers if lg.spec.index > max(mine) for v in lg.spec.in_acts}
    params = list(dict.fromkeys(i for lg in layers for i in lg.spec.param_inputs))
    batch = list(dict.fromkeys(i for lg in layers for i in lg.spec.batch_inputs))
    in_acts = list(dict.fromkeys(v for lg in layers for v in lg.spec.in_acts if v not in produced))
    last = max(lg.spec.index for lg in all_layers) in mine
    out_acts = list(layers[-1].spec.out_acts) if last else \
        [v for lg in layers for v in lg.spec.out_acts if v in later]
    return StageLayers(tuple(layers), tuple(params), tuple(batch), tuple(in_acts), tuple(dict.fromkeys(out_acts)), last)


def _out_spec(lg: LayerGraph, cost: LayerCost, v: int) -> DimSharding:
    """Layout in which layer `lg` returns its out_act `v`."""
    return cost.out_specs[lg.spec.out_acts.index(v)]


def compose(stage: StageLayers, costs: Sequence[LayerCost], mesh: LogicalMesh, *, state_bytes_per_param_byte: float,
            send_s_per_byte: float, reshard: Callable = reshard_cost, share: float = 1.0,
            context_bytes: Sequence[float] = ()) -> StageCost:
    """The stage's cost from its layers' ILP solutions: their objectives, the reshards
    where one layer hands a value to the next in another layout, a parameter read by
    several layers in different layouts, and the transfers to neighbouring stages.
    `reshard`: `reshard_cost` or a planning run's memo of it (`ShardingCosts.reshard`).
    For token slices: working memory on `share` of the positions (the longest slice's),
    and per layer the bytes per device of the keys and values its attention keeps per
    micro-batch in flight as the later slices' context (`context_bytes`)."""
    ms = mesh.shape
    by_index = {lg.spec.index: (lg, c) for lg, c in zip(stage.layers, costs)}
    producer = {v: lg.spec.index for lg in stage.layers for v in lg.spec.out_acts}
    time_s = sum(c.time_s for c in costs)
    fwd_s = sum(c.forward_s for c in costs)
    compute = sum(c.plan.compute_s for c in costs)
    comm = sum(c.plan.comm_s for c in costs)
    reshard_s = sum(c.plan.reshard_s for c in costs)
    colls = [x for c in costs for x in c.collectives]
    # hand-offs between layers of the stage (forward value, backward cotangent)
    for lg, c in zip(stage.layers, costs):
        for j, v in enumerate(lg.spec.in_acts):
            if v not in producer:
                continue
            src_lg, src_c = by_index[producer[v]]
            have, want = _out_spec(src_lg, src_c, v), c.var_specs.get(lg.act_vars[j], replicated(len(lg.graph.vars[lg.act_vars[j]].shape)))
            spec = lg.graph.vars[lg.act_vars[j]]
            t, cs = reshard(have, want, spec, mesh)
            ct = src_lg.ct_vars[src_lg.spec.out_acts.index(v)]
            if ct is not None:
                t2, cs2 = reshard(want, src_c.var_specs.get(ct, have), spec, mesh)
                t, cs = t + t2, cs + cs2
            reshard_s += t
            time_s += t
            colls.extend(cs)
    # one stored layout per parameter (its first reader's); other readers reshard it
    first: dict[int, DimSharding] = {}
    weight = 0.0
    for lg, c in zip(stage.layers, costs):
        for i, v, nbytes in zip(lg.spec.param_inputs, lg.param_vars, c.param_bytes):
            spec = c.var_specs.get(v) or replicated(lg.graph.vars[v].ndim)
            if i not in first:
                first[i] = spec
                weight += nbytes
            elif first[i] != spec:
                t, cs = reshard(first[i], spec, lg.graph.vars[v], mesh)
                t2, cs2 = reshard(spec, first[i], lg.graph.vars[v], mesh)
                reshard_s += t + t2
                time_s += t + t2
                colls.extend(cs + cs2)
    sent = 0.0
    for v in () if stage.is_last else stage.out_acts:
        lg, c = by_index[producer[v]]
        w = lg.out_vars[lg.spec.out_acts.index(v)]
        sent += per_device_bytes(lg, {w: _out_spec(lg, c, v)}, ms, w)
    send = 2 * sent * send_s_per_byte   # activations out, their cotangents back
    time_s += send
    state = weight * (1.0 + state_bytes_per_param_byte)             # params + optimizer state
    update_s = mesh.memory_s(weight * (3.0 + 2.0 * state_bytes_per_param_byte))  # read p, g, s; write p, s
    return StageCost(micro_batch_s=time_s, iteration_s=update_s, weight_bytes=state + weight,
                     activation_bytes=sum(c.residual_bytes for c in costs) + sum(context_bytes),
                     working_bytes=working_bytes(stage.layers, costs, share, context_bytes),
                     update_bytes=state, forward_s=fwd_s, compute_s=compute, comm_s=comm, reshard_s=reshard_s,
                     send_s=send, collectives=tuple(colls), context_bytes=tuple(context_bytes))


def working_bytes(layers: Sequence[LayerGraph], costs: Sequence[LayerCost], share: float = 1.0,
                  context_bytes: Sequence[float] = ()) -> float:
    """A stage's working memory per device on `share` of the sequence's positions. On a
    token slice each layer's attention also holds its keys and values over the whole
    context and, in the backward, their cotangents (`context_bytes`: the keys and values
    per layer)."""
    context = [2.0 * b if share < 1 else 0.0 for b in context_bytes] or [0.0] * len(costs)
    fwd = [c.forward_working.bytes_at(share) + x for c, x in zip(costs, context)]
    bwd = [c.backward_working.bytes_at(share) + x for c, x in zip(costs, context)]
    working = max(max(fwd), max(bwd))
    if any(lg.remat != "none" for lg in layers):
        # measured on XLA CPU: with the forwards recomputed, the backward program holds
        # every layer's working memory at once (not one layer's at a time)
        working = max(working, sum(bwd))
    return working


# --------------------------------------------------------------------------- programs
@dataclass
class StagePrograms:
    """The forward and backward programs of one stage on its mesh, with the layouts of
    everything that crosses their boundaries."""

    stage: StageLayers
    layouts: tuple[Any, ...]            # per layer: .var_specs and .out_specs (a LayerCost or a saved layout)
    mesh: Mesh
    num_micro_batches: int
    compiler_options: dict | None = None
    forward_compiled: Any = None
    backward_compiled: Any = None
    _forward: Any = field(default=None, repr=False)
    _backward: Any = field(default=None, repr=False)
    kernels: tuple = ()                 # per layer: the ChosenKernels serving its ops (empty: XLA's code)

    # --- layouts ------------------------------------------------------------------
    def _named(self, spec: DimSharding | None, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, to_partition_spec(spec if spec is not None else replicated(ndim)))

    def _first(self, inputs: str, key: int):
        """(layer graph, its layout, index) of the first layer whose spec lists `key` in
        `inputs` ("param_inputs", "batch_inputs", "in_acts" or "out_acts")."""
        for lg, layout in zip(self.stage.layers, self.layouts):
            keys = getattr(lg.spec, inputs)
            if key in keys:
                return lg, layout, keys.index(key)
        raise KeyError(key)

    def _of_var(self, lg: LayerGraph, layout: Any, v: int) -> NamedSharding:
        return self._named(layout.var_specs.get(v), lg.graph.vars[v].ndim)

    def _of_output(self, lg: LayerGraph, layout: Any, position: int) -> NamedSharding:
        return self._named(layout.out_specs[position], lg.graph.vars[lg.graph.outvars[position]].ndim)

    def param_sharding(self, pos: int) -> NamedSharding:
        """Where parameter `pos` (a loss input) lives: its first reader's layout."""
        lg, layout, k = self._first("param_inputs", pos)
        return self._of_var(lg, layout, lg.param_vars[k])

    def batch_sharding(self, pos: int) -> NamedSharding:
        lg, layout, k = self._first("batch_inputs", pos)
        return self._of_var(lg, layout, lg.batch_vars[k])

    def in_act_sharding(self, v: int) -> NamedSharding:
        lg, layout, k = self._first("in_acts", v)
        return self._of_var(lg, layout, lg.act_vars[k])

    def out_act_sharding(self, v: int) -> NamedSharding:
        lg, layout, k = self._first("out_acts", v)
        return self._of_output(lg, layout, k)

    def ct_sharding(self, v: int) -> NamedSharding:
        """Layout the backward takes the cotangent of out_act `v` in."""
        lg, layout, k = self._first("out_acts", v)
        return self._of_var(lg, layout, lg.ct_vars[k])

    def act_grad_sharding(self, v: int) -> NamedSharding:
        lg, layout, k = self._first("in_acts", v)
        return self._of_output(lg, layout, len(lg.spec.out_acts) + len(lg.spec.param_inputs) + sum(lg.float_in[:k]))

    def residual_shardings(self) -> list[NamedSharding]:
        return [self._named(c.var_specs.get(r), lg.graph.vars[r].ndim)
                for lg, c in zip(self.stage.layers, self.layouts) for r in lg.residuals]

    @property
    def float_out_acts(self) -> tuple[int, ...]:
        return tuple(v for v in self.stage.out_acts if self._is_float_loss_var(v))

    @property
    def float_in_acts(self) -> tuple[int, ...]:
        return tuple(v for v in self.stage.in_acts if self._is_float_loss_var(v))

    def _is_float_loss_var(self, v: int) -> bool:
        for lg in self.stage.layers:
            if v in lg.spec.out_acts:
                return lg.float_out[lg.spec.out_acts.index(v)]
            if v in lg.spec.in_acts:
                return lg.float_in[lg.spec.in_acts.index(v)]
        raise KeyError(v)

    # --- the programs --------------------------------------------------------------
    def _hook(self, specs: dict[int, DimSharding]):
        def hook(op, vid, value):
            spec = specs.get(vid)
            if spec is None or not getattr(value, "ndim", 0):
                return value
            return jax.lax.with_sharding_constraint(value, self._named(spec, value.ndim))
        return hook

    def _overrides(self, k: int) -> dict | None:
        """Op index -> tuned kernel call, for the ops of layer `k` kernels serve."""
        from autopar.kernel_choice import overrides

        return (overrides(self.kernels[k], self.mesh) or None) if self.kernels else None

    def _constrain(self, specs: dict[int, DimSharding], v: int, value: Any) -> Any:
        spec = specs.get(v)
        if spec is None or not getattr(value, "ndim", 0):
            return value
        return jax.lax.with_sharding_constraint(value, self._named(spec, value.ndim))

    def forward_fn(self):
        st = self.stage
        B = self.num_micro_batches

        def forward(params, batch, acts, loss_acc):
            loss_env: dict[int, Any] = dict(zip(st.in_acts, acts))
            p = dict(zip(st.param_inputs, params))
            b = dict(zip(st.batch_inputs, batch))
            residuals = []
            for k, (lg, c) in enumerate(zip(st.layers, self.layouts)):
                specs = c.var_specs
                env: dict[int, Any] = {}
                for i, v in zip(lg.spec.param_inputs, lg.param_vars):
                    env[v] = self._constrain(specs, v, p[i])
                for i, v in zip(lg.spec.batch_inputs, lg.batch_vars):
                    env[v] = self._constrain(specs, v, b[i])
                for w, v in zip(lg.spec.in_acts, lg.act_vars):
                    env[v] = self._constrain(specs, v, loss_env[w])
                eval_ops(lg.graph, env, range(lg.num_forward_ops), self._hook(specs), self._overrides(k))
                for k, (w, v) in enumerate(zip(lg.spec.out_acts, lg.out_vars)):
                    val = _read(lg.graph, env, v)
                    loss_env[w] = self._constrain({v: c.out_specs[k]}, v, val)
                residuals.extend(_read(lg.graph, env, r) for r in lg.residuals)
            outs = tuple(loss_env[v] for v in st.out_acts)
            if self.stage.is_last:
                loss_acc = loss_acc + outs[0] / B
            return outs, tuple(residuals), loss_acc
        return forward

    def backward_fn(self):
        st = self.stage
        float_outs = self.float_out_acts

        def backward(params, residuals, cts, grad_acc):
            ct_env: dict[int, Any] = dict(zip(float_outs, cts))
            p = dict(zip(st.param_inputs, params))
            acc = dict(zip(st.param_inputs, grad_acc))
            res = iter(residuals)
            per_layer = [[next(res) for _ in lg.residuals] for lg in st.layers]
            for k, lg, c, rs in reversed(list(zip(range(len(st.layers)), st.layers, self.layouts, per_layer))):
                specs = c.var_specs
                env: dict[int, Any] = dict(zip(lg.residuals, rs))
                for i, v in zip(lg.spec.param_inputs, lg.param_vars):
                    if v in lg.backward_reads_params:
                        env[v] = self._constrain(specs, v, p[i])
                for w, ct in zip(lg.spec.out_acts, lg.ct_vars):
                    if ct is not None:
                        env[ct] = self._constrain(specs, ct, ct_env.pop(w))
                # the layer's backward (a recomputed forward included) waits for its cotangents:
                # otherwise XLA may start every layer's recomputation at once and keep it all
                held = [v for v in (*lg.residuals, *(c for c in lg.ct_vars if c is not None)) if v in env]
                env.update(zip(held, jax.lax.optimization_barrier(tuple(env[v] for v in held))))
                eval_ops(lg.graph, env, range(lg.num_forward_ops, len(lg.graph.ops)), self._hook(specs),
                         self._overrides(k))
                for i, g in zip(lg.spec.param_inputs, lg.param_grad_vars):   # into the accumulator at once
                    acc[i] = acc[i] + _read(lg.graph, env, g).astype(acc[i].dtype)
                for w, g in zip(lg.spec.in_acts, lg.act_grad_vars):
                    if g is not None:
                        val = _read(lg.graph, env, g)
                        ct_env[w] = val if w not in ct_env else ct_env[w] + val
            return tuple(acc[i] for i in st.param_inputs), tuple(ct_env[v] for v in self.float_in_acts)
        return backward

    def shardings(self):
        """(forward in, forward out, backward in, backward out) shardings."""
        st = self.stage
        params = tuple(self.param_sharding(i) for i in st.param_inputs)
        batch = tuple(self.batch_sharding(i) for i in st.batch_inputs)
        acts = tuple(self.in_act_sharding(v) for v in st.in_acts)
        scalar = NamedSharding(self.mesh, to_partition_spec(()))
        residuals = tuple(self.residual_shardings())
        outs = tuple(self.out_act_sharding(v) for v in st.out_acts)
        loss = scalar if self.stage.is_last else ()
        cts = tuple(self.ct_sharding(v) for v in self.float_out_acts)
        act_grads = tuple(self.act_grad_sharding(v) for v in self.float_in_acts)
        return ((params, batch, acts, loss), (outs, residuals, loss),
                (params, residuals, cts, params), (params, act_grads))

    def programs(self):
        """(forward, backward) as jitted functions with their shardings."""
        if self._forward is None:
            f_in, f_out, b_in, b_out = self.shardings()
            self._forward = jax.jit(self.forward_fn(), in_shardings=f_in, out_shardings=f_out)
            self._backward = jax.jit(self.backward_fn(), in_shardings=b_in, out_shardings=b_out, donate_argnums=(3,))
        return self._forward, self._backward

    def forward(self, *args):
        if self.forward_compiled is None:
            self.forward_compiled = self.programs()[0].lower(*args).compile(self.compiler_options)
        return self.forward_compiled(*args)

    def backward(self, *args):
        if self.backward_compiled is None:
            self.backward_compiled = self.programs()[1].lower(*args).compile(self.compiler_options)
        return self.backward_compiled(*args)


def _read(graph: OpGraph, env: dict[int, Any], v: int) -> Any:
    return env[v] if v in env else graph.literals[v]


@dataclass(frozen=True)
class PlacedStage:
    """A planned stage as its programs are built from it: its layers, each layer's layouts
    (a LayerCost, or a saved layout), the indices of its devices among the devices the
    step runs on, and its logical mesh shape."""

    layers: StageLayers
    layouts: tuple[Any, ...]
    device_indices: tuple[int, ...]
    logical_mesh: tuple[int, int]


def stage_programs(stages: Sequence[PlacedStage], devices: Sequence[Any], num_micro_batches: int,
                   kernels: Sequence[tuple] = ()) -> list[StagePrograms]:
    """The programs of planned stages on their devices."""
    from autopar.lower import build_mesh

    return [StagePrograms(st.layers, tuple(st.layouts), build_mesh([devices[i] for i in st.device_indices],
                                                                   st.logical_mesh),
                          num_micro_batches, kernels=kernels[k] if kernels else ())
            for k, st in enumerate(stages)]
