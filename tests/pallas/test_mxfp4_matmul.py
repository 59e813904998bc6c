"""Pallas MXFP4 matmul (dense and grouped) against its jnp references (docs/numerics.md §10.8; docs/design.md §3.3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops import mx
from k3jax.quant import mxfp4_pack
from k3jax.testing import TOL, assert_close, jaxpr_eqns, rel_rms
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


@pytest.mark.parametrize("platform", [pytest.param("tpu", marks=pytest.mark.slow), "cpu"])  # tpu: ~17 s interpreted
def test_unselected_experts_and_unused_tiles_are_skipped(platform):
    """B = 1-like call: 5 rows reach expert 3 of 8. Every other expert's scales are NaN (byte 255) and the TPU
    interpreter fills unwritten memory with NaN, yet y is exact and finite, and rows past the groups are 0; the TPU
    grid visits the one used tile's (N/bn)·(K/bk) = 4 points, where the static grid had T = ceil(8/16) + 8 + 1 = 10
    tiles (40 points), and fetches each of its weight blocks once (4 fetches)."""
    G, N, K, M = 8, 256, 512, 8
    packed, scale = _weights(jax.random.key(0), (G, N, K))
    scale = scale.at[jnp.arange(G) != 3].set(255)  # E8M0 255 = NaN
    x = _x(jax.random.key(1), M, K, jnp.float32)
    gs = jnp.zeros((G,), jnp.int32).at[3].set(5)
    points = []

    def record(token, point, core):
        points.append(tuple(int(v) for v in point))
        return token

    interpret = pltpu.InterpretParams(grid_point_recorder=record) if platform == "tpu" else True
    y = mxfp4_gmm(x, packed, scale, gs, block_m=16, block_n=128, block_k=256, platform=platform, interpret=interpret)
    want = mxfp4_matmul_reference(x[:5], packed[3], scale[3])
    assert_close(y[:5], want, TOL["fp32_vs_fp64"], name="y")
    assert np.all(np.asarray(y[5:]) == 0)
    if platform == "tpu":
        assert sorted(points) == [(0, j, k) for j in range(2) for k in range(2)]
        assert len({(j, k) for _, j, k in points}) == 4  # weight block (3, j, k) changes every step: 4 fetches


def test_static_and_dynamic_tpu_grids_agree():
    """The TPU kernels' two grids (kernel.static_tpu_grid): the static (megacore) one over all T tiles and the
    dynamic one over the used tiles give the used tiles' rows bit for bit, forward and transposed (two N and two K
    steps, an empty expert, unused tail tiles); the static grid writes zeros for unused tiles. Each grid with the
    experts' weights resident in VMEM (one block per expert, sliced per step: ``kernel.resident_weights``) and
    blocked: the same bits."""
    from pallas_kernels.mxfp4_matmul import kernel, kernel_t

    rng = np.random.default_rng(7)  # NumPy inputs: no eager jax op to compile (the test's budget is the kernels)
    packed = rng.integers(0, 256, (3, 64, 64), dtype=np.uint8)  # any byte is two E2M1 codes
    scale = rng.integers(124, 131, (3, 64, 4), dtype=np.uint8)  # 2^-3 .. 2^3
    bs = kernel.BlockSizes(16, 32, 64)
    tile_group = np.array([0, 2, 2, -1, -1, -1], np.int32)  # group_tile_metadata of sizes (5, 0, 17), 24 rows
    xe, xo, g = rng.standard_normal((3, 96, 64), dtype=np.float32)
    used = np.repeat(tile_group >= 0, 16)

    @jax.jit  # one program for the four calls: one compile (~3 s here, ~6 s as four)
    def run(xe, xo, g):
        return [jax.tree.leaves((kernel.mxfp4_gmm_tpu(tile_group, xe, xo, packed, scale, bs, **kw),
                                 kernel_t.mxfp4_gmm_t_tpu(tile_group, g, packed, scale, bs, **kw)))
                for kw in ({"interpret": True, "static_grid": True, "resident": True},
                           {"interpret": True, "static_grid": False, "resident": False},
                           {"interpret": True, "static_grid": True, "resident": False},
                           {"interpret": True, "static_grid": False, "resident": True})]

    static, dynamic, *others = run(xe, xo, g)  # y, dx even, dx odd
    for s, d in zip(static, dynamic, strict=True):
        np.testing.assert_array_equal(np.asarray(s)[used], np.asarray(d)[used])
        np.testing.assert_array_equal(np.asarray(s)[~used], 0.0)
        assert np.abs(np.asarray(s)[used]).sum() > 0
    for other in others:
        for s, o in zip(static, other, strict=True):
            np.testing.assert_array_equal(np.asarray(s)[used], np.asarray(o)[used])
    assert kernel.resident_weights(64, 32, True) and not kernel.resident_weights(64, 32, False)
    assert not kernel.resident_weights(3584, 4096, True)      # 14 MiB of packed bytes: blocked


def test_the_tpu_grid_follows_rows_per_expert():
    """mxfp4_gmm on TPU: training-like rows (ceil(M/bm) > 2·G) take the static grid with the tile and column axes
    "parallel" (a megacore chip splits them), its VJP the tile axis; decode-like rows the dynamic, all-"arbitrary"
    grid; the dense matmul (every tile used) always the static one."""
    from pallas_kernels.mxfp4_matmul import kernel

    def semantics(M, G, grouped=True):
        packed = jnp.zeros((G, 256, 256), jnp.uint8)
        scale = jnp.zeros((G, 256, 16), jnp.uint8)
        blocks = {"block_m": 16, "block_n": 128, "block_k": 256, "platform": "tpu", "interpret": True}

        def f(x):
            if not grouped:
                return mxfp4_matmul(x, packed[0], scale[0], **blocks)
            y, vjp = jax.vjp(lambda x: mxfp4_gmm(x, packed, scale, jnp.full((G,), M // G, jnp.int32), **blocks), x)
            return vjp(y)[0]

        calls = [e for e in jaxpr_eqns(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((M, 512), jnp.float32)).jaxpr)
                 if e.primitive.name == "pallas_call"]
        return {e.params["name"]: _dimension_semantics(e.params["compiler_params"]) for e in calls}

    assert kernel.static_tpu_grid(16 + 2 + 1, 2) and not kernel.static_tpu_grid(1 + 4 + 1, 4)
    train, decode, dense = semantics(256, 2), semantics(8, 4), semantics(8, 1, grouped=False)
    assert train == {"mxfp4_gmm_tpu_fwd": kernel.TPU_SEMANTICS["static"],
                     "mxfp4_gmm_tpu_bwd_x": kernel.TPU_SEMANTICS["static_t"]}, train
    assert set(decode.values()) == {kernel.TPU_SEMANTICS["dynamic"]}, decode
    assert dense == {"mxfp4_gmm_tpu_fwd": kernel.TPU_SEMANTICS["static"]}, dense



def test_block_m_follows_the_expected_rows_per_used_expert():
    """On TPU, block_m follows the rows per group: the worst case's ceil(M / G) without an expectation, the routing
    expectation's rows per used expert with one (decode at B = 64 on v5p-64: 1,024 rows over 56 local experts of
    which ~40 get ~1.6 rows: 32-row tiles → 16); training's many rows per expert keep 256. Exact either way: a call
    with the expectation (16-row tiles) gives the bits of the one without (64-row tiles), forward and VJP."""
    from pallas_kernels.mxfp4_matmul.api import block_sizes, expected_load_of, rows_per_group

    def bm(M, G, expected=None):
        return block_sizes("tpu", rows_per_group(M, G, expected), 768, 3584, None, None, None).block_m

    assert (bm(1024, 56), bm(1024, 56, expected_load_of(64.0, 40.0, 56))) == (32, 16)
    assert bm(85760, 14, expected_load_of(81920.0, 14.0, 14)) == bm(85760, 14) == 256
    k = jax.random.split(jax.random.key(3), 2)
    packed, scale = _weights(k[0], (4, 256, 256))
    x = _x(k[1], 256, 256, jnp.float32)
    gs = jnp.array([3, 0, 200, 1], jnp.int32)
    calls = [jax.vjp(lambda x, e=e: mxfp4_gmm(x, packed, scale, gs, platform="tpu", interpret=True, block_n=128,
                                                block_k=256, expected_rows=e), x) for e in (None, 8.0)]
    outs = [(y, vjp(y)[0]) for y, vjp in calls]
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)


def _dimension_semantics(params) -> tuple:
    """A pallas_call's TPU dimension_semantics: its CompilerParams, or (older jax) inside a dict of them."""
    if isinstance(params, dict):
        params = next(v for v in params.values() if hasattr(v, "dimension_semantics"))
    return tuple(str(d).lower().split(".")[-1] for d in params.dimension_semantics)
