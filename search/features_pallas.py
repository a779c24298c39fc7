"""Features of a Pallas program for the cost model: one dict per kernel (`pallas_call`), the
names in `cost_model.features.PALLAS_FEATURES`, marked `backend: "pallas"` so that a model is
never trained on C and Pallas programs together."""
from __future__ import annotations

import math

from .pallas_plan import PallasProgram
from .prior_pallas import GpuModel, kernel_estimate_s, kernel_work


def kernel_features(prog: PallasProgram) -> list[dict[str, float | str]]:
    """One feature dict per kernel, in launch order; each also carries the program's size
    (`out_elems`, `io_bytes`, the normalisers) and the kernel's analytic estimate `est_s`."""
    out_elems = float(math.prod(next(s.shape for s in prog.stages if s.name == prog.output)))
    io_bytes = 4.0 * (sum(math.prod(shape) for _, shape in prog.inputs) + out_elems)
    out: list[dict[str, float | str]] = []
    for k in prog.kernels:
        w = kernel_work(prog, k)
        waves = -(-w.programs // GpuModel().sms)
        block = math.prod(width for _, width in k.root.region)
        real = math.prod(prog.stage(k.name).shape)
        out.append({
            "backend": "pallas",
            "flops_total": w.flops, "flops_math": w.math_flops, "dot_share": w.dot_flops / max(w.flops, 1.0),
            "recompute": w.flops / max(w.once_flops, 1.0),
            "programs": float(w.programs), "waves": float(waves), "block_elems": float(block),
            "n_stages": float(len(k.stages)), "local_elems": float(sum(
                math.prod(width for _, width in sp.region) for sp in k.stages[:-1])),
            "reduce_steps": float(w.serial_steps), "padding": math.prod(k.out_padded_shape) / max(real, 1),
            "bytes_read": w.bytes_read, "bytes_written": w.bytes_written,
            "bytes_per_program": w.bytes_read / max(w.programs, 1),
            "arithmetic_intensity": w.flops / max(w.bytes_read + w.bytes_written, 1.0),
            "out_elems": out_elems, "io_bytes": io_bytes, "est_s": kernel_estimate_s(w),
        })
    return out
