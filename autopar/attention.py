"""`causal_attention`: causal softmax attention that a token pipeline (TeraPipe) can find.

Outside a token pipeline it is the plain computation, so any model can call it
unconditionally. It runs as a `jax.jit` call named `autopar_causal_attention`, which the
planner finds in the traced loss (`attention_calls`) and, inlined, marks op by op
(`mark_calls=ATTENTION_CALL`) to tell its FLOPs from the rest of a layer's and to run it
on a token slice with the earlier slices' keys and values (`pipeline/token_eval.py`).

Keys and values may be longer than the queries: the queries are then the last positions
of the sequence and the leading keys and values are their context (a token slice after
the slices before it), each query attending to every key at or before its own position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ATTENTION_CALL = "autopar_causal_attention"


@jax.jit
def autopar_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: jax.Array) -> jax.Array:
    tq, tk = q.shape[1], k.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale.astype(q.dtype)
    causal = jnp.arange(tk)[None, :] <= jnp.arange(tq)[:, None] + (tk - tq)
    s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def causal_attention(q: Any, k: Any, v: Any, *, scale: float | None = None) -> jax.Array:
    """Causal softmax attention of q, k, v shaped [batch, seq, heads, head_dim] (k and v
    may carry earlier positions as context); `scale` defaults to 1 / sqrt(head_dim)."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"causal_attention takes q, k, v shaped [batch, seq, heads, head_dim]; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or k.shape[1] < q.shape[1]:
        raise ValueError(f"causal_attention: k and v must have q's batch, heads and head_dim and at least its "
                         f"sequence length (the extra leading positions are context); got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5
    return autopar_causal_attention(q, k, v, np.asarray(scale, np.float32))


@dataclass(frozen=True)
class AttentionCall:
    """One `causal_attention` call found in a traced function."""

    batch: int
    query_len: int
    key_len: int
    heads: int
    head_dim: int
    dtype: str

    @property
    def forward_flops(self) -> float:
        """FLOPs of the two matmuls (scores and weighted values) as computed: every query
        against every key, the masked ones included."""
        return 4.0 * self.batch * self.heads * self.head_dim * self.query_len * self.key_len


def attention_calls(jaxpr: Any) -> list[AttentionCall]:
    """The `causal_attention` calls of a (closed) jaxpr, nested calls and scan bodies included
    (a call inside a scan is listed once per iteration)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found: list[AttentionCall] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pjit", "jit") and eqn.params.get("name") == ATTENTION_CALL \
                and len(eqn.invars) == 4 and eqn.invars[0].aval.ndim == 4:
            q, k = eqn.invars[0].aval, eqn.invars[1].aval
            found.append(AttentionCall(batch=q.shape[0], query_len=q.shape[1], key_len=k.shape[1],
                                       heads=q.shape[2], head_dim=q.shape[3], dtype=str(q.dtype)))
            continue
        repeat = int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1
        for sub in _subjaxprs(eqn):
            found.extend(attention_calls(sub) * repeat)
    return found


def _subjaxprs(eqn: Any) -> list[Any]:
    """The jaxprs an equation's params hold (call bodies, scan and cond branches)."""
    out = []
    for p in eqn.params.values():
        for x in (p if isinstance(p, (tuple, list)) else (p,)):
            if hasattr(x, "eqns") or hasattr(getattr(x, "jaxpr", None), "eqns"):
                out.append(x)
    return out
