"""A pipelined loss that is not a mean over the batch gets a warning: the pipeline averages
its micro-batches' losses, which equals the full batch only for a mean of per-example
terms. The analysis's verdict is checked against that fact itself: each loss is evaluated
on the full batch and on its micro-batches."""
import warnings
from dataclasses import replace

import jax
import jax.numpy as jnp
import optax
import pytest

import autopar
from autopar.model_zoo import MoELM
from autopar.model_zoo.moe import moe_loss
from autopar.pipeline.loss_check import PerExample, _reshape_layout, batch_mean_verdict
from pipeline_gpt import _block, _ln, init_params, loss_fn, make_batch
from rockmate.graph import trace_graph
from test_model_zoo import MOE_SMALL

B = 2      # micro-batches
NOT_A_MEAN = "the pipelined loss is not a mean over the batch"


def _log_probs(params, tokens):
    """Log-probabilities [batch, seq, vocab] of the pipeline GPT, and its last hidden state."""
    x = params["embed"][tokens] + params["pos"]
    for p in params["blocks"]:
        x = _block(p, x)
    return jax.nn.log_softmax(_ln(x, params["ln_f"]) @ params["embed"].T), x


def _token_logp(params, batch):
    """Per-token log-likelihood [batch, seq] of the targets, and the last hidden state."""
    logp, x = _log_probs(params, batch["tokens"])
    return jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0], x


def _load_balancing(params, batch):
    """LM loss + a Switch-style load-balancing term over the whole batch: experts x
    sum_e(fraction of tokens routed to e x mean router probability of e)."""
    logp, x = _token_logp(params, batch)
    probs = jax.nn.softmax(x[..., :4], -1)          # a router over 4 experts
    fraction = jax.nn.one_hot(jnp.argmax(probs, -1), 4).mean((0, 1))
    return -logp.mean() + 4 * jnp.sum(fraction * probs.mean((0, 1)))


def _masked_mean(params, batch):
    mask = batch["tokens"] < 20
    return -(_token_logp(params, batch)[0] * mask).sum() / mask.sum()


def _batch_norm(params, batch):
    """The LM head on batch-normalised features."""
    h = _token_logp(params, batch)[1]
    logp = jax.nn.log_softmax((h - h.mean(0)) / (h.std(0) + 1e-5) @ params["embed"].T)
    return -jnp.take_along_axis(logp, batch["targets"][..., None], -1).mean()


def _l2(params):
    return sum(jnp.vdot(p, p) for p in jax.tree_util.tree_leaves(params))


LOSSES = {   # name: (loss(params, batch), the kind of finding, or None for a mean)
    "mean": (loss_fn, None),
    "mean over sequence then batch": (lambda p, b: -_token_logp(p, b)[0].mean(1).mean(0), None),
    "sequence sum, batch mean": (lambda p, b: -_token_logp(p, b)[0].sum(1).mean(), None),
    "sum / batch size": (lambda p, b: -_token_logp(p, b)[0].sum() / b["tokens"].shape[0], None),
    "mean + weight decay": (lambda p, b: loss_fn(p, b) + 1e-3 * _l2(p), None),
    "sum": (lambda p, b: -_token_logp(p, b)[0].sum(), "sum"),
    "sum / a constant": (lambda p, b: -_token_logp(p, b)[0].sum() / 3.0, "sum"),
    "load balancing": (_load_balancing, "product"),
    "masked mean": (_masked_mean, "ratio"),
    "log of a mean": (lambda p, b: jnp.log(loss_fn(p, b)), "nonlinear"),
    "max over the batch": (lambda p, b: -_token_logp(p, b)[0].mean(1).max(), "nonlinear"),
    "batch norm": (_batch_norm, "statistic"),
}


def _micro_batch_gap(loss, params, batch) -> float:
    """|loss(full batch) - mean of loss(micro-batch)|, relative: what the pipeline changes."""
    full = jax.jit(loss)(params, batch)
    micro = jax.jit(jax.vmap(loss, in_axes=(None, 0)))(
        params, jax.tree_util.tree_map(lambda a: a.reshape(B, -1, *a.shape[1:]), batch))
    return float(abs(full - micro.mean()) / abs(full))


def _params():
    """A one-block pipeline GPT with peaked predictions (per-example losses that differ)."""
    return jax.tree_util.tree_map(lambda p: 5 * p, init_params(jax.random.PRNGKey(0), layers=1))


def _skewed_batch(params):
    """Random tokens; the first micro-batch's targets are the model's own predictions, so
    the two micro-batches' losses differ a lot (as real batches can)."""
    batch = make_batch(jax.random.PRNGKey(1), 8)
    predicted = jnp.argmax(jax.jit(_log_probs)(params, batch["tokens"])[0], -1)
    half = batch["tokens"].shape[0] // B
    return {**batch, "targets": batch["targets"].at[:half].set(predicted[:half])}


def _verdict(loss, params, batch):
    """The analysis on the loss traced at the full batch, the batch's leaves split."""
    graph = trace_graph(loss, params, batch, keep_custom_rules=True)
    n_params = len(jax.tree_util.tree_leaves(params))
    return batch_mean_verdict(graph, [i >= n_params for i in range(len(graph.invars))])


@pytest.fixture(scope="module")
def gpt_data():
    params = _params()
    return params, _skewed_batch(params)


@pytest.mark.parametrize("name", LOSSES)
def test_the_verdict_says_whether_micro_batching_changes_the_loss(name, gpt_data):
    loss, kind = LOSSES[name]
    params, batch = gpt_data
    verdict = _verdict(loss, params, batch)
    gap = _micro_batch_gap(loss, params, batch)
    if kind is None:
        assert verdict.is_mean is True, verdict
        assert gap < 1e-5
    else:
        assert verdict.is_mean is False and verdict.kind == kind, verdict
        assert gap > 1e-4                # the finding is real: micro-batches give another loss
        assert "test_loss_check.py" in verdict.op     # it names the line that makes it so


def test_the_moe_zoo_loss_is_a_mean_over_groups_of_whole_examples():
    """The zoo's GShard load-balancing term is a product of means over each group of
    tokens (groups of two whole examples here), then a mean over groups: micro-batches
    of whole groups do not change it, and the analysis follows the groups through the
    reshapes (no warning); evaluated on micro-batches, the loss is unchanged."""
    cfg = replace(MOE_SMALL, layers=2)
    assert cfg.expert_group_size == 2 * cfg.seq
    model = MoELM(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (cfg.batch, cfg.seq), 0, cfg.vocab)
    params = jax.jit(model.init)(jax.random.PRNGKey(1), tokens)["params"]
    batch = (tokens, jnp.roll(tokens, -1, 1))
    assert _verdict(moe_loss(model), params, batch).is_mean is True
    assert _micro_batch_gap(moe_loss(model), params, batch) < 1e-5


def test_reshapes_follow_the_batch_into_merged_axes_and_groups_of_whole_examples():
    """Row-major reshapes of a [8, 16, 32] batch: merged with the sequence (16 rows per
    example), cut into token groups of two whole examples (4 units), back again (2 rows
    of 16 per unit), and lost where an example straddles two rows."""
    batch = PerExample(0, 1, 8)
    assert _reshape_layout(batch, (8, 16, 32), (128, 32)) == PerExample(0, 16, 8)
    assert _reshape_layout(batch, (8, 16, 32), (4, 32, 32)) == PerExample(0, 1, 4)
    assert _reshape_layout(PerExample(0, 1, 4), (4, 32, 32), (8, 16, 32)) == PerExample(0, 2, 4)
    assert _reshape_layout(PerExample(1, 1, 8), (2, 8, 4), (16, 4)) == PerExample(0, 1, 8)
    assert _reshape_layout(PerExample(0, 1, 6), (6, 4), (4, 6)) is None


def _step(loss):
    """A two-block pipeline GPT's train step with `loss`, and its state."""
    opt = optax.sgd(0.1)

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value
    params = init_params(jax.random.PRNGKey(0), layers=2)
    return step, (params, opt.init(params))


def test_pipeshard_warns_for_a_sum_loss_and_not_for_the_gpt_mean():
    """End to end, at planning: the pipeline GPT's mean loss plans without the warning; a
    sum over the batch warns, naming the sum and the number of micro-batches."""
    batch = make_batch(jax.random.PRNGKey(2), 8)
    method = autopar.PipeshardParallel(num_micro_batches=B, num_stages=2)
    step, state = _step(loss_fn)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*" + NOT_A_MEAN)
        autopar.parallelize(step, method=method, devices=jax.devices()[:2]).get_plan(state, batch)

    step, state = _step(LOSSES["sum"][0])
    with pytest.warns(UserWarning, match=NOT_A_MEAN + r".*a sum over the batch.*2 micro-batches") as record:
        autopar.parallelize(step, method=method, devices=jax.devices()[:2]).get_plan(state, batch)
    assert "Divide it by the batch size" in str(record[0].message)
