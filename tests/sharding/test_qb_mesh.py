"""Quantile Balancing on a mesh (docs/model.md §8.2): the sharded update equals one device's, with one all-reduce
(the math itself: tests/optim/test_qb.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.optim.qb import QB_BINS, qb_histogram, qb_update
from k3jax.sharding.mesh import make_mesh
from k3jax.sharding.qb import qb_update_sharded

K = 4


def _scores(m=2048, E=32, seed=0):
    """Sigmoid scores with a strong known per-expert imbalance."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(m, E)) + np.linspace(-2.5, 2.5, E)[None, :]
    return jnp.asarray(1 / (1 + np.exp(-logits)), jnp.float32)


def _route(s, b, k=K):
    vals, idx = jax.lax.top_k(s + b, k + 1)
    return idx[:, :k], vals[:, k]


def test_sharded_update_equals_single_device():
    """One int32 psum of the [E, B] histogram over the 8 token shards gives the single-device bias exactly."""
    s = _scores(m=1024, E=16)
    b = jnp.asarray(np.random.default_rng(2).normal(size=16) * 0.05, jnp.float32)
    _, alpha = _route(s, b)
    mesh = make_mesh({"data": 2, "expert": 4})
    fn = jax.jit(qb_update_sharded(mesh, "ep", top_k=K))
    got = fn(s, alpha, b)
    want = qb_update(s, alpha, b, top_k=K)
    # the int32 histograms are identical; the float tail (argmax, interpolation, mean) may round differently
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    hlo = fn.lower(s, alpha, b).as_text()
    assert hlo.count("all-reduce") == 1 or hlo.count("all_reduce") == 1, "expected one all-reduce"
    # micro-batches: histograms add
    h = qb_histogram(s[:512], alpha[:512], b) + qb_histogram(s[512:], alpha[512:], b)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(qb_histogram(s, alpha, b)))
    assert QB_BINS == 1000
