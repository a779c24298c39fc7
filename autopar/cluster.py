"""The cluster model: hosts of identical devices, two link classes, and 2-D logical meshes
with alpha-beta collective costs per mesh axis (Alpa, OSDI'22, section 4 and 5).

Everything here is plain data and closed-form cost functions; `autopar.calibrate` measures
real collectives to fill in the link numbers.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from autopar.device_presets import (
    ALIASES, LINK_PRESETS, PRESETS, DeviceSpec, LinkSpec, preset_for_device_kind,
    resolve_preset_name,
)

__all__ = ["DeviceSpec", "LinkSpec", "Cluster", "LogicalMesh", "PRESETS", "ALIASES",
           "LINK_PRESETS", "parse_memory"]

_MEMORY_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}
_MEMORY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(value: int | float | str) -> int:
    """Bytes from an int or a string like "12GB" (1e9), "12GiB" (2**30), "500MB", "1.5TB"."""
    if isinstance(value, bool):
        raise ValueError(f"memory size must be a byte count or a string like '12GB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value} bytes")
        return value
    if isinstance(value, float):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"memory size must be a positive finite byte count, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"memory size must be an int or a string like '12GB', got "
                         f"{type(value).__name__} {value!r}")
    m = _MEMORY_RE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _MEMORY_UNITS:
        raise ValueError(
            f"cannot read memory size {value!r}; write a number and a unit, e.g. '12GB' "
            f"(decimal: KB MB GB TB) or '12GiB' (binary: KiB MiB GiB TiB), or a byte count")
    nbytes = int(float(m.group(1)) * _MEMORY_UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return nbytes


def _as_axes(axes: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    """Normalise an axis or tuple of axes; ValueError on out-of-range or repeated axes."""
    tup = (axes,) if isinstance(axes, int) else tuple(axes)
    for a in tup:
        if not isinstance(a, int) or isinstance(a, bool) or not 0 <= a < ndim:
            raise ValueError(f"mesh axis {a!r} is not one of the axes 0..{ndim - 1} of this mesh")
    if len(set(tup)) != len(tup):
        raise ValueError(f"mesh axes {tup} repeat an axis")
    return tup


@dataclass(frozen=True)
class LogicalMesh:
    """A 2-D view of devices with latency (alpha) and inverse bandwidth (beta) per axis."""

    shape: tuple[int, int]
    device: DeviceSpec
    alpha_s: tuple[float, float]
    beta_s_per_byte: tuple[float, float]

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        if len(shape) != 2 or min(shape) < 1:
            raise ValueError(f"LogicalMesh shape must be two positive ints, got {self.shape!r}")
        if len(self.alpha_s) != 2 or len(self.beta_s_per_byte) != 2:
            raise ValueError("LogicalMesh needs one alpha_s and one beta_s_per_byte per axis (2 each)")
        if min(self.alpha_s) < 0 or min(self.beta_s_per_byte) < 0:
            raise ValueError(f"LogicalMesh alpha/beta must be non-negative, got "
                             f"alpha_s={self.alpha_s}, beta_s_per_byte={self.beta_s_per_byte}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "alpha_s", tuple(float(a) for a in self.alpha_s))
        object.__setattr__(self, "beta_s_per_byte", tuple(float(b) for b in self.beta_s_per_byte))

    @property
    def num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    def axis_size(self, axes: int | Sequence[int]) -> int:
        """Number of devices in one group along `axes` (product of their sizes; () -> 1)."""
        return math.prod(self.shape[a] for a in _as_axes(axes, 2))

    def _alpha_beta(self, axes: int | Sequence[int]) -> tuple[int, float, float]:
        tup = _as_axes(axes, 2)
        n = math.prod(self.shape[a] for a in tup)
        if n == 1:
            return 1, 0.0, 0.0
        # Over several axes the slowest link bounds the ring.
        return (n, max(self.alpha_s[a] for a in tup if self.shape[a] > 1),
                max(self.beta_s_per_byte[a] for a in tup if self.shape[a] > 1))

    def all_reduce_s(self, nbytes: float, axes: int | Sequence[int]) -> float:
        """Ring all-reduce of an `nbytes` per-device buffer: alpha + 2(n-1)/n * nbytes * beta."""
        n, alpha, beta = self._alpha_beta(axes)
        return 0.0 if n == 1 else alpha + 2.0 * (n - 1) / n * float(nbytes) * beta

    def all_gather_s(self, nbytes: float, axes: int | Sequence[int]) -> float:
        """All-gather producing `nbytes` per device: alpha + (n-1)/n * nbytes * beta."""
        n, alpha, beta = self._alpha_beta(axes)
        return 0.0 if n == 1 else alpha + (n - 1) / n * float(nbytes) * beta

    def reduce_scatter_s(self, nbytes: float, axes: int | Sequence[int]) -> float:
        """Reduce-scatter of an `nbytes` input per device: alpha + (n-1)/n * nbytes * beta."""
        n, alpha, beta = self._alpha_beta(axes)
        return 0.0 if n == 1 else alpha + (n - 1) / n * float(nbytes) * beta

    def all_to_all_s(self, nbytes: float, axes: int | Sequence[int]) -> float:
        """All-to-all of an `nbytes` per-device buffer: alpha + (n-1)/n * nbytes * beta."""
        n, alpha, beta = self._alpha_beta(axes)
        return 0.0 if n == 1 else alpha + (n - 1) / n * float(nbytes) * beta

    def send_s(self, nbytes: float, axis: int) -> float:
        """One device sending `nbytes` to its neighbour along `axis`: alpha + nbytes * beta."""
        n, alpha, beta = self._alpha_beta(axis)
        return 0.0 if n == 1 else alpha + float(nbytes) * beta

    def compute_s(self, flops: float, dtype: Any) -> float:
        """Per-device compute time of `flops` FLOPs (roofline peak for `dtype`)."""
        return self.device.compute_s(flops, dtype)

    def memory_s(self, nbytes: float) -> float:
        """Per-device time to stream `nbytes` through memory."""
        return self.device.memory_s(nbytes)


def _axis_within_host(shape: tuple[int, int], axis: int, devices_per_host: int) -> bool:
    """True when every device group along `axis` of a row-major `shape` sits on one host."""
    rows, cols = shape
    if shape[axis] == 1:
        return True
    groups = ([[i * cols + j for j in range(cols)] for i in range(rows)] if axis == 1
              else [[i * cols + j for i in range(rows)] for j in range(cols)])
    return all(len({d // devices_per_host for d in g}) == 1 for g in groups)


@dataclass(frozen=True)
class Cluster:
    """`num_hosts` hosts of `devices_per_host` identical devices; fast links inside a host,
    slower ones between hosts."""

    device: DeviceSpec
    num_hosts: int
    devices_per_host: int
    intra_host: LinkSpec
    inter_host: LinkSpec

    def __post_init__(self) -> None:
        for field_name in ("num_hosts", "devices_per_host"):
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Cluster.{field_name} must be a positive int, got {v!r}")
        if not isinstance(self.device, DeviceSpec):
            raise ValueError(f"Cluster.device must be a DeviceSpec, got {type(self.device).__name__}")
        for field_name in ("intra_host", "inter_host"):
            if not isinstance(getattr(self, field_name), LinkSpec):
                raise ValueError(f"Cluster.{field_name} must be a LinkSpec")

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    # ---- construction -------------------------------------------------------------
    @staticmethod
    def preset(name: str, num_hosts: int = 1, devices_per_host: int = 8) -> "Cluster":
        """A cluster of preset devices with that family's usual links (see device_presets)."""
        key = resolve_preset_name(name)
        intra, inter = LINK_PRESETS[key]
        return Cluster(PRESETS[key], num_hosts, devices_per_host, intra, inter)

    @staticmethod
    def parse(spec: str) -> "Cluster":
        """A cluster from "HOSTSxDEVICES:preset" (e.g. "4x8:a100-80g") or a bare preset name."""
        if not isinstance(spec, str):
            raise ValueError(f"cluster spec must be a string like '4x8:a100-80g', got {spec!r}")
        m = re.fullmatch(r"\s*(?:(\d+)\s*[xX]\s*(\d+)\s*:)?\s*([A-Za-z0-9_.\-]+)\s*", spec)
        if m is None:
            raise ValueError(
                f"cannot read cluster spec {spec!r}; write HOSTSxDEVICES_PER_HOST:PRESET, e.g. "
                f"'4x8:a100-80g' (4 hosts of 8 A100-80GB), or just a preset name. Known presets: "
                f"{', '.join(sorted(PRESETS))}")
        hosts, per_host, name = m.groups()
        if hosts is None and re.fullmatch(r"\d+[xX]\d+", name):
            raise ValueError(f"cluster spec {spec!r} has no device preset; write e.g. "
                             f"'{name}:a100-80g'. Known presets: {', '.join(sorted(PRESETS))}")
        if hosts is None:
            return Cluster.preset(name)
        if int(hosts) < 1 or int(per_host) < 1:
            raise ValueError(f"cluster spec {spec!r}: hosts and devices per host must be >= 1")
        return Cluster.preset(name, int(hosts), int(per_host))

    @staticmethod
    def from_devices(devices: Iterable[Any] | None = None) -> "Cluster":
        """The cluster of these jax devices (default jax.devices()): hosts are process
        indices, the device type comes from platform / device_kind."""
        if devices is None:
            import jax
            devices = jax.devices()
        devices = list(devices)
        if not devices:
            raise ValueError("Cluster.from_devices needs at least one device")
        kinds = {(d.platform, d.device_kind) for d in devices}
        if len(kinds) != 1:
            raise ValueError(f"Cluster.from_devices needs identical devices; got {sorted(kinds)}")
        (platform, device_kind), = kinds
        key = preset_for_device_kind(platform, device_kind)
        per_process: dict[int, int] = {}
        for d in devices:
            per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
        counts = set(per_process.values())
        if len(counts) != 1:
            raise ValueError(f"Cluster.from_devices needs the same number of devices on every "
                             f"host (process); got {dict(sorted(per_process.items()))}")
        return Cluster.preset(key, num_hosts=len(per_process), devices_per_host=counts.pop())

    # ---- meshes -------------------------------------------------------------------
    def logical_mesh_shapes(self, num_devices: int | None = None) -> list[tuple[int, int]]:
        """Every 2-D shape (a, b) with a * b == num_devices (default: the whole cluster)."""
        n = self.num_devices if num_devices is None else num_devices
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_devices must be a positive int, got {n!r}")
        return [(a, n // a) for a in range(1, n + 1) if n % a == 0]

    def submesh_shapes(self) -> list[tuple[int, int]]:
        """Alpa's submesh shapes: (1, 2^k) inside one host, then (n, devices_per_host) for
        n = 2..num_hosts. (1, devices_per_host) is added when it is not a power of two."""
        shapes = []
        k = 1
        while k <= self.devices_per_host:
            shapes.append((1, k))
            k *= 2
        if shapes[-1] != (1, self.devices_per_host):
            shapes.append((1, self.devices_per_host))
        shapes.extend((n, self.devices_per_host) for n in range(2, self.num_hosts + 1))
        return shapes

    def logical_mesh(self, shape: tuple[int, int]) -> LogicalMesh:
        """The alpha-beta mesh over the first a*b devices laid out row-major (hosts hold
        consecutive devices): an axis uses intra-host links when each of its device groups
        sits on one host, inter-host links otherwise."""
        try:
            a, b = (int(s) for s in shape)
        except (TypeError, ValueError):
            raise ValueError(f"logical mesh shape must be a pair of ints, got {shape!r}") from None
        if a < 1 or b < 1:
            raise ValueError(f"logical mesh shape must be positive, got {shape!r}")
        if a * b > self.num_devices:
            raise ValueError(f"logical mesh {shape} needs {a * b} devices but the cluster has "
                             f"{self.num_devices} ({self.num_hosts}x{self.devices_per_host})")
        links = [self.intra_host if _axis_within_host((a, b), ax, self.devices_per_host)
                 else self.inter_host for ax in (0, 1)]
        return LogicalMesh((a, b), self.device, tuple(l.latency_s for l in links),
                           tuple(l.beta_s_per_byte for l in links))

    # ---- serialization ------------------------------------------------------------
    def to_json(self) -> dict:
        return {"device": self.device.to_json(), "num_hosts": self.num_hosts,
                "devices_per_host": self.devices_per_host,
                "intra_host": self.intra_host.to_json(), "inter_host": self.inter_host.to_json()}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "Cluster":
        if not isinstance(d, Mapping):
            raise ValueError(f"Cluster JSON must be an object (dict), got {type(d).__name__}")
        missing = {"device", "num_hosts", "devices_per_host", "intra_host", "inter_host"} - set(d)
        if missing:
            raise ValueError(f"Cluster JSON is missing {sorted(missing)}; got keys {sorted(d)}")
        return Cluster(DeviceSpec.from_json(d["device"]), int(d["num_hosts"]),
                       int(d["devices_per_host"]), LinkSpec.from_json(d["intra_host"]),
                       LinkSpec.from_json(d["inter_host"]))

    def __str__(self) -> str:
        return f"{self.num_hosts}x{self.devices_per_host}:{self.device.name}"
