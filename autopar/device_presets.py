"""What one accelerator and one link are, and datasheet numbers for known ones.

The planner's roofline and alpha-beta costs read these numbers; calibration
(`autopar.calibrate`) replaces the link numbers with measured ones.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

GiB = 2**30
MiB = 2**20


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name ("float32", "bfloat16", ...) for a string, numpy or jax dtype."""
    if isinstance(dtype, str):
        return _str_dtype_name(dtype)
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype).lower()


@functools.lru_cache(maxsize=None)
def _str_dtype_name(dtype: str) -> str:
    name = dtype.strip().lower()
    try:
        return np.dtype(name).name
    except TypeError:
        return name


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: dense peak FLOP/s per dtype, memory size and memory bandwidth."""

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth_Bps: float

    def __post_init__(self) -> None:
        if "float32" not in self.peak_flops:
            raise ValueError(
                f"DeviceSpec {self.name!r}: peak_flops needs a 'float32' entry (the fallback "
                f"for dtypes without their own number); got keys {sorted(self.peak_flops)}")
        for dt, flops in self.peak_flops.items():
            if not (float(flops) > 0 and np.isfinite(flops)):
                raise ValueError(f"DeviceSpec {self.name!r}: peak_flops[{dt!r}] must be a "
                                 f"positive finite FLOP/s number, got {flops!r}")
        if int(self.memory_bytes) <= 0:
            raise ValueError(f"DeviceSpec {self.name!r}: memory_bytes must be positive, "
                             f"got {self.memory_bytes!r}")
        if not (float(self.memory_bandwidth_Bps) > 0 and np.isfinite(self.memory_bandwidth_Bps)):
            raise ValueError(f"DeviceSpec {self.name!r}: memory_bandwidth_Bps must be a positive "
                             f"finite bytes/s number, got {self.memory_bandwidth_Bps!r}")
        # Normalise keys and freeze the mapping's contents into a plain dict copy.
        object.__setattr__(self, "peak_flops",
                           {dtype_name(k): float(v) for k, v in self.peak_flops.items()})
        object.__setattr__(self, "memory_bytes", int(self.memory_bytes))
        object.__setattr__(self, "memory_bandwidth_Bps", float(self.memory_bandwidth_Bps))
        # planners key their caches by device: hashed millions of times while planning
        object.__setattr__(self, "_hash", hash((self.name, tuple(sorted(self.peak_flops.items())), self.memory_bytes,
                                                self.memory_bandwidth_Bps)))

    def __hash__(self) -> int:
        return self._hash

    def peak_flops_for(self, dtype: Any) -> float:
        """Dense peak FLOP/s for `dtype`; dtypes without their own number use float32's."""
        return self.peak_flops.get(dtype_name(dtype), self.peak_flops["float32"])

    def compute_s(self, flops: float, dtype: Any) -> float:
        """Roofline compute time of `flops` FLOPs at peak for `dtype`, in seconds."""
        return float(flops) / self.peak_flops_for(dtype)

    def memory_s(self, nbytes: float) -> float:
        """Time to stream `nbytes` through device memory at peak bandwidth, in seconds."""
        return float(nbytes) / self.memory_bandwidth_Bps

    def to_json(self) -> dict:
        return {"name": self.name, "peak_flops": dict(self.peak_flops),
                "memory_bytes": self.memory_bytes,
                "memory_bandwidth_Bps": self.memory_bandwidth_Bps}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "DeviceSpec":
        missing = {"name", "peak_flops", "memory_bytes", "memory_bandwidth_Bps"} - set(d)
        if missing:
            raise ValueError(f"DeviceSpec JSON is missing {sorted(missing)}; got keys {sorted(d)}")
        return DeviceSpec(name=str(d["name"]), peak_flops=dict(d["peak_flops"]),
                          memory_bytes=int(d["memory_bytes"]),
                          memory_bandwidth_Bps=float(d["memory_bandwidth_Bps"]))


@dataclass(frozen=True)
class LinkSpec:
    """A link class between devices: bandwidth per device in one direction, and latency."""

    bandwidth_Bps: float
    latency_s: float

    def __post_init__(self) -> None:
        if not (float(self.bandwidth_Bps) > 0 and np.isfinite(self.bandwidth_Bps)):
            raise ValueError(f"LinkSpec: bandwidth_Bps must be a positive finite bytes/s "
                             f"number, got {self.bandwidth_Bps!r}")
        if not (float(self.latency_s) >= 0 and np.isfinite(self.latency_s)):
            raise ValueError(f"LinkSpec: latency_s must be a non-negative finite number of "
                             f"seconds, got {self.latency_s!r}")
        object.__setattr__(self, "bandwidth_Bps", float(self.bandwidth_Bps))
        object.__setattr__(self, "latency_s", float(self.latency_s))

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / self.bandwidth_Bps

    def to_json(self) -> dict:
        return {"bandwidth_Bps": self.bandwidth_Bps, "latency_s": self.latency_s}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "LinkSpec":
        missing = {"bandwidth_Bps", "latency_s"} - set(d)
        if missing:
            raise ValueError(f"LinkSpec JSON is missing {sorted(missing)}; got keys {sorted(d)}")
        return LinkSpec(bandwidth_Bps=float(d["bandwidth_Bps"]), latency_s=float(d["latency_s"]))


# ---------------------------------------------------------------------------------------
# Datasheet numbers. Dense (no structured sparsity) peaks. GPU memory is the capacity the
# driver reports (nvidia-smi "Total", in MiB); TPU memory is the HBM size per chip.
#
# NVIDIA V100 datasheet (SXM2): FP64 7.8 TF, FP32 15.7 TF, FP16 tensor core 125 TF (no bf16);
#   16GB HBM2 900 GB/s (the driver reports 16160 MiB).
# NVIDIA A100 datasheet (SXM4): FP64 tensor core 19.5 TF, FP32 19.5 TF, TF32 156 TF,
#   BF16/FP16 312 TF, INT8 624 TOPS; 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s.
# NVIDIA H100 datasheet (SXM5): FP64 tensor core 67 TF, FP32 67 TF, TF32 494.7 TF,
#   BF16/FP16 989.4 TF, FP8 1,978.9 TF, INT8 1,978.9 TOPS; 80GB HBM3 3.35 TB/s.
# NVIDIA H200 datasheet (SXM): same compute as H100 SXM; 141GB HBM3e 4.8 TB/s.
# Google Cloud TPU docs: v4 275 TF bf16/int8, 32 GiB HBM2, 1,200 GB/s;
#   v5e 197 TF bf16, 394 TOPS int8, 16 GiB HBM2, 819 GB/s;
#   v5p 459 TF bf16, 918 TOPS int8, 95 GiB HBM2e, 2,765 GB/s.
#   TPU float32 matmuls at JAX's default precision run as one bf16 MXU pass, so
#   float32 gets the bf16 peak (use precision="highest" and expect about 1/6 of it).
# "cpu" is a nominal host device (one simulated XLA CPU device), not a datasheet part:
#   use `autopar.calibrate` to replace its link numbers with measured ones.
# ---------------------------------------------------------------------------------------

def _v100(name: str, memory_bytes: int) -> DeviceSpec:
    return DeviceSpec(name, {"float64": 7.8e12, "float32": 15.7e12, "float16": 125e12}, memory_bytes, 900e9)


def _a100(name: str, memory_bytes: int, bandwidth_Bps: float) -> DeviceSpec:
    return DeviceSpec(name, {"float64": 19.5e12, "float32": 19.5e12, "tensorfloat32": 156e12,
                             "bfloat16": 312e12, "float16": 312e12, "int8": 624e12},
                      memory_bytes, bandwidth_Bps)


def _hopper(name: str, memory_bytes: int, bandwidth_Bps: float) -> DeviceSpec:
    return DeviceSpec(name, {"float64": 67e12, "float32": 67e12, "tensorfloat32": 494.7e12,
                             "bfloat16": 989.4e12, "float16": 989.4e12,
                             "float8_e4m3fn": 1978.9e12, "float8_e5m2": 1978.9e12,
                             "int8": 1978.9e12},
                      memory_bytes, bandwidth_Bps)


def _tpu(name: str, bf16: float, int8: float, memory_bytes: int, bandwidth_Bps: float) -> DeviceSpec:
    return DeviceSpec(name, {"float32": bf16, "bfloat16": bf16, "int8": int8},
                      memory_bytes, bandwidth_Bps)


PRESETS: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec("cpu", {"float64": 5e10, "float32": 1e11, "bfloat16": 5e10,
                              "float16": 5e10}, 16 * GiB, 2e10),
    "v100-16g": _v100("v100-16g", 16160 * MiB),
    "a100-40g": _a100("a100-40g", 40960 * MiB, 1555e9),
    "a100-80g": _a100("a100-80g", 81920 * MiB, 2039e9),
    "h100": _hopper("h100", 81559 * MiB, 3.35e12),
    "h200": _hopper("h200", 143771 * MiB, 4.8e12),
    "tpu-v4": _tpu("tpu-v4", 275e12, 275e12, 32 * GiB, 1200e9),
    "tpu-v5e": _tpu("tpu-v5e", 197e12, 394e12, 16 * GiB, 819e9),
    "tpu-v5p": _tpu("tpu-v5p", 459e12, 918e12, 95 * GiB, 2765e9),
}

# Other spellings accepted by `Cluster.preset` / `Cluster.parse`.
ALIASES: dict[str, str] = {
    "v100": "v100-16g", "v100-16gb": "v100-16g", "p3.16xlarge": "v100-16g",
    "a100": "a100-80g", "a100-80gb": "a100-80g", "a100-40gb": "a100-40g",
    "h100-80g": "h100", "h100-sxm": "h100", "h200-141g": "h200", "h200-sxm": "h200",
    "v4": "tpu-v4", "v5e": "tpu-v5e", "tpu-v5-lite": "tpu-v5e", "v5p": "tpu-v5p", "host": "cpu",
}

# Links per preset: (intra_host, inter_host), bandwidth per device and direction.
#   p3.16xlarge (TeraPipe's hosts): NVLink2 hybrid cube mesh, 6 links x 25 GB/s per V100
#     per direction, not every pair directly linked: about 130 GB/s for a ring over all 8;
#     25 Gbps Ethernet per host shared by its 8 GPUs -> 3.125 GB/s / 8 per device.
#   DGX A100: NVLink3 600 GB/s bidirectional per GPU -> 300 GB/s per direction;
#     one HDR InfiniBand 200 Gb/s NIC per GPU -> 25 GB/s.
#   DGX H100/H200: NVLink4 900 GB/s bidirectional -> 450 GB/s; NDR 400 Gb/s per GPU -> 50 GB/s.
#   TPU: hosts of one slice are joined by ICI too, so both levels use ICI: per-chip ICI
#     bandwidth / number of links (v4 2400 Gb/s / 6, v5e 1600 Gb/s / 4, v5p 4800 Gb/s / 6).
#     Multi-slice DCN is not modelled by the presets; calibrate or build a Cluster by hand.
#   cpu: 8 simulated XLA CPU devices on 2 cores measured about 1 GB/s and 50 us per
#     collective (autopar.calibrate); 10 GbE between hosts.
# Latencies are typical small-message collective latencies, not datasheet numbers.
_NVLINK3 = LinkSpec(300e9, 5e-6)
_NVLINK4 = LinkSpec(450e9, 5e-6)
_HDR_IB = LinkSpec(25e9, 1e-5)
_NDR_IB = LinkSpec(50e9, 1e-5)
LINK_PRESETS: dict[str, tuple[LinkSpec, LinkSpec]] = {
    "v100-16g": (LinkSpec(130e9, 5e-6), LinkSpec(3.125e9 / 8, 3e-5)),
    "cpu": (LinkSpec(1e9, 5e-5), LinkSpec(1.25e9, 5e-5)),
    "a100-40g": (_NVLINK3, _HDR_IB),
    "a100-80g": (_NVLINK3, _HDR_IB),
    "h100": (_NVLINK4, _NDR_IB),
    "h200": (_NVLINK4, _NDR_IB),
    "tpu-v4": (LinkSpec(50e9, 5e-6), LinkSpec(50e9, 1e-5)),
    "tpu-v5e": (LinkSpec(50e9, 5e-6), LinkSpec(50e9, 1e-5)),
    "tpu-v5p": (LinkSpec(100e9, 5e-6), LinkSpec(100e9, 1e-5)),
}


def resolve_preset_name(name: str) -> str:
    """The canonical preset name for `name` or an alias; ValueError listing known names."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(
            f"unknown device preset {name!r}; known presets: {', '.join(sorted(PRESETS))} "
            f"(aliases: {', '.join(sorted(ALIASES))}). Build a DeviceSpec by hand for other devices.")
    return key


def preset_for_device_kind(platform: str, device_kind: str) -> str:
    """Map a jax device's (platform, device_kind) to a preset name; ValueError if unknown."""
    platform = platform.lower()
    kind = device_kind.lower()
    if platform == "cpu":
        return "cpu"
    if platform in ("gpu", "cuda", "rocm"):
        if "h200" in kind:
            return "h200"
        if "h100" in kind:
            return "h100"
        if "v100" in kind:
            return "v100-16g"
        if "a100" in kind:
            return "a100-80g" if "80g" in kind else "a100-40g"
    if platform == "tpu":
        if "v4" in kind:
            return "tpu-v4"
        if "v5 lite" in kind or "v5e" in kind or "v5litepod" in kind:
            return "tpu-v5e"
        if "v5" in kind:
            return "tpu-v5p"
    raise ValueError(
        f"no device preset matches platform {platform!r}, device_kind {device_kind!r}; known "
        f"presets: {', '.join(sorted(PRESETS))}. Use Cluster.preset(name, ...) or build a "
        f"Cluster with your own DeviceSpec.")
