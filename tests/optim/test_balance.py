"""Balancing updates (docs/model.md §8): QB settles loads on a fixed score matrix, the sign rule moves the right way,
the auxiliary loss has its balanced value, and micro-batch statistics add up to the whole-step statistics."""

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.routing import route
from k3jax.optim import balance as bal

E, K, D, M = 16, 2, 24, 512


def _setup():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (M, D), jnp.float32)
    w = jax.random.normal(kw, (D, E), jnp.float32) * 0.3
    w = w.at[:, 0].add(0.4)  # expert 0 is everyone's favourite
    return x, w


def _ratio(x, w, b):
    r = route(x, w, b, top_k=K)
    return float(bal.load_ratio(bal.micro_stats([r], b[None], E, mode="off")["loads"])[0])


def test_qb_iterations_balance_a_fixed_score_matrix():
    x, w = _setup()
    b = jnp.zeros((1, E), jnp.float32)
    start = _ratio(x, w, b[0])
    ratios = []
    for _ in range(30):
        r = route(x, w, b[0], top_k=K)
        st = bal.micro_stats([r], b, E, mode="qb")
        b = bal.new_biases(st, b, mode="qb", top_k=K)
        ratios.append(_ratio(x, w, b[0]))
    assert start > 2.0, start
    assert ratios[-1] <= 1.2, ratios
    np.testing.assert_allclose(float(jnp.mean(b)), 0.0, atol=1e-6)  # centred


def test_qb_ema_averages_the_target_with_the_current_bias():
    x, w = _setup()
    b = jnp.asarray(np.random.default_rng(0).standard_normal((1, E)) * 0.1, jnp.float32)
    b = b - jnp.mean(b)
    st = bal.micro_stats([route(x, w, b[0], top_k=K)], b, E, mode="qb")
    plain = bal.new_biases(st, b, mode="qb", top_k=K)
    rho = 0.7
    ema = bal.new_biases(st, b, mode="qb", top_k=K, qb_ema=rho)
    # both b and centre(b-hat) have zero mean, so the EMA of the centred target equals the centred EMA
    np.testing.assert_allclose(np.asarray(ema), np.asarray(rho * b + (1 - rho) * plain), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(ema), np.asarray(plain))
    # iterating the damped update still balances the fixed score matrix
    for _ in range(60):
        st = bal.micro_stats([route(x, w, b[0], top_k=K)], b, E, mode="qb")
        b = bal.new_biases(st, b, mode="qb", top_k=K, qb_ema=0.5)
    assert _ratio(x, w, b[0]) <= 1.2


def test_micro_batch_statistics_sum_to_the_step_statistics():
    x, w = _setup()
    b = jnp.zeros((1, E), jnp.float32)
    whole = bal.micro_stats([route(x, w, b[0], top_k=K)], b, E, mode="qb")
    parts = [bal.micro_stats([route(xp, w, b[0], top_k=K)], b, E, mode="qb") for xp in jnp.split(x, 4)]
    summed = jax.tree.map(lambda *a: sum(a), *parts)
    for k in whole:
        np.testing.assert_array_equal(whole[k], summed[k])


def test_sign_rule_raises_underloaded_and_lowers_overloaded_biases():
    x, w = _setup()
    b = jnp.zeros((1, E), jnp.float32)
    st = bal.micro_stats([route(x, w, b[0], top_k=K)], b, E, mode="sign")
    nb = bal.new_biases(st, b, mode="sign", top_k=K, sign_gamma=1e-3)
    load = np.asarray(st["loads"][0])
    mean = load.mean()
    np.testing.assert_allclose(np.asarray(nb[0]), 1e-3 * np.sign(mean - load))
    assert float(nb[0, 0]) < 0  # the favourite is overloaded


def test_aux_loss_is_one_when_balanced_and_frozen_modes_keep_bias():
    s = jnp.full((8, 4), 0.5)
    ids = jnp.array([[0, 1], [2, 3]] * 4)
    from k3jax.ops.routing import Routing
    r = Routing(ids=ids, weights=jnp.full((8, 2), 0.5), scores=s, cutoff=jnp.full((8,), 0.5))
    np.testing.assert_allclose(float(bal.aux_loss([r], top_k=2)), 1.0, rtol=1e-6)
    b = jnp.arange(4.0)[None]
    for mode in ("aux", "off"):
        np.testing.assert_array_equal(bal.new_biases({"loads": jnp.ones((1, 4), jnp.int32)}, b, mode=mode, top_k=2), b)
