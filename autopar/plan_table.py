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
    # force_jupyter=False: in Jupyter rich would display the tables itself and write nothing to buf
    con = Console(file=buf, width=width, force_terminal=False, force_jupyter=False, color_system=None)
    head = (f"autopar plan (schema {plan.schema_version}) method={plan.method}  stages={len(plan.stages)}  "
            f"micro-batches={plan.num_micro_batches}  predicted step={_fmt_s(plan.predicted_time_s)}  "
            f"planned in {plan.planning_time_s:.2f} s")
    con.print(head)
    if plan.memory_budget_bytes:
        con.print(f"memory budget per device: {_fmt_bytes(plan.memory_budget_bytes)}")
    if plan.spmd_pipeline is not None:
        sp = plan.spmd_pipeline
        ticks = sp.num_micro_batches + sp.num_stages - 1
        con.print(f"SPMD pipeline: {sp.num_layers} layers in {sp.num_stages} stages (mesh axis x) x {sp.data_parallel} "
                  f"data-parallel (y), {sp.num_micro_batches} micro-batches of {sp.micro_batch_size}, {ticks} ticks "
                  f"of {_fmt_s(sp.tick_s)}; rest {_fmt_s(sp.rest_s)}, gradient sync {_fmt_s(sp.grad_sync_s)}"
                  + (f"; per-stage runtime predicted {_fmt_s(sp.per_stage_step_s)}"
                     if sp.per_stage_step_s is not None else ""))
    if plan.pipeline is not None:
        _pipeline_tables(con, plan)
    else:
        st = Table(title="stage")
        for c in ("mesh", "devices", "time", "compute", "comm", "reshard", "comm bytes", "memory/dev", "args/dev", "solver"):
            st.add_column(c)
        for s in plan.stages:
            st.add_row(f"{s.mesh_shape[0]}x{s.mesh_shape[1]}", ",".join(map(str, s.device_ids)),
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
        if s.kernels:
            kt = Table(title=f"stage {i} kernels ({sum(k.used for k in s.kernels)} of {len(s.kernels)} ops on tuned "
                             f"kernels; times of the local op on one device)")
            for c in ("op", "task", "serves", "tuned", "XLA", "why"):
                kt.add_column(c)
            for k in s.kernels[:max_rows]:
                kt.add_row(f"layer {k.layer} op {k.op}" if k.layer is not None else str(k.op), k.workload_key, "tuned kernel" if k.used else "XLA",
                           _fmt_s(k.tuned_s) if k.tuned_s is not None else "-",
                           _fmt_s(k.xla_s) if k.xla_s is not None else "-", k.reason)
            con.print(kt)
        elif s.kernel_tasks:
            con.print(f"kernel tasks: {len(s.kernel_tasks)} local ops a tuned kernel could serve "
                      f"({sum(k.ops for k in s.kernel_tasks)} ops); `autopar tune --plan PLAN.json` tunes them, "
                      "`kernels=\"cached\"` then uses them")
    if plan.remat is not None:
        r = plan.remat
        line = f"remat: mode={r.mode} applied={r.applied}"
        if r.applied == "rockmate":
            line += (f", activation budget {_fmt_bytes(r.activation_budget_bytes)}, predicted temp "
                     f"{_fmt_bytes(r.predicted_temp_bytes)}, {r.blocks} blocks")
        if r.measured_temp_bytes is not None:
            line += (f"; compiled: arguments {_fmt_bytes(r.measured_argument_bytes)} + temp "
                     f"{_fmt_bytes(r.measured_temp_bytes)} ({'fits' if r.measured_fits_budget else 'over'} the budget, "
                     f"{r.replans} re-plans)")
        con.print(line)
    return buf.getvalue()


def _pipeline_tables(con: Console, plan) -> None:
    p = plan.pipeline
    con.print(f"pipeline: schedule={p.schedule}  micro-batches={p.num_micro_batches} of {p.micro_batch_size}  "
              f"layers={p.num_layers}")
    if p.token_slices is not None:
        t = p.token_slices
        groups: dict[tuple, list[int]] = {}
        for b, sl in zip(t.micro_batch_sizes, t.slices):
            groups.setdefault((b, tuple(sl)), []).append(b)
        shown = "; ".join(f"{len(v)} x {b} seqs in slices {list(sl)}" for (b, sl), v in groups.items())
        con.print(f"token slices (TeraPipe, {t.seq_len} tokens, {t.slice_times} slice times): {shown}; "
                  f"predicted step {_fmt_s(t.predicted_step_s)} vs " +
                  (f"{_fmt_s(t.unsliced_step_s)} with whole sequences" if t.unsliced_step_s is not None
                   else "whole sequences, which do not fit these stages' memory"))
    if p.search is not None:
        s = p.search
        con.print(f"search: B candidates {list(s.micro_batch_candidates)}, priced {list(s.micro_batch_evaluated)}; "
                  f"L tried {list(s.layer_counts)}; {s.ilp_solves} layer ILPs, {s.dp_runs} stage DPs, "
                  f"{s.meshes_priced} logical meshes priced")
    t = Table(title="stages (per micro-batch unless noted)")
    for c in ("stage", "layers", "submesh", "mesh", "devices", "fwd", "bwd", "update/step", "compute", "comm",
              "reshard", "send", "remat", "in flight", "weights", "acts/mb", "working", "memory/dev"):
        t.add_column(c)
    for i, s in enumerate(plan.stages):
        remat = s.remat.mode if s.remat is not None else "none"
        if s.remat is not None and s.remat.mode != "none":
            remat += f" (+{_fmt_s(s.remat.recompute_s)})"
        t.add_row(str(i), f"{s.layer_range[0]}..{s.layer_range[1] - 1}", "x".join(map(str, s.submesh or ())),
                  f"{s.mesh_shape[0]}x{s.mesh_shape[1]}", _ids(s.device_ids), _fmt_s(s.forward_s),
                  _fmt_s(s.backward_s), _fmt_s(s.iteration_s), _fmt_s(s.compute_s), _fmt_s(s.comm_s),
                  _fmt_s(s.reshard_s), _fmt_s(s.send_s), remat, str(s.in_flight), _fmt_bytes(s.weight_bytes),
                  _fmt_bytes(s.activation_bytes), _fmt_bytes(s.working_bytes), _fmt_bytes(s.memory_bytes))
    con.print(t)


def _ids(ids) -> str:
    ids = list(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))
