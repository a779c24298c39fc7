"""Run a pipelined loss and its gradient: stage programs on their submeshes, tasks issued
from Python in schedule order.

Activations go to the stages that read them, and cotangents come back, with
`jax.device_put` into the receiving program's layout (`distributed.transfer`: across processes
through JAX's cross-host transfers); JAX's asynchronous dispatch
overlaps the stages. There is no RPC of our own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopar.distributed import transfer
from autopar.pipeline.schedule import Task
from autopar.pipeline.stage import StagePrograms


@dataclass
class PipelineRun:
    """What one pipelined gradient computation returns and what it observed."""

    loss: Any
    grads: dict[int, Any]                  # loss input position -> gradient, on the owner stage
    peak_live_micro_batches: list[int]     # per stage: most residual sets alive at once
    order: list[Task] = field(default_factory=list)
    peak_live_bytes: list[int] = field(default_factory=list)   # per stage: most residual bytes alive at once


_split = jax.jit(lambda x, B: tuple(x.reshape(B, x.shape[0] // B, *x.shape[1:])), static_argnums=1)


def split_micro_batches(x: Any, B: int) -> list[Any]:
    """B equal slices of x along axis 0 (one small program, on x's current devices)."""
    if B == 1:
        return [x]
    if isinstance(x, np.ndarray):
        return list(np.split(x, B))
    return list(_split(x, B))


class PipelineRuntime:
    """Runs forward/backward of the stages over micro-batches in a given task order."""

    def __init__(self, programs: Sequence[StagePrograms], order: Sequence[Task], num_micro_batches: int):
        self.programs = list(programs)
        self.order = list(order)
        self.num_micro_batches = num_micro_batches
        self.owner: dict[int, int] = {}          # param position -> first stage that reads it
        for s, p in enumerate(self.programs):
            for i in p.stage.param_inputs:
                self.owner.setdefault(i, s)
        self.producer = {v: s for s, p in enumerate(self.programs) for v in p.stage.out_acts}
        self.consumers = [{v: [t for t in range(s + 1, len(self.programs)) if v in self.programs[t].stage.in_acts]
                           for v in p.stage.out_acts} for s, p in enumerate(self.programs)]

    def param_sharding(self, pos: int):
        """Where parameter `pos` (loss input position) is stored: its owner stage's layout."""
        return self.programs[self.owner[pos]].param_sharding(pos)

    def run(self, inputs: Sequence[Any], diff_mask: Sequence[bool], split_mask: Sequence[bool]) -> PipelineRun:
        """Loss and gradients of the loss inputs `inputs` (at the full batch): inputs in
        `split_mask` are cut into micro-batches along axis 0, other non-parameters go whole
        to every micro-batch."""
        B = self.num_micro_batches
        micro = {i: (split_micro_batches(x, B) if split_mask[i] else [x] * B)
                 for i, x in enumerate(inputs) if not diff_mask[i]}
        params = [tuple(transfer(inputs[i], p.param_sharding(i)) for i in p.stage.param_inputs)
                  for p in self.programs]
        grad_acc = [tuple(jnp.zeros(x.shape, x.dtype, device=x.sharding) for x in ps) for ps in params]
        last = len(self.programs) - 1
        lp = self.programs[last]
        loss_scalar = lp.out_act_sharding(lp.stage.out_acts[0])
        loss_acc = jnp.zeros((), inputs_dtype(lp), device=loss_scalar)
        ct_loss = transfer(np.asarray(1.0 / B, inputs_dtype(lp)), lp.ct_sharding(lp.stage.out_acts[0]))
        inbox: dict[tuple[int, int, int], Any] = {}
        ct_inbox: dict[tuple[int, int, int], list] = {}
        residuals: dict[tuple[int, int], Any] = {}
        live = [0] * len(self.programs)
        peak = [0] * len(self.programs)
        live_bytes = [0] * len(self.programs)
        peak_bytes = [0] * len(self.programs)
        for task in self.order:
            s, m = task.stage, task.micro_batch
            prog = self.programs[s]
            st = prog.stage
            if task.kind == "F":
                batch = tuple(transfer(micro[i][m], prog.batch_sharding(i)) for i in st.batch_inputs)
                acts = tuple(inbox.pop((s, m, v)) for v in st.in_acts)
                outs, res, acc = prog.forward(params[s], batch, acts, loss_acc if s == last else ())
                if s == last:
                    loss_acc = acc
                residuals[(s, m)] = res
                live[s] += 1
                peak[s] = max(peak[s], live[s])
                live_bytes[s] += sum(x.nbytes for x in res)
                peak_bytes[s] = max(peak_bytes[s], live_bytes[s])
                for v, x in zip(st.out_acts, outs):
                    for t in self.consumers[s].get(v, ()):
                        inbox[(t, m, v)] = transfer(x, self.programs[t].in_act_sharding(v))
            else:
                res = residuals.pop((s, m))
                live[s] -= 1
                live_bytes[s] -= sum(x.nbytes for x in res)
                if s == last:
                    cts = (ct_loss,)
                else:
                    cts = tuple(_sum(ct_inbox.pop((s, m, v))) for v in prog.float_out_acts)
                grad_acc[s], act_grads = prog.backward(params[s], res, cts, grad_acc[s])
                for v, g in zip(prog.float_in_acts, act_grads):
                    src = self.producer[v]
                    ct_inbox.setdefault((src, m, v), []).append(
                        transfer(g, self.programs[src].ct_sharding(v)))
        grads: dict[int, Any] = {}
        for prog, acc in zip(self.programs, grad_acc):
            for i, g in zip(prog.stage.param_inputs, acc):
                g = transfer(g, self.param_sharding(i))
                grads[i] = g if i not in grads else grads[i] + g
        for i, d in enumerate(diff_mask):
            if d and i not in grads:     # a parameter no layer reads
                grads[i] = jnp.zeros_like(inputs[i])
        return PipelineRun(loss_acc, grads, peak, list(self.order), peak_bytes)


def inputs_dtype(prog: StagePrograms) -> Any:
    lg = prog.stage.layers[-1]
    return lg.graph.vars[lg.out_vars[0]].abstract().dtype


def _sum(values: list) -> Any:
    out = values[0]
    for v in values[1:]:
        out = out + v
    return out
