"""The one FLOP counter (rockmate.graph.flops, read through trace_graph) against hand-counted closed forms."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from autopar.graph import trace_graph

N, H, W, CIN, COUT = 2, 8, 8, 8, 16


def conv_flops(graph) -> float:
    return graph.flops_by_name()["conv_general_dilated"]


def xla_flops(fun, *args) -> float:
    cost = jax.jit(fun).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("stride", [1, 2])
def test_flax_conv_is_two_flops_per_multiply_add_of_its_window(stride, groups):
    conv = nn.Conv(COUT, (3, 3), strides=(stride, stride), feature_group_count=groups, use_bias=False)
    x = jnp.ones((N, H, W, CIN))
    params = conv.init(jax.random.PRNGKey(0), x)
    assert params["params"]["kernel"].shape == (3, 3, CIN // groups, COUT)      # HWIO
    ho, wo = H // stride, W // stride                                          # SAME padding
    # each output element: a 3 x 3 x (CIN / groups) multiply-add
    want = 2 * N * ho * wo * COUT * 3 * 3 * (CIN // groups)
    assert conv_flops(trace_graph(conv.apply, params, x)) == want


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("stride", [1, 2])
def test_conv_input_and_kernel_gradients_each_cost_one_forward_pass(stride, groups):
    """dL/dx and dL/dkernel are convs with as many multiply-adds as the forward conv; for a
    strided conv dL/dx slides over a cotangent dilated by the stride, whose holes are free."""
    conv = nn.Conv(COUT, (3, 3), strides=(stride, stride), feature_group_count=groups, use_bias=False)
    x = jnp.ones((N, H, W, CIN))
    params = conv.init(jax.random.PRNGKey(0), x)
    fwd = 2 * N * (H // stride) * (W // stride) * COUT * 3 * 3 * (CIN // groups)
    graph = trace_graph(jax.grad(lambda p, x: conv.apply(p, x).sum(), argnums=(0, 1)), params, x)
    convs = [op for op in graph.ops if op.name == "conv_general_dilated"]
    assert len(convs) == 3
    assert [op.flops for op in convs] == [fwd, fwd, fwd]


@pytest.mark.parametrize("b,i,j,k", [(4, 8, 16, 32), (3, 5, 7, 2)])
def test_batched_matmul_is_two_flops_per_multiply_add(b, i, j, k):
    x, y = jnp.ones((b, i, j)), jnp.ones((b, j, k))
    fun = lambda x, y: jnp.einsum("bij,bjk->bik", x, y)
    graph = trace_graph(fun, x, y)
    assert [op.name for op in graph.ops] == ["dot_general"]
    want = 2 * b * i * j * k
    assert graph.total_flops == want
    assert xla_flops(fun, x, y) == want


# GShard's mixture-of-experts einsums: G groups of S tokens of width M, E experts with C slots each, FFN width F
G, S, M, E, C, F = 2, 16, 8, 4, 6, 24


@pytest.mark.parametrize("subscripts,lhs,rhs,want", [
    ("gsec,gsm->egcm", (G, S, E, C), (G, S, M), 2 * G * E * C * M * S),      # dispatch: sum over the group's tokens
    ("egcm,emf->egcf", (E, G, C, M), (E, M, F), 2 * E * G * C * F * M),      # expert FFN, batched over experts
    ("gsec,egcm->gsm", (G, S, E, C), (E, G, C, M), 2 * G * S * M * E * C),   # combine: sum over experts and slots
], ids=["dispatch", "expert", "combine"])
def test_moe_einsums_count_every_multiply_add(subscripts, lhs, rhs, want):
    fun = lambda a, b: jnp.einsum(subscripts, a, b)
    a, b = jnp.ones(lhs), jnp.ones(rhs)
    graph = trace_graph(fun, a, b)
    assert graph.flops_by_name()["dot_general"] == want
    assert xla_flops(fun, a, b) == want
