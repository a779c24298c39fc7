"""GShard mixture-of-experts LM (Lepikhin et al. 2020), the MoE model of Alpa's benchmark.

A pre-LN causal transformer whose every other layer replaces its FFN with E experts and
top-2 gating. Tokens are cut into groups of `expert_group_size`; in each group every
expert has `capacity` slots. The gating builds a combine tensor [groups, tokens, experts,
capacity] (the gate weight of each token in each slot) and its 0/1 dispatch mask; one
einsum moves tokens into [experts, groups, capacity, hidden], the experts run as batched
matmuls over the expert dim, and a second einsum combines their outputs back. A token
whose expert is full is dropped from that expert (the residual carries it on). The
auxiliary load-balancing loss of each MoE layer is added to the LM loss.

Differences from GShard, on purpose: the second expert is always the second-best one
(GShard dispatches it at random with probability 2 * its gate), so a step is
deterministic and comparable across plans; the router runs in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.model_zoo.train_step import abstract_language_model_setup, cross_entropy, language_model_setup
from autopar.model_zoo.transformer import attention_sublayer, dense_ffn


@dataclass(frozen=True)
class MoEConfig:
    vocab: int = 256
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 2               # even: (dense layer, MoE layer) pairs
    experts: int = 4
    expert_group_size: int = 64   # tokens routed together (GShard's S); divides batch * seq
    capacity_factor: float = 2.0  # slots per expert = ceil(factor * group / experts); GShard: 2S/E
    ffn_factor: int = 8           # FFN width / hidden, dense and expert FFNs (8 in Alpa's MoE suite)
    aux_loss_weight: float = 0.01
    batch: int = 16
    scan: bool = False            # nn.scan over the layer pairs instead of an unrolled loop
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        if self.layers < 2 or self.layers % 2:
            raise ValueError(f"MoEConfig.layers={self.layers}: need an even number (dense, MoE) of layers")
        if self.experts < 2:
            raise ValueError(f"MoEConfig.experts={self.experts}: top-2 gating needs at least 2 experts")
        if (self.batch * self.seq) % self.expert_group_size:
            raise ValueError(f"MoEConfig: batch * seq = {self.batch * self.seq} tokens do not split into "
                             f"groups of expert_group_size={self.expert_group_size}")
        if self.hidden % self.heads:
            raise ValueError(f"MoEConfig: hidden={self.hidden} is not a multiple of heads={self.heads}")

    @property
    def capacity(self) -> int:
        """Slots per expert in each group of tokens."""
        return math.ceil(self.capacity_factor * self.expert_group_size / self.experts)

    @property
    def num_params(self) -> int:
        """Embedding (tied with the LM head) + positions + layer pairs + final LayerNorm."""
        h, e, f = self.hidden, self.experts, self.ffn_factor * self.hidden
        attention = 4 * h * h + 6 * h                      # LayerNorm, qkv, proj (with biases)
        ffn = 2 * h * f + f + 3 * h                        # LayerNorm, fc1, fc2
        moe_ffn = 2 * h + h * e + e * (2 * h * f + f + h)  # LayerNorm, router, experts' wi, bi, wo, bo
        return self.vocab * h + self.seq * h + self.layers // 2 * (2 * attention + ffn + moe_ffn) + 2 * h

    @property
    def train_flops(self) -> float:
        """Matmul FLOPs (dot_general, 2 per multiply-add) of one train step, forward + backward.

        Forward, with T = batch * seq tokens, H hidden, F = ffn_factor * H, E experts, C slots:
        attention 8TH^2 + 4 batch seq^2 H per layer, dense FFN 4THF, MoE FFN 2THE (router)
        + 2TECH (dispatch) + 4 (T / group) E C H F (experts) + 2TECH (combine), LM head 2THV.
        The backward pass doubles every matmul except the dispatch, whose 0/1 mask takes no
        gradient: train = 3 x forward - 2TECH per MoE layer.
        """
        t, h, e, c = self.batch * self.seq, self.hidden, self.experts, self.capacity
        f = self.ffn_factor * h
        attention = 8 * t * h * h + 4 * self.batch * self.seq * self.seq * h
        moe_ffn = 2 * t * h * e + 4 * t * e * c * h + 4 * (t // self.expert_group_size) * e * c * h * f
        pair = 2 * attention + 4 * t * h * f + moe_ffn
        forward = self.layers // 2 * pair + 2 * t * h * self.vocab
        return float(3 * forward - self.layers // 2 * 2 * t * e * c * h)


def top2_routing(logits: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 gating of router logits [groups, tokens, experts].

    Returns (combine [G, S, E, C] gate weights, dispatch [G, S, E, C] 0/1 mask, aux loss).
    Each token goes to its two best experts, at the next free slot of each, first choices
    before second choices; a token that finds its expert full is dropped there. The two
    gate weights are renormalised to sum to 1. aux = E * sum_e(fraction of tokens whose
    first choice is e * mean gate probability of e), averaged over groups: 1 when balanced.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    experts = probs.shape[-1]
    first = jax.nn.one_hot(jnp.argmax(probs, axis=-1), experts)
    second = jax.nn.one_hot(jnp.argmax(jnp.where(first > 0, -1.0, probs), axis=-1), experts)
    aux = experts * jnp.mean(jnp.sum(first.mean(axis=1) * probs.mean(axis=1), axis=-1))

    # slot = number of earlier tokens of the group sent to the same expert (firsts fill up first)
    slot_first = jnp.cumsum(first, axis=1) - first
    kept_first = first * (slot_first < capacity)
    slot_second = jnp.cumsum(second, axis=1) - second + kept_first.sum(axis=1, keepdims=True)
    kept_second = second * (slot_second < capacity)

    def placement(kept, slot):  # [G, S, E] x [G, S, E] -> [G, S, E, C]
        return kept[..., None] * jax.nn.one_hot(slot.astype(jnp.int32), capacity)

    dispatch_first, dispatch_second = placement(kept_first, slot_first), placement(kept_second, slot_second)
    gate_first, gate_second = (probs * first).sum(-1), (probs * second).sum(-1)
    norm = gate_first + gate_second
    combine = ((gate_first / norm)[..., None, None] * dispatch_first
               + (gate_second / norm)[..., None, None] * dispatch_second)
    return combine, dispatch_first + dispatch_second, aux


class MoEFeedForward(nn.Module):
    """Top-2 gated mixture of E FFN experts over [batch, seq, hidden]; returns (output, aux loss)."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        b, s, h = x.shape
        f = c.ffn_factor * h
        # fan-in initialisation per expert: the leading expert dim is a batch of matrices
        per_expert = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", batch_axis=(0,))
        router = self.param("router", nn.initializers.lecun_normal(), (h, c.experts))
        wi = self.param("wi", per_expert, (c.experts, h, f))
        bi = self.param("bi", nn.initializers.zeros, (c.experts, f))
        wo = self.param("wo", per_expert, (c.experts, f, h))
        bo = self.param("bo", nn.initializers.zeros, (c.experts, h))

        tokens = x.reshape(-1, c.expert_group_size, h).astype(c.dtype)
        logits = jnp.einsum("gsh,he->gse", tokens.astype(jnp.float32), router)
        combine, dispatch, aux = top2_routing(logits, c.capacity)
        slots = jnp.einsum("gsec,gsh->egch", dispatch.astype(c.dtype), tokens)
        hid = jax.nn.relu(jnp.einsum("egch,ehf->egcf", slots, wi.astype(c.dtype)) + bi[:, None, None].astype(c.dtype))
        out = jnp.einsum("egcf,efh->egch", hid, wo.astype(c.dtype)) + bo[:, None, None].astype(c.dtype)
        y = jnp.einsum("gsec,egch->gsh", combine.astype(c.dtype), out)
        return y.reshape(b, s, h), aux


class DenseLayer(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):
        x = attention_sublayer(x, self.cfg.heads, self.cfg.dtype)
        return dense_ffn(x, self.cfg.ffn_factor * x.shape[-1], self.cfg.dtype)


class MoELayer(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):
        x = attention_sublayer(x, self.cfg.heads, self.cfg.dtype)
        y, aux = MoEFeedForward(self.cfg, name="moe")(nn.LayerNorm(dtype=self.cfg.dtype)(x))
        return x + y, aux


class LayerPair(nn.Module):
    """A dense layer then an MoE layer; carries (activations, summed aux loss) so nn.scan can stack it."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, carry, _=None):
        x, aux = carry
        x, layer_aux = MoELayer(self.cfg, name="moe_layer")(DenseLayer(self.cfg, name="dense_layer")(x))
        return (x, aux + layer_aux), None


class MoELM(nn.Module):
    """tokens [batch, seq] -> (logits [batch, seq, vocab], aux loss summed over MoE layers)."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        embed = nn.Embed(c.vocab, c.hidden, dtype=c.dtype, name="wte")
        pos = self.param("wpe", nn.initializers.normal(0.02), (c.seq, c.hidden))
        carry = (embed(tokens) + pos[None, : tokens.shape[1]].astype(c.dtype), jnp.zeros((), jnp.float32))
        if c.scan:
            stack = nn.scan(LayerPair, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=c.layers // 2)
            carry, _ = stack(c, name="pairs")(carry, None)
        else:
            for i in range(c.layers // 2):
                carry, _ = LayerPair(c, name=f"pair{i}")(carry)
        x, aux = carry
        return embed.attend(nn.LayerNorm(dtype=c.dtype)(x)), aux


def moe_loss(model: MoELM) -> Callable:
    """Next-token cross-entropy + aux_loss_weight x the MoE layers' load-balancing losses."""
    def loss(params, batch):
        tokens, targets = batch
        logits, aux = model.apply({"params": params}, tokens)
        return cross_entropy(logits, targets) + model.cfg.aux_loss_weight * aux
    return loss


def moe_setup(cfg: MoEConfig, optimizer: optax.GradientTransformation | None = None, seed: int = 0):
    """(train_step, state, batch) for an MoE config, with concrete random data."""
    model = MoELM(cfg)
    return language_model_setup(model, moe_loss(model), cfg, optimizer, seed)


def moe_abstract_setup(cfg: MoEConfig, optimizer: optax.GradientTransformation | None = None):
    """(train_step, state, batch) as ShapeDtypeStructs: plan a model too big to materialise."""
    model = MoELM(cfg)
    return abstract_language_model_setup(model, moe_loss(model), cfg, optimizer)
