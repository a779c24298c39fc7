"""The train step every model family uses, and the (train_step, state, batch) triple built around it."""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """step(state, batch) -> (new_state, loss) with state = (params, opt_state)."""
    def step(state, batch):
        params, opt_state = state
        # plain JAX: pipelines and remat find the loss of this call while they trace
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
    return step


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over integer labels, in float32 whatever the compute dtype."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def concrete_setup(model: nn.Module, loss_fn: Callable, optimizer: optax.GradientTransformation | None,
                   batch: tuple[jax.Array, jax.Array], init_key: jax.Array,
                   jit_init: bool = True) -> tuple[Callable, Any, Any]:
    """(train_step, state, batch) with parameters initialised on the batch's inputs (adamw(1e-3) by default).

    `jit_init` compiles the initialisation as one program (eagerly, every op compiles on its
    own: seconds per model); the numbers differ from an eager init in the last bits.
    """
    optimizer = optimizer or optax.adamw(1e-3)
    params = (jax.jit(model.init) if jit_init else model.init)(init_key, batch[0])["params"]
    return make_train_step(loss_fn, optimizer), (params, optimizer.init(params)), batch


def abstract_setup(model: nn.Module, loss_fn: Callable, optimizer: optax.GradientTransformation | None,
                   batch: tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]) -> tuple[Callable, Any, Any]:
    """(train_step, state, batch) as ShapeDtypeStructs: plan a model too big to materialise."""
    optimizer = optimizer or optax.adamw(1e-3)
    params = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x)["params"], batch[0])
    return make_train_step(loss_fn, optimizer), (params, jax.eval_shape(optimizer.init, params)), batch


def language_model_setup(model: nn.Module, loss_fn: Callable, cfg: Any, optimizer: optax.GradientTransformation | None,
                         seed: int, jit_init: bool = True) -> tuple[Callable, Any, Any]:
    """concrete_setup on random tokens [cfg.batch, cfg.seq] < cfg.vocab, targets = the next token (wrapped)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    tokens = jax.random.randint(k1, (cfg.batch, cfg.seq), 0, cfg.vocab)
    return concrete_setup(model, loss_fn, optimizer, (tokens, jnp.roll(tokens, -1, axis=1)), k2, jit_init)


def abstract_language_model_setup(model: nn.Module, loss_fn: Callable, cfg: Any,
                                  optimizer: optax.GradientTransformation | None) -> tuple[Callable, Any, Any]:
    """abstract_setup on int32 tokens [cfg.batch, cfg.seq] (the targets have the same shape)."""
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
    return abstract_setup(model, loss_fn, optimizer, (tokens, tokens))
