"""Stage planning for token slices (TeraPipe): which values shrink with a slice, the working
memory as a function of the slice's share of the sequence, a pipeline planned under a
budget that whole sequences do not meet, and slices counted as work items by the stage DP."""
import jax
import numpy as np
import optax
import pytest

import autopar
from autopar import model_zoo as mz
from autopar.intra_op import MemoryBudgetError
from autopar.pipeline.layer_cost import WorkingMemory, per_device_bytes, working_memory
from autopar.pipeline.layer_graph import trace_layer
from autopar.pipeline.layers import cut_layers, repeat_cuts
from autopar.pipeline.stage import working_bytes
from autopar.pipeline.trace import StepTracer
from pipeline_gpt import SEQ, init_state, make_batch, make_step
from rockmate.graph.fusion import liveness_peak, materialized


def test_working_memory_is_the_largest_program_point_at_every_share():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 30))
        fixed, per_position = rng.uniform(0, 100, n), rng.uniform(0, 100, n)
        w = WorkingMemory.from_levels(fixed, per_position)
        assert len(w.fixed) <= n
        for share in (0.0, 1 / 64, 0.3, 0.5, 1.0):
            assert w.bytes_at(share) == pytest.approx(float(np.max(fixed + share * per_position)))
    assert WorkingMemory.from_levels([], []).bytes_at(0.5) == 0.0


@pytest.fixture(scope="module")
def layers():
    opt = optax.adamw(1e-2)
    state, batch = init_state(opt), make_batch(jax.random.PRNGKey(0), 4)
    t = StepTracer(make_step(opt, closure=True, attention=autopar.causal_attention), (state, batch)).at(1)
    specs = cut_layers(t.loss, repeat_cuts(t.loss), t.diff_mask)
    return [trace_layer(t.loss, spec, remat) for spec in (specs[0], specs[1], specs[-1])
            for remat in ("none", "full")]


def test_whole_sequences_keep_the_liveness_peak(layers):
    """At share 1 the split working memory is the plain liveness peak of the layer's
    forward and backward (what the planner priced before token slices)."""
    for lg in layers:
        g, size = lg.graph, (lambda v, g=lg.graph: g.vars[v].nbytes)
        residual = set(lg.residuals)
        keep = materialized(g, residual)
        nf = lg.num_forward_ops
        fwd = liveness_peak(g, range(nf), size, live_out=residual | set(g.outvars),
                            count=lambda v: v in keep and v not in residual)
        bwd = liveness_peak(g, range(nf, len(g.ops)), size, live_out=set(g.outvars), count=lambda v: v in keep)
        f, b = working_memory(lg, size)
        assert f.whole == pytest.approx(fwd) and b.whole == pytest.approx(bwd)
        # a slice needs less, and never less than the fixed part
        assert b.bytes_at(0.25) < b.whole and b.bytes_at(0.25) >= b.bytes_at(0.0)


def test_per_position_values_of_a_gpt_block(layers):
    """Attention scores and activations shrink with a slice; parameters and their gradients
    (sums over the positions) do not."""
    block = layers[2]
    g, pos = block.graph, block.per_position_vars
    scores = [v for v in pos if len(g.vars[v].shape) == 4 and g.vars[v].shape[-2:] == (SEQ, SEQ)]
    assert scores, "the attention scores [b, h, T, T] are per position"
    assert all(v in pos for v in block.act_vars) and all(v in pos for v in block.out_vars)
    assert not pos & set(block.param_vars) and not pos & set(block.param_grad_vars)
    assert all(v in pos for v in block.act_grad_vars if v is not None)


# --- planning under a budget ------------------------------------------------------------
CFG = mz.GPTConfig(vocab=128, seq=256, hidden=32, heads=4, layers=4, batch=4)


def _plan(token_slices, budget):
    step, state, batch = mz.gpt_abstract_setup(CFG)
    return autopar.make_plan(step, state, batch, cluster="2x4:a100-80g", memory_budget=budget,
                             method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2,
                                                              token_slices=token_slices))


@pytest.fixture(scope="module")
def whole_sequence_minimum():
    with pytest.raises(MemoryBudgetError) as e:
        _plan(1, 1000)
    return e.value.min_bytes


@pytest.fixture(scope="module")
def sliced_plan(whole_sequence_minimum):
    return _plan("auto", 0.6 * whole_sequence_minimum)


def test_slices_fit_a_budget_whole_sequences_do_not(whole_sequence_minimum, sliced_plan):
    """At 60% of the smallest budget a whole-sequence pipeline needs (256 tokens: the
    attention scores dominate the working memory), token_slices="auto" plans stages for
    short slices and keeps its slices to what fits: the planned memory of every stage,
    with the working memory of the longest slice chosen, is within the budget."""
    budget = 0.6 * whole_sequence_minimum
    with pytest.raises(MemoryBudgetError):
        _plan(1, budget)
    plan = sliced_plan
    ts = plan.pipeline.token_slices
    assert ts.unsliced_step_s is None and "do not fit these stages' memory" in " ".join(plan.summary().split())
    assert max(max(s) for s in ts.slices) < CFG.seq
    assert all(st.memory_bytes <= budget * (1 + 1e-9) for st in plan.stages)
    assert autopar.Plan.from_json(plan.to_json()) == plan


def test_an_explicit_slicing_is_planned_for_its_longest_slice(whole_sequence_minimum):
    """token_slices=8 plans stage memory for 32-token slices: it fits where whole sequences
    do not, and a budget below what even 1-token slices need is refused with a message that
    says what stage memory was planned for."""
    budget = 0.6 * whole_sequence_minimum
    plan = _plan(8, budget)
    assert [list(s) for s in plan.pipeline.token_slices.slices] == [[32] * 8] * 2
    assert all(st.memory_bytes <= budget * (1 + 1e-9) for st in plan.stages)
    with pytest.raises(MemoryBudgetError, match="planned for token slices of 32 of the 256 tokens") as e:
        _plan(8, 1000)
    assert e.value.min_bytes > 1000


def test_stage_working_memory_on_a_slice_adds_the_context(layers):
    """On a slice each layer also holds its keys and values over the context and their
    cotangents; on whole sequences that term is absent."""
    from autopar.cluster import Cluster
    from autopar.pipeline.layer_cost import LayerSolver

    lg = layers[2]
    c = LayerSolver()(lg, Cluster.parse("1x4:a100-80g").logical_mesh((1, 4)))
    plain = working_bytes([lg], [c], 0.5)
    assert working_bytes([lg], [c], 0.5, [1000.0]) == pytest.approx(plain + 2000.0)
    assert working_bytes([lg], [c], 1.0, [1000.0]) == pytest.approx(working_bytes([lg], [c], 1.0))
    assert per_device_bytes(lg, c.var_specs, c.mesh_shape, lg.act_vars[0]) > 0


def test_slice_working_memory_against_the_compiled_slice_programs(sliced_plan):
    """The planned working memory on the longest slice against XLA's temp memory of that
    slice's compiled forward and backward, per stage. Measured 2.1x and 2.8x here (docs/
    token_pipeline.md): with remat the plan adds up every layer's recomputation and
    backward, and at 256 tokens x 32 features the transients that XLA overlaps dominate.
    Without the slice share the prediction would be 4.5x and more."""
    from autopar.check import build_plan, check_executable, check_slice_working

    step, state, batch = mz.gpt_abstract_setup(CFG)
    plan = sliced_plan
    exe, _ = build_plan(step, state, batch, plan=plan)
    checks = check_slice_working(exe)
    assert [c.stage for c in checks] == [0, 1]
    assert all(c.slice_tokens == max(max(s) for s in plan.pipeline.token_slices.slices) for c in checks)
    for c in checks:
        assert 0.5 <= c.ratio <= 3.0, c
    with pytest.raises(ValueError, match="check_slice_working"):
        check_executable(exe, (state, batch))


def test_the_stage_dp_counts_slices_as_work_items():
    """With token slices the stage DP's latency counts B x k work items (the pipeline fills
    with slices); the decision still reports the step with whole micro-batches."""
    from autopar.api import signature_of
    from autopar.cluster import Cluster
    from autopar.interface import PlanRequest

    step, state, batch = mz.gpt_abstract_setup(CFG)
    method = autopar.PipeshardParallel(num_micro_batches=2, num_stages=2, token_slices=8)
    request = PlanRequest(fun=step, args=(state, batch), kwargs={}, cluster=Cluster.parse("2x4:a100-80g"),
                          signature=signature_of((state, batch), {}), remat="auto")
    planner = method._planner(request)
    d = planner.plan()
    assert planner.items_per_micro_batch == 8 and planner.slice_share == 32 / 256
    times = [s.cost.micro_batch_s for s in d.stages]
    whole = sum(times) + sum(s.cost.iteration_s for s in d.stages) + (d.num_micro_batches - 1) * max(times)
    assert d.latency_s == pytest.approx(whole)
