"""`autopar.parallelize`: the decorator that traces, plans, lowers and runs a train step."""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import jax
import numpy as np

from autopar.cluster import Cluster, parse_memory
from rockmate.graph.op_graph import OpGraph
from rockmate.graph.trace import trace_graph
from autopar.intra_op import MemoryBudgetError, ShardingPlan
from autopar.lower import build_mesh, sharded_function
from autopar.methods import resolve_method
from autopar.pipeline import PipeshardParallel
from autopar.pipeline.api import build_pipeshard, plan_pipeshard, plan_to_dict
from autopar.plan import Plan, PlanFileError, StagePlan
from search.database import TuningDB
from autopar.planner import input_infos, plan_single_stage, stage_plan, state_ties
from autopar.sharding_spec import AXIS_NAMES


def _abstract(x: Any) -> Any:
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)) if not isinstance(x, jax.ShapeDtypeStruct) else x


def signature_of(args: tuple, kwargs: dict) -> str:
    """Input signature a plan is cached under: pytree structure, shapes and dtypes."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    shapes = ",".join(f"{jax.numpy.result_type(l).name}{list(np.shape(l))}" for l in leaves)
    return f"{tree}|{shapes}"


@dataclass
class _Entry:
    graph: OpGraph
    plan: Plan
    jitted: Any
    flat_donate: tuple[int, ...]


class CompiledStep:
    """The compiled program(s) of a plan: one jax Compiled per pipeline stage."""

    def __init__(self, stages: list[Any]):
        self.stages = stages

    def as_text(self) -> str:
        return "\n".join(s.as_text() for s in self.stages)

    def memory_analysis(self) -> list[Any]:
        """Per-stage `memory_analysis()` (a list, one entry per stage)."""
        return [s.memory_analysis() for s in self.stages]

    def cost_analysis(self) -> list[Any]:
        return [s.cost_analysis() for s in self.stages]


class LoweredStep:
    def __init__(self, lowered: list[Any]):
        self.lowered = lowered

    def as_text(self) -> str:
        return "\n".join(l.as_text() for l in self.lowered)

    def compile(self) -> CompiledStep:
        return CompiledStep([l.compile() for l in self.lowered])


class _LoweredPipeline:
    def __init__(self, exe, args):
        self.exe, self.args = exe, args

    def compile(self) -> CompiledStep:
        self.exe.compile(*self.args)
        return CompiledStep(list(self.exe.stages))


class Parallelized:
    """A train step planned and run by autopar; call it like the original function."""

    def __init__(self, fun: Callable, *, devices=None, method="auto", memory_budget=None, batch_argnums=(1,),
                 donate_argnums=(), remat="auto", tuning_db=None, plan=None):
        if remat not in ("auto", "none", "full"):
            raise ValueError(f"remat={remat!r}; use 'auto', 'none' or 'full'")
        self.fun = fun
        self.devices = list(devices) if devices is not None else None
        self.method = resolve_method(method)
        self.memory_budget_bytes = parse_memory(memory_budget) if memory_budget is not None else None
        self.batch_argnums = tuple(batch_argnums) if not isinstance(batch_argnums, int) else (batch_argnums,)
        self.donate_argnums = tuple(donate_argnums) if not isinstance(donate_argnums, int) else (donate_argnums,)
        self.remat = remat
        self.tuning_db = tuning_db
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        self.fixed_plan: Plan | None = plan
        self._cache: dict[str, _Entry] = {}
        self.plan: Plan | None = None
        functools.update_wrapper(self, fun)

    # --- planning ------------------------------------------------------------------
    def _devices(self) -> list[Any]:
        return self.devices if self.devices is not None else list(jax.devices())

    def _entry(self, args: tuple, kwargs: dict) -> _Entry:
        sig = signature_of(args, kwargs)
        entry = self._cache.get(sig)
        if entry is not None:
            return entry
        devices = self._devices()
        if isinstance(self.method, PipeshardParallel):
            entry = self._pipeshard_entry(args, kwargs, sig, devices)
            self._cache[sig] = entry
            return entry
        if self.fixed_plan is not None:
            if self.fixed_plan.signature != sig:
                raise PlanFileError("the saved plan was made for inputs with a different signature:\n"
                                    f"  plan:  {self.fixed_plan.signature[:300]}\n  given: {sig[:300]}\n"
                                    "re-plan (drop plan=...) or pass inputs shaped like the planned ones")
            graph = _trace(self.fun, args, kwargs)
            splan = _sharding_plan_from(self.fixed_plan, graph)
            plan = self.fixed_plan
        else:
            graph, splan, plan = _plan(self.fun, args, kwargs, Cluster.from_devices(devices), self.method,
                                       memory_budget_bytes=self.memory_budget_bytes, batch_argnums=self.batch_argnums,
                                       device_ids=[d.id for d in devices], remat=self.remat)
        flat_donate = _flat_indices(args, self.donate_argnums)
        jitted = sharded_function(graph, splan, build_mesh(devices, splan.mesh_shape), flat_donate)
        if self.fixed_plan is None and (plan.remat or {}).get("applied") == "rockmate" \
                and self.memory_budget_bytes is not None:
            graph, splan, plan, jitted = self._fit_remat(args, kwargs, devices, flat_donate, graph, splan, plan, jitted)
        entry = _Entry(graph, plan, jitted, flat_donate)
        self._cache[sig] = entry
        return entry

    def _fit_remat(self, args, kwargs, devices, flat_donate, graph, splan, plan, jitted, max_replans: int = 3):
        """Compile the SPMD program and check its per-device memory (arguments + temp, from
        XLA's memory_analysis) against the budget; while over, re-plan with the rockmate
        activation budget cut by the measured overshoot. The measurement and the outcome
        go into plan.remat; a program that still does not fit is reported with a warning."""
        budget = self.memory_budget_bytes
        scale, history, best = 1.0, [], None
        while True:
            ma = measured_step_memory(jitted, args, kwargs)
            used = ma.argument_size_in_bytes + ma.temp_size_in_bytes
            history.append({"activation_budget_bytes": plan.remat["activation_budget_bytes"],
                            "measured_argument_bytes": int(ma.argument_size_in_bytes),
                            "measured_temp_bytes": int(ma.temp_size_in_bytes)})
            if best is None or used < best[0]:
                best = (used, ma, graph, splan, plan, jitted)
            if used <= budget or len(history) > max_replans:
                break
            if budget <= ma.argument_size_in_bytes:
                break
            # cut rockmate's (whole-batch) activation budget by the measured per-device
            # overshoot times the batch shards, plus a tenth for the model's slack, and by
            # at least 3 % (a tiny cut leaves the DP's schedule unchanged)
            act = plan.remat["activation_budget_bytes"]
            target = act - max(1.1 * (used - budget) * plan.remat["batch_shards"], 0.03 * act)
            if target <= 0:
                break
            scale *= target / act
            try:
                g2, s2, p2 = _plan(self.fun, args, kwargs, Cluster.from_devices(devices), self.method,
                                   memory_budget_bytes=budget, batch_argnums=self.batch_argnums,
                                   device_ids=[d.id for d in devices], remat=self.remat, activation_scale=scale)
            except MemoryBudgetError:
                break
            if (p2.remat or {}).get("applied") != "rockmate":
                break
            graph, splan, plan = g2, s2, p2
            jitted = sharded_function(graph, splan, build_mesh(devices, splan.mesh_shape), flat_donate)
        # a tighter schedule can measure worse (more recomputation, less predictable fusion):
        # keep the attempt that measured least
        used, ma, graph, splan, plan, jitted = best
        fits = used <= budget
        info = dict(plan.remat, measured_argument_bytes=int(ma.argument_size_in_bytes),
                    measured_temp_bytes=int(ma.temp_size_in_bytes), measured_fits_budget=bool(fits),
                    replans=len(history) - 1, attempts=history)
        if not fits:
            import warnings

            warnings.warn(f"autopar: with rockmate remat the compiled step needs {used / 1e6:.1f} MB per device "
                          f"(arguments {ma.argument_size_in_bytes / 1e6:.1f} MB + temp {ma.temp_size_in_bytes / 1e6:.1f} MB, "
                          f"XLA memory_analysis; best of {len(history)} schedules) against a budget of "
                          f"{budget / 1e6:.1f} MB; raise memory_budget, use more devices or a smaller batch")
        return graph, splan, replace(plan, remat=info), jitted

    def _pipeshard_entry(self, args: tuple, kwargs: dict, sig: str, devices: list) -> _Entry:
        if kwargs:
            raise TypeError("PipeshardParallel steps take positional arguments only")
        t0 = time.perf_counter()
        db = TuningDB(self.tuning_db) if self.method.profile else None
        exe = build_pipeshard(self.fun, args, self.method, devices, batch_argnums=self.batch_argnums, tuning_db=db)
        plan = _pipeline_plan(exe.plan_dict(), self.method, sig, Cluster.from_devices(devices), self.memory_budget_bytes,
                              time.perf_counter() - t0)
        return _Entry(None, plan, exe, ())

    def get_plan(self, *args, **kwargs) -> Plan:
        """Plan (or fetch the cached plan) without running."""
        return self._entry(args, kwargs).plan

    def lower(self, *args, **kwargs) -> LoweredStep:
        entry = self._entry(args, kwargs)
        if entry.graph is None:  # a pipeline: its stage programs compile by running one step
            return _LoweredPipeline(entry.jitted, args)
        flat = jax.tree_util.tree_leaves((args, kwargs))
        return LoweredStep([entry.jitted.lower(*flat)])

    def __call__(self, *args, **kwargs):
        entry = self._entry(args, kwargs)
        if entry.graph is None:
            out = entry.jitted(*args)
            self.plan = entry.plan
            return out
        flat = jax.tree_util.tree_leaves((args, kwargs))
        out = entry.jitted(*flat)
        self.plan = entry.plan
        return jax.tree_util.tree_unflatten(entry.graph.out_tree, out)


def measured_step_memory(jitted, args: tuple, kwargs: dict):
    """XLA's per-device memory_analysis of the compiled step (the SPMD program)."""
    flat = jax.tree_util.tree_leaves((args, kwargs))
    return jitted.lower(*flat).compile().memory_analysis()


def _trace(fun: Callable, args: tuple, kwargs: dict) -> OpGraph:
    return trace_graph(fun, *jax.tree_util.tree_map(_abstract, args), **jax.tree_util.tree_map(_abstract, kwargs))


def _plan(fun, args, kwargs, cluster: Cluster, method, *, memory_budget_bytes, batch_argnums, device_ids, remat="none",
          activation_scale: float = 1.0):
    t0 = time.perf_counter()
    infos = input_infos(args, kwargs, batch_argnums)
    budget = memory_budget_bytes if memory_budget_bytes is not None else math.inf

    def plan_once(graph, limit=budget, scope="peak"):
        ties = state_ties(graph, args, batch_argnums)
        splan, _ = plan_single_stage(graph, cluster, method, infos, num_devices=len(device_ids),
                                     memory_budget_bytes=limit, tie_outputs=ties, memory_scope=scope)
        return splan

    graph = _trace(fun, args, kwargs)
    remat_info: dict[str, Any] = {"mode": remat, "applied": "none"}
    try:
        splan = plan_once(graph)
        needs_remat = remat == "full" or (remat == "auto" and memory_budget_bytes is not None and splan.peak_memory_bytes > budget)
    except MemoryBudgetError as e:
        if remat == "none":
            raise
        splan, needs_remat = None, e
    if needs_remat:
        graph, splan, remat_info = _plan_with_remat(fun, args, kwargs, graph, splan, needs_remat, infos, plan_once,
                                                    remat, budget, cluster, method, device_ids, activation_scale)
    elif remat == "auto":
        remat_info["applied"] = "none (the plan fits the memory budget without it)"
    out_names = [f"out{jax.tree_util.keystr(p)}" for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(graph.out_tree, [0] * len(graph.outvars)))[0]]
    stage = stage_plan(graph, splan, infos, device_ids, out_names)
    plan = Plan(method=getattr(method, "name", type(method).__name__), signature=signature_of(args, kwargs),
                cluster=cluster.to_json(), stages=(stage,), memory_budget_bytes=memory_budget_bytes,
                remat=remat_info, planning_time_s=time.perf_counter() - t0)
    return graph, splan, plan


def _plan_with_remat(fun, args, kwargs, graph, splan, reason, infos, plan_once, remat, budget, cluster, method, device_ids,
                     activation_scale: float = 1.0):
    """Re-trace the step with a rockmate schedule on the loss given to autopar.value_and_grad,
    under the activation budget left per device after parameters and optimizer state
    (times `activation_scale`, < 1 when a compiled program measured over the budget)."""
    import rockmate

    from autopar.pipeline.grad import transform_losses

    if splan is None:  # nothing fitted: assume fully sharded arguments and batch, the best case
        arg_bytes = sum(graph.vars[v].nbytes for v in graph.invars if v in graph.vars) / len(device_ids)
        factor = len(device_ids)
    else:
        arg_bytes, factor = splan.argument_bytes, _batch_shards(graph, splan, infos)
    used: list = []

    def transform(loss_fn, loss_args):
        example = jax.tree_util.tree_map(_abstract, loss_args)
        if remat == "full" or not math.isfinite(budget):
            rplan = rockmate.plan_remat(loss_fn, rockmate.min_budget(loss_fn, *example), *example)
        else:
            try:
                if budget <= arg_bytes:  # nothing left for activations
                    raise rockmate.InfeasibleBudgetError(0, rockmate.min_budget(loss_fn, *example))
                rplan = rockmate.plan_remat(loss_fn, int((budget - arg_bytes) * factor * activation_scale), *example)
            except rockmate.InfeasibleBudgetError as e:
                mesh_shape = tuple(splan.mesh_shape) if splan is not None else (1, len(device_ids))
                raise MemoryBudgetError(budget, arg_bytes + e.min_budget_bytes / factor, mesh_shape) from None
        used.append(rplan)
        # no `cond` at block boundaries: the intra-op planner plans a cond replicated, which
        # would replicate every activation around it (measured: 9x the per-device temp)
        return rockmate.apply_plan(loss_fn, rplan, boundary_conds=False)

    with transform_losses(transform):
        new_graph = _trace(fun, args, kwargs)
    if not used:
        import warnings

        warnings.warn("autopar: remat needs the loss; compute gradients with autopar.value_and_grad / autopar.grad "
                      "in the train step so that rockmate can reschedule it. Planning without remat.")
        if splan is None:
            raise reason
        return graph, splan, {"mode": remat, "applied": "none (the step does not call autopar.value_and_grad)"}
    # rockmate owns the activations now: the ILP places the arguments (with the old plan's
    # argument footprint as their budget) and the memory estimate is arguments + remat temp.
    new_splan = plan_once(new_graph, arg_bytes * 1.0001 + 1 if math.isfinite(budget) else budget, "arguments")
    rp = used[0]
    new_splan = replace(new_splan, peak_memory_bytes=new_splan.argument_bytes + rp.predicted_temp_bytes / factor)
    info = {"mode": remat, "applied": "rockmate", "activation_budget_bytes": rp.budget_bytes,
            "predicted_temp_bytes": rp.predicted_temp_bytes, "min_budget_bytes": rp.min_budget_bytes,
            "predicted_fwd_bwd_s": rp.predicted_time_s, "blocks": len(rp.blocks),
            "batch_shards": factor, "summary": rp.summary()}
    return new_graph, new_splan, info


def _batch_shards(graph: OpGraph, splan: ShardingPlan, infos) -> int:
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


def make_plan(fun: Callable, *args, cluster: Cluster | str, method="auto", memory_budget=None,
              batch_argnums=(1,), **kwargs) -> Plan:
    """Plan `fun(*args)` for a cluster that need not exist here (args may be ShapeDtypeStructs)."""
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    budget = parse_memory(memory_budget) if memory_budget is not None else None
    method = resolve_method(method)
    if isinstance(method, PipeshardParallel):
        t0 = time.perf_counter()
        d = plan_to_dict(plan_pipeshard(fun, args, method, cluster, batch_argnums=tuple(batch_argnums)))
        return _pipeline_plan(d, method, signature_of(args, kwargs), cluster, budget, time.perf_counter() - t0)
    _, _, plan = _plan(fun, args, kwargs, cluster, resolve_method(method), memory_budget_bytes=budget,
                       batch_argnums=tuple(batch_argnums), device_ids=list(range(cluster.num_devices)))
    return plan


def _pipeline_plan(d: dict, method: PipeshardParallel, sig: str, cluster: Cluster, budget, planning_s: float) -> Plan:
    """A Plan whose stages are the pipeline's submeshes (their intra-op layouts live in `pipeline`)."""
    stages = tuple(StagePlan(tuple(st["logical_mesh"]), ("data", "model"), tuple(st["device_ids"]), (), (),
                             predicted_time_s=st["predicted_iteration_s"], memory_bytes=st["predicted_memory_bytes"],
                             layer_range=tuple(st["layers"])) for st in d["stages"])
    return Plan(method=f"pipeshard({method.schedule}, B={method.num_micro_batches})", signature=sig,
                cluster=cluster.to_json(), stages=stages, memory_budget_bytes=budget,
                num_micro_batches=method.num_micro_batches, schedule=method.schedule, pipeline=d,
                remat={"mode": "none", "applied": "none (not yet inside pipeline stages)"}, planning_time_s=planning_s)


def _flat_indices(args: tuple, argnums: Sequence[int]) -> tuple[int, ...]:
    out, offset = [], 0
    for i, a in enumerate(args):
        n = len(jax.tree_util.tree_leaves(a))
        if i in argnums:
            out.extend(range(offset, offset + n))
        offset += n
    return tuple(out)


def _sharding_plan_from(plan: Plan, graph: OpGraph) -> ShardingPlan:
    """Rebuild the layouts of a saved single-stage plan on a freshly traced graph."""
    if len(plan.stages) != 1:
        raise PlanFileError("reusing a saved pipeline plan through plan=... is not supported yet; re-plan instead")
    st = plan.stages[0]
    ax = {n: i for i, n in enumerate(AXIS_NAMES)}

    def spec(t):
        return tuple(tuple(ax[a] for a in axes) for axes in t.spec)

    var_specs = {v: spec(t) for v, t in zip(graph.invars, st.inputs)}
    for t in st.intermediates:
        head = t.name.split()[0]  # op#N:k
        n, k = head[3:].split(":")
        op = graph.ops[int(n)]
        var_specs[op.outputs[int(k)]] = spec(t)
    out_specs = tuple(spec(t) for t in st.outputs)
    return ShardingPlan(st.mesh_shape, var_specs, {}, out_specs, st.predicted_time_s, st.compute_s, st.comm_s,
                        st.reshard_s, st.memory_bytes, st.argument_bytes, (), "reused", 0.0, 0, 0)


def parallelize(fun: Callable | None = None, **options) -> Any:
    """Decorator: `@autopar.parallelize` or `@autopar.parallelize(method=..., ...)`."""
    if fun is None:
        return lambda f: Parallelized(f, **options)
    return Parallelized(fun, **options)
