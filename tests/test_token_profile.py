"""Measured slice times (`PipeshardParallel(token_slices=..., profile=True)`): what is
measured, how the measurements are interpolated and that the token DP follows them (a
profiled plan equal to one device: tests/test_token_pipeline.py)."""
import jax
import numpy as np
import pytest

import autopar
from autopar.pipeline import token_profile
from autopar.pipeline.token_profile import MeasuredSliceCost, SliceSample, profile_lengths
from pipeline_gpt import SEQ, make_step
from test_token_pipeline import _decision, _setup


def test_measured_costs_interpolate_lengths_and_contexts():
    """Samples of t(l, c) = 1 + 2 l + 0.5 l c (linear in l without context, a context
    slope linear in l) are reproduced exactly everywhere in between."""
    T = 16
    t = lambda l, c: 1.0 + 2.0 * l + 0.5 * l * c
    samples = tuple(SliceSample(batch=1, length=l, context=c, forward_s=t(l, c) / 4, backward_s=3 * t(l, c) / 4)
                    for l in profile_lengths(T, 2) for c in dict.fromkeys((0, T - l)))
    cost = MeasuredSliceCost(seq_len=T, samples=samples)
    assert profile_lengths(T, 2) == (2, 4, 8, 16)
    ls = np.array([2, 3, 5, 7, 8, 11, 16])
    cs = np.array([0, 9, 4, 1, 8, 5, 0])
    np.testing.assert_allclose(cost.time_s(1, ls, cs), t(ls, cs), rtol=1e-12)
    assert cost.time_s(1, 6, 3) == pytest.approx(t(6, 3))
    assert cost.forward_fraction == pytest.approx(0.25)
    with pytest.raises(ValueError, match="no slice of 2 sequences was measured"):
        cost.time_s(2, 4, 0)
    # noise that makes the most context look cheaper never gives a negative context term
    noisy = MeasuredSliceCost(seq_len=4, samples=(SliceSample(1, 2, 0, 1.0, 1.0), SliceSample(1, 2, 2, 0.9, 0.9),
                                                  SliceSample(1, 4, 0, 3.0, 3.0)))
    assert noisy.time_s(1, 2, 2) == pytest.approx(2.0)


def _fake(asked, overhead_s, per_pair_s):
    """A measure_slice that records what it was asked and returns t(b, l, c)."""
    def measure(stage, batch, length, context, repeats=3):
        asked.append((id(stage), batch, length, context))
        t = overhead_s + 1e-3 * batch * length + per_pair_s * batch * length * (length + context)
        return SliceSample(batch=batch, length=length, context=context, forward_s=t / 3, backward_s=2 * t / 3)
    return measure


def test_profiled_slicing_follows_the_measured_times(monkeypatch):
    """The DP prices slices from what was measured on each stage: a fixed cost per slice
    keeps sequences whole; a cost growing with query-key pairs cuts them; every stage is
    measured at each micro-batch size, each profiled length, no and the most context."""
    from autopar.pipeline.token_plan import plan_token_slices

    planner, decision = _decision()
    devices = jax.devices()
    asked = []
    monkeypatch.setattr(token_profile, "measure_slice", _fake(asked, 1.0, 0.0))
    fixed = plan_token_slices(planner, decision, "auto", devices)
    assert fixed.slicing.slice_times == "measured"
    assert all(len(s) == 1 for s in fixed.slicing.slices)
    assert fixed.slicing.predicted_step_s == pytest.approx(fixed.slicing.unsliced_step_s)
    b0 = decision.traced.micro_batch_size
    sizes = [b for b in range(1, b0 + 1) if (b0 * decision.num_micro_batches) % b == 0]
    want = {(b, l, c) for b in sizes for l in profile_lengths(SEQ, 1) for c in (0, SEQ - l)}
    per_stage = {}
    for stage, b, l, c in asked:
        per_stage.setdefault(stage, set()).add((b, l, c))
    assert len(per_stage) == len(decision.stages) and all(v == want for v in per_stage.values())
    for cost in fixed.stage_costs:
        for b, l, c in want:
            t = 1.0 + 1e-3 * b * l
            assert cost.time_s(b, l, c) == pytest.approx(t)
    assert fixed.forward_fraction == pytest.approx((1 / 3,) * len(decision.stages))

    monkeypatch.setattr(token_profile, "measure_slice", _fake([], 0.0, 1.0))
    pairs = plan_token_slices(planner, decision, "auto", devices).slicing
    assert max(len(s) for s in pairs.slices) > 1
    assert pairs.predicted_step_s < pairs.unsliced_step_s
    # the DP's choice is the best of the uniform slicings under the same measurements
    uniform = [plan_token_slices(planner, decision, k, devices).slicing.predicted_step_s for k in (1, 2, 4, 8)]
    assert pairs.predicted_step_s <= min(uniform) * (1 + 1e-12)


def test_profile_needs_token_slices_and_local_devices():
    with pytest.raises(ValueError, match="needs token_slices != 1"):
        autopar.PipeshardParallel(num_micro_batches=2, profile=True)
    opt, state, batch = _setup()
    step = make_step(opt, closure=True, markers=True, attention=autopar.causal_attention)
    with pytest.raises(ValueError, match="cluster that is not here"):
        autopar.make_plan(step, state, batch, cluster="2x4:a100-80g", method=autopar.PipeshardParallel(
            num_micro_batches=2, num_stages=2, token_slices="auto", profile=True))
