"""The one interface every parallelization method implements, single-stage and pipeline.

`parallelize` only caches by input signature and calls these: `plan` (decide), `restore`
(a saved plan on freshly traced inputs, without deciding again) and `build` (an
executable step for the devices).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from autopar.cluster import Cluster
from autopar.executable import LoweredStep
from autopar.plan import Plan


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct of an array (kept as is if it already is one): methods trace and
    plan on these, so a step can be planned for arrays that are never allocated."""
    return x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))


@dataclass(frozen=True)
class PlanRequest:
    """One train step to plan: the function, example inputs (arrays or ShapeDtypeStructs),
    the cluster, and the user's options. `devices` is None when planning for a cluster
    that is not here (nothing can be compiled then). Made by `autopar.api.plan_request`:
    `args`/`kwargs` hold only traced leaves (static ones, such as an equinox module's
    activation functions, are None there) and `fun` takes them (`static_leaves.StaticStep`);
    `signature` describes the whole inputs, static leaves included."""

    fun: Callable[..., Any]
    args: tuple
    kwargs: dict
    cluster: Cluster
    signature: str
    memory_budget_bytes: int | None = None
    batch_argnums: tuple[int, ...] = (1,)
    remat: str = "auto"
    devices: tuple[Any, ...] | None = None
    donate_argnums: tuple[int, ...] = ()
    tuning_db: Any = None
    kernels: str = "xla"            # "xla" | "cached" | "tuned": tuned kernels for the plan's matmuls
    tuning_trials: int = 64         # per distinct kernel task, with kernels="tuned"
    device_ids: tuple[int, ...] = field(default=())

    @property
    def num_devices(self) -> int:
        return len(self.device_ids) if self.device_ids else self.cluster.num_devices


class Planned(Protocol):
    """A method's decision: the Plan plus whatever in-memory form building needs."""

    plan: Plan


class Executable(Protocol):
    """A planned train step for one input signature."""

    plan: Plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def lower(self, *args: Any, **kwargs: Any) -> LoweredStep: ...


class Method(Protocol):
    """How to parallelize: every method (baselines, the ILP, pipelines) implements these."""

    @property
    def name(self) -> str: ...

    def plan(self, request: PlanRequest) -> Planned: ...

    def restore(self, plan: Plan, request: PlanRequest) -> Planned: ...

    def build(self, planned: Planned, request: PlanRequest) -> Executable: ...


def check_devices(devices: Sequence[Any]) -> list[Any]:
    """The devices as a list of distinct jax devices; a clear error otherwise."""
    import jax

    devices = list(devices)
    if not devices:
        raise ValueError("devices=[] gives nothing to run on; pass jax devices (default: jax.devices())")
    bad = [d for d in devices if not isinstance(d, jax.Device)]
    if bad:
        raise TypeError(f"devices must be jax devices (e.g. jax.devices()[:4]), got {bad[0]!r} "
                        f"({type(bad[0]).__name__}); to pick devices by index use [jax.devices()[i] for i in ...]")
    seen: set[int] = set()
    dup = [d for d in devices if d.id in seen or seen.add(d.id)]
    if dup:
        raise ValueError(f"devices lists {dup[0]} more than once; each device can hold one place in a mesh. "
                         f"Pass distinct devices, e.g. jax.devices()[:{len(seen)}]")
    return devices
