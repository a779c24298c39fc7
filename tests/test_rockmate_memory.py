"""The saving is real in the compiled program: measured temp memory of jax.grad(f2) follows
the prediction and the budget, on an unrolled model (where plain jax.checkpoint does not
save memory on XLA CPU) as well as on a scanned one."""
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rockmate

LAYERS, BATCH, WIDTH, HIDDEN = 6, 512, 64, 256


def residual_mlp():
    key = jax.random.PRNGKey(0)
    params = [(jax.random.normal(jax.random.fold_in(key, i), (WIDTH, HIDDEN)) * 0.05,
               jax.random.normal(jax.random.fold_in(key, 100 + i), (HIDDEN, WIDTH)) * 0.05)
              for i in range(LAYERS)]
    x = jax.random.normal(key, (BATCH, WIDTH))

    def f(params, x):
        h = x
        for a, b in params:
            h = h + jnp.tanh(h @ a) @ b
        return jnp.sum(h ** 2)
    return f, params, x


def temp_bytes(f, *args) -> int:
    return jax.jit(jax.grad(f)).lower(*args).compile().memory_analysis().temp_size_in_bytes


def sweep(f, *args, points=5):
    """(budget, predicted, measured) from the minimum budget up to no-remat memory.

    measured: the temp bytes rockmate.remat read off the compiled program it returns
    (`schedule.measured_temp_bytes`); at the tightest budget the program is compiled again
    here and must measure the same (compiling every point twice doubled the sweep's time)."""
    plain = temp_bytes(f, *args)
    lo = rockmate.min_budget(f, *args)
    results = []
    for budget in np.linspace(lo, max(plain, lo), points).astype(int):
        f2 = rockmate.remat(f, int(budget), *args)
        assert f2.schedule.predicted_temp_bytes <= budget
        measured = f2.schedule.measured_temp_bytes
        if not results:
            assert measured == temp_bytes(f2, *args)
        results.append((int(budget), f2.schedule.predicted_temp_bytes, measured))
    return plain, results


def test_measured_temp_follows_prediction_over_budget_sweep():
    f, params, x = residual_mlp()
    plain, results = sweep(f, params, x)
    for budget, predicted, measured in results:
        assert abs(measured - predicted) <= 0.15 * predicted, results
        assert measured <= 1.10 * budget, results
    # the tightest schedule saves a real share of no-remat memory
    assert results[0][2] < 0.4 * plain, (results, plain)


class ResBlock(nn.Module):
    ch: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Conv(self.ch, (3, 3))(x))
        return nn.relu(x + nn.Conv(self.ch, (3, 3))(h))


class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        for _ in range(4):
            x = ResBlock(16)(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


def test_resnet_measured_temp_follows_prediction_over_budget_sweep():
    """Conv blocks: relu(x + conv(h)) outputs that XLA would otherwise fuse into every
    consumer, and weight gradients reading a transposed copy of the input image."""
    m = ResNet()
    x = jax.random.normal(jax.random.PRNGKey(2), (4, 16, 16, 16))
    params = m.init(jax.random.PRNGKey(3), x)
    f = lambda p, x: jnp.mean(m.apply(p, x) ** 2)  # noqa: E731
    plain, results = sweep(f, params, x)
    for budget, predicted, measured in results:
        assert abs(measured - predicted) <= 0.15 * predicted, results
        assert measured <= 1.10 * budget, results
    assert results[0][2] < 0.5 * plain, (results, plain)


def test_gpt_measured_temp_stays_under_budget_over_sweep():
    """Transformer blocks: measured temp never exceeds the budget by more than 10 % and is
    within 15 % of the prediction at the tight end. Known gap: at loose budgets the
    prediction is high (measured up to ~30 % lower), because XLA keeps fewer of a
    keep-everything block's residuals than JAX's VJP lists (it re-derives cheap
    elementwise ones from fused neighbours), and the per-block calibration in isolation
    does not see that saving."""
    from test_rockmate_grads import GPT
    m = GPT(layers=4, d=64, heads=1, vocab=256)
    tok = jax.random.randint(jax.random.PRNGKey(0), (2, 64), 0, 256)
    params = m.init(jax.random.PRNGKey(1), tok)

    def f(params, tok):
        lp = jax.nn.log_softmax(m.apply(params, tok))
        return -jnp.mean(jnp.take_along_axis(lp, tok[..., None], -1))
    plain, results = sweep(f, params, tok, points=4)
    for budget, predicted, measured in results:
        assert measured <= 1.10 * budget, results
    budget, predicted, measured = results[0]
    assert abs(measured - predicted) <= 0.15 * predicted, results
    assert measured < 0.4 * plain, (results, plain)


def test_tied_recomputation_beats_plain_checkpoint_on_unrolled_layers():
    """Plain per-layer jax.checkpoint is undone by XLA CPU (CSE after barrier removal);
    the same schedule through rockmate's lowering keeps only layer inputs."""
    f, params, x = residual_mlp()

    def f_ckpt(params, x):
        h = x
        for a, b in params:
            h = jax.checkpoint(lambda h, a, b: h + jnp.tanh(h @ a) @ b)(h, a, b)
        return jnp.sum(h ** 2)
    plain, ckpt = temp_bytes(f, params, x), temp_bytes(f_ckpt, params, x)
    lo = rockmate.min_budget(f, params, x)
    ours = temp_bytes(rockmate.remat(f, lo, params, x), params, x)
    assert ckpt > 0.8 * plain  # the XLA CPU behaviour this lowering works around
    assert ours < 0.5 * ckpt


def test_scanned_layers_follow_prediction():
    f_unrolled, params, x = residual_mlp()
    stacked = jax.tree.map(lambda *p: jnp.stack(p), *params)

    def f(stacked, x):
        def body(h, p):
            a, b = p
            return h + jnp.tanh(h @ a) @ b, None
        h, _ = jax.lax.scan(body, x, stacked)
        return jnp.sum(h ** 2)
    plain = temp_bytes(f, stacked, x)
    lo = rockmate.min_budget(f, stacked, x)
    f2 = rockmate.remat(f, lo, stacked, x)
    measured = temp_bytes(f2, stacked, x)
    assert measured < 0.5 * plain
    assert abs(measured - f2.schedule.predicted_temp_bytes) <= 0.15 * f2.schedule.predicted_temp_bytes, \
        (measured, f2.schedule.predicted_temp_bytes)


def scan_with_head():
    """A scanned residual MLP whose stacked weights the head reads too."""
    _, params, x = residual_mlp()
    stacked = jax.tree.map(lambda *p: jnp.stack(p), *params)

    def f(stacked, x):
        h, _ = jax.lax.scan(lambda h, p: (h + jnp.tanh(h @ p[0]) @ p[1], None), x, stacked)
        e = jnp.tanh(h @ stacked[0][0])
        return jnp.sum(e ** 2) + jnp.sum(jnp.exp(-e @ stacked[1][0]))
    return f, stacked, x


def test_scan_whose_weights_the_head_also_reads_follows_prediction():
    """The scan block is measured whole (its loops, the carries it saves), and the gradient
    of the stacked weights, summed from the scan's backward and the head's, is held
    across the backward: before both, this measured 1.6x the predicted minimum."""
    f, stacked, x = scan_with_head()
    plain = temp_bytes(f, stacked, x)
    lo = rockmate.min_budget(f, stacked, x)
    measured = temp_bytes(rockmate.remat(f, lo, stacked, x), stacked, x)
    assert measured < 0.5 * plain
    assert abs(measured - lo) <= 0.1 * lo, (measured, lo)


def test_remat_at_the_minimum_meets_it_or_says_by_how_much():
    """The compiled program is measured: within 1 % of the budget, or a warning naming the
    measured bytes and the overshoot. The recorded measurement is the program's own."""
    f_mlp, params, x = residual_mlp()
    f_scan, stacked, _ = scan_with_head()
    for f, args in [(f_mlp, (params, x)), (f_scan, (stacked, x))]:
        lo = rockmate.min_budget(f, *args)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            f2 = rockmate.remat(f, lo, *args)
        measured = temp_bytes(f2, *args)
        assert f2.schedule.measured_temp_bytes == measured
        said = [str(w.message) for w in caught if "over the budget" in str(w.message)]
        if measured > 1.01 * lo:
            assert len(said) == 1 and f"needs {measured / 1e6:.2f} MB" in said[0], (said, measured, lo)
            assert f"{100 * (measured / lo - 1):.1f} % over the budget of {lo / 1e6:.2f} MB" in said[0]
        else:
            assert not said, said


def fake_overshoot(monkeypatch, overshoot_bytes):
    """Make remat's compiled-program measurement read `overshoot_bytes` over the prediction;
    return the list of plans it measures."""
    import rockmate.api

    measured = []

    def fake(f2, args):
        measured.append(f2.schedule)
        return f2.schedule.predicted_temp_bytes + overshoot_bytes
    monkeypatch.setattr(rockmate.api, "program_temp_bytes", fake)
    return measured


def test_a_program_measuring_over_budget_is_replanned_to_fit(monkeypatch):
    """Over budget by a steady overshoot d: planning again for the prediction minus the
    overshoot fits, with no warning."""
    f, params, x = residual_mlp()
    lo, plain = rockmate.min_budget(f, params, x), temp_bytes(f, params, x)
    budget = (lo + plain) // 2
    first = rockmate.plan_remat(f, budget, params, x).predicted_temp_bytes
    assert lo < first <= budget
    overshoot = (budget - first) + (first - lo) // 2  # first plan over, budget - overshoot >= lo
    measured = fake_overshoot(monkeypatch, overshoot)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f2 = rockmate.remat(f, budget, params, x)
    assert len(measured) == 2 and measured[1].predicted_temp_bytes < first
    assert f2.schedule.budget_bytes == budget and f2.schedule.measured_temp_bytes <= budget


def test_a_program_that_cannot_fit_is_reported_with_the_overshoot(monkeypatch):
    f, params, x = residual_mlp()
    lo, plain = rockmate.min_budget(f, params, x), temp_bytes(f, params, x)
    budget = (lo + plain) // 2
    measured = fake_overshoot(monkeypatch, budget - lo + 100_000)  # no plan can absorb it
    with pytest.warns(UserWarning, match="over the budget") as caught:
        f2 = rockmate.remat(f, budget, params, x)
    assert len(measured) == 1
    over = f2.schedule.measured_temp_bytes - budget
    assert f"needs {f2.schedule.measured_temp_bytes / 1e6:.2f} MB" in str(caught[0].message)
    assert f"Raise the budget by {over / 1e6:.2f} MB" in str(caught[0].message)
