"""An analytic latency estimate of a Pallas program on a GPU, per kernel: launch cost plus the
larger of its compute and memory times at the share of the GPU its programs fill, plus the
serial steps of its reductions (each waits on its loads). A ranking prior for the cost model,
as `search.prior` is for C kernels; it needs only the plan, so it ranks the first batch too."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .expr import op_counts
from .pallas_plan import KernelPlan, PallasProgram, is_dot


@dataclass(frozen=True)
class GpuModel:
    """Throughputs of one GPU (defaults: an H100 SXM; fp32 on CUDA cores, since the kernels'
    dots run in full fp32, not on TF32 tensor cores)."""

    sms: int = 132
    flops_per_s: float = 67e12
    bytes_per_s: float = 3.35e12
    launch_s: float = 3e-6
    step_s: float = 5e-7            # one reduction step of a program: a round trip to memory
    elementwise_loss: float = 2.0   # a reduction that is not a dot builds its product tile first


@dataclass(frozen=True)
class KernelWork:
    """What one kernel does, summed over its programs."""

    programs: int
    flops: float
    dot_flops: float
    math_flops: float        # exp, tanh, rsqrt, ...
    bytes_read: float
    bytes_written: float
    serial_steps: int        # reduction steps one program takes, one after another
    once_flops: float        # the kernel's stages computed once each, without recomputation


def kernel_work(prog: PallasProgram, kp: KernelPlan) -> KernelWork:
    programs = math.prod(kp.grid)
    flops = dot = math_ops = 0.0
    steps = 0
    once = 0.0
    for sp in kp.stages:
        st = prog.stage(sp.name)
        points = math.prod(w for _, w in sp.region) * math.prod(a.extent for a in st.reduce_axes)
        ops = op_counts(st.body)
        f = points * (sum(ops.values()) + (1 if st.reduce_op else 0))
        widths = {a.name: w for a, (_, w) in zip(st.axes, sp.region)}
        widths.update({a.name: t for a, t in zip(st.reduce_axes, sp.reduce_tiles)})
        flops += f
        dot += f if is_dot(st, widths) else 0.0
        math_ops += points * ops["math"]
        steps += math.prod(a.extent // t for a, t in zip(st.reduce_axes, sp.reduce_tiles))
        once += st.flops()
    read = sum(4.0 * math.prod(r.read) for r in kp.reads)
    written = 4.0 * math.prod(kp.out_padded_shape)
    return KernelWork(programs, programs * flops, programs * dot, programs * math_ops, programs * read,
                      written, steps, once)


def kernel_estimate_s(work: KernelWork, model: GpuModel | None = None) -> float:
    """Estimated seconds of one kernel."""
    m = model or GpuModel()
    waves = -(-work.programs // m.sms)
    filled = work.programs / (waves * m.sms)  # share of the SMs busy, averaged over waves
    slow = work.flops - work.dot_flops
    compute = (work.dot_flops + m.elementwise_loss * slow) / (m.flops_per_s * filled)
    memory = (work.bytes_read + work.bytes_written) / (m.bytes_per_s * filled)
    return m.launch_s + max(compute, memory) + waves * work.serial_steps * m.step_s


def estimate_s(prog: PallasProgram, model: GpuModel | None = None) -> float:
    """Estimated latency of the whole program (a ranking prior, not a prediction to report)."""
    return sum(kernel_estimate_s(kernel_work(prog, k), model) for k in prog.kernels)
