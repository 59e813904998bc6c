"""Blockwise causal attention (flash-style custom VJP) against a naive float64 softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.attention import causal_attention
from k3jax.testing import TOL, assert_close


def naive(q, k, v, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, N, _ = q.shape
    S = k.shape[1]
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    mask = np.arange(S)[None, :] <= (np.arange(T) + S - T)[:, None]
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnv->btnv", p, v), s.max(-1).max(-1)


@pytest.mark.parametrize("T,S,block", [(1, 1, 4), (13, 13, 4), (16, 16, 16), (17, 17, 8), (5, 12, 4), (33, 33, 64)])
def test_forward_and_max_logit(T, S, block):
    rng = np.random.default_rng(T * 100 + S)
    q = rng.normal(size=(2, T, 3, 12)).astype(np.float32)
    k = rng.normal(size=(2, S, 3, 12)).astype(np.float32)
    v = rng.normal(size=(2, S, 3, 5)).astype(np.float32)
    o, ml = causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=0.3, block_size=block)
    want, want_ml = naive(q, k, v, 0.3)
    assert_close(o, want, TOL["fp32_vs_fp64"])
    assert_close(ml, want_ml, TOL["fp32_shallow"])  # a 12-term dot product


@pytest.mark.parametrize("block", [4, 7, 32])
def test_gradients_match_autodiff_of_naive(block, x64):
    rng = np.random.default_rng(block)
    q, k = rng.normal(size=(1, 19, 2, 6)), rng.normal(size=(1, 19, 2, 6))
    v, ct = rng.normal(size=(1, 19, 2, 4)), rng.normal(size=(1, 19, 2, 4))

    def dense(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) * 0.4
        s = jnp.where(jnp.tril(jnp.ones((19, 19), bool)), s, -jnp.inf)
        return jnp.einsum("bnts,bsnv->btnv", jax.nn.softmax(s, -1), v)

    f = lambda q, k, v: jnp.sum(causal_attention(q, k, v, scale=0.4, block_size=block)[0] * ct)  # noqa: E731
    g = lambda q, k, v: jnp.sum(dense(q, k, v) * ct)  # noqa: E731
    got = jax.grad(f, argnums=(0, 1, 2))(*map(jnp.asarray, (q, k, v)))
    want = jax.grad(g, argnums=(0, 1, 2))(*map(jnp.asarray, (q, k, v)))
    for a, b, n in zip(got, want, "qkv"):
        assert_close(a, b, TOL["fp64_vs_fp64"], name=f"d{n}")


def test_causality_bit_identical():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 20, 2, 8)), jnp.float32) for _ in range(3))
    o1, _ = causal_attention(q, k, v, scale=0.3, block_size=8)
    k2 = k.at[:, 11:].set(5.0)
    v2 = v.at[:, 11:].set(-3.0)
    o2, _ = causal_attention(q.at[:, 11:].set(1.0), k2, v2, scale=0.3, block_size=8)
    np.testing.assert_array_equal(np.asarray(o1[:, :11]), np.asarray(o2[:, :11]))


def test_memory_does_not_grow_quadratically():
    # Compiled forward+backward temp memory at fixed block size must grow ~linearly in T (a [T, T] score matrix
    # would make it grow 4x per doubling of T).
    def temp_bytes(T, blk=256):
        q = jax.ShapeDtypeStruct((1, T, 1, 16), jnp.float32)
        f = jax.jit(jax.grad(lambda q: jnp.sum(causal_attention(q, q, q, scale=0.25, block_size=blk)[0])))
        mem = f.lower(q).compile().memory_analysis()
        if mem is None:
            pytest.skip("memory analysis unavailable on this backend")
        return mem.temp_size_in_bytes

    small, big = temp_bytes(4096), temp_bytes(16384)
    assert big < 6 * small, (small, big)  # quadratic would be 16x
    assert big < 16384 * 16384 * 4 / 8, big


def test_bad_shapes():
    with pytest.raises(ValueError, match="incompatible"):
        causal_attention(jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 3, 8)), jnp.zeros((1, 4, 3, 8)), scale=1.0)


@pytest.mark.parametrize("block", [4, 16])
def test_packed_documents_attend_within_their_own(block, x64):
    """segment_ids: outputs, max logits and gradients == attention over each document alone (fp64)."""
    rng = np.random.default_rng(block + 7)
    starts = ([0, 1, 6, 16, 18], [0, 9])
    B, T = 2, 19
    q, k = rng.normal(size=(B, T, 2, 6)), rng.normal(size=(B, T, 2, 6))
    v, ct = rng.normal(size=(B, T, 2, 4)), rng.normal(size=(B, T, 2, 4))
    seg = np.zeros((B, T), np.int32)
    for b, st in enumerate(starts):
        for i, a in enumerate(st):
            seg[b, a:] = i + 1

    def alone(q, k, v):
        outs, mls = [], []
        for b, st in enumerate(starts):
            bounds = [*st, T]
            row, ml = [], []
            for a, e in zip(bounds[:-1], bounds[1:], strict=True):
                o, m = causal_attention(q[b:b + 1, a:e], k[b:b + 1, a:e], v[b:b + 1, a:e], scale=0.4, block_size=4)
                row.append(o)
                ml.append(m)
            outs.append(jnp.concatenate(row, axis=1))
            mls.append(jnp.max(jnp.stack(ml), axis=0))
        return jnp.concatenate(outs), jnp.concatenate(mls)

    packed = lambda q, k, v: causal_attention(q, k, v, scale=0.4, block_size=block,  # noqa: E731
                                              segment_ids=jnp.asarray(seg))
    args = tuple(map(jnp.asarray, (q, k, v)))
    (o, ml), (o_ref, ml_ref) = packed(*args), alone(*args)
    assert_close(o, o_ref, TOL["fp64_vs_fp64"], name="o")
    assert_close(ml, ml_ref, TOL["fp64_vs_fp64"], name="max logit")
    got = jax.grad(lambda *a: jnp.sum(packed(*a)[0] * ct), argnums=(0, 1, 2))(*args)
    want = jax.grad(lambda *a: jnp.sum(alone(*a)[0] * ct), argnums=(0, 1, 2))(*args)
    for a, b, n in zip(got, want, "qkv", strict=True):
        assert_close(a, b, TOL["fp64_vs_fp64"], name=f"d{n}")
