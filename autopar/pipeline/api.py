"""Entry point for `PipeshardParallel`: trace a train step, plan stages, build the
runtime, and run it with the same inputs and outputs as the original step.

The step must compute its gradient with `autopar.value_and_grad`/`autopar.grad` (see
`autopar.pipeline.grad`); that call is pipelined, the rest of the step (the optimizer
update) runs per stage on the parameters each stage owns.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from autopar.pipeline.grad import GradCall, capture_grads, pipeline_grad_p
from autopar.pipeline.method import PipeshardParallel
from autopar.pipeline.planner import PipelinePlan, plan_pipeline
from autopar.pipeline.runtime import PipelineRun, PipelineRuntime, replicated
from autopar.pipeline.schedule import issue_order, simulate, stage_orders
from autopar.pipeline.split import eval_eqns, split_loss
from autopar.pipeline.stage_cost import DeviceModel, device_model_from_cluster
from autopar.pipeline.update_split import StepSplit, SubProgram, split_step


@dataclass(frozen=True)
class TracedStep:
    """A train step traced with its gradient call left opaque, and the loss traced at
    micro-batch size."""

    step_jaxpr: Any          # ClosedJaxpr of the whole step
    grad_eqn_index: int
    call: GradCall
    loss_jaxpr: Any          # ClosedJaxpr of loss_fn on one micro-batch
    in_tree: Any
    out_tree: Any
    split_mask: tuple[bool, ...] = ()   # per loss input: split into micro-batches?


def trace_step(fun: Callable[..., Any], args: Sequence[Any], num_micro_batches: int,
               batch_argnums: Sequence[int] | None = None) -> TracedStep:
    """Trace `fun(*args)`; find its one `autopar.value_and_grad` call; trace that loss on
    one micro-batch.

    The loss inputs that are split into micro-batches: its non-differentiated, non-scalar
    inputs, and with `batch_argnums` only those computed from the step's batch arguments
    (others, e.g. a PRNG key or a mask, go whole to every micro-batch)."""
    leaves, in_tree = jax.tree_util.tree_flatten(tuple(args))
    out_tree_box = []

    def flat_fun(*flat):
        out = fun(*jax.tree_util.tree_unflatten(in_tree, flat))
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(out_tree)
        return out_leaves

    with capture_grads() as calls:
        step_jaxpr = jax.make_jaxpr(flat_fun)(*leaves)
        idx = [k for k, e in enumerate(step_jaxpr.jaxpr.eqns) if e.primitive is pipeline_grad_p]
        if len(idx) != 1 or len(calls) != 1:
            raise ValueError(
                f"PipeshardParallel needs the train step to compute its gradient with exactly "
                f"one top-level autopar.value_and_grad / autopar.grad call; found {len(idx)} "
                f"(jax.grad calls cannot be pipelined: replace them with autopar.grad)")
        call = calls[0]
    eqn = step_jaxpr.jaxpr.eqns[idx[0]]
    B = num_micro_batches
    from_batch = None
    if batch_argnums is not None:
        from_batch = set()
        offset = 0
        for i, a in enumerate(args):
            n = len(jax.tree_util.tree_leaves(a))
            if i in batch_argnums:
                from_batch.update(step_jaxpr.jaxpr.invars[offset:offset + n])
            offset += n
        for e in step_jaxpr.jaxpr.eqns[:idx[0]]:
            if any(isinstance(v, jcore.Var) and v in from_batch for v in e.invars):
                from_batch.update(e.outvars)
    split_mask = tuple(not diff and v.aval.ndim > 0 and
                       (from_batch is None or (isinstance(v, jcore.Var) and v in from_batch))
                       for v, diff in zip(eqn.invars, call.diff_leaf_mask))
    avals = []
    for v, split in zip(eqn.invars, split_mask):
        a = v.aval
        if split:
            if a.shape[0] % B:
                raise ValueError(f"a batch input of the loss has shape {a.shape}: its leading "
                                 f"dimension is not divisible by num_micro_batches={B}")
            a = jax.ShapeDtypeStruct((a.shape[0] // B, *a.shape[1:]), a.dtype)
        else:
            a = jax.ShapeDtypeStruct(a.shape, a.dtype)
        avals.append(a)
    loss_jaxpr = jax.make_jaxpr(
        lambda *l: call.loss_fn(*jax.tree_util.tree_unflatten(call.args_tree, l)))(*avals)
    return TracedStep(step_jaxpr, idx[0], call, loss_jaxpr, in_tree, out_tree_box[-1], split_mask)


def default_device_model(devices: Sequence[Any], devices_per_host: int) -> DeviceModel:
    """Roofline numbers of the given devices, from the cluster presets."""
    from autopar.cluster import Cluster

    c = Cluster.from_devices(devices)
    c = Cluster(c.device, len(devices) // devices_per_host, devices_per_host,
                c.intra_host, c.inter_host)
    return device_model_from_cluster(c)


def _make_mesh(devs: Sequence[Any], shape: tuple[int, int]) -> Mesh:
    return Mesh(np.asarray(devs, dtype=object).reshape(shape), ("data", "model"),
                axis_types=(AxisType.Auto, AxisType.Auto))


class _JittedProgram:
    """A sub-program of the step jaxpr, jitted and compiled on first call."""

    def __init__(self, jaxpr: Any, consts: dict, prog: SubProgram, compiler_options: dict | None):
        eqns = [jaxpr.eqns[i] for i in prog.eqn_indices]

        def fn(*ins):
            env = dict(consts)
            env.update(zip(prog.invars, ins))
            eval_eqns(eqns, env)
            return tuple(env[v] for v in prog.outvars)

        self.prog = prog
        self.jitted = jax.jit(fn)
        self.compiled = None
        self.compiler_options = compiler_options
        with warnings.catch_warnings():   # a cache key only: no debug info needed
            warnings.simplefilter("ignore", DeprecationWarning)
            sub = jcore.Jaxpr(jaxpr.constvars, list(prog.invars), list(prog.outvars), eqns)
        self.key = (str(sub), tuple(sorted((compiler_options or {}).items())))

    def __call__(self, *ins):
        if self.compiled is None:
            key = (self.key, tuple(getattr(x, "sharding", None) for x in ins))
            if key not in _UPDATE_CACHE:
                _UPDATE_CACHE[key] = self.jitted.lower(*ins).compile(self.compiler_options)
            self.compiled = _UPDATE_CACHE[key]
        return self.compiled(*ins)


_UPDATE_CACHE: dict[Any, Any] = {}


class PipeshardExecutable:
    """A planned, runnable pipeline for one input signature."""

    def __init__(self, traced: TracedStep, method: PipeshardParallel, devices: Sequence[Any],
                 plan: PipelinePlan, compiler_options: dict | None = None,
                 param_sharding_fn: Callable | None = None):
        self.traced, self.method, self.devices, self.plan = traced, method, list(devices), plan
        self.meshes = [_make_mesh([self.devices[i] for i in ids], lm)
                       for ids, lm in zip(plan.device_ids, plan.logical_meshes)]
        loss = traced.loss_jaxpr
        mask = traced.call.diff_leaf_mask
        self.specs = split_loss(loss.jaxpr, plan.stage_eqn_cuts, mask)
        orders = stage_orders(method.schedule, len(self.specs), method.num_micro_batches)
        self.runtime = PipelineRuntime(loss, self.specs, self.meshes, issue_order(orders),
                                       method.num_micro_batches, compiler_options,
                                       param_sharding_fn)
        S = len(self.specs)
        diff_pos = [i for i, d in enumerate(mask) if d]
        owner = self.runtime.owner
        grad_in_stage = [owner.get(i, 0) if d else None for i, d in enumerate(mask)]
        grad_out_stage = [S - 1] + [owner.get(i, 0) for i in diff_pos]
        jaxpr = traced.step_jaxpr.jaxpr
        self.split: StepSplit = split_step(jaxpr, traced.grad_eqn_index, grad_in_stage,
                                           grad_out_stage, S)
        consts = dict(zip(jaxpr.constvars, traced.step_jaxpr.consts))
        self.home = _make_mesh(self.devices[:len(sum(plan.device_ids, ()))],
                               (len(sum(plan.device_ids, ())), 1))
        self.pre = _JittedProgram(jaxpr, consts, self.split.pre, compiler_options) if self.split.pre.eqn_indices else None
        if self.split.updates is not None:
            self.updates = [_JittedProgram(jaxpr, consts, u, compiler_options) for u in self.split.updates]
            self.update_all = None
        else:
            self.updates = None
            self.update_all = _JittedProgram(jaxpr, consts, self.split.update_all, compiler_options)
        self.diff_pos = diff_pos
        self.last_run: PipelineRun | None = None

    def compile(self, *args) -> "PipeshardExecutable":
        """Make sure every stage program is compiled, by running one step on `args` and
        discarding its result (the step is pure; costs one step of compute)."""
        if any(p.backward.compiled is None for p in self.runtime.programs):
            jax.block_until_ready(self(*args))
        return self

    def as_text(self) -> str:
        """HLO of every compiled stage program."""
        return "\n\n".join(f"// stage {s} {name}\n{c.as_text()}"
                            for s, progs in enumerate(self.stage_programs())
                            for name, c in progs.items() if c is not None)

    def memory_analysis(self) -> list[Any]:
        """`memory_analysis()` of each stage's backward program (holds the residuals)."""
        return [c.memory_analysis() for c in self.stages]

    @property
    def stages(self) -> list[Any]:
        """One jax Compiled per stage (its backward program, which holds the vjp and the
        gradient accumulation); available after the first call."""
        return [p.backward.compiled for p in self.runtime.programs]

    def stage_programs(self) -> list[dict[str, Any]]:
        """All compiled programs of each stage: forward, backward, update."""
        out = []
        for s, p in enumerate(self.runtime.programs):
            d = {"forward": p.forward.compiled, "backward": p.backward.compiled}
            if self.updates is not None:
                d["update"] = self.updates[s].compiled
            out.append(d)
        return out

    def __call__(self, *args):
        leaves, tree = jax.tree_util.tree_flatten(tuple(args))
        if tree != self.traced.in_tree:
            raise ValueError("the arguments' pytree structure differs from the one this "
                             "pipeline was planned for; plan again for the new structure")
        jaxpr = self.traced.step_jaxpr.jaxpr
        for k, (v, x) in enumerate(zip(jaxpr.invars, leaves)):
            if tuple(np.shape(x)) != tuple(v.aval.shape):
                raise ValueError(f"argument leaf {k} has shape {tuple(np.shape(x))} but this pipeline "
                                 f"was planned for {tuple(v.aval.shape)}; plan again for the new shapes")
        env = dict(zip(jaxpr.invars, leaves))
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        if self.pre is not None:
            ins = [jax.device_put(read(v), replicated(self.home)) for v in self.pre.prog.invars]
            env.update(zip(self.pre.prog.outvars, self.pre(*ins)))
        g = jaxpr.eqns[self.traced.grad_eqn_index]
        run = self.runtime.run([read(v) for v in g.invars], self.traced.call.diff_leaf_mask,
                               self.traced.split_mask)
        self.last_run = run
        env[g.outvars[0]] = run.loss
        for v, i in zip(g.outvars[1:], self.diff_pos):
            env[v] = run.grads[i]
        if self.updates is not None:
            for s, prog in enumerate(self.updates):
                if not prog.prog.eqn_indices:
                    continue
                sh = replicated(self.meshes[s])
                outs = prog(*[jax.device_put(read(v), sh) for v in prog.prog.invars])
                env.update(zip(prog.prog.outvars, outs))
        elif self.update_all.prog.eqn_indices:
            sh = replicated(self.home)
            outs = self.update_all(*[jax.device_put(read(v), sh) for v in self.update_all.prog.invars])
            env.update(zip(self.update_all.prog.outvars, outs))
        out = [read(v) for v in jaxpr.outvars]
        return jax.tree_util.tree_unflatten(self.traced.out_tree, out)

    def plan_dict(self) -> dict[str, Any]:
        """Stages, submeshes, layer ranges, micro-batches, schedule and predicted times,
        as JSON-ready plain data (for the Plan JSON and `autopar inspect`)."""
        p = self.plan
        return plan_to_dict(p, updates_split=self.updates is not None,
                            eqn_names=[e.primitive.name for e in self.traced.loss_jaxpr.jaxpr.eqns])


def plan_to_dict(p: PipelinePlan, updates_split: bool = True,
                 eqn_names: Sequence[str] | None = None) -> dict[str, Any]:
    """A `PipelinePlan` as JSON-ready data, including the simulated schedule."""
    S = len(p.stage_layers)
    fwd = [c.micro_batch_s / 3.0 for c in p.stage_costs]
    bwd = [c.micro_batch_s * 2.0 / 3.0 for c in p.stage_costs]
    timed = simulate(stage_orders(p.schedule, S, p.num_micro_batches), fwd, bwd)
    stages = []
    for s in range(S):
        a, b = p.stage_layers[s]
        c = p.stage_costs[s]
        stages.append({
            "stage": s, "layers": [a, b], "equations": [p.layer_cuts[a], p.layer_cuts[b]],
            "submesh": list(p.submeshes[s]), "logical_mesh": list(p.logical_meshes[s]),
            "device_ids": list(p.device_ids[s]),
            "predicted_micro_batch_s": c.micro_batch_s, "predicted_iteration_s": c.iteration_s,
            "predicted_memory_bytes": c.memory_bytes(
                min(S - s, p.num_micro_batches) if p.schedule == "1f1b" else p.num_micro_batches),
        })
    return {
        "kind": "pipeshard", "predicted_step_s": p.predicted_latency_s, "schedule": p.schedule, "num_micro_batches": p.num_micro_batches,
        "num_stages": S, "num_layers": len(p.layer_cuts) - 1, "layer_cuts": list(p.layer_cuts),
        "stages": stages, "predicted_latency_s": p.predicted_latency_s,
        "planning_s": p.planning_s, "update_split_per_stage": updates_split,
        "timeline": [{"stage": t.task.stage, "kind": t.task.kind, "micro_batch": t.task.micro_batch,
                      "start_s": t.start_s, "end_s": t.end_s} for t in timed],
    }


def _hosts(num_devices: int, method: PipeshardParallel, default_dph: int) -> tuple[int, int]:
    dph = method.devices_per_host or default_dph
    if num_devices % dph:
        raise ValueError(f"{num_devices} devices do not form whole hosts of "
                         f"devices_per_host={dph}; pass PipeshardParallel(devices_per_host=...)")
    return num_devices // dph, dph


def _check_method(method: Any) -> None:
    if not isinstance(method, PipeshardParallel):
        raise TypeError(f"method must be a PipeshardParallel, got {type(method).__name__}")


def plan_pipeshard(fun: Callable[..., Any], args: Sequence[Any], method: PipeshardParallel,
                   cluster: Any, stage_cost_fn: Callable | None = None,
                   batch_argnums: Sequence[int] | None = None) -> PipelinePlan:
    """Plan without running, for a cluster that need not exist here (`args` may be
    `jax.ShapeDtypeStruct`s). Serialise with `plan_to_dict`."""
    _check_method(method)
    if method.profile:
        raise ValueError("profile=True measures stages on this machine's devices; it cannot "
                         "plan for a cluster model")
    traced = trace_step(fun, args, method.num_micro_batches, batch_argnums)
    hosts, dph = _hosts(cluster.num_devices, method, cluster.devices_per_host)
    return plan_pipeline(traced.loss_jaxpr.jaxpr, traced.call.diff_leaf_mask, method, hosts, dph,
                         device_model_from_cluster(cluster), stage_cost_fn)


def build_pipeshard(fun: Callable[..., Any], args: Sequence[Any], method: PipeshardParallel,
                    devices: Sequence[Any] | None = None, stage_cost_fn: Callable | None = None,
                    device_model: DeviceModel | None = None,
                    compiler_options: dict | None = None, tuning_db: Any = None,
                    param_sharding_fn: Callable | None = None,
                    batch_argnums: Sequence[int] | None = None) -> PipeshardExecutable:
    """Trace, plan and build a pipeline for `fun(*args)`.

    stage_cost_fn(layer_range, submesh_shape, logical_mesh_shape) -> StageCost or
    (time_s, memory_bytes), with layer_range = (first, end) equation indices of the
    micro-batch loss jaxpr (`trace_step(...).loss_jaxpr`); default: roofline estimate,
    or with `method.profile` measurements on `devices` cached in `tuning_db`.
    compiler_options are passed to XLA for every stage program.
    batch_argnums: the step arguments holding the batch (see `trace_step`); None splits
    every non-scalar, non-differentiated loss input.
    param_sharding_fn(stage, leaf, aval, mesh) -> NamedSharding or PartitionSpec over the
    stage mesh's ("data", "model") axes places each parameter (the stage's intra-op plan);
    default: the stage cost's own layouts when it has `param_sharding_fn_for(plan)` (the
    intra-op ILP adapter does), else replicated, with the batch split over the whole stage
    mesh (data parallel).
    """
    _check_method(method)
    devices = list(jax.devices() if devices is None else devices)
    traced = trace_step(fun, args, method.num_micro_batches, batch_argnums)
    per_process = sum(d.process_index == devices[0].process_index for d in devices)
    hosts, dph = _hosts(len(devices), method, per_process)
    device = device_model or default_device_model(devices, dph)
    if method.profile:
        if stage_cost_fn is not None:
            raise ValueError("pass either stage_cost_fn or PipeshardParallel(profile=True), not both")
        from autopar.pipeline.profile import StageProfiler

        stage_cost_fn = StageProfiler(traced.loss_jaxpr, traced.call.diff_leaf_mask, devices,
                                      device.state_bytes_per_param_byte, tuning_db,
                                      compiler_options)
    plan = plan_pipeline(traced.loss_jaxpr.jaxpr, traced.call.diff_leaf_mask, method, hosts, dph,
                         device, stage_cost_fn)
    if param_sharding_fn is None and hasattr(stage_cost_fn, "param_sharding_fn_for"):
        param_sharding_fn = stage_cost_fn.param_sharding_fn_for(plan)   # e.g. the intra-op ILP's layouts
    return PipeshardExecutable(traced, method, devices, plan, compiler_options, param_sharding_fn)
