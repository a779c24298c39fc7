"""Tuned kernels for a planned program: tune (or look up) the local matmul of every site,
time each against XLA's own code for the same local op, head to head on one device of this
machine, and keep a kernel only where it is faster. The comparison is stored in the
tuning DB (profile kind "kernel_vs_xla", keyed by the site's local op and the target) with
the records, so `kernels="cached"` reuses it.

Anything that goes wrong (no compiler, a kernel that fails to build or to match XLA's
result, an interrupted tuning run) leaves the affected ops to XLA, and says so once.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from autopar.kernel_sites import Site, kernel_tasks, search_task
from autopar.plan import KernelUse
from autopar.sharding_spec import to_partition_spec

KERNEL_MODES = ("xla", "cached", "tuned")
PROFILE_KIND = "kernel_vs_xla"


@dataclass
class ChosenKernels:
    """The decision for one program: what serves each site, and the kernels to call."""

    uses: tuple[KernelUse, ...]
    kernels: dict[int, Any]            # op index -> search.Kernel, for the sites it serves
    sites: dict[int, Site] = field(default_factory=dict)   # op index -> site, for the same ops
    shim: Any = None                   # the FFI shim the kernels are called through


def site_override(site: Site, kernel: Any, mesh: Mesh | None) -> Callable[[list], list]:
    """The op replaced by the kernel on every device's block (`eval_graph`'s override)."""
    run = site.local(kernel)
    if mesh is None or mesh.devices.size == 1:
        return lambda inputs: [run(*inputs)]
    f = jax.shard_map(run, mesh=mesh, in_specs=(to_partition_spec(site.lhs_spec), to_partition_spec(site.rhs_spec)),
                      out_specs=to_partition_spec(site.out_spec), check_vma=False)
    return lambda inputs: [f(*inputs)]


def overrides(chosen: ChosenKernels | None, mesh: Mesh | None) -> dict[int, Callable[[list], list]]:
    """Op index -> the kernel's replacement, for the ops `chosen` serves with kernels."""
    if chosen is None:
        return {}
    return {op: site_override(chosen.sites[op], k, mesh) for op, k in chosen.kernels.items()}


def interleaved_best_s(calls: Sequence[Callable[[], Any]], rounds: int, repeats: int = 1) -> list[float]:
    """Best wall time of each no-argument call (each waited for, after one warm-up call),
    timed in alternating rounds of `repeats` calls each, so that the machine's drift falls on
    all of them alike."""
    for call in calls:
        jax.block_until_ready(call())
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, call in enumerate(calls):
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                best[i] = min(best[i], time.perf_counter() - t0)
    return best


def head_to_head(site: Site, kernel: Any, xla_op: Callable[[Any, Any], Any], rounds: int = 3
                 ) -> tuple[float, float, float]:
    """(kernel s, XLA s, max relative error of the kernel) for the site's local op on one
    device (`xla_op(lhs, rhs)`: the op as the program has it), timed in interleaved rounds."""
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal(site.lhs_local, np.float32))
    rhs = jnp.asarray(rng.standard_normal(site.rhs_local, np.float32))
    tuned = jax.jit(site.local(kernel))
    xla = jax.jit(xla_op)
    want = np.asarray(xla(lhs, rhs))
    got = np.asarray(tuned(lhs, rhs))
    err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
    t_k, t_x = interleaved_best_s([lambda: tuned(lhs, rhs), lambda: xla(lhs, rhs)], rounds, repeats=7)
    return t_k, t_x, err


def _xla_op(op: Any) -> Callable[[Any, Any], Any]:
    """The graph op as a function of its two operands (XLA's code for it)."""
    params = op.primitive.get_bind_params(op.params)
    return lambda lhs, rhs: op.primitive.bind(lhs, rhs, **params)


def _profile_key(site: Site, workload: str, target: str) -> str:
    return f"{workload}|lhs{site.lhs_local}{site.lhs_perm}|rhs{site.rhs_local}{site.rhs_perm}|{target}"


class _Notes:
    """Warnings about ops left to XLA, each said once per choice."""

    def __init__(self):
        self.seen: set[str] = set()

    def say(self, message: str) -> None:
        if message not in self.seen:
            self.seen.add(message)
            warnings.warn(f"autopar kernels: {message}; those ops run with XLA's code", stacklevel=4)


@dataclass(frozen=True)
class SiteGroup:
    """The sites of one program piece: a single-stage program, or one layer of a pipeline
    stage (`layer`, its index in the loss), whose ops they index."""

    graph: Any
    sites: tuple[Site, ...]
    layer: int | None = None


def choose_kernels(graph: Any, sites: Sequence[Site], mode: str, trials: int, db: Any = None,
                   measure: Callable | None = None) -> ChosenKernels:
    """Kernels for `sites` of `graph`: `mode` "tuned" tunes every distinct local matmul with
    `trials` trials each (the task scheduler spends them where the expected gain is
    largest), "cached" uses only what the tuning DB holds."""
    return choose_group_kernels([SiteGroup(graph=graph, sites=tuple(sites))], mode, trials, db, measure)[0]


def choose_group_kernels(groups: Sequence[SiteGroup], mode: str, trials: int, db: Any = None,
                         measure: Callable | None = None) -> list[ChosenKernels]:
    """`choose_kernels` for several program pieces at once: their tasks are tuned together
    and each kernel is built once, whichever pieces it serves."""
    from search import tune_tasks
    from search.backend import CBackend, CompilerNotFoundError
    from search.tune import best_schedule, build, open_db

    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels={mode!r}: use one of {KERNEL_MODES}")
    sites = [s for g in groups for s in g.sites]
    if mode == "xla" or not sites:
        return [ChosenKernels(uses=(), kernels={}) for _ in groups]
    measure = measure or head_to_head
    notes = _Notes()

    def all_on_xla(reason: str) -> list[ChosenKernels]:
        return [ChosenKernels(uses=tuple(KernelUse(op=s.op, workload_key=s.task().workload_key, used=False,
                                                   reason=reason, layer=g.layer) for s in g.sites), kernels={})
                for g in groups]

    try:
        from autopar.ffi_kernels import FfiShim

        shim = FfiShim.get()
    except Exception as e:           # no C++ compiler, failed build: the whole step on XLA
        notes.say(f"the FFI shim is unavailable ({e})")
        return all_on_xla("FFI shim unavailable")
    try:
        target = CBackend().target_key()
    except CompilerNotFoundError as e:     # kernels are built with the C compiler: none, none to use
        notes.say(str(e).rstrip("."))
        return all_on_xla("no C compiler")
    database, owned = open_db(db)
    try:
        planned = kernel_tasks(sites)
        tasks = {kt.workload_key: search_task(kt) for kt in planned}
        counts = {kt.workload_key: kt.ops for kt in planned}
        if mode == "tuned":
            keys = sorted(tasks)
            try:
                # rounds no larger than the per-task budget, so every task gets measured
                tune_tasks([tasks[k] for k in keys], trials=trials * len(keys), weights=[counts[k] for k in keys],
                           db=database, batch_size=max(1, min(16, trials)))
            except KeyboardInterrupt:
                notes.say("tuning was interrupted; using what it measured")
            except Exception as e:
                notes.say(f"tuning failed ({type(e).__name__}: {e}); using what the tuning DB held")
        built: dict[str, Any] = {}
        for key, task in tasks.items():
            schedule = best_schedule(task, database)
            if schedule is None:
                continue
            try:
                built[key] = build(task, schedule)
            except Exception as e:
                notes.say(f"building the kernel of {task} failed ({type(e).__name__}: {e})")
        missing = sorted(set(tasks) - set(built))
        if missing:
            why = ("tuning found no valid kernel" if mode == "tuned" else
                   "the tuning DB holds no kernel (`autopar tune --plan` or kernels=\"tuned\" makes them)")
            notes.say(f"{why} for {len(missing)} of {len(tasks)} local ops' tasks ({', '.join(missing[:3])}"
                      f"{', ...' if len(missing) > 3 else ''})")
        return [_decide(g, built, database, target, measure, notes, shim) for g in groups]
    finally:
        if owned:
            database.close()


def _decide(group: SiteGroup, built: dict[str, Any], database: Any, target: str, measure: Callable, notes: _Notes,
            shim: Any) -> ChosenKernels:
    """Which of `group`'s sites a built kernel serves: those where it beat XLA head to head
    (measured once per local op and machine, then read from the DB) with XLA's result."""
    uses, kernels = [], {}
    for s in group.sites:
        key = s.task().workload_key
        kernel = built.get(key)
        if kernel is None:
            uses.append(KernelUse(op=s.op, workload_key=key, used=False, reason="no tuned schedule", layer=group.layer))
            continue
        pkey = _profile_key(s, key, target)
        prof = database.get_profile(PROFILE_KIND, pkey)
        if prof is None or prof.get("schedule") != repr(kernel.schedule):
            t_k, t_x, err = measure(s, kernel, _xla_op(group.graph.ops[s.op]))
            prof = {"tuned_s": t_k, "xla_s": t_x, "rel_error": err, "schedule": repr(kernel.schedule),
                    "workload_key": key, "target_key": target}
            database.put_profile(PROFILE_KIND, pkey, prof)
        if prof["rel_error"] > 1e-4:
            notes.say(f"the kernel of {key} does not match XLA's result (relative error {prof['rel_error']:.2g})")
            uses.append(KernelUse(op=s.op, workload_key=key, tuned_s=prof["tuned_s"], xla_s=prof["xla_s"],
                                  used=False, reason="wrong result", layer=group.layer))
            continue
        faster = prof["tuned_s"] < prof["xla_s"]
        uses.append(KernelUse(op=s.op, workload_key=key, tuned_s=prof["tuned_s"], xla_s=prof["xla_s"],
                              used=faster, reason="faster than XLA" if faster else "slower than XLA",
                              layer=group.layer))
        if faster:
            kernels[s.op] = kernel
    return ChosenKernels(uses=tuple(uses), kernels=kernels,
                         sites={s.op: s for s in group.sites if s.op in kernels}, shim=shim)
