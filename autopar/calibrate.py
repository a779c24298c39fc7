"""Calibrate the cluster's alpha-beta link model by timing real collectives.

`measure_collectives` is the only side effect: it compiles and runs all-reduce,
all-gather, reduce-scatter and all-to-all along each axis of a 2-D device mesh.
`fit_alpha_beta` turns the timings into latency and inverse bandwidth per axis by
non-negative least squares on the same formulas `LogicalMesh` uses, and `calibrate`
writes them into a `Cluster`'s links.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from autopar.cluster import Cluster, LinkSpec
from autopar.lower import build_mesh
from autopar.sharding_spec import AXIS_NAMES

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
DEFAULT_SIZES_BYTES = (2**12, 2**16, 2**20, 2**22)
_HLO_NAMES = {"all_reduce": "all-reduce", "all_gather": "all-gather",
              "reduce_scatter": "reduce-scatter", "all_to_all": "all-to-all"}


def bandwidth_factor(collective: str, n: int) -> float:
    """c in t = alpha + c * nbytes * beta for a ring collective over n devices."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
    return (2.0 if collective == "all_reduce" else 1.0) * (n - 1) / n


@dataclass(frozen=True)
class Measurement:
    """Timings of one collective on one mesh axis; `nbytes` follows LogicalMesh's
    convention (all-reduce/all-to-all: per-device buffer, all-gather: gathered result,
    reduce-scatter: full input)."""

    collective: str
    axis: int
    axis_size: int
    nbytes: int
    times_s: tuple[float, ...]

    @property
    def time_s(self) -> float:
        """Median of the repeats: robust to a stray slow run on a shared machine."""
        return float(statistics.median(self.times_s))

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"times_s": list(self.times_s)}

    @staticmethod
    def from_json(d: dict) -> "Measurement":
        return Measurement(str(d["collective"]), int(d["axis"]), int(d["axis_size"]),
                           int(d["nbytes"]), tuple(float(t) for t in d["times_s"]))


@dataclass(frozen=True)
class AxisFit:
    """Fitted alpha/beta of one mesh axis and how well they explain the measurements."""

    axis: int
    alpha_s: float
    beta_s_per_byte: float
    rel_rms_residual: float     # sqrt(mean(((pred - t) / t)^2))
    num_points: int


# ---- the measured programs -------------------------------------------------------------

def _mesh(devices: Sequence[Any], mesh_shape: tuple[int, int]):
    """The project's one mesh builder (row-major in the given order, axes AXIS_NAMES):
    axis 1 walks consecutive devices, which is what Cluster.logical_mesh assumes."""
    if len(mesh_shape) != 2 or min(mesh_shape) < 1:
        raise ValueError(f"mesh_shape must be two positive ints, got {mesh_shape!r}")
    return build_mesh(list(devices), tuple(mesh_shape))


def _elements(nbytes: int, n: int) -> int:
    """float32 elements per device for about `nbytes`, divisible by the group size n."""
    return max(n, int(round(nbytes / 4 / n)) * n)


def collective_program(mesh, collective: str, axis: int, nbytes: int) -> tuple[Callable, Any, int]:
    """A jitted SPMD program that runs `collective` on mesh `axis` k times in a loop
    (k is a runtime argument), an example input and the exact nbytes it moves."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    name = AXIS_NAMES[axis]
    n = mesh.shape[name]
    m = _elements(nbytes, n)

    # Each body feeds its result into the next iteration so XLA cannot hoist the
    # collective out of the loop; the extra local ops touch at most m/n elements.
    if collective == "all_reduce":
        local, body = m, lambda i, x: lax.psum(x, name)
    elif collective == "all_gather":
        local = m // n
        body = lambda i, x: lax.all_gather(x, name, axis=1, tiled=True)[:, :local]
    elif collective == "reduce_scatter":
        local = m
        body = lambda i, x: lax.dynamic_update_slice(
            x, lax.psum_scatter(x, name, scatter_dimension=1, tiled=True), (0, 0))
    elif collective == "all_to_all":
        local, body = m, lambda i, x: lax.all_to_all(x, name, 1, 1, tiled=True)
    else:
        raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")

    spec = P(AXIS_NAMES)
    fn = jax.shard_map(lambda x, k: lax.fori_loop(0, k, body, x), mesh=mesh,
                       in_specs=(spec, P()), out_specs=spec, check_vma=False)
    # Zeros stay zeros under repeated psum, so long loops never overflow.
    x = jax.device_put(jnp.zeros((mesh.size, local), jnp.float32), NamedSharding(mesh, spec))
    return jax.jit(fn), x, m * 4


def compiled_collective_hlo(devices: Sequence[Any], mesh_shape: tuple[int, int],
                            collective: str, axis: int, nbytes: int = 2**16) -> str:
    """The compiled (partitioned) HLO text of one measurement program, for inspection."""
    import jax.numpy as jnp
    mesh = _mesh(devices, mesh_shape)
    fn, x, _ = collective_program(mesh, collective, axis, nbytes)
    return fn.lower(x, jnp.int32(1)).compile().as_text()


def measure_collectives(devices: Sequence[Any], mesh_shape: tuple[int, int],
                        sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, repeats: int = 5,
                        collectives: Sequence[str] = COLLECTIVES,
                        loop_counts: tuple[int, int] = (2, 10)) -> list[Measurement]:
    """Time every collective on every mesh axis of size > 1, for each size.

    Each timing runs the collective k1 and k2 times inside one compiled loop and takes
    (t(k2) - t(k1)) / (k2 - k1), which cancels dispatch and loop-entry overhead; the
    program is warmed up once before timing. Collectives run in float32.
    """
    import jax.numpy as jnp
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    k1, k2 = loop_counts
    if not 0 <= k1 < k2:
        raise ValueError(f"loop_counts must be (k1, k2) with 0 <= k1 < k2, got {loop_counts}")
    if not sizes_bytes or min(sizes_bytes) <= 0:
        raise ValueError(f"sizes_bytes must be positive byte counts, got {sizes_bytes!r}")
    mesh = _mesh(devices, tuple(mesh_shape))
    out: list[Measurement] = []
    for axis in (0, 1):
        n = mesh_shape[axis]
        if n == 1:
            continue
        for collective in collectives:
            for size in sizes_bytes:
                fn, x, nbytes = collective_program(mesh, collective, axis, int(size))
                fn = fn.lower(x, jnp.int32(k1)).compile()
                fn(x, jnp.int32(k2)).block_until_ready()   # warm-up
                times = []
                for _ in range(repeats):
                    t = []
                    for k in (k1, k2):
                        start = time.perf_counter()
                        fn(x, jnp.int32(k)).block_until_ready()
                        t.append(time.perf_counter() - start)
                    times.append(max(t[1] - t[0], 0.0) / (k2 - k1))
                out.append(Measurement(collective, axis, n, nbytes, tuple(times)))
    return out


# ---- fitting -----------------------------------------------------------------------------

def fit_axis(measurements: Sequence[Measurement]) -> AxisFit:
    """Non-negative least squares of t = alpha + c(collective, n) * nbytes * beta over the
    measurements of one axis, weighted by 1/t so small and large messages count alike."""
    from scipy.optimize import nnls
    if not measurements:
        raise ValueError("fit_axis needs at least one measurement")
    axes = {m.axis for m in measurements}
    if len(axes) != 1:
        raise ValueError(f"fit_axis fits one mesh axis at a time, got axes {sorted(axes)}")
    t = np.array([m.time_s for m in measurements])
    x = np.array([bandwidth_factor(m.collective, m.axis_size) * m.nbytes for m in measurements])
    if len({float(v) for v in x}) < 2:
        raise ValueError("fit_axis needs measurements of at least two different message sizes "
                         "to tell latency from bandwidth")
    # Relative weighting, floored so a zero/negative-clipped timing cannot blow up.
    w = 1.0 / np.maximum(t, max(float(np.median(t)) * 1e-3, 1e-12))
    x_scale = float(np.max(x))
    a = np.stack([w, w * x / x_scale], axis=1)
    (alpha, beta_scaled), _ = nnls(a, w * t)
    beta = beta_scaled / x_scale
    pred = alpha + x * beta
    rel = (pred - t) / np.maximum(t, 1e-12)
    return AxisFit(axis=axes.pop(), alpha_s=float(alpha), beta_s_per_byte=float(beta),
                   rel_rms_residual=float(np.sqrt(np.mean(rel**2))), num_points=len(t))


def fit_alpha_beta(measurements: Sequence[Measurement], num_axes: int = 2
                   ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(alpha_s, beta_s_per_byte), one entry per mesh axis; axes without measurements
    (size-1 axes, where every collective is free) get 0.0."""
    alpha = [0.0] * num_axes
    beta = [0.0] * num_axes
    for axis in sorted({m.axis for m in measurements}):
        if not 0 <= axis < num_axes:
            raise ValueError(f"measurement on axis {axis} but num_axes={num_axes}")
        f = fit_axis([m for m in measurements if m.axis == axis])
        alpha[axis], beta[axis] = f.alpha_s, f.beta_s_per_byte
    return tuple(alpha), tuple(beta)


def _link(alpha_s: float, beta_s_per_byte: float, which: str) -> LinkSpec:
    if not beta_s_per_byte > 0:
        raise ValueError(
            f"calibration of the {which} link found no bandwidth term (beta = 0): the timings "
            f"did not grow with message size. Measure larger sizes_bytes or more repeats.")
    return LinkSpec(bandwidth_Bps=1.0 / beta_s_per_byte, latency_s=alpha_s)


def calibrate(cluster: Cluster, devices: Sequence[Any] | None = None,
              sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, repeats: int = 5) -> Cluster:
    """`cluster` with link numbers measured on `devices` (default jax.devices()).

    Devices are grouped by process (host). The mesh is (hosts, devices per host): axis 1
    lies within a host and its fit becomes `intra_host`; axis 0 crosses hosts and its fit
    becomes `inter_host`. With a single host only `intra_host` is measured and
    `inter_host` keeps the cluster's numbers. Device specs are not changed.
    """
    if devices is None:
        import jax
        devices = jax.devices()
    by_host: dict[int, list[Any]] = {}
    for d in devices:
        by_host.setdefault(d.process_index, []).append(d)
    counts = {len(v) for v in by_host.values()}
    if len(counts) != 1:
        raise ValueError(f"calibrate needs the same number of devices per host, got "
                         f"{ {h: len(v) for h, v in sorted(by_host.items())} }")
    per_host = counts.pop()
    if len(by_host) == 1 and per_host == 1:
        raise ValueError("calibrate needs at least two devices to time collectives")
    ordered = [d for h in sorted(by_host) for d in by_host[h]]
    shape = (len(by_host), per_host)
    alpha, beta = fit_alpha_beta(measure_collectives(ordered, shape, sizes_bytes, repeats))
    intra = _link(alpha[1], beta[1], "intra-host") if per_host > 1 else cluster.intra_host
    inter = _link(alpha[0], beta[0], "inter-host") if len(by_host) > 1 else cluster.inter_host
    return dataclasses.replace(cluster, intra_host=intra, inter_host=inter)
