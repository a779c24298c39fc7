"""Single-program methods (the ILP and its baselines): trace the whole step, solve the
intra-op ILP on each allowed mesh, reschedule the loss with rockmate when the memory
budget needs it, and run the result as one jitted SPMD program."""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Sequence

import jax
import numpy as np

from autopar.executable import LoweredStep
from autopar.interface import PlanRequest, abstract
from autopar.intra_op import MemoryBudgetError, ShardingPlan
from autopar.lost_update import check_single_program_step
from autopar.distributed import is_multi_process, transfer
from autopar.lower import build_mesh, input_shardings, sharded_function
from autopar.plan import Plan, PlanFileError, RematAttempt, RematInfo
from autopar.planner import InputInfo, input_infos, plan_single_stage, stage_plan, state_ties
from autopar.sharding_costs import ShardingCosts
from autopar.sharding_spec import AXIS_NAMES, DimSharding, is_valid
from rockmate.graph import OpGraph, trace_graph


@dataclass(frozen=True)
class SingleStagePlanned:
    """A single-program decision: the Plan, the traced step and the ILP's layouts."""

    plan: Plan
    graph: OpGraph
    sharding: ShardingPlan
    kernels: Any = None             # kernel_choice.ChosenKernels, when tuned kernels serve ops


class SingleStageExecutable:
    """One jitted SPMD program following a single-stage plan."""

    def __init__(self, planned: SingleStagePlanned, devices: Sequence[Any], donate_argnums: Sequence[int], args: tuple):
        self.plan = planned.plan
        self.graph = planned.graph
        self.planned = planned
        flat_donate = flat_indices(args, donate_argnums)
        mesh = build_mesh(devices, planned.sharding.mesh_shape)
        from autopar.kernel_choice import overrides

        self.jitted = sharded_function(planned.graph, planned.sharding, mesh, flat_donate,
                                       overrides=overrides(planned.kernels, mesh))
        self.in_shardings = input_shardings(planned.graph, planned.sharding, mesh)

    def _flat_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """The step's flat inputs; with several processes, as global arrays laid out by the
        plan (host values must then be the same in every process)."""
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if not is_multi_process():
            return leaves
        return [transfer(x, s) for x, s in zip(leaves, self.in_shardings)]

    def __call__(self, *args, **kwargs):
        out = self.jitted(*self._flat_inputs(args, kwargs))
        return jax.tree_util.tree_unflatten(self.graph.out_tree, out)

    def lower(self, *args, **kwargs) -> LoweredStep:
        return LoweredStep([self.jitted.lower(*self._flat_inputs(args, kwargs))])


def with_kernels(planned: SingleStagePlanned, request: PlanRequest) -> SingleStagePlanned:
    """The plan with its kernel tasks (the local ops a tuned kernel could serve) recorded in
    its stage, and with `request.kernels` != "xla" the kernels chosen for them; choosing
    needs this machine's devices (kernels are timed against XLA here)."""
    from autopar.kernel_choice import choose_kernels
    from autopar.kernel_sites import kernel_tasks, kernel_sites

    sites = kernel_sites(planned.graph, planned.sharding.var_specs, planned.sharding.mesh_shape)
    stage = replace(planned.plan.stages[0], kernel_tasks=kernel_tasks(sites))
    planned = replace(planned, plan=replace(planned.plan, stages=(stage,)))
    if request.kernels == "xla" or request.devices is None:
        return planned
    chosen = choose_kernels(planned.graph, sites, request.kernels, request.tuning_trials, request.tuning_db)
    chosen = _confirm_in_step(planned, request, chosen)
    stage = replace(stage, kernels=chosen.uses)
    return replace(planned, plan=replace(planned.plan, stages=(stage,)), kernels=chosen)


def _confirm_in_step(planned: SingleStagePlanned, request: PlanRequest, chosen: Any) -> Any:
    """The chosen kernels that also make the whole step faster (`kernel_in_step`), when the
    example inputs are real arrays in one process; otherwise `chosen` as it is."""
    import hashlib

    from autopar.kernel_in_step import concrete, confirm_in_step
    from search.backend import CBackend
    from search.tune import open_db

    if not chosen.kernels or is_multi_process() or not concrete((request.args, request.kwargs)):
        return chosen

    def build(kernels: Any) -> SingleStageExecutable:
        return SingleStageExecutable(replace(planned, kernels=kernels), request.devices, (), request.args)

    layouts = hashlib.sha256(repr(sorted(planned.sharding.var_specs.items())).encode()).hexdigest()[:16]
    context = f"{planned.plan.signature}|{planned.sharding.mesh_shape}|{layouts}|{CBackend().target_key()}"
    database, owned = open_db(request.tuning_db)
    try:
        return confirm_in_step(chosen, build, request.args, request.kwargs, database, context)
    finally:
        if owned:
            database.close()


def trace_step(fun, args: tuple, kwargs: dict) -> OpGraph:
    return trace_graph(fun, *jax.tree_util.tree_map(abstract, args), **jax.tree_util.tree_map(abstract, kwargs))


def trace_checked_step(fun, args: tuple, kwargs: dict) -> OpGraph:
    """`trace_step`, refusing a step that computes a gradient and returns nothing
    computed from it (an nnx.jit-style step: it would train nothing; see `lost_update`)."""
    args, kwargs = jax.tree_util.tree_map(abstract, args), jax.tree_util.tree_map(abstract, kwargs)
    graph = trace_graph(fun, *args, **kwargs)
    check_single_program_step(fun, args, kwargs, graph)
    return graph


def flat_indices(args: tuple, argnums: Sequence[int]) -> tuple[int, ...]:
    """Positions in the flattened arguments of the leaves of `args[argnums]`."""
    out, offset = [], 0
    for i, a in enumerate(args):
        n = len(jax.tree_util.tree_leaves(a))
        if i in argnums:
            out.extend(range(offset, offset + n))
        offset += n
    return tuple(out)


def plan(method: Any, request: PlanRequest) -> SingleStagePlanned:
    """Plan the step; with devices at hand and rockmate applied under a budget, compile the
    program and re-plan while XLA's measured memory exceeds the budget."""
    t0 = time.perf_counter()
    costs = ShardingCosts()
    planned = _plan(method, request, costs)
    if request.devices is not None and planned.plan.remat.applied == "rockmate" \
            and request.memory_budget_bytes is not None:
        planned = _fit_remat(method, request, planned, costs)
    planned = with_kernels(planned, request)
    return replace(planned, plan=replace(planned.plan, planning_time_s=time.perf_counter() - t0))


def _plan(method: Any, request: PlanRequest, costs: ShardingCosts, activation_scale: float = 1.0
          ) -> SingleStagePlanned:
    args, kwargs = request.args, request.kwargs
    infos = input_infos(args, kwargs, request.batch_argnums)
    budget = request.memory_budget_bytes if request.memory_budget_bytes is not None else math.inf
    cluster, n = request.cluster, request.num_devices

    def plan_once(graph, limit=budget, scope="peak"):
        ties = state_ties(graph, args, request.batch_argnums)
        splan, _ = plan_single_stage(graph, cluster, method, infos, num_devices=n, memory_budget_bytes=limit,
                                     tie_outputs=ties, memory_scope=scope, costs=costs)
        return splan

    remat = request.remat
    if remat not in ("auto", "none", "full"):
        raise ValueError(f"remat={remat!r}: a single-program method takes 'auto', 'none' or 'full' (both of "
                         f"the others use rockmate); 'rockmate' fixes the per-stage choice of PipeshardParallel")
    graph = trace_checked_step(request.fun, args, kwargs)
    remat_info = RematInfo(mode=remat, applied="none")
    try:
        splan = plan_once(graph)
        needs_remat = remat == "full" or (remat == "auto" and request.memory_budget_bytes is not None
                                          and splan.peak_memory_bytes > budget)
    except MemoryBudgetError as e:
        if remat == "none":
            raise
        splan, needs_remat = None, e
    if needs_remat:
        graph, splan, remat_info = _plan_with_remat(request, graph, splan, needs_remat, infos, plan_once, budget,
                                                    activation_scale)
    elif remat == "auto":
        remat_info = replace(remat_info, applied="none (the plan fits the memory budget without it)")
    out_names = [f"out{jax.tree_util.keystr(p)}" for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(graph.out_tree, [0] * len(graph.outvars)))[0]]
    device_ids = request.device_ids or tuple(range(n))
    stage = stage_plan(graph, splan, infos, device_ids, out_names)
    p = Plan(method=method.name, signature=request.signature, cluster=cluster.to_json(), stages=(stage,),
             memory_budget_bytes=request.memory_budget_bytes, remat=remat_info)
    return SingleStagePlanned(p, graph, splan)


def _plan_with_remat(request: PlanRequest, graph, splan, reason, infos, plan_once, budget, activation_scale: float):
    """Re-trace the step with a rockmate schedule on the loss of its gradient call,
    under the activation budget left per device after parameters and optimizer state
    (times `activation_scale`, < 1 when a compiled program measured over the budget)."""
    import rockmate

    from autopar.pipeline.grad import transform_losses

    n = request.num_devices
    if splan is None:  # nothing fitted: assume fully sharded arguments and batch, the best case
        arg_bytes = sum(graph.vars[v].nbytes for v in graph.invars if v in graph.vars) / n
        factor = n
    else:
        arg_bytes, factor = splan.argument_bytes, batch_shards(graph, splan, infos)
    used: list = []

    def transform(loss_fn, loss_args):
        example = jax.tree_util.tree_map(abstract, loss_args)
        if request.remat == "full" or not math.isfinite(budget):
            rplan = rockmate.plan_remat(loss_fn, rockmate.min_budget(loss_fn, *example), *example)
        else:
            try:
                if budget <= arg_bytes:  # nothing left for activations
                    raise rockmate.InfeasibleBudgetError(0, rockmate.min_budget(loss_fn, *example))
                rplan = rockmate.plan_remat(loss_fn, int((budget - arg_bytes) * factor * activation_scale), *example)
            except rockmate.InfeasibleBudgetError as e:
                mesh_shape = tuple(splan.mesh_shape) if splan is not None else (1, n)
                raise MemoryBudgetError(budget, arg_bytes + e.min_budget_bytes / factor, mesh_shape,
                                        remat_on=True) from None
        used.append(rplan)
        # no `cond` at block boundaries: the intra-op planner plans a cond replicated, which
        # would replicate every activation around it (measured: 9x the per-device temp)
        return rockmate.apply_plan(loss_fn, rplan, boundary_conds=False)

    with transform_losses(transform):
        new_graph = trace_step(request.fun, request.args, request.kwargs)
    if not used:
        warnings.warn("autopar: remat needs the loss, and the step computes no gradient with jax.value_and_grad / "
                      "jax.grad (or a wrapper of them) outside jit and loops; mark it with autopar.value_and_grad so "
                      "that rockmate can reschedule it. Planning without remat.")
        if splan is None:
            raise reason
        return graph, splan, RematInfo(mode=request.remat, applied="none (no gradient call found in the step)")
    # rockmate owns the activations now: the ILP places the arguments (with the old plan's
    # argument footprint as their budget) and the memory estimate is arguments + remat temp.
    new_splan = plan_once(new_graph, arg_bytes * 1.0001 + 1 if math.isfinite(budget) else budget, "arguments")
    rp = used[0]
    new_splan = replace(new_splan, peak_memory_bytes=new_splan.argument_bytes + rp.predicted_temp_bytes / factor)
    info = RematInfo(mode=request.remat, applied="rockmate", activation_budget_bytes=rp.budget_bytes,
                     predicted_temp_bytes=rp.predicted_temp_bytes, min_budget_bytes=rp.min_budget_bytes,
                     predicted_fwd_bwd_s=rp.predicted_time_s, blocks=len(rp.blocks), batch_shards=factor,
                     summary=rp.summary())
    return new_graph, new_splan, info


def batch_shards(graph: OpGraph, splan: ShardingPlan, infos: Sequence[InputInfo]) -> int:
    """How many pieces the plan cuts the batch into (activations per device scale by 1/this)."""
    best = 1
    for v, info in zip(graph.invars, infos):
        spec = splan.var_specs.get(v)
        if info.is_batch and spec:
            n = 1
            for a in spec[0]:
                n *= splan.mesh_shape[a]
            best = max(best, n)
    return best


def measured_step_memory(planned: SingleStagePlanned, request: PlanRequest):
    """XLA's per-device memory_analysis of the compiled step (the SPMD program)."""
    exe = SingleStageExecutable(planned, request.devices, request.donate_argnums, request.args)
    return exe.lower(*request.args, **request.kwargs).compile().memory_analysis()[0]


def _fit_remat(method, request: PlanRequest, planned: SingleStagePlanned, costs: ShardingCosts,
               max_replans: int = 3) -> SingleStagePlanned:
    """Compile the SPMD program and check its per-device memory (arguments + temp, from
    XLA's memory_analysis) against the budget; while over, re-plan with the rockmate
    activation budget cut by the measured overshoot. The measurement and the outcome
    go into plan.remat; a program that still does not fit is reported with a warning."""
    budget = request.memory_budget_bytes
    scale, history, best = 1.0, [], None
    while True:
        ma = measured_step_memory(planned, request)
        used = ma.argument_size_in_bytes + ma.temp_size_in_bytes
        remat = planned.plan.remat
        history.append(RematAttempt(remat.activation_budget_bytes, int(ma.argument_size_in_bytes),
                                    int(ma.temp_size_in_bytes)))
        if best is None or used < best[0]:
            best = (used, ma, planned)
        if used <= budget or len(history) > max_replans or budget <= ma.argument_size_in_bytes:
            break
        # cut rockmate's (whole-batch) activation budget by the measured per-device
        # overshoot times the batch shards, plus a tenth for the model's slack, and by
        # at least 3 % (a tiny cut leaves the DP's schedule unchanged)
        act = remat.activation_budget_bytes
        target = act - max(1.1 * (used - budget) * remat.batch_shards, 0.03 * act)
        if target <= 0:
            break
        scale *= target / act
        try:
            again = _plan(method, request, costs, activation_scale=scale)
        except MemoryBudgetError:
            break
        if again.plan.remat.applied != "rockmate":
            break
        planned = again
    # a tighter schedule can measure worse (more recomputation, less predictable fusion):
    # keep the attempt that measured least
    used, ma, planned = best
    fits = used <= budget
    info = replace(planned.plan.remat, measured_argument_bytes=int(ma.argument_size_in_bytes),
                   measured_temp_bytes=int(ma.temp_size_in_bytes), measured_fits_budget=bool(fits),
                   replans=len(history) - 1, attempts=tuple(history))
    if not fits:
        warnings.warn(f"autopar: with rockmate remat the compiled step needs {used / 1e6:.1f} MB per device "
                      f"(arguments {ma.argument_size_in_bytes / 1e6:.1f} MB + temp {ma.temp_size_in_bytes / 1e6:.1f} MB, "
                      f"XLA memory_analysis; best of {len(history)} schedules) against a budget of "
                      f"{budget / 1e6:.1f} MB; raise memory_budget, use more devices or a smaller batch")
    return replace(planned, plan=replace(planned.plan, remat=info))


def restore(plan: Plan, request: PlanRequest) -> SingleStagePlanned:
    """A saved single-stage plan on the freshly traced step, checked against it."""
    if len(plan.stages) != 1 or plan.pipeline is not None or plan.spmd_pipeline is not None:
        raise PlanFileError("this is a pipeline plan; reuse it with its pipeline method (plan=... picks it)")
    graph = trace_checked_step(request.fun, request.args, request.kwargs)
    if plan.remat is not None and plan.remat.applied == "rockmate":
        raise PlanFileError("this plan rescheduled the loss with rockmate; reusing such a plan is not supported: "
                            "re-plan (drop plan=...)")
    st = plan.stages[0]
    ax = {name: i for i, name in enumerate(st.axis_names)}
    mesh_shape = tuple(st.mesh_shape)

    def spec(t, shape) -> DimSharding:
        try:
            s = tuple(tuple(ax[a] for a in axes) for axes in t.spec)
        except KeyError as e:
            raise PlanFileError(f"{t.name}: unknown mesh axis {e.args[0]!r} (the plan's axes are {st.axis_names})") from None
        if not is_valid(tuple(shape), s, mesh_shape):
            raise PlanFileError(f"{t.name}: layout {t.spec_str()} does not fit shape {tuple(shape)} on mesh "
                                f"{mesh_shape[0]}x{mesh_shape[1]} (a dimension not divisible, or an axis used twice)")
        return s

    if len(st.inputs) != len([v for v in graph.invars if v in graph.vars]):
        raise PlanFileError(f"the plan has {len(st.inputs)} inputs but the step takes {len(graph.invars)}")
    var_specs: dict[int, DimSharding] = {}
    for v, t in zip(graph.invars, st.inputs):
        if tuple(t.shape) != graph.vars[v].shape:
            raise PlanFileError(f"input {t.name}: the plan has shape {tuple(t.shape)}, the step {graph.vars[v].shape}")
        var_specs[v] = spec(t, graph.vars[v].shape)
    for t in st.intermediates:
        if t.op is None or t.output is None or not 0 <= t.op < len(graph.ops) \
                or not 0 <= t.output < len(graph.ops[t.op].outputs):
            raise PlanFileError(f"intermediate {t.name}: op {t.op} output {t.output} is not in the traced step "
                                f"({len(graph.ops)} ops); the plan was made for another program")
        v = graph.ops[t.op].outputs[t.output]
        if tuple(t.shape) != graph.vars[v].shape:
            raise PlanFileError(f"intermediate {t.name}: the plan has shape {tuple(t.shape)}, the step "
                                f"{graph.vars[v].shape}; the plan was made for another program")
        var_specs[v] = spec(t, graph.vars[v].shape)
    outs = [v for v in graph.outvars]
    if len(st.outputs) != len(outs):
        raise PlanFileError(f"the plan has {len(st.outputs)} outputs but the step returns {len(outs)}")
    out_specs = tuple(spec(t, graph.vars[v].shape) for t, v in zip(st.outputs, outs))
    sp = ShardingPlan(mesh_shape, var_specs, {}, out_specs, st.predicted_time_s, st.compute_s, st.comm_s,
                      st.reshard_s, st.memory_bytes, st.argument_bytes, (), "reused", 0.0, 0, 0)
    return with_kernels(SingleStagePlanned(plan, graph, sp), request)


def build(planned: SingleStagePlanned, request: PlanRequest) -> SingleStageExecutable:
    n = int(np.prod(planned.sharding.mesh_shape))
    if len(request.devices) != n:
        raise PlanFileError(f"the plan is for {n} devices (mesh {planned.sharding.mesh_shape[0]}x"
                            f"{planned.sharding.mesh_shape[1]}) but {len(request.devices)} are given; re-plan for these "
                            f"devices or pass {n}")
    return SingleStageExecutable(planned, request.devices, request.donate_argnums, request.args)
