"""The MXFP4 kernels' cost estimates are honest: at K3's expert shapes, the bytes ``pallas_kernels/mxfp4_matmul
/cost.py`` declares equal the bytes the pipelined grid moves, counted here by walking the grid with block index
maps written from the tiling table (pallas_kernels/mxfp4_matmul/README.md), not from the kernel's code: a block is
fetched when its index differs from the previous step's, an output block written back when its index changes and
at the end. And the estimates reach the compiled program: the kernels' pallas_calls carry them."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.testing import jaxpr_eqns
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


@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "transposed"])
def test_static_grid_charge_is_the_grids_traffic(transposed):
    """The static (megacore) TPU grid at w1's shapes, 3 of 7 tiles used (experts 0, 0, 1): the used tiles' traffic,
    then the unused ones, which name the last tile's rows and weight block (0, 0, 0) (one fetch between them) and
    each write their own output block; charged_cost(expected = 3, static_grid=True) declares exactly that."""
    (N, K), (bm, bn, bk) = SHAPES["w13"], BLOCKS
    tiles, used, isz = 7, 3, 2
    tg = [0, 0, 1, -1, -1, -1, -1]
    on = lambda t: tg[t] >= 0  # noqa: E731
    w = lambda t, m, k: (tg[t], m, k) if on(t) else (0, 0, 0)  # noqa: E731
    row = lambda t: t if on(t) else tiles - 1  # noqa: E731
    grid = (tiles, N // bn, K // bk)
    if transposed:
        operands = [(bm * bn * isz, lambda t, n, k: (row(t), n if on(t) else 0)),
                    (bn * bk // 2, w), (bn * K // 32, lambda t, n, k: w(t, n, k)[:2])]
        outputs = [(bm * K // 2 * isz, lambda t, n, k: ("dxe", t)), (bm * K // 2 * isz, lambda t, n, k: ("dxo", t))]
    else:
        operands = [(bm * K // 2 * isz, lambda t, j, k: ("xe", row(t))),
                    (bm * K // 2 * isz, lambda t, j, k: ("xo", row(t))),
                    (bn * bk // 2, w), (bn * K // 32, lambda t, j, k: w(t, j, k)[:2])]
        outputs = [(bm * bn * isz, lambda t, j, k: (t, j))]
    fn = cost.gmm_t_cost if transposed else cost.gmm_cost
    got = cost.charged_cost(fn, "tpu", tiles, used, bm, bn, bk, N, K, isz, static_grid=True)
    assert got["bytes_accessed"] == _walk(grid, operands, outputs)
    assert got["flops"] == 2 * used * bm * N * K


@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "transposed"])
def test_resident_weights_charge_is_the_grids_traffic(transposed):
    """Resident expert weights on the static grid at w1's shapes (tiles of experts 0, 0, 1, 1, 1, 2, then two
    unused): the weight and scale blocks are indexed by the expert alone, so a run of one expert's tiles fetches them
    once, and the unused tiles' (expert 0) once more. charged_cost(resident_groups=3, static_grid=True) declares that
    traffic plus one more expert's weights (where the megacore's second core starts inside a run; this walk is one
    core's order), and the weights' share falls from once per tile to once per expert."""
    (N, K), (bm, bn, bk) = SHAPES["w13"], BLOCKS
    tg = [0, 0, 1, 1, 1, 2, -1, -1]
    tiles, used, isz = len(tg), 6, 2
    on = lambda t: tg[t] >= 0  # noqa: E731
    row = lambda t: t if on(t) else tiles - 1  # noqa: E731
    expert = lambda t, *_: ("w", max(tg[t], 0))  # noqa: E731   kernel.tile_blocks: an unused tile names expert 0
    grid = (tiles, N // bn, K // bk)
    weights = [(N * K // 2, expert), (N * K // 32, lambda t, *_: ("s",) + expert(t)[1:])]
    if transposed:
        operands = [(bm * bn * isz, lambda t, n, k: (row(t), n if on(t) else 0)), *weights]
        outputs = [(bm * K // 2 * isz, lambda t, n, k: ("dxe", t)), (bm * K // 2 * isz, lambda t, n, k: ("dxo", t))]
    else:
        operands = [(bm * K // 2 * isz, lambda t, j, k: ("xe", row(t))),
                    (bm * K // 2 * isz, lambda t, j, k: ("xo", row(t))), *weights]
        outputs = [(bm * bn * isz, lambda t, j, k: (t, j))]
    fn = cost.gmm_t_cost if transposed else cost.gmm_cost
    walked = _walk(grid, operands, outputs)
    got = cost.charged_cost(fn, "tpu", tiles, used, bm, bn, bk, N, K, isz, static_grid=True, resident_groups=3)
    assert got["bytes_accessed"] == walked + N * (K // 2 + K // 32)
    blocked = cost.charged_cost(fn, "tpu", tiles, used, bm, bn, bk, N, K, isz, static_grid=True)
    assert blocked["bytes_accessed"] - got["bytes_accessed"] == \
        (used - 3 - 2) * N * (K // 2 + K // 32) + bn * bk // 2 + bn * K // 32    # and no unused-tile weight block
    assert got["flops"] == blocked["flops"] == 2 * used * bm * N * K


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

    calls = [e for e in jaxpr_eqns(jax.make_jaxpr(f)(x).jaxpr) if e.primitive.name == "pallas_call"]
    est = {e.params["name"]: e.params["cost_estimate"] for e in calls}
    tiles = math.ceil(M / 16) + G + 1  # api.group_tile_metadata's static tile count (the last one always unused)
    fwd = cost.gmm_cost("tpu", tiles, 16, 128, 256, N, K, 4)
    bwd = cost.gmm_t_cost("tpu", tiles, 16, 128, 256, N, K, 4)
    assert (est["mxfp4_gmm_tpu_fwd"].flops, est["mxfp4_gmm_tpu_fwd"].bytes_accessed) == \
        (fwd["flops"], fwd["bytes_accessed"])
    assert (est["mxfp4_gmm_tpu_bwd_x"].flops, est["mxfp4_gmm_tpu_bwd_x"].bytes_accessed) == \
        (bwd["flops"], bwd["bytes_accessed"])


# --- the expected-load estimate (B = 1 decode: a chip's rows reach ~1 of its experts) ---------------------------

# K3 decode on v5p-64, expert axis 16: E = 896 experts, top-k 8, E_l = 56 per chip; w1 / w3 (N, K) = (3072, 3584),
# TPU blocks (bm, bn, bk) = (16, 256, 512) (bm follows the rows per expert: min 16), bf16 rows
K3 = {"E": 896, "k": 8, "El": 56}


def test_expected_load_at_b1_decode_by_hand():
    load = cost.expected_load(1, K3["k"], K3["E"], K3["El"])
    assert load["rows"] == pytest.approx(0.5)  # 1 token · 8 slots · 56 / 896
    assert load["groups"] == pytest.approx(0.5)  # 56 · (1 - (1 - 8/896)^1)
    assert cost.expected_tiles(0.5, 0.5, 16) == pytest.approx(0.5)  # 0.5 · 15/16 + 0.5/16


def test_expected_load_bounds_distinct_experts_and_tiles():
    """The two inequalities the charge rests on, on random draws: (1) Jensen: for any routing probabilities p_e
    (sum k) the expected distinct experts reached is at most the uniform value, which is at least the
    with-replacement form; (2) per draw, sum_g ceil(n_g/bm) <= D·(1 - 1/bm) + rows/bm."""
    rng = np.random.default_rng(0)
    E, k, t = 64, 4, 5
    for _ in range(20):
        p = rng.dirichlet(np.full(E, 0.3)) * k
        p = np.minimum(p, 1.0)
        p *= k / p.sum()
        if p.max() > 1:
            continue
        assert np.sum(1 - (1 - p) ** t) <= cost.expected_load(t, k, E, E)["groups"] + 1e-9
    assert cost.expected_load(t, k, E, 8)["groups"] >= 8 * (1 - (1 - 1 / E) ** (t * k))
    for bm in (1, 16, 32):
        sizes = rng.integers(0, 70, size=12) * (rng.random(12) < 0.6)
        used = sizes[sizes > 0]
        assert np.sum(-(-used // bm)) <= cost.expected_tiles(sizes.sum(), len(used), bm) + 1e-9


def test_charged_cost_by_hand_at_b1_decode():
    """w1 at B = 1 (8 rows on 56 experts: T = ceil(8/16) + 56 + 1 = 58 static tiles), charged 0.5 expected tiles
    plus the no-tile-used visit. Per tile: rows 16·3584·2 = 114,688 + weights 3072·(1792 + 112) = 5,849,088 + out
    16·3072·2 = 98,304 = 6,062,080 B; FLOPs 2·16·3072·3584 = 352,321,536. The visit: one weight block 256·256 +
    scale block 256·112 = 94,208 + x 16·3584·2 + out 16·3072·2 = 212,992."""
    args = (16, 256, 512, 3072, 3584, 2)
    static = cost.charged_cost(cost.gmm_cost, "tpu", 58, None, *args)
    assert static == {"flops": 58 * 352_321_536, "bytes_accessed": 58 * 6_062_080}  # 351,600,640 B
    got = cost.charged_cost(cost.gmm_cost, "tpu", 58, 0.5, *args)
    assert got == {"flops": 176_160_768, "bytes_accessed": 3_031_040 + 94_208 + 212_992}  # 3,338,240 B: 105x less
    # the loop schedule (GPU) has no such visit: an unused program loads nothing; expected tiles cap at T - 1
    assert cost.charged_cost(cost.gmm_cost, "loop", 58, 0.5, *args)["flops"] == 176_160_768
    assert cost.charged_cost(cost.gmm_cost, "tpu", 4, 100.0, *args) == cost.charged_cost(cost.gmm_cost, "tpu", 4, 3,
                                                                                          *args) | {
        "bytes_accessed": 3 * 6_062_080 + 94_208 + 212_992}


def test_the_kernels_charge_the_callers_expected_load():
    """mxfp4_gmm(expected_rows=, expected_groups=): the forward and transposed pallas_calls carry charged_cost."""
    G, N, K, M = 4, 256, 512, 8
    x = jax.ShapeDtypeStruct((M, K), jnp.float32)
    packed, scale = jnp.zeros((G, N, K // 2), jnp.uint8), jnp.zeros((G, N, K // 32), jnp.uint8)
    gs = jnp.array([0, 3, 0, 0], jnp.int32)
    blocks = {"block_m": 16, "block_n": 128, "block_k": 256, "platform": "tpu", "interpret": True}

    def f(x):
        y, vjp = jax.vjp(lambda x: mxfp4_gmm(x, packed, scale, gs, expected_rows=2.0, expected_groups=1.5,
                                             **blocks), x)
        return vjp(y)[0]

    calls = [e for e in jaxpr_eqns(jax.make_jaxpr(f)(x).jaxpr) if e.primitive.name == "pallas_call"]
    est = {e.params["name"]: e.params["cost_estimate"] for e in calls}
    tiles = math.ceil(M / 16) + G + 1
    used = 1.5 * 15 / 16 + 2.0 / 16
    for name, fn in (("mxfp4_gmm_tpu_fwd", cost.gmm_cost), ("mxfp4_gmm_tpu_bwd_x", cost.gmm_t_cost)):
        want = cost.charged_cost(fn, "tpu", tiles, used, 16, 128, 256, N, K, 4)
        assert (est[name].flops, est[name].bytes_accessed) == (want["flops"], want["bytes_accessed"])
    with pytest.raises(ValueError, match="expected_groups"):
        mxfp4_gmm(jnp.zeros((M, K)), packed, scale, gs, expected_rows=1.0, expected_groups=9.0, **blocks)
