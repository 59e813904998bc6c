"""Attention over the MLA latent cache (k3jax/ops/latent_attention.py) against a float64 NumPy definition: keys
and values materialized per head from the latent, softmax over the visible positions, simple loops."""

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.latent_attention import latent_attention
from k3jax.testing import TOL, assert_close


def reference(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, q_pos, kv_len, scale):
    """o[b, t, n] = Σ_j softmax_j(s) v_j over keys j <= q_pos[b, t], j < kv_len[b] (float64, per query)."""
    B, T, N, _ = q_nope.shape
    out = np.zeros((B, T, N, w_uv.shape[-1]))
    for b in range(B):
        k_n = np.einsum("sr,rnh->snh", c_kv[b], w_uk)                          # k^N = c_kv W_UK
        v = np.einsum("sr,rnv->snv", c_kv[b], w_uv)
        for t in range(T):
            keys = [j for j in range(kv_len[b]) if j <= q_pos[b, t]]
            if not keys:
                continue
            for n in range(N):
                s = np.array([(q_nope[b, t, n] @ k_n[j, n] + q_rope[b, t, n] @ k_rope[b, j]) * scale for j in keys])
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, t, n] = sum(pi * v[j, n] for pi, j in zip(p, keys, strict=True))
    return out


def _case(rng, B=3, T=5, S=24, N=2, Hn=8, Hr=4, R=16, V=6):
    f = lambda *s: rng.normal(size=s)  # noqa: E731
    kv_len = np.array([S - 3, 7, 1])[:B]
    q_pos = np.stack([np.arange(T) + kv_len[b] - T + (0 if b != 1 else 2) for b in range(B)])  # a query sees a prefix
    q_pos = np.maximum(q_pos, 0)
    c_kv = f(B, S, R)
    c_kv[1, kv_len[1]:] = 1e30                                                 # stale (finite) contents are ignored
    return dict(q_nope=f(B, T, N, Hn), q_rope=f(B, T, N, Hr), c_kv=c_kv, k_rope=f(B, S, Hr), w_uk=f(R, N, Hn) / 4,
                w_uv=f(R, N, V)), q_pos, kv_len, 1 / np.sqrt(Hn + Hr)


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("block, big_block", [(8, None), (4, 16), (2, 8)])   # big blocks first, then the tail
def test_float64_matches_definition(x64, absorbed, block, big_block):
    arrays, q_pos, kv_len, scale = _case(np.random.default_rng(0))
    ref = reference(**arrays, q_pos=q_pos, kv_len=kv_len, scale=scale)
    o = latent_attention(**{k: jnp.asarray(v) for k, v in arrays.items()}, q_pos=q_pos, kv_len=kv_len, scale=scale,
                         block=block, big_block=big_block, absorbed=absorbed)
    assert_close(o, ref, TOL["fp64_vs_fp64"], name=f"absorbed={absorbed}, blocks {block}/{big_block}")


@pytest.mark.parametrize("absorbed", [False, True])
def test_float32_matches_definition(absorbed):
    arrays, q_pos, kv_len, scale = _case(np.random.default_rng(1))
    ref = reference(**arrays, q_pos=q_pos, kv_len=kv_len, scale=scale)
    o = latent_attention(**{k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()}, q_pos=q_pos, kv_len=kv_len,
                         scale=scale, block=8, absorbed=absorbed)
    assert_close(o, ref, TOL["fp32_shallow"], name=f"absorbed={absorbed}")


def test_a_longer_cache_gives_identical_results():
    """A cache 4x longer than its filled part (the rest huge) gives bit-identical results. (That the extra blocks are
    not even read — the loop runs ceil(max(kv_len) / block) times — shows in ``k3 bench decode``'s
    decode_time_1k_in_64k_cache_over_1k_cache.)"""
    arrays, q_pos, kv_len, scale = _case(np.random.default_rng(2))
    big = dict(arrays)
    for k in ("c_kv", "k_rope"):
        pad = np.full((arrays[k].shape[0], 3 * arrays[k].shape[1], arrays[k].shape[2]), 1e30)
        big[k] = np.concatenate([arrays[k], pad], axis=1)
    run = lambda a: latent_attention(**{k: jnp.asarray(v, jnp.float32) for k, v in a.items()},  # noqa: E731
                                     q_pos=q_pos, kv_len=kv_len, scale=scale, block=8, absorbed=True)
    np.testing.assert_array_equal(np.asarray(run(big)), np.asarray(run(arrays)))


def test_cache_length_must_be_a_block_multiple():
    arrays, q_pos, kv_len, scale = _case(np.random.default_rng(3))
    with pytest.raises(ValueError, match="multiple of the key block"):
        latent_attention(**{k: jnp.asarray(v) for k, v in arrays.items()}, q_pos=q_pos, kv_len=kv_len, scale=scale,
                         block=7, absorbed=True)
