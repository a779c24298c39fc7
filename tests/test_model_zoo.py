"""Model zoo: parameter and FLOP closed forms against the initialised and traced models,
GShard top-2 routing against a token-by-token reference, one parallelized step against
jax.jit on one device, and Alpa's suites planned from shapes alone."""
import re
from dataclasses import replace

import jax
import numpy as np
import optax
import pytest

import autopar
from autopar.graph import trace_graph
from autopar.model_zoo import (GPT_SUITE, MOE_SUITE, WRESNET_SUITE, GPTConfig, MoEConfig, WResNetConfig,
                               gpt_abstract_setup, gpt_setup, moe_abstract_setup, moe_setup, top2_routing,
                               wresnet_abstract_setup, wresnet_setup)
from models import LR, assert_tree_close

GPT_SMALL = GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=2, batch=8)
# capacity_factor 1: 8 slots per expert for 2 x 32 choices of a group, so tokens get dropped
MOE_SMALL = MoEConfig(vocab=64, seq=16, hidden=32, heads=2, layers=4, experts=4, expert_group_size=32,
                      capacity_factor=1.0, ffn_factor=2, batch=8)
# image 32: every strided conv halves an even side (16, 8, 4, 2 -> 1), see test_flops.py
WRESNET_SMALL = WResNetConfig(image_size=32, num_classes=10, layers=14, channels=8, width=2, norm_groups=4, batch=8)

SMALL = {"gpt": GPT_SMALL, "gpt_scan": replace(GPT_SMALL, scan=True), "moe": MOE_SMALL,
         "moe_pair": replace(MOE_SMALL, layers=2),
         "moe_scan": replace(MOE_SMALL, scan=True), "wresnet": WRESNET_SMALL,
         "wresnet26": replace(WRESNET_SMALL, layers=26, batch=4)}
SETUP = {GPTConfig: gpt_setup, MoEConfig: moe_setup, WResNetConfig: wresnet_setup}
ABSTRACT_SETUP = {GPTConfig: gpt_abstract_setup, MoEConfig: moe_abstract_setup, WResNetConfig: wresnet_abstract_setup}


def param_count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("name", SMALL)
def test_num_params_is_the_initialised_count(name):
    """Counted on the shapes init returns (jax.eval_shape of init: the same code, no values)."""
    cfg = SMALL[name]
    _, (params, _), _ = ABSTRACT_SETUP[type(cfg)](cfg)
    assert param_count(params) == cfg.num_params


def nominal(name: str) -> float:
    value, unit = re.fullmatch(r".*-([\d.]+)([MB])", name).groups()
    return float(value) * {"M": 1e6, "B": 1e9}[unit]


@pytest.mark.parametrize("case", GPT_SUITE + MOE_SUITE + WRESNET_SUITE, ids=lambda c: c.name)
def test_suite_sizes_are_alpas(case):
    """num_params is what init would allocate and within 4% of the size in the name (Alpa's
    Table 4, rounded: Alpa's own count for MoE-1.3B is 1.35B); GPTConfig has an untied LM
    head that the GPT-3 sizes do not count."""
    cfg = case.model
    _, (params, _), _ = ABSTRACT_SETUP[type(cfg)](cfg)
    assert param_count(params) == cfg.num_params
    untied_head = cfg.hidden * cfg.vocab + cfg.vocab if isinstance(cfg, GPTConfig) else 0
    assert abs((cfg.num_params - untied_head) / nominal(case.name) - 1) < 0.04
    assert case.devices in (1, 4, 8, 16, 32, 64)


def test_suites_scale_weakly_from_1_to_64_devices():
    for suite in (GPT_SUITE, MOE_SUITE, WRESNET_SUITE):
        assert [c.devices for c in suite] == [1, 4, 8, 16, 32, 64]
        sizes = [c.model.num_params for c in suite]
        assert sizes == sorted(sizes)
    assert {(c.model.seq, c.model.vocab, c.model.batch) for c in GPT_SUITE} == {(1024, 51200, 1024)}


def matmul_flops(cfg) -> float:
    flops = trace_graph(*ABSTRACT_SETUP[type(cfg)](cfg)).flops_by_name()
    return flops.get("dot_general", 0.0) + flops.get("conv_general_dilated", 0.0)


@pytest.mark.parametrize("name", ["moe", "moe_scan", "wresnet", "wresnet26"])
def test_train_flops_is_the_traced_matmul_and_conv_count(name):
    """The closed form counts exactly the dots and convs of the traced step (tolerance: float rounding)."""
    cfg = SMALL[name]
    assert matmul_flops(cfg) == pytest.approx(cfg.train_flops, rel=1e-9)


@pytest.mark.parametrize("name", ["gpt", "gpt_scan"])
def test_gpt_train_flops_is_traced_matmuls_plus_6_per_token_per_other_param(name):
    """GPTConfig.train_flops = 6 x params x tokens + attention: it also charges 6 FLOPs per
    token to parameters outside matmuls (embedding tables, biases, LayerNorms)."""
    cfg = SMALL[name]
    d, tokens = cfg.hidden, cfg.batch * cfg.seq
    matmul_weights = cfg.layers * 12 * d * d + d * cfg.vocab      # qkv, proj, fc1, fc2 kernels; LM head
    assert matmul_flops(cfg) == pytest.approx(cfg.train_flops - 6 * tokens * (cfg.num_params - matmul_weights),
                                              rel=1e-9)


def reference_top2(probs: np.ndarray, capacity: int) -> np.ndarray:
    """Token by token: all first choices in order, then all second choices, each into the
    next free slot of its expert unless the expert is full; gates renormalised over the two."""
    groups, tokens, experts = probs.shape
    combine = np.zeros((groups, tokens, experts, capacity))
    for g in range(groups):
        order = np.argsort(-probs[g], axis=-1)
        weight = probs[g, np.arange(tokens)[:, None], order[:, :2]]
        weight = weight / weight.sum(-1, keepdims=True)
        used = np.zeros(experts, int)
        for choice in range(2):
            for s in range(tokens):
                e = order[s, choice]
                if used[e] < capacity:
                    combine[g, s, e, used[e]] = weight[s, choice]
                    used[e] += 1
    return combine


def test_top2_routing_matches_a_token_by_token_reference():
    logits = jax.random.normal(jax.random.PRNGKey(3), (3, 12, 4)) * 2
    capacity = 4                                  # 16 slots for 24 choices per group: some are dropped
    combine, dispatch, aux = top2_routing(logits, capacity)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
    want = reference_top2(probs, capacity)
    np.testing.assert_allclose(np.asarray(combine), want, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(dispatch), want > 0)
    assert np.asarray(dispatch).sum() < 3 * 12 * 2                  # capacity dropped some choices
    assert np.asarray(dispatch).sum(axis=(1, 3)).max() <= capacity  # no expert over capacity
    first = np.eye(4)[probs.argmax(-1)]
    want_aux = 4 * np.mean(np.sum(first.mean(axis=1) * probs.mean(axis=1), axis=-1))
    assert float(aux) == pytest.approx(want_aux, rel=1e-5)


def test_balanced_routing_has_aux_loss_one():
    # token s prefers expert s mod 4, then expert s + 1 mod 4: every expert is chosen first
    # by a quarter of the tokens and second by another quarter, so all 32 choices fit
    logits = np.tile(np.eye(4) * 3.0 + np.roll(np.eye(4), 1, axis=1), (1, 4, 1))
    _, dispatch, aux = top2_routing(logits, capacity=8)
    assert float(aux) == pytest.approx(1.0, rel=1e-6)
    assert np.asarray(dispatch).sum() == 2 * 16


@pytest.mark.parametrize("name,opt_name,mesh_shape", [("moe_pair", "sgd", None), ("moe_scan", "adamw", (2, 4)),
                                                      ("wresnet", "sgd", (2, 4))])
def test_parallelized_step_matches_single_device(name, opt_name, mesh_shape):
    cfg = SMALL[name]
    optimizer = {"sgd": optax.sgd(LR), "adamw": optax.adamw(LR)}[opt_name]
    step, state, batch = SETUP[type(cfg)](cfg, optimizer)
    (ref_params, ref_opt), ref_loss = jax.jit(step)(state, batch)
    method = autopar.ShardParallel(mesh_shape=mesh_shape) if mesh_shape else "auto"
    pstep = autopar.parallelize(step, method=method)
    (params, opt), loss = pstep(state, batch)
    assert len(pstep.plan.stages[0].device_ids) == 8
    assert_tree_close(loss, ref_loss)
    # sgd: the update is lr x gradient, so the parameters check the gradients tightly
    assert_tree_close(params, ref_params, param_atol=2 * LR if opt_name == "adamw" else 0.0)
    assert_tree_close(opt, ref_opt, rtol=1e-4, floor=1e-5)
    moved = jax.tree_util.tree_map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), params, state[0])
    assert min(jax.tree_util.tree_leaves(moved)) > 0          # every weight took part in the step


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


@pytest.mark.parametrize("case", [GPT_SUITE[0], MOE_SUITE[0], WRESNET_SUITE[0]], ids=lambda c: c.name)
def test_smallest_suite_entry_plans_from_shapes_alone(case):
    cfg = case.model
    before = live_bytes()
    step, state, batch = ABSTRACT_SETUP[type(cfg)](cfg)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves((state, batch)))
    plan = autopar.make_plan(step, state, batch, cluster="1x8:a100-80g")
    assert live_bytes() - before < 64 * 2 ** 20             # the model alone would take > 1 GB
    assert sum(len(s.device_ids) for s in plan.stages) == 8
    # no plan beats every device computing its share of the matmuls at peak speed
    cluster = autopar.Cluster.parse("1x8:a100-80g")
    bound_s = cluster.device.compute_s(cfg.train_flops / 8, cfg.dtype)
    assert sum(s.predicted_time_s for s in plan.stages) >= bound_s
