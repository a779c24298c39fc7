"""Token slices for a planned pipeline (TeraPipe): the slicing a user asked for, or the
one TeraPipe's DP chooses jointly with the batch split, priced on the chosen stages."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from autopar.attention import AttentionCall, attention_calls
from autopar.pipeline.planner import PipelineDecision
from autopar.pipeline.token_eval import Slice, check_sliceable, sized_loss
from autopar.pipeline.token_cost import StageSliceCost, attention_marked_loss, item_time_s, stage_slice_cost
from autopar.pipeline.token_profile import MeasuredSliceCost, profile_lengths, profile_stage
from autopar.pipeline.token_dp import (cost_table, granularity_for, item_depth, latency_s, token_dp,
                                       uniform_lengths)
from autopar.plan import TokenSlicing

MAX_UNITS = 64      # the auto DP cuts sequences at multiples of seq_len / 64 (or finer)


class MissingAttentionMarkerError(ValueError):
    """token_slices != 1 for a loss without `autopar.causal_attention`."""


def sequence_length(calls: Sequence[AttentionCall], token_slices: Any) -> int:
    """The sequence length the loss's `causal_attention` calls share."""
    if not calls:
        raise MissingAttentionMarkerError(
            f"token_slices={token_slices!r} needs the model's attention to be autopar.causal_attention(q, k, v) "
            f"(q, k, v: [batch, seq, heads, head_dim]); the traced loss has no causal_attention call, so autopar "
            f"cannot tell which positions may see which. Use autopar.causal_attention in the model "
            f"(it is plain causal attention outside a token pipeline) or token_slices=1")
    lengths = {(c.query_len, c.key_len) for c in calls}
    if len(lengths) != 1 or len({n for pair in lengths for n in pair}) != 1:
        raise ValueError(f"token slicing needs every causal_attention call to attend over the whole sequence "
                         f"(queries and keys of one length); found (query, key) lengths {sorted(lengths)}")
    return calls[0].query_len


def requested_lengths(token_slices: int | Sequence[int], seq_len: int) -> tuple[int, ...]:
    """The slice lengths of an int or list `token_slices`, checked against the sequence."""
    if isinstance(token_slices, int):
        if token_slices > seq_len:
            raise ValueError(f"token_slices={token_slices} is more slices than the sequence has tokens ({seq_len})")
        return uniform_lengths(seq_len, token_slices)
    lengths = tuple(int(l) for l in token_slices)
    if sum(lengths) != seq_len:
        raise ValueError(f"token_slices={list(lengths)} sums to {sum(lengths)} tokens, but the sequence has "
                         f"{seq_len}; give lengths that sum to {seq_len}")
    return lengths


def stage_slice_costs(planner: Any, decision: PipelineDecision, seq_len: int) -> list[StageSliceCost]:
    traced = decision.traced
    marked = attention_marked_loss(traced)
    return [stage_slice_cost(d, marked, seq_len, traced.micro_batch_size, planner.logical_mesh(d.logical_mesh))
            for d in decision.stages]


@dataclass(frozen=True)
class TokenPlan:
    """The chosen slicing and the slice costs of the stages it was priced on (modelled,
    or measured with profile=True)."""

    slicing: TokenSlicing
    stage_costs: tuple[StageSliceCost | MeasuredSliceCost, ...]
    forward_fraction: tuple[float, ...]         # per stage: forward time / (forward + backward)

    def task_s(self, stage: int, kind: str):
        """(micro-batch, slice) -> predicted time of that F or B task on `stage`."""
        sl = self.slicing
        cost, f = self.stage_costs[stage], self.forward_fraction[stage]

        def time_s(m: int, i: int) -> float:
            lengths = sl.slices[m]
            t = float(cost.time_s(sl.micro_batch_sizes[m], lengths[i], sum(lengths[:i])))
            return t * (f if kind == "F" else 1.0 - f)
        return time_s


def measured_stage_costs(planner: Any, decision: PipelineDecision, devices: Sequence[Any], seq_len: int,
                         sizes: Sequence[int], lengths: Sequence[int]) -> list[MeasuredSliceCost]:
    """Every stage's slice times measured on its devices (`token_profile`), for micro-batches
    of each of `sizes` sequences and slices of each of `lengths` tokens."""
    from autopar.pipeline.stage import stage_programs
    from autopar.pipeline.token_runtime import TokenStage, slice_losses

    losses = slice_losses(planner.tracer, decision.traced, seq_len, sizes)
    programs = stage_programs([d.placed() for d in decision.stages], devices, decision.num_micro_batches)
    return [profile_stage(TokenStage(p, losses, seq_len), sorted(sizes), sorted(set(lengths))) for p in programs]


def slice_caps(planner: Any, decision: PipelineDecision, seq_len: int, granularity: int,
               sizes: Sequence[int]) -> dict[int, int]:
    """Per micro-batch size, the longest slice (in units of `granularity` tokens) with which
    every stage's memory still holds: its weights, the residuals and keys and values of its
    micro-batches in flight, and its working memory on the slice, which shrinks with the
    slice's share of the micro-batch's planned tokens (`stage.working_bytes`). 0: none."""
    limit = planner.memory_limit_bytes * (1 + 1e-9)
    b0, n = decision.traced.micro_batch_size, seq_len // granularity

    def fits(b: int, units: int) -> bool:
        share = units * granularity * b / (seq_len * b0)
        return all(replace(d.cost, working_bytes=d.working_bytes_at(share)).memory_bytes(d.in_flight) <= limit
                   for d in decision.stages)

    caps = {}
    for b in sizes:
        lo, hi = 0, n           # fits(b, lo) or lo == 0; the working memory grows with the slice
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(b, mid) else (lo, mid - 1)
        caps[b] = lo
    return caps


def plan_token_slices(planner: Any, decision: PipelineDecision, token_slices: Any,
                      devices: Sequence[Any] | None = None) -> TokenPlan:
    """Token slices for the decision's stages: `token_slices` an int (equal slices), a list
    of lengths, or "auto" (TeraPipe's DP over slicings and batch splits into micro-batches
    no larger than the planned one, so that every stage's memory plan still holds, and
    dividing the batch, so that the step traces on them, and slices no longer than fit the
    stages' memory, `slice_caps`). With `devices` (profile=True) the slices are priced
    from times measured on them, else by the cost model."""
    traced = decision.traced
    T = sequence_length(attention_calls(traced.loss_jaxpr), token_slices)
    if token_slices != "auto":
        lengths = requested_lengths(token_slices, T)
    check_sliceable(sized_loss(traced, T), Slice(T // 2, T - T // 2, T) if T > 1 else Slice(0, 1, 1))
    b0, B = traced.micro_batch_size, decision.num_micro_batches
    g = granularity_for(T, MAX_UNITS)
    sizes = [b for b in range(1, b0 + 1) if (B * b0) % b == 0] if token_slices == "auto" else [b0]
    costs = stage_slice_costs(planner, decision, T) if devices is None else \
        measured_stage_costs(planner, decision, devices, T, sizes,
                             profile_lengths(T, g) if token_slices == "auto" else (*lengths, T))
    depth = item_depth([float(s.time_s(b0, T, 0)) for s in costs])
    update_s = sum(d.cost.iteration_s for d in decision.stages)

    def schedule_s(sizes: Sequence[int], slices: Sequence[Sequence[int]]) -> float:
        items = []
        for b, ls in zip(sizes, slices):
            ctx = np.concatenate([[0], np.cumsum(ls)[:-1]])
            items.extend(float(x) for x in np.atleast_1d(item_time_s(costs, b, np.asarray(ls), ctx)))
        return latency_s(items, depth) + update_s

    caps = slice_caps(planner, decision, T, g, sizes)
    unsliced = schedule_s([b0] * B, [(T,)] * B) if caps[b0] * g == T else None
    if token_slices == "auto":
        tables = {}
        for b in sizes:
            if caps[b]:
                tables[b] = cost_table(lambda l, c, b=b: item_time_s(costs, b, l, c), T, g)
                tables[b][caps[b]:, :] = np.inf         # longer slices do not fit the stages' memory
        best = token_dp(tables, B * b0, depth, granularity=g)
        sizes, slices, tried = best.micro_batch_sizes, best.slices, best.bounds_tried
    else:
        sizes, slices, tried = (b0,) * B, (lengths,) * B, 0
    slicing = TokenSlicing(seq_len=T, micro_batch_sizes=tuple(sizes), slices=tuple(tuple(s) for s in slices),
                           predicted_step_s=schedule_s(sizes, slices), unsliced_step_s=unsliced, bounds_tried=tried,
                           slice_times="model" if devices is None else "measured")
    fractions = tuple(c.forward_fraction if isinstance(c, MeasuredSliceCost) else
                      d.cost.forward_s / d.cost.micro_batch_s if d.cost.micro_batch_s > 0 else 0.5
                      for c, d in zip(costs, decision.stages))
    return TokenPlan(slicing=slicing, stage_costs=tuple(costs), forward_fraction=fractions)


def sliced_decision(decision: PipelineDecision, slicing: TokenSlicing) -> PipelineDecision:
    """The decision with each stage's working memory on the slicing's longest slice (the
    stage DP planned it for the longest slice it allowed)."""
    b0, T = decision.traced.micro_batch_size, slicing.seq_len
    share = max(max(ls) * b / (T * b0) for b, ls in zip(slicing.micro_batch_sizes, slicing.slices))
    stages = tuple(replace(d, cost=replace(d.cost, working_bytes=d.working_bytes_at(share))) for d in decision.stages)
    return replace(decision, stages=stages)
