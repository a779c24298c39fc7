"""Small train steps shared by the tests: MLP, GPT (unrolled and nn.scan), embedding + softmax
cross-entropy head, conv net; each with a choice of optax optimizer."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from autopar.model_zoo import GPTConfig, gpt_setup, make_train_step

LR = 1e-2


def optimizer(name: str) -> optax.GradientTransformation:
    return {"sgd": optax.sgd(LR), "adamw": optax.adamw(LR)}[name]


def _setup(module: nn.Module, loss_of_output, x, y, opt_name: str):
    params = module.init(jax.random.PRNGKey(0), x)["params"]
    opt = optimizer(opt_name)

    def loss_fn(p, batch):
        bx, by = batch
        return loss_of_output(module.apply({"params": p}, bx), by)

    return make_train_step(loss_fn, opt), (params, opt.init(params)), (x, y)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(8)(x)


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=(2, 2))(x))
        x = x.mean(axis=(1, 2))
        return nn.Dense(4)(x)


class EmbedHead(nn.Module):
    vocab: int = 64

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(self.vocab, 32)(ids)
        h = nn.tanh(nn.Dense(32)(h))
        return nn.Dense(self.vocab)(h)


def make(model: str, opt_name: str):
    """(step, state, batch) for a named small model."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    if model == "mlp":
        x = jax.random.normal(k1, (16, 32))
        y = jax.random.normal(k2, (16, 8))
        return _setup(MLP(), lambda out, t: jnp.mean((out - t) ** 2), x, y, opt_name)
    if model == "conv":
        x = jax.random.normal(k1, (8, 8, 8, 4))
        y = jax.random.randint(k2, (8,), 0, 4)
        return _setup(ConvNet(), lambda out, t: optax.softmax_cross_entropy_with_integer_labels(out, t).mean(), x, y, opt_name)
    if model == "embed":
        ids = jax.random.randint(k1, (8, 8), 0, 64)
        return _setup(EmbedHead(), lambda out, t: optax.softmax_cross_entropy_with_integer_labels(out, t).mean(),
                      ids, jnp.roll(ids, -1, axis=1), opt_name)
    if model in ("gpt", "gpt_scan"):
        cfg = GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=2, batch=8, scan=model == "gpt_scan")
        return gpt_setup(cfg, optimizer(opt_name))
    raise ValueError(model)


def assert_tree_close(got, want, opt_name: str = "sgd", rtol: float = 1e-4, floor: float = 1e-6, param_atol: float = 0.0):
    """Error relative to each leaf's largest value; leaves of float noise around zero are
    measured against `floor`; `param_atol` allows adam's +-lr flips on near-zero gradients."""
    gl, wl = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(gl, wl):
        g, w = np.asarray(g, dtype=np.float64), np.asarray(w, dtype=np.float64)
        assert g.shape == w.shape
        if not g.size:
            continue
        scale = max(float(np.max(np.abs(w))), floor)
        err = float(np.max(np.abs(g - w)))
        assert err <= rtol * scale + param_atol, f"max error {err:.3e} vs scale {scale:.3e}"
