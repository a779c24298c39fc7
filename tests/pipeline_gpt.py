"""A tiny GPT (pure JAX, tied embedding) and its train step for the pipeline tests; the loss closes over the batch in `make_step(closure=True)`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from autopar.boundary import mark_stage_boundary
from autopar.pipeline.grad import value_and_grad

D, SEQ, VOCAB, HEADS, LAYERS = 32, 8, 64, 2, 4


def init_params(key, layers=LAYERS):
    keys = jax.random.split(key, 2 + layers)
    n = lambda k, shape: 0.1 * jax.random.normal(k, shape, jnp.float32)
    blocks = []
    for i in range(layers):
        k = jax.random.split(keys[2 + i], 4)
        blocks.append({"ln1": jnp.ones(D), "qkv": n(k[0], (D, 3 * D)), "proj": n(k[1], (D, D)),
                       "ln2": jnp.ones(D), "fc1": n(k[2], (D, 4 * D)), "fc2": n(k[3], (4 * D, D))})
    return {"embed": n(keys[0], (VOCAB, D)), "pos": n(keys[1], (SEQ, D)), "blocks": blocks,
            "ln_f": jnp.ones(D)}


def _ln(x, g):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return g * (x - mu) / jnp.sqrt(var + 1e-5)


def _attention(q, k, v):
    t = q.shape[1]
    att = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(D // HEADS)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(att, -1), v)


def _block(p, x, attention=_attention):
    b, t, _ = x.shape
    h = _ln(x, p["ln1"]) @ p["qkv"]
    q, k, v = jnp.split(h.reshape(b, t, 3, HEADS, D // HEADS), 3, axis=2)
    y = attention(q[:, :, 0], k[:, :, 0], v[:, :, 0]).reshape(b, t, D)
    x = x + y @ p["proj"]
    return x + jax.nn.gelu(_ln(x, p["ln2"]) @ p["fc1"]) @ p["fc2"]


def loss_fn(params, batch, markers=False, attention=_attention):
    """`attention`: this file's plain causal attention or `autopar.causal_attention`."""
    tokens, targets = batch["tokens"], batch["targets"]
    x = params["embed"][tokens] + params["pos"]
    for p in params["blocks"]:
        x = _block(p, x, attention)
        if markers:
            x = mark_stage_boundary(x)
    logits = _ln(x, params["ln_f"]) @ params["embed"].T     # tied embedding
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, targets[..., None], -1).mean()


def make_batch(key, batch_size):
    k1, k2 = jax.random.split(key)
    return {"tokens": jax.random.randint(k1, (batch_size, SEQ), 0, VOCAB),
            "targets": jax.random.randint(k2, (batch_size, SEQ), 0, VOCAB)}


def make_step(optimizer, markers=False, closure=False, grad_api="autopar", attention=_attention):
    """step(state, batch); with `closure` the loss closes over the batch
    (`value_and_grad(lambda p: loss(p, batch))`, the most common way to write it).
    `grad_api` picks the gradient call: "autopar" (autopar.value_and_grad),
    "jax.value_and_grad" or "jax.grad"; `attention` as in `loss_fn`."""
    vg = {"autopar": value_and_grad, "jax.value_and_grad": jax.value_and_grad,
          "jax.grad": lambda f, **kw: (lambda *a: (None, jax.grad(f, **kw)(*a)))}[grad_api]

    def step(state, batch):
        params, opt_state = state
        if closure:
            loss, grads = vg(lambda p: loss_fn(p, batch, markers, attention))(params)
        else:
            loss, grads = vg(lambda p, b: loss_fn(p, b, markers, attention))(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        if loss is None:     # jax.grad: report a value computed from the gradient instead
            loss = sum(jnp.vdot(g, g) for g in jax.tree_util.tree_leaves(grads))
        return (optax.apply_updates(params, updates), opt_state), loss
    return step


def init_state(optimizer, key=jax.random.PRNGKey(0)):
    params = init_params(key)
    return params, optimizer.init(params)
