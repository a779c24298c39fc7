"""A plan's predictions against the programs XLA compiles for it: per-device memory and
collective bytes of every stage, from ahead-of-time compiles with abstract inputs (no data
is made, so a plan for a model far larger than this machine can be checked on simulated
CPU devices).

Compiled memory of a single-program stage is XLA's accounting (arguments + outputs +
temp - aliased). A pipeline stage holds its parameters, accumulators and optimizer state,
the residuals of the micro-batches in flight, and the working memory of the program
running; from the compiled forward, backward and update programs that is
max(forward total + accumulators + optimizer state, backward total + optimizer state,
update total) + (in flight - 1) x one micro-batch's residuals, where a program's total is
its arguments + outputs + temp - aliased. Collective bytes are read from
the HLO (`hlo_collectives`) in the cost model's conventions; XLA's CPU backend emits
all-reduce + slice where GPUs and TPUs emit reduce-scatter, so those two are compared
together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from autopar.hlo_collectives import bytes_by_kind
from autopar.plan import Plan


@dataclass(frozen=True)
class StageCheck:
    """One stage: predicted and compiled per-device memory and collective bytes."""

    stage: int
    predicted_memory_bytes: float
    compiled_memory_bytes: float
    predicted_collectives: dict[str, float]
    compiled_collectives: dict[str, float]

    @property
    def memory_ratio(self) -> float:
        """predicted / compiled memory."""
        return self.predicted_memory_bytes / self.compiled_memory_bytes if self.compiled_memory_bytes else float("nan")

    @property
    def predicted_collective_bytes(self) -> float:
        return float(sum(self.predicted_collectives.values()))

    @property
    def compiled_collective_bytes(self) -> float:
        return float(sum(self.compiled_collectives.values()))

    @property
    def collective_ratio(self) -> float:
        """predicted / compiled collective bytes (1 when both are zero)."""
        p, c = self.predicted_collective_bytes, self.compiled_collective_bytes
        return 1.0 if p == c == 0 else (p / c if c else float("inf"))


def merge_reduce_scatter(by_kind: dict[str, float]) -> dict[str, float]:
    """all-reduce and reduce-scatter together (the CPU backend lowers one as the other)."""
    out = dict(by_kind)
    out["all-reduce"] = out.get("all-reduce", 0.0) + out.pop("reduce-scatter", 0.0)
    return {k: v for k, v in out.items() if v}


def _single_memory(compiled: Any) -> float:
    m = compiled.memory_analysis()
    return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


@dataclass(frozen=True)
class SliceWorkingCheck:
    """One stage of a token-sliced pipeline: the working memory per device the plan
    predicts on its longest slice, against XLA's temp memory for that slice's forward and
    backward (the last such slice of its sequence: the most context)."""

    stage: int
    slice_tokens: int
    context_tokens: int
    predicted_bytes: float
    compiled_bytes: float

    @property
    def ratio(self) -> float:
        """predicted / compiled working memory."""
        return self.predicted_bytes / self.compiled_bytes if self.compiled_bytes else float("nan")


def check_slice_working(exe: Any, stages: Sequence[int] | None = None) -> list[SliceWorkingCheck]:
    """Compile each stage's (or the given stages') programs for the plan's longest token
    slice (from abstract inputs) and compare their temp memory with the plan's working
    memory."""
    from autopar.pipeline.token_eval import Slice

    plan: Plan = exe.plan
    sl = plan.pipeline.token_slices if plan.pipeline is not None else None
    if sl is None:
        raise ValueError("check_slice_working needs a token-sliced pipeline plan (token_slices != 1); "
                         "use check_executable for other plans")
    m = max(range(len(sl.slices)), key=lambda k: max(sl.slices[k]) * sl.micro_batch_sizes[k])
    lengths, size = sl.slices[m], sl.micro_batch_sizes[m]
    i = max(k for k, l in enumerate(lengths) if l == max(lengths))
    seq = Slice(int(sum(lengths[:i])), int(lengths[i]), sl.seq_len)
    out = []
    for s, (st, ts) in enumerate(zip(plan.stages, exe.runtime.stages)):
        if stages is not None and s not in stages:
            continue
        options = exe.programs[s].compiler_options
        temps = [low.compile(options).memory_analysis().temp_size_in_bytes for low in ts.lower(size, seq, lengths[:i])]
        out.append(SliceWorkingCheck(s, seq.length, seq.offset, st.working_bytes, float(max(temps))))
    return out


def check_executable(exe: Any, args: Sequence[Any], kwargs: dict | None = None) -> list[StageCheck]:
    """Compile `exe`'s programs (from abstract inputs) and compare with its plan."""
    plan: Plan = exe.plan
    if plan.pipeline is not None and plan.pipeline.token_slices is not None:
        raise ValueError("a token-sliced pipeline runs one program per slice: compare its working memory with "
                         "check_slice_working (its whole-stage memory check is not built)")
    compiled = exe.lower(*args, **(kwargs or {})).compile()
    out = []
    if plan.pipeline is None:
        st = plan.stages[0]
        prog = compiled.stages[0]
        return [StageCheck(0, st.memory_bytes, _single_memory(prog), merge_reduce_scatter(st.collectives),
                           merge_reduce_scatter(bytes_by_kind(prog.as_text())))]
    for s, (st, progs) in enumerate(zip(plan.stages, compiled.programs)):
        f, b = progs["forward"], progs["backward"]
        _, (params, residuals, _, accumulators) = exe.abstract_stage_args(s)
        residual = float(sum(_nbytes(x) for x in residuals))
        acc = float(sum(_nbytes(x) for x in accumulators))
        update, state = _update_memory(exe, s)
        memory = max(_single_memory(f) + acc + state, _single_memory(b) + state, update) + (st.in_flight - 1) * residual
        hlo = bytes_by_kind(progs["forward"].as_text())
        for k, v in bytes_by_kind(progs["backward"].as_text()).items():
            hlo[k] = hlo.get(k, 0.0) + v
        out.append(StageCheck(s, st.memory_bytes, float(memory), merge_reduce_scatter(st.collectives),
                              merge_reduce_scatter(hlo)))
    return out


def _update_memory(exe: Any, s: int) -> tuple[float, float]:
    """(total, optimizer state) bytes per device of stage s's compiled update program; the
    state is its inputs other than the stage's parameters and their gradients."""
    import jax

    if exe.updates is None or not exe.updates[s].prog.ops:
        return 0.0, 0.0
    run = exe.updates[s]
    step = exe.traced.step
    g = step.ops[exe.traced.grad_op]
    params_and_grads = {v for v, d in zip(g.inputs, exe.traced.diff_mask) if d} | set(g.outputs[1:])
    abstract = [jax.ShapeDtypeStruct(step.vars[v].shape, step.vars[v].abstract().dtype, sharding=sh)
                for v, sh in zip(run.prog.inputs, run.in_shardings)]
    state = float(sum(_nbytes(x) for v, x in zip(run.prog.inputs, abstract) if v not in params_and_grads))
    return _single_memory(run.jitted.lower(*abstract).compile()), state


def _nbytes(x: Any) -> int:
    from rockmate.graph.op_graph import dtype_itemsize

    n = 1
    for d in x.shape:
        n *= d
    shards = 1
    spec = getattr(getattr(x, "sharding", None), "spec", ())
    mesh = getattr(getattr(x, "sharding", None), "mesh", None)
    for part in spec:
        for axis in (part if isinstance(part, tuple) else (part,)):
            if axis is not None and mesh is not None:
                shards *= mesh.shape[axis]
    return n * dtype_itemsize(str(x.dtype)) // shards


def check_plan(fun: Callable, *args: Any, plan: Plan, devices: Sequence[Any] | None = None,
               batch_argnums: Sequence[int] = (1,)) -> list[StageCheck]:
    """Build a saved or made plan on these devices (default: jax.devices(), e.g. simulated
    CPU devices standing in for the plan's cluster) and compare it with what XLA compiles.
    `args` may be ShapeDtypeStructs; nothing runs."""
    exe, args = build_plan(fun, *args, plan=plan, devices=devices, batch_argnums=batch_argnums)
    return check_executable(exe, args)


def build_plan(fun: Callable, *args: Any, plan: Plan, devices: Sequence[Any] | None = None,
               batch_argnums: Sequence[int] = (1,)) -> tuple[Any, tuple]:
    """The executable of a saved or made plan on these devices (default: jax.devices())
    and the arguments its programs take; `args` may be ShapeDtypeStructs, nothing runs."""
    import jax

    from autopar.api import Parallelized

    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < plan.num_devices:
        raise ValueError(f"the plan uses {plan.num_devices} devices but only {len(devices)} are here; on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={plan.num_devices} before jax starts")
    step = Parallelized(fun, devices=devices[:plan.num_devices], plan=_on_devices(plan, devices),
                        batch_argnums=batch_argnums)
    from autopar.static_leaves import split_call

    return step._executable(args, {}), split_call(args, {}).args


def _on_devices(plan: Plan, devices: Sequence[Any]) -> Plan:
    """The plan with its device ids (0..N-1 of a cluster that is not here) mapped onto
    `devices` in order."""
    from dataclasses import replace

    ids = sorted({i for st in plan.stages for i in st.device_ids})
    to = {i: devices[k].id for k, i in enumerate(ids)}
    return replace(plan, stages=tuple(replace(st, device_ids=tuple(to[i] for i in st.device_ids)) for st in plan.stages))
