"""Token-level pipelining (TeraPipe): `causal_attention`, slices planned and run through
the stages with the earlier slices' keys and values as context, equal to one device;
the cost model and the planner's choice; bad input refused before anything runs."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.pipeline.token_eval import TokenSliceError
from autopar.pipeline.token_plan import MissingAttentionMarkerError
from pipeline_gpt import SEQ, _attention, init_state, loss_fn, make_batch, make_step


def _assert_close(got, want, rtol=1e-4, atol=1e-6):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def _setup(opt=None):
    opt = opt or optax.sgd(0.1)
    return opt, init_state(opt), make_batch(jax.random.PRNGKey(1), 4)


def _executable(pstep, state, batch):
    return pstep._executable((state, batch), {})


# --- the marker -----------------------------------------------------------------------
def test_causal_attention_is_plain_causal_attention_and_takes_context():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    q, kk, v = (jax.random.normal(x, (2, 8, 2, 16)) for x in k)
    full = autopar.causal_attention(q, kk, v)
    np.testing.assert_allclose(full, _attention(q, kk, v), rtol=1e-6, atol=1e-6)
    # queries 5..7 with keys and values 0..7: the tail of the full computation
    np.testing.assert_allclose(autopar.causal_attention(q[:, 5:], kk, v), full[:, 5:], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(autopar.causal_attention(q, kk, v, scale=0.5),
                               _attention(q * (0.5 * 4.0), kk, v), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        autopar.causal_attention(q[0], kk[0], v[0])
    with pytest.raises(ValueError, match="at least its sequence length"):
        autopar.causal_attention(q, kk[:, :4], v[:, :4])


# --- numerics -------------------------------------------------------------------------
@pytest.mark.parametrize("stages,slices,schedule,B,profile", [
    (2, 2, "1f1b", 1, True),        # slices priced from times measured here (tests/test_token_profile.py)
    (2, [3, 5], "gpipe", 2, False),
    (4, 4, "gpipe", 1, False),
    (4, [2, 1, 4, 1], "1f1b", 2, False),
])
def test_token_pipeline_equals_one_device(stages, slices, schedule, B, profile):
    opt, state, batch = _setup()
    step = make_step(opt, closure=True, markers=True, attention=autopar.causal_attention)
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(
        num_micro_batches=B, num_stages=stages, schedule=schedule, token_slices=slices, profile=profile))
    (p1, _), loss = pstep(state, batch)
    (p2, _), ref = jax.jit(step)(state, batch)
    _assert_close(loss, ref)
    _assert_close(p1, p2)
    plan = pstep.plan
    want = list(slices) if isinstance(slices, list) else [SEQ // slices] * slices
    assert [list(s) for s in plan.pipeline.token_slices.slices] == [want] * B
    kind = "measured" if profile else "model"
    assert plan.pipeline.token_slices.slice_times == kind and f"{kind} slice times" in plan.summary()
    run = _executable(pstep, state, batch).last_run
    # every (micro-batch, slice) ran forward and backward on every stage, backwards in reverse slice order
    for s in range(stages):
        fwd = [(t.micro_batch, t.slice) for t in run.order if t.stage == s and t.kind == "F"]
        bwd = [(t.micro_batch, t.slice) for t in run.order if t.stage == s and t.kind == "B"]
        assert fwd == [(m, i) for m in range(B) for i in range(len(want))]
        assert bwd == [(m, i) for m in range(B) for i in reversed(range(len(want)))]


def test_unequal_micro_batches_from_a_saved_plan_equal_one_device(tmp_path):
    """TeraPipe's batch split: micro-batches of 2, 1 and 1 sequences, each sliced its own
    way (a loaded plan; the losses of each size are weighted by their sequences)."""
    opt, state, batch = _setup()
    step = make_step(opt, closure=True, markers=True, attention=autopar.causal_attention)
    method = autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, token_slices=2)
    plan = autopar.parallelize(step, method=method).get_plan(state, batch)
    ts = plan.pipeline.token_slices
    ts = dataclasses.replace(ts, micro_batch_sizes=(2, 1, 1), slices=((4, 4), (2, 6), (8,)))
    path = tmp_path / "plan.json"
    dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, token_slices=ts)).save(path)
    pstep = autopar.parallelize(step, method=method, plan=str(path))
    (p1, _), loss = pstep(state, batch)
    (p2, _), ref = jax.jit(step)(state, batch)
    _assert_close(loss, ref)
    _assert_close(p1, p2)
    bad = dataclasses.replace(ts, micro_batch_sizes=(2, 1), slices=((4, 4), (8,)))
    dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, token_slices=bad)).save(path)
    with pytest.raises(autopar.PlanFileError, match="sum to 3 sequences, the batch has 4"):
        autopar.parallelize(step, method=method, plan=str(path))(state, batch)


def test_first_stage_keeps_less_with_slices():
    """1F1B, 2 stages, 2 micro-batches: without slices the first stage keeps both micro-
    batches' residuals; with 4 slices it keeps at most one micro-batch's slices (and their
    keys and values)."""
    opt, state, batch = _setup()
    peaks = {}
    for slices in (1, 4):
        step = make_step(opt, closure=True, markers=True, attention=autopar.causal_attention)
        pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(
            num_micro_batches=2, num_stages=2, token_slices=slices))
        pstep(state, batch)
        peaks[slices] = _executable(pstep, state, batch).last_run.peak_live_bytes[0]
    assert 0 < peaks[4] < 0.75 * peaks[1], peaks


def test_remat_stages_recompute_each_slice_and_equal_one_device():
    """Stages planned with remat="full" keep only each slice's inputs between its forward
    and backward (fewer bytes in flight than the same slices without remat), same numbers."""
    opt, state, batch = _setup()
    peaks = {}
    for remat in ("none", "full"):
        step = make_step(opt, closure=True, markers=True, attention=autopar.causal_attention)
        pstep = autopar.parallelize(step, remat=remat, method=autopar.PipeshardParallel(
            num_micro_batches=2, num_stages=2, token_slices=2))
        (p1, _), loss = pstep(state, batch)
        (p2, _), ref = jax.jit(step)(state, batch)
        _assert_close(loss, ref)
        _assert_close(p1, p2)
        assert {s.remat.mode if s.remat else "none" for s in pstep.plan.stages} == {remat}
        peaks[remat] = _executable(pstep, state, batch).last_run.peak_live_bytes[0]
    assert 0 < peaks["full"] < 0.75 * peaks["none"], peaks


# --- planning -------------------------------------------------------------------------
def _decision(cluster="2x4:a100-80g", B=2):
    from autopar.pipeline.planner import PipelinePlanner
    from autopar.pipeline.trace import StepTracer

    opt, state, batch = _setup()
    step = make_step(opt, closure=True, markers=True, attention=autopar.causal_attention)
    cl = autopar.Cluster.parse(cluster)
    planner = PipelinePlanner(StepTracer(step, (state, batch)), autopar.PipeshardParallel(num_micro_batches=B),
                              cl, cl.device.memory_bytes)
    return planner, planner.plan()


def test_auto_slicing_is_the_best_under_the_cost_model():
    from autopar.pipeline.token_cost import attention_marked_loss
    from autopar.pipeline.token_plan import plan_token_slices, stage_slice_costs

    planner, decision = _decision()
    auto = plan_token_slices(planner, decision, "auto").slicing
    every = [plan_token_slices(planner, decision, k).slicing for k in (1, 2, 4, 8)]
    assert auto.predicted_step_s <= min(t.predicted_step_s for t in every) + 1e-15
    assert every[0].predicted_step_s == pytest.approx(every[0].unsliced_step_s)
    # the slice model reproduces the ILP's stage time at the planned shapes (whole sequences)
    costs = stage_slice_costs(planner, decision, SEQ)
    b0 = decision.traced.micro_batch_size
    marked = attention_marked_loss(decision.traced)
    for c, d in zip(costs, decision.stages):
        if c.weight_floor_s <= c.token_s:
            assert c.time_s(b0, SEQ, 0) == pytest.approx(d.cost.micro_batch_s, rel=1e-9)
        # attention FLOPs: 4 b h d T^2 per causal_attention call in the stage, forward + backward
        calls = {marked.ops[i].mark for lg in d.layers.layers for i in lg.spec.ops} - {None}
        flops = (4 if d.remat != "none" else 3) * len(calls) * 4 * b0 * 2 * 16 * SEQ * SEQ
        mesh = planner.logical_mesh(d.logical_mesh)
        assert c.attention_s == pytest.approx(mesh.compute_s(flops / mesh.num_devices, "float32"), rel=1e-9)
    assert sum(len(set(marked.ops[i].mark for lg in d.layers.layers for i in lg.spec.ops) - {None})
               for d in decision.stages) == 4


def test_plan_records_slices_and_shows_them(tmp_path):
    from autopar.pipeline.gantt import timeline_bars

    opt, state, batch = _setup()
    step = make_step(opt, closure=True, markers=True, attention=autopar.causal_attention)
    plan = autopar.make_plan(step, state, batch, cluster="2x4:a100-80g",
                             method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, token_slices="auto"))
    ts = plan.pipeline.token_slices
    assert ts.seq_len == SEQ and sum(ts.micro_batch_sizes) == 4 and all(sum(s) == SEQ for s in ts.slices)
    assert plan.predicted_time_s == ts.predicted_step_s <= ts.unsliced_step_s
    path = tmp_path / "p.json"
    plan.save(path)
    assert autopar.Plan.load(path) == plan
    assert "token slices (TeraPipe" in plan.summary()
    bars = timeline_bars(plan)
    assert len(bars) == 2 * len(plan.stages) * ts.num_items
    assert max(t.end_s for t in plan.pipeline.timeline) > 0


# --- bad input ------------------------------------------------------------------------
def _plan(step, token_slices):
    _, state, batch = _setup()
    return autopar.make_plan(step, state, batch, cluster="1x2:cpu",
                             method=autopar.PipeshardParallel(num_micro_batches=1, num_stages=2,
                                                              token_slices=token_slices))


def test_bad_slicings_and_a_missing_marker_are_refused():
    opt, _, _ = _setup()
    marked = make_step(opt, closure=True, markers=True, attention=autopar.causal_attention)
    with pytest.raises(ValueError, match=r"sums to 7 tokens, but the sequence has 8"):
        _plan(marked, [3, 4])
    with pytest.raises(ValueError, match="more slices than the sequence has tokens"):
        _plan(marked, 9)
    with pytest.raises(MissingAttentionMarkerError, match="autopar.causal_attention"):
        _plan(make_step(opt, closure=True, markers=True), 2)
    for bad in (0, "some", [2, 0], True):
        with pytest.raises(ValueError, match="token_slices"):
            autopar.PipeshardParallel(token_slices=bad)


def _step_with(loss):
    opt = optax.sgd(0.1)

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(lambda p: loss(p, batch))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value
    return step


def _hidden(params, batch):
    from pipeline_gpt import _block, _ln

    x = params["embed"][batch["tokens"]] + params["pos"]
    for p in params["blocks"]:
        x = autopar.mark_stage_boundary(_block(p, x, autopar.causal_attention))
    return _ln(x, params["ln_f"])


@pytest.mark.parametrize("loss,match", [
    # a mean over the sequence before the head: the head sees every position at once
    (lambda p, b: -jax.nn.log_softmax(_hidden(p, b).mean(1) @ p["embed"].T)[:, 0].mean(),
     "not a sum of per-position terms"),
    # a running sum over the positions outside attention
    (lambda p, b: jnp.cumsum(_hidden(p, b), axis=1).var(), "mixes positions"),
    # next-token targets made by shifting the tokens inside the loss
    (lambda p, b: (_hidden(p, b)[:, :-1] @ p["embed"].T).var(), "mixes positions"),
])
def test_losses_that_mix_positions_are_refused(loss, match):
    with pytest.raises(TokenSliceError, match=match):
        _plan(_step_with(loss), 2)


def test_a_per_token_loss_plus_a_weight_penalty_equals_one_device():
    """Terms that do not depend on the tokens are added once, not once per slice."""
    opt = optax.sgd(0.1)
    loss = lambda p, b: loss_fn(p, b, True, autopar.causal_attention) + 1e-2 * jnp.vdot(p["ln_f"], p["ln_f"])
    step = _step_with(loss)
    _, state, batch = _setup(opt)
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2,
                                                                       token_slices=4))
    (p1, _), v1 = pstep(state, batch)
    (p2, _), v2 = jax.jit(step)(state, batch)
    _assert_close(v1, v2)
    _assert_close(p1, p2)


def test_slice_programs_compile_ahead_of_time():
    """`lower().compile()` compiles every slice's forward and backward from abstract inputs;
    the slice programs take the planned parameter layouts and a later slice's backward
    holds more than the first's (its context grows)."""
    opt, state, batch = _setup()
    step = make_step(opt, closure=True, markers=True, attention=autopar.causal_attention)
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=1, num_stages=2,
                                                                       token_slices=2))
    compiled = pstep.lower(state, batch).compile()
    assert [sorted(p) for p in compiled.programs] == [sorted(
        f"{kind} b=4 tokens {a}:{b}" for kind in ("forward", "backward") for a, b in ((0, 4), (4, 8)))] * 2
    first = compiled.programs[0]["forward b=4 tokens 0:4"].memory_analysis()
    later = compiled.programs[0]["forward b=4 tokens 4:8"].memory_analysis()
    assert later.argument_size_in_bytes > first.argument_size_in_bytes      # the context comes in
    assert len(compiled.memory_analysis()) == 2
    assert "tokens 4:8" in pstep.lower(state, batch).as_text()
    (p1, _), loss = pstep(state, batch)
    (p2, _), ref = jax.jit(step)(state, batch)
    _assert_close(loss, ref)


def test_a_budget_too_small_for_the_shortest_slices_says_what_was_planned():
    """token_slices="auto" plans for whole sequences, then for the shortest slices (1 of
    the 8 tokens); a budget neither meets names the slice length (tests/test_slice_memory.py
    has budgets that slices do meet)."""
    from autopar.intra_op import MemoryBudgetError

    opt, state, batch = _setup()
    step = make_step(opt, closure=True, markers=True, attention=autopar.causal_attention)
    with pytest.raises(MemoryBudgetError, match="planned for token slices of 1 of the 8 tokens") as e:
        autopar.make_plan(step, state, batch, cluster="2x4:a100-80g", memory_budget=1000,
                          method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, token_slices="auto"))
    assert e.value.min_bytes > 1000
