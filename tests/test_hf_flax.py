"""A Hugging Face Flax model built from a config (random weights, nothing downloaded), trained
with plain jax.value_and_grad and optax, gives the same loss and parameters under autopar as
jax.jit on one device. Skipped where transformers is missing or has no Flax models (v5+)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar

transformers = pytest.importorskip("transformers")
if not all(hasattr(transformers, name) for name in ("FlaxGPT2LMHeadModel", "FlaxBertForMaskedLM")):
    pytest.skip(f"transformers {transformers.__version__} has no Flax models (removed in v5; "
                "install transformers<5 to run these tests)", allow_module_level=True)

VOCAB, SEQ, BATCH = 64, 16, 8
MASK_ID = 0            # the batch draws tokens from 1..VOCAB-1; 0 stands in for [MASK]


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    return transformers.FlaxGPT2LMHeadModel(config, input_shape=(1, SEQ), _do_init=False)


def _bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=SEQ)
    return transformers.FlaxBertForMaskedLM(config, input_shape=(1, SEQ), _do_init=False)


def _causal_lm_loss(model, params, batch):
    """Next-token cross entropy, a mean over the batch."""
    logits = model(batch["input_ids"], params=params, train=False).logits
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], batch["input_ids"][:, 1:]).mean()


def _masked_lm_loss(model, params, batch):
    """Cross entropy of the original tokens at the masked positions, a mean over them."""
    masked = jnp.where(batch["mask"], MASK_ID, batch["input_ids"])
    logits = model(masked, params=params, train=False).logits
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["input_ids"])
    return (xent * batch["mask"]).sum() / batch["mask"].sum()


def _train_step(model, loss_fn, opt):
    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, batch))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
    return step


@functools.cache
def _case(name):
    """(step, state, batch, what jax.jit(step) returns on one device) for one model, built once."""
    model, loss_fn = {"gpt2": (_gpt2(), _causal_lm_loss), "bert": (_bert(), _masked_lm_loss)}[name]
    # An optimizer linear in the gradient: attention's key bias has a true gradient of zero
    # (softmax ignores a shift), and Adam would scale its rounding noise up to the step size.
    opt = optax.sgd(0.1, momentum=0.9)
    params = jax.jit(model.init_weights, static_argnums=1)(jax.random.PRNGKey(0), (1, SEQ))
    rng = np.random.default_rng(1)
    mask = rng.random((BATCH, SEQ)) < 0.25
    mask[:, 0] = True
    batch = {"input_ids": jnp.asarray(rng.integers(1, VOCAB, (BATCH, SEQ)), jnp.int32),
             "mask": jnp.asarray(mask)}
    step, state = _train_step(model, loss_fn, opt), (params, opt.init(params))
    return step, state, batch, jax.jit(step)(state, batch)


def _assert_close(got, want, rtol=1e-4, atol=1e-6):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_default_method_equals_one_device(name):
    """autopar.parallelize(step) with the default method, on 8 devices: the loss, the new
    parameters and the optimizer state equal jax.jit(step) on one device."""
    step, state, batch, want = _case(name)
    _assert_close(autopar.parallelize(step)(state, batch), want)


def test_gpt2_in_a_two_stage_pipeline_equals_one_device():
    """A 2-stage, 2-micro-batch pipeline over the HF GPT-2 (dropout off: each micro-batch
    would draw its own mask) equals jax.jit(step) on one device."""
    step, state, batch, want = _case("gpt2")
    pstep = autopar.parallelize(step, method=autopar.PipeshardParallel(num_micro_batches=2, num_stages=2))
    assert len(pstep.get_plan(state, batch).stages) == 2
    _assert_close(pstep(state, batch), want)
