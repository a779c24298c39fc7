"""Tuned kernels confirmed in the step itself. A kernel that beats XLA's code for its op in
isolation can still slow the step: inside the whole program XLA multiplies transposed
operands in place and fuses a dot with its element-wise neighbours, which a custom call
prevents. So the kernels chosen head to head are kept task by task (largest isolated gain
first) only while the planned step, timed on its own example inputs against the step
without them, gets faster. The decision is stored in the tuning DB (profile kind
"kernel_in_step") and reused by `kernels="cached"`.
"""
from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any, Callable, Sequence

import jax

from autopar.kernel_choice import ChosenKernels, interleaved_best_s

PROFILE_KIND = "kernel_in_step"
MARGIN = 0.02          # a kernel set must beat the current step by 2%: step times here vary by 1-5% run to run
ROUNDS = 5


def step_times(build: Callable[[ChosenKernels | None], Callable[..., Any]], args: tuple, kwargs: dict,
               a: ChosenKernels | None, b: ChosenKernels | None, rounds: int = ROUNDS) -> tuple[float, float]:
    """Best wall time of the step built with kernels `a` and with `b`, timed in alternating
    rounds after a warm-up call of each."""
    fa, fb = build(a), build(b)
    ta, tb = interleaved_best_s([lambda: fa(*args, **kwargs), lambda: fb(*args, **kwargs)], rounds)
    return ta, tb


def subset(chosen: ChosenKernels, keys: set[str]) -> ChosenKernels:
    """`chosen` with kernels only for the sites of the tasks in `keys`."""
    kernels = {op: k for op, k in chosen.kernels.items() if chosen.sites[op].task().workload_key in keys}
    return replace(chosen, kernels=kernels, sites={op: chosen.sites[op] for op in kernels})


def confirm_in_step(chosen: ChosenKernels, build: Callable[[ChosenKernels | None], Callable[..., Any]],
                    args: tuple, kwargs: dict, database: Any, context: str) -> ChosenKernels:
    """Keep the kernels of `chosen` whose tasks make the step faster (greedy, by isolated
    gain); the others' uses say "slower in the step". `context` identifies the program (its
    plan and mesh) for the stored decision."""
    if not chosen.kernels:
        return chosen
    gain: dict[str, float] = {}
    for u in chosen.uses:
        if u.used:
            gain[u.workload_key] = gain.get(u.workload_key, 0.0) + (u.xla_s - u.tuned_s)
    order = sorted(gain, key=lambda k: -gain[k])
    key = _profile_key(chosen, context)
    stored = database.get_profile(PROFILE_KIND, key) if database is not None else None
    if stored is not None:
        kept = set(stored["kept"])
    else:
        kept: set[str] = set()
        times: dict[str, float] = {}
        every = subset(chosen, set(order))
        t_none, t_all = step_times(build, args, kwargs, None, every)
        times["xla"], times["all"] = t_none, t_all
        if t_all < t_none * (1 - MARGIN):
            kept = set(order)
        else:
            best = t_none
            for k in order:
                t_best, t_try = step_times(build, args, kwargs, subset(chosen, kept) if kept else None,
                                           subset(chosen, kept | {k}))
                best = min(best, t_best)
                times[k] = t_try
                if t_try < best * (1 - MARGIN):
                    kept.add(k)
                    best = t_try
        if database is not None:
            database.put_profile(PROFILE_KIND, key, {"kept": sorted(kept), "step_s": times})
    final = subset(chosen, kept)
    uses = tuple(replace(u, used=False, reason="slower in the step") if u.used and u.workload_key not in kept else u
                 for u in chosen.uses)
    return replace(final, uses=uses)


def _profile_key(chosen: ChosenKernels, context: str) -> str:
    parts = sorted(f"{op}:{chosen.sites[op].task().workload_key}:{k.schedule!r}"
                   for op, k in chosen.kernels.items())
    return hashlib.sha256("|".join([context, *parts]).encode()).hexdigest()


def concrete(args: Sequence[Any]) -> bool:
    """Whether the example inputs are real arrays (the step can run), not abstract values."""
    return all(not isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(args))
