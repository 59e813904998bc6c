"""Pallas MXFP4 matmul (dense and grouped) against its jnp references (docs/numerics.md §10.8; docs/design.md §3.3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3jax.ops import mx
from k3jax.quant import mxfp4_pack
from k3jax.testing import TOL, assert_close, rel_rms
from pallas_kernels.mxfp4_matmul import mxfp4_gmm, mxfp4_matmul
from pallas_kernels.mxfp4_matmul.api import group_tile_metadata
from pallas_kernels.mxfp4_matmul.reference import (
    dequantize_packed,
    mxfp4_gmm_loop_reference,
    mxfp4_gmm_reference,
    mxfp4_matmul_reference,
)

DTYPE_TOL = {jnp.float32: TOL["fp32_vs_fp64"], jnp.bfloat16: TOL["bf16"]}
BLOCKS = {"block_n": 32, "block_k": 64}  # several tiles along N and K at test sizes


def _weights(key, shape):
    k1, k2 = jax.random.split(key)
    w = jax.random.normal(k1, shape) * jnp.exp2(jax.random.randint(k2, shape[:-1] + (1,), -3, 3))
    return mxfp4_pack(w)


def _x(key, M, K, dtype):
    return jax.random.normal(key, (M, K)).astype(dtype)


class Mxfp4MatmulCases:  # shared bodies; no Test prefix, so pytest does not collect the base
    interpret: bool

    @pytest.mark.parametrize("schedule", ["grid", "loop"])
    @pytest.mark.parametrize("M", [1, 37])
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_dense_matches_reference(self, schedule, M, dtype):
        k = jax.random.split(jax.random.key(M), 2)
        packed, scale = _weights(k[0], (96, 256))
        x = _x(k[1], M, 256, dtype)
        f = jax.jit(lambda x, p, s: mxfp4_matmul(x, p, s, schedule=schedule, interpret=self.interpret, **BLOCKS))
        y = f(x, packed, scale)
        assert y.shape == (M, 96) and y.dtype == dtype
        assert_close(y, mxfp4_matmul_reference(x, packed, scale), DTYPE_TOL[dtype], name="y")

    @pytest.mark.parametrize("group_sizes", [(5, 0, 23, 9), (0, 0, 40, 0), (16, 16, 0, 8), (0, 0, 0, 0), (1, 2, 3, 4)],
                             ids=["ragged", "one-expert", "whole-tiles", "all-empty", "tail-rows"])
    def test_grouped_matches_reference(self, group_sizes):
        k = jax.random.split(jax.random.key(1), 2)
        packed, scale = _weights(k[0], (4, 64, 128))
        x = _x(k[1], 40, 128, jnp.float32)
        gs = jnp.array(group_sizes, jnp.int32)
        y = jax.jit(lambda x, gs: mxfp4_gmm(x, packed, scale, gs, interpret=self.interpret, **BLOCKS))(x, gs)
        want = mxfp4_gmm_loop_reference(x, packed, scale, gs)
        assert_close(mxfp4_gmm_reference(x, packed, scale, gs), want, TOL["fp32_shallow"], name="ragged_dot rung")
        assert_close(y, want, TOL["fp32_vs_fp64"], name="y")
        np.testing.assert_array_equal(np.asarray(y)[sum(group_sizes):], 0.0)  # rows past the groups

    def test_grouped_bf16(self):
        k = jax.random.split(jax.random.key(2), 2)
        packed, scale = _weights(k[0], (3, 32, 96))
        x = _x(k[1], 24, 96, jnp.bfloat16)
        gs = jnp.array([7, 0, 17], jnp.int32)
        y = mxfp4_gmm(x, packed, scale, gs, interpret=self.interpret, block_n=16, block_k=32)
        assert y.dtype == jnp.bfloat16
        assert_close(y, mxfp4_gmm_reference(x, packed, scale, gs), TOL["bf16"], name="y")

    def test_gradient_wrt_x_matches_reference(self):
        k = jax.random.split(jax.random.key(3), 3)
        packed, scale = _weights(k[0], (4, 64, 128))
        x = _x(k[1], 33, 128, jnp.float32)
        gs = jnp.array([10, 0, 15, 6], jnp.int32)
        ct = jax.random.normal(k[2], (33, 64))
        y, vjp = jax.vjp(lambda x: mxfp4_gmm(x, packed, scale, gs, interpret=self.interpret, **BLOCKS), x)
        _, vjp_ref = jax.vjp(lambda x: mxfp4_gmm_loop_reference(x, packed, scale, gs), x)
        assert_close(vjp(ct)[0], vjp_ref(ct)[0], TOL["fp32_vs_fp64"], name="dx grouped")
        dense = jax.grad(lambda x: jnp.sum(mxfp4_matmul(x, packed[0], scale[0], interpret=self.interpret,
                                                        **BLOCKS) * ct))(x)
        dense_ref = jax.grad(lambda x: jnp.sum(mxfp4_matmul_reference(x, packed[0], scale[0]) * ct))(x)
        assert_close(dense, dense_ref, TOL["fp32_vs_fp64"], name="dx dense")

    def test_act_quant_is_mxfp8_of_x(self):
        k = jax.random.split(jax.random.key(4), 2)
        packed, scale = _weights(k[0], (32, 64))
        x = _x(k[1], 16, 64, jnp.float32)
        y = mxfp4_matmul(x, packed, scale, act_quant="ceil", interpret=self.interpret, block_n=16, block_k=32)
        want = mxfp4_matmul_reference(mx.fake_quant_mxfp8(x, axis=-1, rule="ceil"), packed, scale)
        assert_close(y, want, TOL["fp32_vs_fp64"], name="y")
        assert rel_rms(y, mxfp4_matmul_reference(x, packed, scale)) > TOL["fp32_vs_fp64"]  # act quant: a real change


@pytest.mark.parametrize("platform", ["cpu", "tpu"], ids=["loop", "tpu"])
def test_rows_gradient_is_the_transposed_kernel(platform):
    """dx = g @ W_g from the transposed kernels over the packed bytes (loop schedule; the TPU schedule in the TPU
    interpreter: two N steps, two K steps, an empty expert, unused tail tiles) against float64 NumPy."""
    k = jax.random.split(jax.random.key(5), 3)
    packed, scale = _weights(k[0], (3, 256, 512))
    x = _x(k[1], 40, 512, jnp.float32)
    gs = np.array([5, 0, 23])
    ct = jax.random.normal(k[2], (40, 256))
    blocks = {"block_m": 16, "block_n": 128, "block_k": 256, "platform": platform, "interpret": True}
    _, vjp = jax.vjp(lambda x: mxfp4_gmm(x, packed, scale, jnp.asarray(gs, jnp.int32), **blocks), x)
    dx = np.asarray(vjp(ct)[0])
    w = np.asarray(dequantize_packed(packed, scale), np.float64)  # [G, N, K], exact
    want = np.zeros((40, 512))
    for g, (lo, hi) in enumerate(zip(np.cumsum(gs) - gs, np.cumsum(gs), strict=True)):
        want[lo:hi] = np.asarray(ct, np.float64)[lo:hi] @ w[g]
    assert_close(dx, want, TOL["fp32_vs_fp64"], name="dx")
    np.testing.assert_array_equal(dx[gs.sum():], 0.0)  # rows past the groups


class TestMxfp4MatmulInterpret(Mxfp4MatmulCases):  # CPU, every CI run
    interpret = True


@pytest.mark.gpu
class TestMxfp4MatmulCompiled(Mxfp4MatmulCases):  # accelerator job only
    interpret = False


_metadata = jax.jit(group_tile_metadata, static_argnums=(1, 2))


@given(st.lists(st.integers(0, 20), min_size=5, max_size=5), st.sampled_from([1, 4, 16]), st.integers(0, 9))
def test_group_tile_metadata_covers_every_row_once(sizes, block_m, extra_rows):
    M = 109  # fixed shapes: one compile per block_m; rows past sum(sizes) are padding
    tile_group, src, dst, valid = (np.asarray(a) for a in _metadata(jnp.array(sizes), M, block_m))
    ends = np.cumsum(sizes)
    real = src[src < M]
    np.testing.assert_array_equal(np.sort(real), np.arange(ends[-1]))  # each grouped row exactly once
    np.testing.assert_array_equal(src[dst[valid]], np.arange(M)[valid])  # dst inverts src
    assert valid.sum() == ends[-1]
    for p in np.flatnonzero(src < M):  # a padded row sits in a tile of its own group
        assert tile_group[p // block_m] == np.searchsorted(ends, src[p], side="right")
    assert (tile_group[: -(-M // block_m) + len(sizes)] >= -1).all()


def test_bad_inputs_raise():
    packed, scale = _weights(jax.random.key(0), (32, 64))
    with pytest.raises(ValueError, match="do not match x"):
        mxfp4_matmul(jnp.ones((2, 96)), packed, scale, interpret=True)
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4_matmul(jnp.ones((2, 64)), packed.astype(jnp.int32), scale, interpret=True)
    with pytest.raises(ValueError, match=r"group_sizes \(3,\)"):
        mxfp4_gmm(jnp.ones((2, 64)), packed[None], scale[None], jnp.ones(3, jnp.int32), interpret=True)
