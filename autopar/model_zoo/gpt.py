"""GPT (decoder-only transformer LM, as in Alpa's GPT-3 benchmark) and its train step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
import optax

from autopar.model_zoo.train_step import abstract_language_model_setup, language_model_setup
from autopar.model_zoo.transformer import attention_sublayer, dense_ffn


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

    def __post_init__(self) -> None:
        for name in ("vocab", "seq", "hidden", "heads", "layers", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a positive integer")
        if self.hidden % self.heads:
            raise ValueError(f"GPTConfig: hidden={self.hidden} is not a multiple of heads={self.heads}; "
                             f"attention splits the hidden size into heads of equal width")

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
        x = attention_sublayer(x, self.cfg.heads, self.cfg.dtype)
        return dense_ffn(x, 4 * x.shape[-1], self.cfg.dtype)


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


def gpt_setup(cfg: GPTConfig, optimizer: optax.GradientTransformation | None = None, seed: int = 0):
    """(train_step, state, batch) for a GPT config, with concrete random data."""
    model = GPT(cfg)
    # an eager init keeps the parameters bit-identical to those of earlier versions
    return language_model_setup(model, gpt_loss(model), cfg, optimizer, seed, jit_init=False)


def gpt_abstract_setup(cfg: GPTConfig, optimizer: optax.GradientTransformation | None = None):
    """(train_step, state, batch) as ShapeDtypeStructs: plan a model too big to materialise."""
    model = GPT(cfg)
    return abstract_language_model_setup(model, gpt_loss(model), cfg, optimizer)
