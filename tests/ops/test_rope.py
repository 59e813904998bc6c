"""Rotary embedding with DeepSeek-style YaRN (k3jax/ops/rope.py) against the float64 loops of
k3jax/reference/draft.py, and the properties the draft relies on: interleaved pairs, scores that depend on the
position difference only, and the published K3 draft's YaRN numbers."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.draft.config import K3_DRAFT_ROPE_THETA, K3_DRAFT_YARN
from k3jax.ops.rope import YarnScaling, apply_rope, rope_spec, yarn_correction_range, yarn_mscale
from k3jax.reference.draft import rope_ref, rotate_ref
from k3jax.testing import TOL, assert_close

SCALINGS = {"plain": None, "k3-draft": K3_DRAFT_YARN,
            "yarn-mscale": YarnScaling(factor=8.0, original_max_position_embeddings=4096, beta_fast=16.0,
                                       beta_slow=2.0, mscale=0.7, mscale_all_dim=0.3)}


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("dim", [8, 64])
def test_apply_rope_matches_reference(name, dim, x64):
    scaling = SCALINGS[name]
    spec = rope_spec(dim, K3_DRAFT_ROPE_THETA, scaling)
    want = rope_ref(dim, K3_DRAFT_ROPE_THETA, scaling)
    assert_close(np.array(spec.inv_freq), want[0], TOL["fp64_vs_fp64"], name="inverse frequencies")
    assert spec.cos_sin_scale == pytest.approx(want[1], rel=1e-15) and spec.attn_scale == pytest.approx(want[2])
    rng = np.random.default_rng(dim)
    x = rng.standard_normal((2, 5, 3, dim))                                  # [B, T, N, Hr]
    pos = rng.integers(0, 1000, (2, 5))          # (a float64 cos of a larger angle rounds past 1e-12 in XLA)
    got = apply_rope(jnp.asarray(x), jnp.asarray(pos, jnp.int32), spec)
    ref = np.array([[[rotate_ref(x[b, t, n], int(pos[b, t]), want) for n in range(3)] for t in range(5)]
                    for b in range(2)])
    assert_close(got, ref, TOL["fp64_vs_fp64"])
    # fp32 angles: position x frequency rounds at ~6e-8 relative, so short positions for the fp32 bound
    got32 = apply_rope(jnp.asarray(x[:, :, 0], jnp.float32), jnp.asarray(pos % 64, jnp.int32), spec)     # [B, T, Hr]
    ref32 = np.array([[rotate_ref(x[b, t, 0], int(pos[b, t] % 64), want) for t in range(5)] for b in range(2)])
    assert got32.dtype == jnp.float32
    assert_close(got32, ref32, TOL["fp32_vs_fp64"])


def test_pairs_are_interleaved():
    # a unit vector on channel 0 turns into channel 1 (its pair), never into channel Hr/2 (rotate-half's partner)
    spec = rope_spec(8, 10000.0)
    e0 = jnp.zeros((2, 5, 8)).at[0, 0, 0].set(1.0)       # (the shapes of the test above: its compiled ops reused)
    y = np.asarray(apply_rope(e0, jnp.ones((2, 5), jnp.int32), spec))[0, 0]
    np.testing.assert_allclose(y[:2], [math.cos(1.0), math.sin(1.0)], rtol=1e-6)
    assert not np.any(y[2:])


def test_scores_depend_on_the_position_difference_only(x64):
    spec = rope_spec(8, K3_DRAFT_ROPE_THETA, K3_DRAFT_YARN)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal(8), rng.standard_normal(8)
    x = np.zeros((2, 5, 3, 8))
    x[0, :3, 0], x[1, :3, 0] = q, k
    pos = np.array([[1000, 7, 5, 0, 0], [993, 0, 5, 0, 0]])
    y = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos, jnp.int32), spec))[:, :3, 0]
    scores = np.sum(y[0] * y[1], axis=-1)                 # q at 1000 · k at 993, q at 7 · k at 0, q · k both at 5
    assert scores[0] == pytest.approx(scores[1], rel=1e-10)
    assert scores[2] == pytest.approx(float(q @ k), rel=1e-12)   # cos/sin scale 1 (mscale == mscale_all_dim)


def test_published_yarn_numbers():
    # K3 draft: 64-d slice, theta 5e4, factor 32 over 32768 positions, mscale = mscale_all_dim = 1
    lo, hi = yarn_correction_range(64, K3_DRAFT_ROPE_THETA, K3_DRAFT_YARN)
    assert (lo, hi) == (15, 26)
    spec = rope_spec(64, K3_DRAFT_ROPE_THETA, K3_DRAFT_YARN)
    assert spec.cos_sin_scale == 1.0
    assert spec.attn_scale == pytest.approx((0.1 * math.log(32) + 1) ** 2)          # 1.8133...
    base = rope_spec(64, K3_DRAFT_ROPE_THETA).inv_freq
    assert spec.inv_freq[:lo + 1] == base[:lo + 1]                                    # fast pairs untouched
    np.testing.assert_allclose(spec.inv_freq[hi:], np.array(base[hi:]) / 32, rtol=1e-15)   # slow ones ÷ factor
    assert yarn_mscale(1.0, 5.0) == 1.0
