"""Measured slice times for the token DP (`PipeshardParallel(token_slices=..., profile=True)`).

TeraPipe prices slices from measurements: a thin slice runs below the device's peak, and
every program pays a fixed launch cost, which the analytic slice model (`token_cost`) does
not see. Each planned stage's forward and backward of one slice is timed on the stage's
own devices, in its planned layouts, at a few slice lengths (the DP's granularity times
powers of two, and the whole sequence), each with no context and with the most context it
can have. Between those points

    t(l, c) = t(l, 0) + c * k(l),   k(l) = (t(l, T - l) - t(l, 0)) / (T - l),

linear in the context as the attention work is, and piecewise linear in l (past the
longest slice measured with context, k grows in proportion to l).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopar.pipeline.token_eval import Slice


@dataclass(frozen=True)
class SliceSample:
    """One measured slice: `batch` sequences, `length` tokens after `context` tokens."""

    batch: int
    length: int
    context: int
    forward_s: float
    backward_s: float

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class MeasuredSliceCost:
    """One stage's slice times, measured (same `time_s` interface as `StageSliceCost`)."""

    seq_len: int
    samples: tuple[SliceSample, ...]

    @property
    def batches(self) -> tuple[int, ...]:
        return tuple(sorted({s.batch for s in self.samples}))

    @property
    def forward_fraction(self) -> float:
        total = sum(s.time_s for s in self.samples)
        return sum(s.forward_s for s in self.samples) / total if total > 0 else 0.5

    def _curves(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Measured lengths, t(l, 0) and the context slope k(l) >= 0 for one micro-batch size."""
        mine = [s for s in self.samples if s.batch == batch]
        if not mine:
            raise ValueError(f"no slice of {batch} sequences was measured (measured sizes: {list(self.batches)})")
        T = self.seq_len
        lengths = np.array(sorted({s.length for s in mine}), dtype=np.float64)
        bare = {s.length: s.time_s for s in mine if s.context == 0}
        most = {s.length: s.time_s for s in mine if s.context == T - s.length and s.context > 0}
        t0 = np.array([bare[int(l)] for l in lengths])
        slope = np.array([max(most[int(l)] - bare[int(l)], 0.0) / (T - l) if int(l) in most else 0.0
                          for l in lengths])
        return lengths, t0, slope

    def time_s(self, batch: Any, length: Any, context: Any = 0) -> Any:
        """Forward + backward of a slice of `length` tokens after `context` tokens for `batch`
        sequences (a measured size; length and context may be numpy arrays)."""
        lengths, t0, slope = self._curves(int(batch))
        ls = np.asarray(length, dtype=np.float64)
        with_ctx = lengths < self.seq_len
        if with_ctx.any():
            lc, kc = lengths[with_ctx], slope[with_ctx]
            # past the longest slice measured with context, the context's work per token
            # grows with the slice's queries
            k = np.where(ls > lc[-1], kc[-1] * ls / lc[-1], np.interp(ls, lc, kc))
        else:
            k = np.zeros_like(ls)
        out = np.interp(ls, lengths, t0) + np.asarray(context, dtype=np.float64) * k
        return float(out) if np.ndim(out) == 0 else out


def profile_lengths(seq_len: int, granularity: int) -> tuple[int, ...]:
    """The slice lengths measured: the granularity times powers of two, and the sequence."""
    out, l = [], granularity
    while l < seq_len:
        out.append(l)
        l *= 2
    return (*out, seq_len)


def _zeros(sds: Any) -> Any:
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), sds)


def _best_of(call, repeats: int) -> tuple[Any, float]:
    """The result of call() and its best wall time of `repeats` runs after a first (compiling) one."""
    out = jax.block_until_ready(call())
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(call())
        best = min(best, time.perf_counter() - t0)
    return out, best


def measure_slice(stage: Any, batch: int, length: int, context: int, repeats: int = 3) -> SliceSample:
    """Time one slice's forward and backward on a `token_runtime.TokenStage`'s devices, on
    zero inputs of the slice's shapes and layouts."""
    T = stage.T
    seq = Slice(context, length, T)
    params, batch_in, acts, ctx = stage.abstract_args(batch, seq, (context,) if context else ())
    params, batch_in, acts, ctx = (_zeros(x) for x in (params, batch_in, acts, ctx))
    fwd, forward_s = _best_of(lambda: stage.forward(batch, seq, params, batch_in, acts, ctx), repeats)
    f_outs, _, kv, kept = fwd
    _, backward_s = _best_of(lambda: stage.backward(batch, seq, params, kept, (f_outs, kv)), repeats)
    return SliceSample(batch=batch, length=length, context=context, forward_s=forward_s, backward_s=backward_s)


def profile_stage(stage: Any, batches: Sequence[int], lengths: Sequence[int], repeats: int = 3
                  ) -> MeasuredSliceCost:
    """A stage's measured slice costs: each size, each length, no context and the most context."""
    T = stage.T
    samples = []
    for b in batches:
        for l in lengths:
            for c in dict.fromkeys((0, T - l)):
                samples.append(measure_slice(stage, b, l, c, repeats))
    return MeasuredSliceCost(seq_len=T, samples=tuple(samples))
