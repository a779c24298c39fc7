"""Render a Plan as readable rich tables (used by Plan.summary and `autopar inspect`)."""
from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table


def _fmt_bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_s(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"


def render_plan(plan, max_rows: int = 40, width: int = 160) -> str:
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    head = (f"autopar plan (schema {plan.schema_version}) method={plan.method}  stages={len(plan.stages)}  "
            f"micro-batches={plan.num_micro_batches}  predicted step={_fmt_s(plan.predicted_time_s)}  "
            f"planned in {plan.planning_time_s:.2f} s")
    con.print(head)
    if plan.memory_budget_bytes:
        con.print(f"memory budget per device: {_fmt_bytes(plan.memory_budget_bytes)}")
    st = Table(title="stages")
    for c in ("stage", "mesh", "devices", "layers", "time", "compute", "comm", "reshard", "comm bytes", "memory/dev", "args/dev", "solver"):
        st.add_column(c)
    for i, s in enumerate(plan.stages):
        st.add_row(str(i), f"{s.mesh_shape[0]}x{s.mesh_shape[1]}", ",".join(map(str, s.device_ids)),
                   "-" if s.layer_range is None else f"{s.layer_range[0]}..{s.layer_range[1]}",
                   _fmt_s(s.predicted_time_s), _fmt_s(s.compute_s), _fmt_s(s.comm_s), _fmt_s(s.reshard_s),
                   _fmt_bytes(s.comm_bytes), _fmt_bytes(s.memory_bytes), _fmt_bytes(s.argument_bytes),
                   f"{s.solver_status} ({s.solve_time_s:.2f} s)")
    con.print(st)
    for i, s in enumerate(plan.stages):
        t = Table(title=f"stage {i} shardings (mesh axes {s.axis_names[0]}={s.mesh_shape[0]}, {s.axis_names[1]}={s.mesh_shape[1]})")
        for c in ("kind", "name", "shape", "dtype", "spec"):
            t.add_column(c)
        rows = [("in", x) for x in s.inputs] + [("out", x) for x in s.outputs] + [("mid", x) for x in s.intermediates]
        for kind, x in rows[:max_rows]:
            t.add_row(kind, x.name, "x".join(map(str, x.shape)) or "()", x.dtype, x.spec_str())
        con.print(t)
        if len(rows) > max_rows:
            con.print(f"... {len(rows) - max_rows} more rows (autopar inspect --all shows them)")
        if s.collectives:
            con.print("predicted collectives: " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in sorted(s.collectives.items())))
        if s.remat:
            con.print(f"remat: {s.remat}")
    if plan.remat:
        con.print(f"remat: {plan.remat}")
    if plan.pipeline:
        con.print(f"pipeline: schedule={plan.schedule} " + ", ".join(f"{k}={v}" for k, v in plan.pipeline.items() if not isinstance(v, (list, dict))))
    return buf.getvalue()
