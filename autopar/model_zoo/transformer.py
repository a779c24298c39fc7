"""Pre-LayerNorm transformer sublayers shared by the GPT and MoE language models.

Both are plain functions called inside a compact flax module, so their parameters
(`LayerNorm_k`, `qkv`, `proj`, `fc1`, `fc2`) belong to that module.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from autopar.attention import causal_attention


def attention_sublayer(x: jax.Array, heads: int, dtype: Any) -> jax.Array:
    """x + multi-head causal self-attention of LayerNorm(x); x is [batch, seq, hidden].
    The attention is `autopar.causal_attention`, so the models can be token-pipelined."""
    b, t, d = x.shape
    h = nn.LayerNorm(dtype=dtype)(x)
    qkv = nn.Dense(3 * d, dtype=dtype, name="qkv")(h)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    hd = d // heads
    q, k, v = (z.reshape(b, t, heads, hd) for z in (q, k, v))
    o = causal_attention(q, k, v).reshape(b, t, d)
    return x + nn.Dense(d, dtype=dtype, name="proj")(o)


def dense_ffn(x: jax.Array, width: int, dtype: Any) -> jax.Array:
    """x + Dense(gelu(Dense(LayerNorm(x), width))): the position-wise feed-forward sublayer."""
    h = nn.LayerNorm(dtype=dtype)(x)
    h = nn.Dense(width, dtype=dtype, name="fc1")(h)
    h = jax.nn.gelu(h)
    return x + nn.Dense(x.shape[-1], dtype=dtype, name="fc2")(h)
