"""RMSNorm, SiTU-GLU and AttnRes against the float64 NumPy transcription of docs/model.md §2.3 / §3 / §6."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.activations import situ, situ_glu, swiglu
from k3jax.ops.attn_res import attn_res, attn_res_masked
from k3jax.ops.norms import rms_norm
from k3jax.reference import model as ref
from k3jax.testing import TOL, assert_close


def test_rms_norm_fp32_and_fp64(x64):
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(3, 5, 64)) * 3, rng.normal(size=64)
    want = ref.rms_norm(x, w, 1e-5)
    assert_close(rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 1e-5), want, TOL["fp32_shallow"])
    got64 = rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5)
    assert got64.dtype == jnp.float64
    assert_close(got64, want, TOL["fp64_vs_fp64"])


def test_rms_norm_bf16_statistic_in_fp32():
    x = jnp.full((4, 128), 300.0, jnp.bfloat16)  # x² overflows nothing in fp32; bf16 sum would lose precision
    y = rms_norm(x, jnp.ones(128, jnp.bfloat16), 1e-5)
    assert y.dtype == jnp.bfloat16
    assert_close(np.asarray(y, np.float32), np.ones((4, 128)), TOL["bf16"])


def test_situ_glu_closed_form_and_bound():
    a = np.linspace(-300, 300, 2001)
    b = np.linspace(-500, 500, 2001)[::-1]
    got = situ_glu(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), 4.0, 25.0)
    assert_close(got, ref.situ_glu(a, b, 4.0, 25.0), TOL["situ"])
    # |SiTU-GLU| < β1·β2 exactly; in fp32 tanh rounds to 1 at saturation, so the bound is attained, never passed
    assert float(jnp.max(jnp.abs(got))) <= 100.0
    assert float(jnp.max(jnp.abs(situ_glu(jnp.asarray(a), jnp.asarray(b), 4.0, 25.0)))) <= 100.0
    # SiTU is bounded by β1 on the gate side and matches Swish to first order near 0
    assert float(jnp.max(jnp.abs(situ(jnp.asarray(a, jnp.float32), 4.0)))) <= 4.0
    z = jnp.asarray([1e-3, -1e-3], jnp.float32)
    assert_close(situ(z, 4.0), jax.nn.silu(z), TOL["situ"])
    assert_close(swiglu(z, z), jax.nn.silu(z) * z, TOL["fp32_shallow"])


def test_situ_gradients_nonzero_in_saturation():
    g = jax.grad(lambda a: jnp.sum(situ_glu(a, a, 4.0, 25.0)))(jnp.asarray([30.0, 60.0, -30.0]))
    assert np.all(np.isfinite(g)) and np.all(np.abs(np.asarray(g)) > 0)


@pytest.mark.parametrize("n_src", [1, 2, 5, 9])
def test_attn_res_matches_reference(n_src, x64):
    rng = np.random.default_rng(n_src)
    srcs = [rng.normal(size=(7, 32)) * (i + 1) for i in range(n_src)]
    q, g = rng.normal(size=32), 1 + 0.1 * rng.normal(size=32)
    want = ref.attn_res(srcs, q, g, 1e-5)
    got32 = attn_res([jnp.asarray(s, jnp.float32) for s in srcs], jnp.asarray(q, jnp.float32),
                     jnp.asarray(g, jnp.float32), 1e-5)
    assert got32.dtype == jnp.float32
    assert_close(got32, want, TOL["attn_res"])
    got64 = attn_res([jnp.asarray(s) for s in srcs], jnp.asarray(q), jnp.asarray(g), 1e-5)
    assert_close(got64, want, TOL["fp64_vs_fp64"])


def test_attn_res_zero_query_is_uniform_mean():
    rng = np.random.default_rng(3)
    srcs = [jnp.asarray(rng.normal(size=(4, 16)), jnp.float32) for _ in range(6)]
    got = attn_res(srcs, jnp.zeros(16), jnp.asarray(rng.normal(size=16), jnp.float32), 1e-5)
    assert_close(got, np.mean(np.stack([np.asarray(s) for s in srcs]), axis=0), TOL["fp32_shallow"])


def test_attn_res_single_source_is_identity():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8)), jnp.float32)
    np.testing.assert_array_equal(attn_res([x], jnp.ones(8), jnp.ones(8), 1e-5), x)


@pytest.mark.parametrize("n_src", [1, 2, 9])
def test_attn_res_mean_square_from_the_gram_matrix(n_src, x64):
    """``with_ms``: the mix the plain form gives, and its mean square over D (α^T G α / D) against the float64
    reference's mix squared; the norm that takes it equals the norm of the mix, forward and gradients; the masked
    (scanned) form with empty slots agrees."""
    rng = np.random.default_rng(10 + n_src)
    srcs = [rng.normal(size=(2, 5, 32)) * (i + 1) for i in range(n_src)]
    q, g, w = rng.normal(size=32), 1 + 0.1 * rng.normal(size=32), rng.normal(size=32)
    want = np.stack([ref.attn_res([s[b] for s in srcs], q, g, 1e-5) for b in range(2)])
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    h, ms = attn_res([f32(s) for s in srcs], f32(q), f32(g), 1e-5, with_ms=True)
    np.testing.assert_array_equal(h, attn_res([f32(s) for s in srcs], f32(q), f32(g), 1e-5))
    assert ms.shape == (2, 5, 1)
    assert_close(ms, np.mean(want**2, axis=-1, keepdims=True), TOL["fp32_shallow"])
    assert_close(rms_norm(h, f32(w), 1e-5, ms=ms), ref.rms_norm(want, w, 1e-5), TOL["fp32_shallow"])

    def normed(vs, gram):
        out = attn_res(vs, f32(q), f32(g), 1e-5, with_ms=gram)
        h, ms = out if gram else (out, None)
        return jnp.sum(jnp.sin(rms_norm(h, f32(w), 1e-5, ms=ms)))
    grads = [jax.grad(normed)([f32(s) for s in srcs], gram) for gram in (False, True)]
    for a, b in zip(*grads, strict=True):
        assert_close(b, a, TOL["fp32_grad"])
    # the buffer form: n_src slots, the first n_src - 1 committed, the last one empty (zeros)
    blocks = jnp.zeros((n_src, 2, 5, 32), jnp.float32)
    for i, s in enumerate(srcs[:-1]):
        blocks = blocks.at[i].set(f32(s))
    hm, msm = attn_res_masked(blocks, n_src - 1, f32(srcs[-1]), f32(q), f32(g), 1e-5, with_ms=True)
    assert_close(hm, want, TOL["attn_res"])
    assert_close(msm, ms, TOL["fp32_shallow"])
