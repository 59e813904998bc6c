"""The MXFP4 kernels' cost estimates are honest: at K3's expert shapes, the bytes ``pallas_kernels/mxfp4_matmul
/cost.py`` declares equal the bytes the pipelined grid moves, counted here by walking the grid with block index
maps written from the tiling table (pallas_kernels/mxfp4_matmul/README.md), not from the kernel's code: a block is
fetched when its index differs from the previous step's, an output block written back when its index changes and
at the end. And the estimates reach the compiled program: the kernels' pallas_calls carry them."""

import itertools
import math

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mxfp4_matmul import cost, mxfp4_gmm

# torch orientation [N = out, K = in]: w1 / w3 3584 -> 3072, w2 3072 -> 3584; TPU blocks (bm, bn, bk)
SHAPES = {"w13": (3072, 3584), "w2": (3584, 3072)}
BLOCKS = (128, 256, 512)


def _walk(grid, operands, outputs) -> float:
    """Bytes moved by a pipelined grid: ``operands`` / ``outputs`` = [(block bytes, index map of the step)]."""
    moved, last = 0.0, [None] * (len(operands) + len(outputs))
    for step in itertools.product(*(range(n) for n in grid)):
        for i, (nbytes, index) in enumerate(operands + outputs):
            idx = index(*step)
            if idx != last[i]:
                moved += nbytes  # a fetch, or the write-back of the output block this step leaves
                last[i] = idx
    return moved


def _expert(t, tiles_per_expert):
    return t // tiles_per_expert  # tiles sorted by expert, every tile used


@pytest.mark.parametrize("weight", ["w13", "w2"])
@pytest.mark.parametrize("tiles,per_expert", [(6, 2), (5, 5)], ids=["3-experts", "1-expert"])
def test_tpu_forward_estimate_is_the_grids_traffic(weight, tiles, per_expert):
    (N, K), (bm, bn, bk) = SHAPES[weight], BLOCKS
    isz = 2  # bf16 rows
    grid = (tiles, N // bn, K // bk)
    operands = [(bm * K // 2 * isz, lambda t, j, k: ("xe", t, 0)), (bm * K // 2 * isz, lambda t, j, k: ("xo", t, 0)),
                (bn * bk // 2, lambda t, j, k: (_expert(t, per_expert), j, k)),
                (bn * K // 32, lambda t, j, k: (_expert(t, per_expert), j, 0))]
    outputs = [(bm * bn * isz, lambda t, j, k: (t, j))]  # written in the rows' dtype
    want = _walk(grid, operands, outputs)
    got = cost.gmm_cost("tpu", tiles, bm, bn, bk, N, K, isz)
    assert got["bytes_accessed"] == want
    assert got["flops"] == 2 * tiles * bm * N * K


@pytest.mark.parametrize("weight", ["w13", "w2"])
def test_tpu_transposed_estimate_is_the_grids_traffic(weight):
    (N, K), (bm, bn, bk) = SHAPES[weight], BLOCKS
    tiles, per_expert, isz = 6, 2, 2
    grid = (tiles, N // bn, K // bk)
    operands = [(bm * bn * isz, lambda t, n, k: (t, n)),
                (bn * bk // 2, lambda t, n, k: (_expert(t, per_expert), n, k)),
                (bn * K // 32, lambda t, n, k: (_expert(t, per_expert), n, 0))]
    outputs = [(bm * K // 2 * isz, lambda t, n, k: ("dxe", t)), (bm * K // 2 * isz, lambda t, n, k: ("dxo", t))]
    assert cost.gmm_t_cost("tpu", tiles, bm, bn, bk, N, K, isz)["bytes_accessed"] == _walk(grid, operands, outputs)


@pytest.mark.parametrize("K", [512, 2048], ids=["one-k-step", "four-k-steps"])
def test_grid_schedule_rereads_rows_per_column_tile_unless_one_k_step(K):
    """The dense grid schedule (row blocks (bm, bk/2) at (i, k)): rows fetched once per column tile, except with a
    single k step, where the row block's index stays (i, 0) across j."""
    N, (bm, bn, bk), tiles = 512, BLOCKS, 3
    bk = min(bk, K)
    grid = (tiles, N // bn, K // bk)
    operands = [(bm * bk * 2, lambda t, j, k: (t, k)), (bn * bk // 2, lambda t, j, k: (j, k)),
                (bn * bk // 32, lambda t, j, k: (j, k))]
    outputs = [(bm * bn * 4, lambda t, j, k: (t, j))]
    assert cost.gmm_cost("grid", tiles, bm, bn, bk, N, K, 2)["bytes_accessed"] == _walk(grid, operands, outputs)


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs in its equations' parameters (custom_vjp, pjit bodies)."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in v if isinstance(v, list | tuple) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_the_kernels_carry_their_estimates():
    """The forward and the transposed kernel's pallas_calls declare cost.py's figures for their padded rows."""
    G, N, K, M = 2, 256, 512, 40
    x = jax.ShapeDtypeStruct((M, K), jnp.float32)
    packed, scale = jnp.zeros((G, N, K // 2), jnp.uint8), jnp.zeros((G, N, K // 32), jnp.uint8)
    gs = jnp.array([10, 30], jnp.int32)
    blocks = {"block_m": 16, "block_n": 128, "block_k": 256, "platform": "tpu", "interpret": True}

    def f(x):
        y, vjp = jax.vjp(lambda x: mxfp4_gmm(x, packed, scale, gs, **blocks), x)
        return vjp(y)[0]

    calls = [e for e in _eqns(jax.make_jaxpr(f)(x).jaxpr) if e.primitive.name == "pallas_call"]
    est = {e.params["name"]: e.params["cost_estimate"] for e in calls}
    tiles = math.ceil(M / 16) + G + 1  # api.group_tile_metadata's static tile count (the last one always unused)
    fwd = cost.gmm_cost("tpu", tiles, 16, 128, 256, N, K, 4)
    bwd = cost.gmm_t_cost("tpu", tiles, 16, 128, 256, N, K, 4)
    assert (est["mxfp4_gmm_tpu_fwd"].flops, est["mxfp4_gmm_tpu_fwd"].bytes_accessed) == \
        (fwd["flops"], fwd["bytes_accessed"])
    assert (est["mxfp4_gmm_tpu_bwd_x"].flops, est["mxfp4_gmm_tpu_bwd_x"].bytes_accessed) == \
        (bwd["flops"], bwd["bytes_accessed"])
