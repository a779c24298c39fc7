"""GPT (decoder-only transformer LM, as in Alpa's GPT-3 benchmark) and its train step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.pipeline.grad import value_and_grad


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    batch: int = 16
    scan: bool = False       # nn.scan over layers instead of an unrolled Python loop
    dtype: Any = jnp.float32

    @property
    def num_params(self) -> int:
        d = self.hidden
        return self.vocab * d + self.seq * d + self.layers * (12 * d * d + 13 * d) + 2 * d + d * self.vocab + self.vocab

    @property
    def train_flops(self) -> float:
        """6 * params * tokens + attention (forward + backward)."""
        tokens = self.batch * self.seq
        return 6.0 * self.num_params * tokens + 12.0 * self.layers * self.batch * self.seq * self.seq * self.hidden


class Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        b, t, d = x.shape
        h = nn.LayerNorm(dtype=c.dtype)(x)
        qkv = nn.Dense(3 * d, dtype=c.dtype, name="qkv")(h)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        hd = d // c.heads
        q, k, v = (z.reshape(b, t, c.heads, hd) for z in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(c.dtype)
        mask = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(mask, scores, jnp.finfo(c.dtype).min)
        att = jax.nn.softmax(scores, axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        x = x + nn.Dense(d, dtype=c.dtype, name="proj")(o)
        h = nn.LayerNorm(dtype=c.dtype)(x)
        h = nn.Dense(4 * d, dtype=c.dtype, name="fc1")(h)
        h = jax.nn.gelu(h)
        return x + nn.Dense(d, dtype=c.dtype, name="fc2")(h)


class ScanBlock(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x, _):
        return Block(self.cfg)(x), None


class GPT(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        x = nn.Embed(c.vocab, c.hidden, name="wte")(tokens)
        pos = self.param("wpe", nn.initializers.normal(0.02), (c.seq, c.hidden))
        x = x + pos[None, : tokens.shape[1]]
        if c.scan:
            stack = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.layers)
            x, _ = stack(c, name="blocks")(x, None)
        else:
            for i in range(c.layers):
                x = Block(c, name=f"block{i}")(x)
        x = nn.LayerNorm(dtype=c.dtype)(x)
        return nn.Dense(c.vocab, dtype=c.dtype, name="head")(x)


def gpt_loss(model: GPT) -> Callable:
    def loss(params, batch):
        tokens, targets = batch
        logits = model.apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """step(state, batch) -> (new_state, loss) with state = (params, opt_state)."""
    def step(state, batch):
        params, opt_state = state
        # autopar's value_and_grad is jax's, but lets pipelines and remat find the loss
        loss, grads = value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
    return step


def gpt_setup(cfg: GPTConfig, optimizer: optax.GradientTransformation | None = None, seed: int = 0):
    """(train_step, state, batch) for a GPT config, with concrete random data."""
    model = GPT(cfg)
    optimizer = optimizer or optax.adamw(1e-3)
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    tokens = jax.random.randint(k1, (cfg.batch, cfg.seq), 0, cfg.vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    params = model.init(k2, tokens)["params"]
    state = (params, optimizer.init(params))
    return make_train_step(gpt_loss(model), optimizer), state, (tokens, targets)


def gpt_abstract_setup(cfg: GPTConfig, optimizer: optax.GradientTransformation | None = None):
    """(train_step, state, batch) as ShapeDtypeStructs: plan a model too big to materialise."""
    model = GPT(cfg)
    optimizer = optimizer or optax.adamw(1e-3)
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
    params = jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t)["params"], tokens)
    opt_state = jax.eval_shape(optimizer.init, params)
    return make_train_step(gpt_loss(model), optimizer), (params, opt_state), (tokens, tokens)
