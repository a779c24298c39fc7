"""rockmate's per-op costs read the op graph's one FLOP/byte counter: a matmul's roofline
time is its closed-form FLOPs over peak, a scan's is its body's times the trip count."""
import jax
import jax.numpy as jnp
import pytest

from rockmate.graph import trace_graph
from rockmate.op_costs import MEMORY_BW_BYTES_PER_S, OP_OVERHEAD_S, PEAK_FLOPS_PER_S, op_cost, op_key


def test_matmul_roofline_time_is_closed_form_flops_over_peak():
    m, k, n = 256, 512, 384
    graph = trace_graph(jnp.matmul, jnp.ones((m, k)), jnp.ones((k, n)))
    (op,) = graph.ops
    cost = op_cost(graph, op)
    assert cost.flops == 2 * m * k * n
    assert cost.bytes_accessed == 4 * (m * k + k * n + m * n)
    assert cost.time_s == pytest.approx(2 * m * k * n / PEAK_FLOPS_PER_S + OP_OVERHEAD_S)
    assert cost.needs_inputs and not cost.needs_output and cost.bwd_time_s == pytest.approx(2 * cost.time_s)


def test_elementwise_op_is_memory_bound_and_profile_overrides_it():
    graph = trace_graph(lambda x: jnp.tanh(x) * 2.0, jnp.ones((1024, 1024)))
    tanh, mul = graph.ops
    cost = op_cost(graph, tanh)
    assert cost.time_s == pytest.approx(2 * 4 * 1024 * 1024 / MEMORY_BW_BYTES_PER_S + OP_OVERHEAD_S)
    assert cost.needs_output and not cost.needs_inputs
    assert op_key(graph, mul) == "mul(float32[1024, 1024],lit)->(float32[1024, 1024])"
    assert op_cost(graph, mul, {op_key(graph, mul): 0.5}).time_s == 0.5


def test_scan_costs_its_body_times_the_trip_count():
    ws = jnp.ones((6, 64, 64))

    def f(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
    graph = trace_graph(f, jnp.ones((32, 64)), ws)
    (scan,) = [op for op in graph.ops if op.name == "scan"]
    body_flops = sum(op_cost(scan.body, op).flops for op in scan.body.ops)
    assert body_flops == 2 * 32 * 64 * 64 + 32 * 64
    assert op_cost(graph, scan).flops == 6 * body_flops
