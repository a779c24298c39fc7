"""`autopar.parallelize`: the decorator that traces, plans, lowers and runs a train step."""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
import numpy as np

from autopar.cluster import Cluster, parse_memory
from autopar.distributed import is_multi_process, next_plan_key, shared_text
from autopar.executable import LoweredStep
from autopar.interface import PlanRequest, check_devices
from autopar.methods import method_for_plan, resolve_method
from autopar.plan import Plan, PlanFileError
from autopar.static_leaves import SplitCall, StaticStep, describe_static, split_call, traced_mask


def signature_of(args: tuple, kwargs: dict) -> str:
    """Input signature a plan is cached under: pytree structure, shapes and dtypes of the
    traced leaves, and a description of each static leaf (see `static_leaves`)."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    shapes = ",".join(f"{jax.numpy.result_type(l).name}{list(np.shape(l))}" if traced
                      else f"static:{describe_static(l)}" for l, traced in zip(leaves, traced_mask((args, kwargs))))
    return f"{tree}|{shapes}"


def plan_request(fun: Callable, call: SplitCall, signature: str, **options) -> tuple[PlanRequest, StaticStep]:
    """Where a step's arguments enter autopar, for every method: the request holds the
    traced parts of the arguments and the step as a function of them (`StaticStep`, which
    closes over the static leaves and keeps the static outputs for `StaticStep.outputs`)."""
    step = StaticStep(fun, call)
    return PlanRequest(fun=step, args=call.args, kwargs=call.kwargs, signature=signature, **options), step


class Parallelized:
    """A train step planned and run by autopar; call it like the original function."""

    def __init__(self, fun: Callable, *, devices=None, method="auto", memory_budget=None, batch_argnums=(1,),
                 donate_argnums=(), remat="auto", tuning_db=None, plan=None, kernels="xla", tuning_trials=64):
        if remat not in ("auto", "none", "full"):
            raise ValueError(f"remat={remat!r}; use 'auto', 'none' or 'full'")
        if kernels not in ("xla", "cached", "tuned"):
            raise ValueError(f"kernels={kernels!r}; use 'xla' (XLA's code), 'cached' (tuned kernels already in the "
                             f"tuning DB) or 'tuned' (tune them now, tuning_trials per kernel)")
        if isinstance(tuning_trials, bool) or not isinstance(tuning_trials, int) or tuning_trials < 1:
            raise ValueError(f"tuning_trials must be a positive int, got {tuning_trials!r}")
        self.kernels, self.tuning_trials = kernels, tuning_trials
        self.fun = fun
        self.devices = check_devices(devices) if devices is not None else None
        self.method = resolve_method(method)
        self.memory_budget_bytes = parse_memory(memory_budget) if memory_budget is not None else None
        self.batch_argnums = tuple(batch_argnums) if not isinstance(batch_argnums, int) else (batch_argnums,)
        self.donate_argnums = tuple(donate_argnums) if not isinstance(donate_argnums, int) else (donate_argnums,)
        self.remat = remat
        self.tuning_db = tuning_db
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan= takes an autopar.Plan or the path of a saved one, got {type(plan).__name__}")
        self.fixed_plan: Plan | None = plan
        # (input signature, static leaves) -> (Executable, the step it traced)
        self._cache: dict[tuple, tuple[Any, StaticStep]] = {}
        self.plan: Plan | None = None
        functools.update_wrapper(self, fun)

    def _entry(self, args: tuple, kwargs: dict) -> tuple[Any, StaticStep, SplitCall]:
        """The executable for these inputs (planned or restored on a cache miss), the step
        it traced, and the call's arguments split for it."""
        call = split_call(args, kwargs)
        sig = signature_of(args, kwargs)
        key = (sig, call.cache_key)
        if key not in self._cache:
            devices = self.devices if self.devices is not None else list(jax.devices())
            request, step = plan_request(
                self.fun, call, sig, cluster=Cluster.from_devices(devices),
                memory_budget_bytes=self.memory_budget_bytes, batch_argnums=self.batch_argnums, remat=self.remat,
                devices=tuple(devices), donate_argnums=self.donate_argnums, tuning_db=self.tuning_db,
                device_ids=tuple(d.id for d in devices), kernels=self.kernels, tuning_trials=self.tuning_trials)
            if self.fixed_plan is not None:
                if self.fixed_plan.signature != sig:
                    raise PlanFileError("the saved plan was made for inputs with a different signature:\n"
                                        f"  plan:  {self.fixed_plan.signature[:300]}\n  given: {sig[:300]}\n"
                                        "re-plan (drop plan=...) or pass inputs shaped like the planned ones")
                method = method_for_plan(self.fixed_plan, self.method)
                planned = method.restore(self.fixed_plan, request)
            elif is_multi_process():
                method, planned = self._plan_once_for_all(request)
            else:
                method = self.method
                planned = method.plan(request)
            self._cache[key] = (method.build(planned, request), step)
        exe, step = self._cache[key]
        return exe, step, call

    def _plan_once_for_all(self, request: PlanRequest) -> tuple[Any, Any]:
        """With several processes: plan on process 0, the others restore its plan, so every
        process runs the same programs."""
        made = []

        def make() -> str:
            made.append(self.method.plan(request))
            return made[0].plan.to_json()

        text = shared_text(next_plan_key(), make)
        if made:
            return self.method, made[0]
        plan = Plan.from_json(text)
        method = method_for_plan(plan, self.method)
        return method, method.restore(plan, request)

    def _executable(self, args: tuple, kwargs: dict) -> Any:
        """The method's executable for these inputs; it takes `split_call(args, kwargs).args`."""
        return self._entry(args, kwargs)[0]

    def get_plan(self, *args, **kwargs) -> Plan:
        """Plan (or fetch the cached plan) without running."""
        return self._executable(args, kwargs).plan

    def lower(self, *args, **kwargs) -> LoweredStep:
        exe, _, call = self._entry(args, kwargs)
        return exe.lower(*call.args, **call.kwargs)

    def __call__(self, *args, **kwargs):
        exe, step, call = self._entry(args, kwargs)
        out = exe(*call.args, **call.kwargs)
        self.plan = exe.plan
        return step.outputs(out)


def make_plan(fun: Callable, *args, cluster: Cluster | str, method="auto", memory_budget=None,
              batch_argnums=(1,), remat: str = "auto", **kwargs) -> Plan:
    """Plan `fun(*args)` for a cluster that need not exist here (args may be ShapeDtypeStructs)."""
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    budget = parse_memory(memory_budget) if memory_budget is not None else None
    request, _ = plan_request(fun, split_call(args, kwargs), signature_of(args, kwargs), cluster=cluster,
                              memory_budget_bytes=budget, batch_argnums=tuple(batch_argnums), remat=remat)
    return resolve_method(method).plan(request).plan


def parallelize(fun: Callable | None = None, **options) -> Any:
    """Decorator: `@autopar.parallelize` or `@autopar.parallelize(method=..., ...)`."""
    if fun is None:
        return lambda f: Parallelized(f, **options)
    return Parallelized(fun, **options)
