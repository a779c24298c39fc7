"""A pipeline decision as a Plan (typed, saveable), and a saved Plan back on a freshly
traced step (checked against it) without planning again."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax

from autopar.cluster import Cluster
from autopar.pipeline.layer_cost import LayerCost
from autopar.pipeline.layer_graph import LayerGraph
from autopar.pipeline.planner import PipelineDecision, PipelinePlanner, StageDecision
from autopar.pipeline.schedule import simulate, stage_orders
from autopar.pipeline.stage import stage_layers
from autopar.pipeline.trace import TracedStep
from autopar.plan import (LayerLayout, PipelinePlan, PipelineSearch, Plan, PlanFileError, StagePlan, StageRemat,
                          TensorPlan, TimelineTask)
from autopar.planner import RECORDED_PRIMITIVES
from autopar.sharding_spec import AXIS_NAMES, DimSharding, is_valid, shard_factor


def _names(spec: DimSharding) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(AXIS_NAMES[a] for a in axes) for axes in spec)


def _axes(names, where: str) -> DimSharding:
    ax = {n: i for i, n in enumerate(AXIS_NAMES)}
    try:
        return tuple(tuple(ax[a] for a in axes) for axes in names)
    except KeyError as e:
        raise PlanFileError(f"{where}: unknown mesh axis {e.args[0]!r}; the plan's meshes have axes {AXIS_NAMES}") from None


def loss_input_names(traced: TracedStep) -> list[str]:
    """Readable names of the loss inputs: the step argument a parameter is, or the
    closed-over value / loss argument it is."""
    step = traced.step
    by_var: dict[int, str] = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(step.in_tree, list(range(len(step.invars)))))
    for path, k in flat:
        by_var[step.invars[k]] = "args" + jax.tree_util.keystr(path[1:]) if path else f"input {k}"
    g = step.ops[traced.grad_op]
    call = traced.call
    arg_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(call.args_tree, [0] * call.num_args_leaves))[0]]
    names = []
    for k, v in enumerate(g.inputs):
        if v in by_var:
            names.append(by_var[v])
        elif k < call.num_consts:
            names.append(f"closure[{k}]")
        else:
            names.append(f"loss arg{arg_paths[k - call.num_consts]}")
    return names


def _layer_layout(lg: LayerGraph, cost: LayerCost) -> LayerLayout:
    specs = cost.var_specs
    return LayerLayout(index=lg.spec.index, key=lg.key, remat=lg.remat,
                       var_specs=tuple(_names(specs[v]) if v in specs else None for v in range(len(lg.graph.vars))),
                       out_specs=tuple(_names(s) for s in cost.plan.out_specs), predicted_time_s=cost.time_s)


def _stage_plan(d: StageDecision, traced: TracedStep, names: list[str], device_ids: Sequence[int]) -> StagePlan:
    loss, st, cost = traced.loss, d.layers, d.cost
    ms = d.logical_mesh

    def tp(name: str, spec_of, shape, dtype, **kw) -> TensorPlan:
        return TensorPlan(name, tuple(shape), dtype, _names(spec_of), **kw)

    inputs, outputs, mids = [], [], []
    for lg, c in zip(st.layers, d.costs):
        for i, v in zip(lg.spec.param_inputs, lg.param_vars):
            if i in st.param_inputs and not any(t.name == names[i] for t in inputs):
                inputs.append(tp(names[i], c.var_specs.get(v, ()), lg.graph.vars[v].shape, lg.graph.vars[v].dtype))
        for i, v in zip(lg.spec.batch_inputs, lg.batch_vars):
            if not any(t.name == names[i] for t in inputs):
                inputs.append(tp(names[i], c.var_specs.get(v, ()), lg.graph.vars[v].shape, lg.graph.vars[v].dtype))
        for w, v in zip(lg.spec.in_acts, lg.act_vars):
            if w in st.in_acts:
                inputs.append(tp(f"activation %{w} (layer {lg.spec.index})", c.var_specs.get(v, ()),
                                 lg.graph.vars[v].shape, lg.graph.vars[v].dtype))
        for k, (w, v) in enumerate(zip(lg.spec.out_acts, lg.out_vars)):
            if w in st.out_acts:
                outputs.append(tp("loss" if st.is_last else f"activation %{w} (layer {lg.spec.index})",
                                  c.plan.out_specs[k], lg.graph.vars[v].shape, lg.graph.vars[v].dtype))
        for op in lg.graph.ops:
            if op.name in RECORDED_PRIMITIVES:
                for k, v in enumerate(op.outputs):
                    if v in c.var_specs and lg.graph.vars[v].ndim:
                        phase = "fwd" if op.index < lg.num_forward_ops else "bwd"
                        name = f"layer {lg.spec.index} {phase} {op.name} {c.plan.op_strategies.get(op.index, '')}".strip()
                        mids.append(tp(name, c.var_specs[v], lg.graph.vars[v].shape, lg.graph.vars[v].dtype,
                                       op=op.index, output=k))
    by_kind: dict[str, float] = {}
    for x in cost.collectives:
        by_kind[x.kind] = by_kind.get(x.kind, 0.0) + x.nbytes
    return StagePlan(
        mesh_shape=ms, axis_names=AXIS_NAMES, device_ids=tuple(device_ids), inputs=tuple(inputs),
        outputs=tuple(outputs), intermediates=tuple(mids), predicted_time_s=cost.micro_batch_s,
        compute_s=cost.compute_s, comm_s=cost.comm_s, reshard_s=cost.reshard_s,
        comm_bytes=float(sum(x.nbytes for x in cost.collectives)), memory_bytes=cost.memory_bytes(d.in_flight),
        argument_bytes=cost.weight_bytes, collectives=by_kind,
        solver_status=",".join(sorted({c.plan.solver_status for c in d.costs})),
        solve_time_s=sum(c.plan.solve_time_s for c in d.costs),
        layer_range=(st.layers[0].spec.index, st.layers[-1].spec.index + 1), submesh=tuple(d.submesh),
        forward_s=cost.forward_s, backward_s=cost.backward_s, iteration_s=cost.iteration_s, send_s=cost.send_s,
        weight_bytes=cost.weight_bytes, activation_bytes=cost.activation_bytes, working_bytes=cost.working_bytes,
        in_flight=d.in_flight, param_mode=d.param_mode,
        remat=StageRemat(mode=d.remat, recompute_s=sum(c.forward_s for c in d.costs) if d.remat != "none" else 0.0),
        layers=tuple(_layer_layout(lg, c) for lg, c in zip(st.layers, d.costs)))


def to_plan(decision: PipelineDecision, *, method_name: str, schedule: str, signature: str, cluster: Cluster,
            memory_budget_bytes, device_ids: Sequence[int], planning_s: float,
            token: Any = None) -> Plan:
    """`token`: a `token_plan.TokenPlan` when the pipeline runs token slices."""
    traced = decision.traced
    names = loss_input_names(traced)
    stages = tuple(_stage_plan(d, traced, names, [device_ids[i] for i in d.device_ids]) for d in decision.stages)
    B = decision.num_micro_batches
    if token is None:
        timed = simulate(stage_orders(schedule, len(stages), B), [d.cost.forward_s for d in decision.stages],
                         [d.cost.backward_s for d in decision.stages])
    else:
        sl = token.slicing
        timed = simulate(stage_orders(schedule, len(stages), len(sl.slices), [len(x) for x in sl.slices]),
                         [token.task_s(s, "F") for s in range(len(stages))],
                         [token.task_s(s, "B") for s in range(len(stages))])
    token_slices = None if token is None else token.slicing
    s = decision.search
    pipeline = PipelinePlan(
        schedule=schedule, num_micro_batches=B, micro_batch_size=traced.micro_batch_size,
        layer_cuts=tuple(decision.layer_cuts),
        predicted_step_s=decision.latency_s if token_slices is None else token_slices.predicted_step_s,
        timeline=tuple(TimelineTask(t.task.stage, t.task.kind, t.task.micro_batch, t.start_s, t.end_s, t.task.slice)
                       for t in timed),
        search=PipelineSearch(**s) if s else None, token_slices=token_slices)
    return Plan(method=method_name, signature=signature, cluster=cluster.to_json(), stages=stages,
                memory_budget_bytes=memory_budget_bytes, num_micro_batches=B, schedule=schedule,
                pipeline=pipeline, planning_time_s=planning_s)


@dataclass(frozen=True)
class SavedLayout:
    """A layer's saved layouts, standing in for its ILP solution when building."""

    var_specs: dict[int, DimSharding]
    out_specs: tuple[DimSharding, ...]


@dataclass(frozen=True)
class RestoredStage:
    """A saved stage on the re-traced step: what building its programs needs."""

    layers: Any                          # StageLayers
    layouts: tuple[SavedLayout, ...]
    devices: tuple[Any, ...]
    mesh_shape: tuple[int, int]


def restore(plan: Plan, planner: PipelinePlanner, device_by_id: dict[int, Any]) -> tuple[TracedStep, list[RestoredStage]]:
    """The saved stages on the re-traced step: layer graphs (with each stage's remat),
    their saved layouts checked against the graphs, and the stage's devices."""
    p = plan.pipeline
    traced = planner.tracer.at(p.num_micro_batches)
    cuts = list(p.layer_cuts)
    if cuts[-1] != len(traced.loss.ops) or cuts[0] != 0:
        raise PlanFileError(f"the plan cuts a loss of {cuts[-1]} ops but this step's loss has {len(traced.loss.ops)} "
                            f"ops; the plan was made for another program: re-plan")
    out = []
    for n, st in enumerate(plan.stages):
        missing = [i for i in st.device_ids if i not in device_by_id]
        if missing:
            raise PlanFileError(f"stage {n} of the plan runs on device ids {list(st.device_ids)}, but device(s) "
                                f"{missing} are not among the {len(device_by_id)} given; re-plan for these devices")
        if st.layer_range is None or not st.layers:
            raise PlanFileError(f"stage {n} has no layers: not a pipeline plan of this autopar")
        remat = st.remat.mode if st.remat is not None else "none"
        all_layers = planner.layer_graphs(traced, cuts, remat)
        a, b = st.layer_range
        if not (0 <= a < b <= len(all_layers)) or len(st.layers) != b - a:
            raise PlanFileError(f"stage {n}: layer range {st.layer_range} does not fit the {len(all_layers)} layers")
        layouts = []
        for lg, saved in zip(all_layers[a:b], st.layers):
            if saved.key != lg.key or len(saved.var_specs) != len(lg.graph.vars):
                raise PlanFileError(f"stage {n}, layer {lg.spec.index}: the saved layouts were made for another "
                                    f"program (layer content differs); re-plan")
            specs = {}
            for v, names in enumerate(saved.var_specs):
                if names is None:
                    continue
                spec = _axes(names, f"stage {n}, layer {lg.spec.index}, value %{v}")
                if not is_valid(lg.graph.vars[v].shape, spec, tuple(st.mesh_shape)):
                    raise PlanFileError(f"stage {n}, layer {lg.spec.index}: layout {names} of a "
                                        f"{lg.graph.vars[v].shape} value does not fit mesh {st.mesh_shape}")
                specs[v] = spec
            outs = tuple(_axes(x, f"stage {n} outputs") for x in saved.out_specs)
            if len(outs) != len(lg.graph.outvars):
                raise PlanFileError(f"stage {n}, layer {lg.spec.index}: {len(outs)} output layouts for "
                                    f"{len(lg.graph.outvars)} outputs")
            layouts.append(SavedLayout(specs, outs))
        if shard_factor(((0, 1),), tuple(st.mesh_shape)) != len(st.device_ids):
            raise PlanFileError(f"stage {n}: mesh {st.mesh_shape} does not hold its {len(st.device_ids)} devices")
        out.append(RestoredStage(stage_layers(all_layers[a:b], all_layers), tuple(layouts),
                                 tuple(device_by_id[i] for i in st.device_ids), tuple(st.mesh_shape)))
    return traced, out
