"""rockmate finds the layers of ordinary models and saves memory on them: a stack whose
layers all read one mask and position table, a 2-layer stack, a flax `nn.scan` stack, a
flax.nnx model and an MoE language model. Each: compiled temp memory of jax.grad under a
budget below the no-remat temp is lower than without remat, and gradients equal jax.grad
of the original."""
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import rockmate
from rockmate.blocks import find_chain
from rockmate.planner import trace
from test_rockmate_grads import GPT, assert_grads_close


def compiled_grad(f, *args):
    return jax.jit(jax.grad(f)).lower(*args).compile()


def check_remat_saves_memory(f, *args):
    """Plan at the least budget (below no-remat temp), compile, compare with jax.grad."""
    plain = compiled_grad(f, *args)
    plain_bytes = plain.memory_analysis().temp_size_in_bytes
    lo = rockmate.min_budget(f, *args)
    assert lo < plain_bytes, (lo, plain_bytes)
    ours = compiled_grad(rockmate.remat(f, lo, *args), *args)
    measured = ours.memory_analysis().temp_size_in_bytes
    assert measured < 0.8 * plain_bytes, (measured, plain_bytes)
    assert measured <= 1.1 * lo, (measured, lo)
    assert_grads_close(ours(*args), plain(*args))


def token_loss(apply):
    """Cross-entropy of the tokens under the logits `apply(params, tok)`."""
    def f(params, tok):
        lp = jax.nn.log_softmax(apply(params, tok))
        return -jnp.mean(jnp.take_along_axis(lp, tok[..., None], -1))
    return f


TOKENS = jax.random.randint(jax.random.PRNGKey(0), (4, 32), 0, 64)


def layer_blocks(f, *args, ops_at_least=1):
    """Blocks of f's chain with at least `ops_at_least` ops, and the chain's side bytes."""
    chain = find_chain(trace(f, args))
    return [b for b in chain.blocks if b.stop - b.start >= ops_at_least], chain.side_bytes


# ---------------------------------------------------------------- a mask and a position table every layer reads

SEQ, WIDTH = 32, 64


def masked_stack(layers):
    key = jax.random.PRNGKey(0)
    ws = [[jax.random.normal(jax.random.fold_in(key, 10 * i + j), shape) * 0.1
           for j, shape in enumerate([(WIDTH, WIDTH), (WIDTH, 4 * WIDTH), (4 * WIDTH, WIDTH)])]
          for i in range(layers)]
    x = jax.random.normal(key, (8, SEQ, WIDTH))

    def f(ws, x):
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))  # made once, read by every layer
        pos = jnp.sin(jnp.arange(SEQ)[:, None] * jnp.arange(WIDTH)[None, :] * 0.01)
        h = x
        for wq, w1, w2 in ws:
            scores = jnp.where(mask, ((h + pos) @ wq) @ h.swapaxes(1, 2), -1e9)
            h = h + jax.nn.softmax(scores, -1) @ h
            h = h + jnp.tanh(h @ w1) @ w2
        return jnp.mean(h ** 2)
    return f, (ws, x)


def test_layers_reading_a_shared_mask_and_position_table_are_cut_into_blocks():
    f, args = masked_stack(4)
    blocks, side_bytes = layer_blocks(f, *args, ops_at_least=10)
    assert len(blocks) >= 4
    assert side_bytes >= SEQ * WIDTH * 4  # the position table is held as a side value
    check_remat_saves_memory(f, *args)


def test_a_two_layer_stack_is_two_blocks():
    f, args = masked_stack(2)
    blocks, _ = layer_blocks(f, *args, ops_at_least=10)
    assert len(blocks) == 2
    check_remat_saves_memory(f, *args)


# ---------------------------------------------------------------- flax nn.scan


def test_nn_scan_stack_checkpoints_its_body():
    m = GPT(layers=4, d=64, heads=2, vocab=64, scan=True)
    f, params = token_loss(m.apply), m.init(jax.random.PRNGKey(1), TOKENS)
    check_remat_saves_memory(f, params, TOKENS)
    (scan,) = [b for b in rockmate.plan_remat(f, rockmate.min_budget(f, params, TOKENS), params, TOKENS).blocks
               if b.is_scan]
    assert not scan.keep_all  # the body is checkpointed, keeping only some of its values


# ---------------------------------------------------------------- flax.nnx


class NnxLayer(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, d, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class NnxLM(nnx.Module):
    def __init__(self, layers: int, d: int, vocab: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([NnxLayer(d, rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tok):
        x = self.embed(tok)
        mask = nnx.make_causal_mask(tok)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def test_nnx_model():
    graphdef, state = nnx.split(NnxLM(2, 64, 64, nnx.Rngs(0)))
    f = token_loss(lambda state, tok: nnx.merge(graphdef, state)(tok))
    blocks, _ = layer_blocks(f, state, TOKENS, ops_at_least=20)
    assert len(blocks) >= 2
    check_remat_saves_memory(f, state, TOKENS)


# ---------------------------------------------------------------- MoE language model


class MoE(nn.Module):
    """Top-2 of `experts` MLPs per token, dense dispatch (every expert sees every token,
    weighted by the gate; enough to have routing, top_k and one-hot in the graph)."""

    experts: int

    @nn.compact
    def __call__(self, x):
        b, s, d = x.shape
        t = x.reshape(b * s, d)
        gates = jax.nn.softmax(nn.Dense(self.experts, use_bias=False)(t), -1)
        top, idx = jax.lax.top_k(gates, 2)
        combine = jnp.sum(jax.nn.one_hot(idx, self.experts) * (top / top.sum(-1, keepdims=True))[..., None], 1)
        w1 = self.param("w1", nn.initializers.lecun_normal(), (self.experts, d, 2 * d))
        w2 = self.param("w2", nn.initializers.lecun_normal(), (self.experts, 2 * d, d))
        y = jnp.einsum("eth,ehd->etd", nn.gelu(jnp.einsum("td,edh->eth", t, w1)), w2)
        return jnp.einsum("etd,te->td", y, combine).reshape(b, s, d)


class MoELM(nn.Module):
    layers: int
    d: int
    vocab: int
    experts: int

    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(self.vocab, self.d)(tok)
        mask = nn.make_causal_mask(tok)
        for _ in range(self.layers):
            x = x + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(x), mask=mask)
            x = x + MoE(self.experts)(nn.LayerNorm()(x))
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def test_moe_language_model():
    m = MoELM(layers=2, d=32, vocab=64, experts=4)
    f, params = token_loss(m.apply), m.init(jax.random.PRNGKey(1), TOKENS)
    blocks, _ = layer_blocks(f, params, TOKENS, ops_at_least=40)
    assert len(blocks) >= 2
    check_remat_saves_memory(f, params, TOKENS)
