"""What a token slice costs on a planned stage: t(batch, slice length, context length),
from the stage's intra-op ILP cost at its planned micro-batch (whole sequences).

The ILP prices one micro-batch of b0 sequences of T tokens with the stage's layouts.
A slice of l tokens after c tokens of context, for a micro-batch of b sequences, keeps
those layouts and scales each part of that cost by what it grows with:

- attention scores and weighted values (the `causal_attention` calls' matmuls): with
  b * l * (l + c), against b0 * T * T at the plan's shapes;
- everything else the devices compute, and the activations that collectives, reshards
  and stage sends move: with the tokens b * l, against b0 * T;
- but no pass over the stage's layers is faster than reading its weights from memory
  (forward and backward: 4 passes over the local parameters): a small slice is memory
  bound, which is why slices cannot be arbitrarily thin (TeraPipe's observation);
- each collective's latency, once per slice.

At (b0, T, 0) this is the ILP's per-micro-batch time whenever the stage is not bound by
its weight reads.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from autopar.attention import ATTENTION_CALL
from autopar.pipeline.planner import StageDecision
from autopar.pipeline.trace import TracedStep
from rockmate.graph import OpGraph, graph_from_jaxpr


@dataclass(frozen=True)
class StageSliceCost:
    """One stage's per-micro-batch cost split by how it scales with a slice (seconds at
    `micro_batch_size` sequences of `seq_len` tokens)."""

    micro_batch_size: int
    seq_len: int
    token_s: float            # compute that grows with the tokens
    attention_s: float        # attention matmuls over every (query, key) pair, forward + backward
    weight_floor_s: float     # reading the local weights in the forward and backward passes
    traffic_s: float          # collectives, reshards, sends: bandwidth part
    latency_s: float          # collectives: latency part, paid per slice

    def time_s(self, batch: Any, length: Any, context: Any = 0) -> Any:
        """Forward + backward of a slice of `length` tokens after `context` tokens, for
        `batch` sequences (numbers or numpy arrays)."""
        tokens = batch * length / (self.micro_batch_size * self.seq_len)
        pairs = batch * length * (length + context) / (self.micro_batch_size * self.seq_len ** 2)
        return (np.maximum(self.token_s * tokens, self.weight_floor_s) + self.attention_s * pairs
                + self.traffic_s * tokens + self.latency_s)


def attention_marked_loss(traced: TracedStep) -> OpGraph:
    """The micro-batch loss graph with the ops of each `causal_attention` call marked (same
    op numbering as `traced.loss`)."""
    return graph_from_jaxpr(traced.loss_jaxpr, keep_custom_rules=True, mark_calls=ATTENTION_CALL)


def stage_slice_cost(d: StageDecision, marked: OpGraph, seq_len: int, micro_batch_size: int,
                     mesh) -> StageSliceCost:
    """The slice cost of a planned stage; `marked`: `attention_marked_loss` of its trace,
    `mesh`: the stage's LogicalMesh."""
    ops = {i for lg in d.layers.layers for i in lg.spec.ops}
    flops, dtype = 0.0, "float32"
    for op in marked.ops:
        if op.index in ops and op.mark is not None and op.name == "dot_general":
            flops += op.flops
            dtype = marked.vars[op.outputs[0]].dtype
    passes = 4.0 if d.remat != "none" else 3.0          # forward (+ recomputed forward) + backward (2x)
    attention = mesh.compute_s(flops * passes / mesh.num_devices, dtype)
    c = d.cost
    token = max(c.compute_s - attention, 0.0)
    param_bytes = sum(sum(lc.param_bytes) for lc in d.costs)
    latency = len(c.collectives) * max(mesh.alpha_s) if c.collectives else 0.0
    traffic = max(c.comm_s + c.reshard_s + c.send_s - latency, 0.0)
    return StageSliceCost(micro_batch_size=micro_batch_size, seq_len=seq_len, token_s=token, attention_s=attention,
                          weight_floor_s=mesh.memory_s(4.0 * param_bytes), traffic_s=traffic, latency_s=latency)


def item_time_s(stages: Sequence[StageSliceCost], batch: Any, length: Any, context: Any) -> Any:
    """A work item's time on the slowest stage (numbers or numpy arrays)."""
    return functools.reduce(np.maximum, (s.time_s(batch, length, context) for s in stages))
