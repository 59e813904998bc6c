"""Public MXFP4-weight matmuls: input checks, grouped-tile metadata, custom_vjp wiring, the interpret flag.

    y = mxfp4_matmul(x, packed, scale)              x [M, K]; W logical torch [N, K]: packed [N, K/2], scale [N, K/32]
    y = mxfp4_gmm(x, packed, scale, group_sizes)    rows of x sorted by expert; packed [G, N, K/2], scale [G, N, K/32]

y = x @ dequant(W)ᵀ, fp32 accumulation, output in x.dtype (bfloat16 or float32). The weights are frozen storage:
the VJP gives dx = g @ dequant(W) (from the jnp reference, until the kernel has its own backward) and no cotangent
for the uint8 arrays. ``act_quant="ceil"`` (or another rule) MXFP8-fake-quantizes x along K first (STE).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops import mx
from pallas_kernels.mxfp4_matmul import kernel as _k
from pallas_kernels.mxfp4_matmul import reference as _ref
from pallas_kernels.mxfp4_matmul.kernel import BlockSizes


def _check(x, packed, scale, *, grouped: bool) -> None:
    want_nd = 3 if grouped else 2
    if x.ndim != 2 or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x must be float32/bfloat16 [M, K], got {x.dtype} {x.shape}")
    if packed.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
        raise ValueError(f"packed and scale must be uint8, got packed {packed.dtype} {packed.shape} and "
                         f"scale {scale.dtype} {scale.shape}")
    K = x.shape[1]
    lead = packed.shape[:-1]
    if packed.ndim != want_nd or packed.shape[-1] * 2 != K or scale.shape != (*lead, K // 32) or K % 32:
        want = "[G, N, K/2] and [G, N, K/32]" if grouped else "[N, K/2] and [N, K/32]"
        raise ValueError(f"packed {packed.shape} / scale {scale.shape} do not match x {x.shape}; expected {want}")


def _fit(block: int, dim: int) -> int:
    """Largest power of two <= block dividing dim (tiles never straddle the N or K edge)."""
    while block > 1 and dim % block:
        block //= 2
    return block


def _split_even_odd(x):
    """[M, K] -> (x[:, 0::2], x[:, 1::2]): the columns that meet low and high nibbles."""
    x2 = x.reshape(x.shape[0], x.shape[1] // 2, 2)
    return x2[..., 0], x2[..., 1]


def group_tile_metadata(group_sizes, num_rows: int, block_m: int):
    """Tile layout for rows sorted by group, each group padded to whole row tiles (plain jnp, no Pallas).

    Steps (G groups, M = num_rows, bm = block_m):
      1. starts[g] = first row of group g in x; tiles[g] = ceil(size_g / bm); tile_starts = exclusive cumsum.
      2. T = ceil(M / bm) + G tiles bound sum(tiles) (a static shape); tile t belongs to group
         tile_group[t] (-1 if t >= sum(tiles): the kernel skips it). Empty groups own no tile.
      3. padded row p = t*bm + q holds x row starts[g] + (t - tile_starts[g])*bm + q when that is inside group g,
         else the zero row M  ->  src_rows [T*bm].
      4. x row r (r < sum(sizes)) lands at dst_rows[r] = tile_starts[g(r)]*bm + r - starts[g(r)]; rows past the
         groups get 0 output (valid_rows false).
    Invariant: every row of every group appears exactly once in src_rows.
    Returns (tile_group int32 [T], src_rows int32 [T*bm], dst_rows int32 [M], valid_rows bool [M]).
    """
    sizes = group_sizes.astype(jnp.int32)
    G = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = (sizes + block_m - 1) // block_m
    tile_ends = jnp.cumsum(tiles)
    tile_starts = tile_ends - tiles
    T = -(-num_rows // block_m) + G
    t = jnp.arange(T, dtype=jnp.int32)
    g_of_t = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right"), G - 1).astype(jnp.int32)
    tile_group = jnp.where(t < tile_ends[-1], g_of_t, -1)
    p = jnp.arange(T * block_m, dtype=jnp.int32)
    g_of_p = g_of_t[p // block_m]
    local = p - tile_starts[g_of_p] * block_m
    inside = (tile_group[p // block_m] >= 0) & (local < sizes[g_of_p])
    src_rows = jnp.where(inside, starts[g_of_p] + local, num_rows)
    r = jnp.arange(num_rows, dtype=jnp.int32)
    g_of_r = jnp.minimum(jnp.searchsorted(ends, r, side="right"), G - 1)
    valid_rows = r < ends[-1]
    dst_rows = jnp.where(valid_rows, tile_starts[g_of_r] * block_m + r - starts[g_of_r], 0)
    return tile_group, src_rows, dst_rows, valid_rows


# ---------------------------------------------------------------------------------------------------------------
# grouped


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _gmm(x, packed, scale, group_sizes, bs: BlockSizes, interpret: bool):
    M = x.shape[0]
    tile_group, src_rows, dst_rows, valid_rows = group_tile_metadata(group_sizes, M, bs.block_m)
    x_rows = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[src_rows]
    xe, xo = _split_even_odd(x_rows)
    y_pad = _k.mxfp4_gmm_loop(tile_group, xe, xo, packed, scale, bs, interpret=interpret)
    return jnp.where(valid_rows[:, None], y_pad[dst_rows], 0.0).astype(x.dtype)


def _gmm_fwd(x, packed, scale, group_sizes, bs, interpret):
    return _gmm(x, packed, scale, group_sizes, bs, interpret), (packed, scale, group_sizes)


def _gmm_bwd(bs, interpret, res, g):
    packed, scale, group_sizes = res
    dx = _ref.mxfp4_gmm_reference_vjp_x(g, packed, scale, group_sizes)
    return dx.astype(g.dtype), None, None, None  # uint8 storage and int sizes: no cotangent


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def mxfp4_gmm(x, packed, scale, group_sizes, *, block_m: int = 16, block_n: int = 128, block_k: int = 256,
              act_quant: str | None = None, interpret: bool = False):
    """Grouped MXFP4 matmul over experts (ragged groups; empty groups and partial tiles allowed).

    Args:
      x: [M, K] float32/bfloat16, rows sorted by expert.
      packed: uint8 [G, N, K/2]; scale: uint8 [G, N, K/32] (per-expert torch orientation, blocks along K).
      group_sizes: int [G], sum <= M; rows past the sum give zeros.
      block_m, block_n, block_k: tile sizes (powers of two; n and k shrink to divide N and K).
      act_quant: None, or the MXFP8 scale rule to fake-quantize x with (blocks of 32 along K).
      interpret: run the Pallas interpreter (CPU).
    Returns: y [M, N] in x.dtype.
    """
    _check(x, packed, scale, grouped=True)
    if group_sizes.shape != (packed.shape[0],):
        raise ValueError(f"group_sizes {group_sizes.shape} must be [G] = [{packed.shape[0]}]")
    if act_quant is not None:
        x = mx.fake_quant_mxfp8(x, axis=-1, rule=act_quant)
    N, K = packed.shape[1], x.shape[1]
    bs = BlockSizes(block_m, _fit(block_n, N), _fit(block_k, K))
    return _gmm(x, packed, scale, group_sizes, bs, interpret)


# ---------------------------------------------------------------------------------------------------------------
# dense


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _matmul(x, packed, scale, bs: BlockSizes, schedule: str, interpret: bool):
    if schedule == "loop":
        return _gmm(x, packed[None], scale[None], jnp.array([x.shape[0]], jnp.int32), bs, interpret)
    M = x.shape[0]
    Mp = -(-M // bs.block_m) * bs.block_m
    xe, xo = _split_even_odd(jnp.pad(x, ((0, Mp - M), (0, 0))))
    return _k.mxfp4_matmul_grid(xe, xo, packed, scale, bs, interpret=interpret)[:M].astype(x.dtype)


def _matmul_fwd(x, packed, scale, bs, schedule, interpret):
    return _matmul(x, packed, scale, bs, schedule, interpret), (packed, scale)


def _matmul_bwd(bs, schedule, interpret, res, g):
    packed, scale = res
    dx = jnp.dot(g.astype(jnp.float32), _ref.dequantize_packed(packed, scale), precision=jax.lax.Precision.HIGHEST)
    return dx.astype(g.dtype), None, None  # y has x's dtype, so g does too


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def mxfp4_matmul(x, packed, scale, *, block_m: int = 16, block_n: int = 128, block_k: int = 256,
                 schedule: str | None = None, act_quant: str | None = None, interpret: bool = False):
    """y [..., N] = x [..., K] @ dequant(W)ᵀ for one MXFP4 weight W (torch [N, K]: packed [N, K/2], scale [N, K/32]).

    ``schedule``: "grid" (grid (M/bm, N/bn, K/bk), reduction last; TPU / interpret) or "loop" (K loop inside the
    kernel; GPU). Default: "loop" on GPU, else "grid". Other arguments as for ``mxfp4_gmm``.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    _check(x2, packed, scale, grouped=False)
    if schedule is None:
        schedule = "loop" if jax.default_backend() == "gpu" else "grid"
    if schedule not in ("grid", "loop"):
        raise ValueError(f"schedule must be 'grid' or 'loop', got {schedule!r}")
    if act_quant is not None:
        x2 = mx.fake_quant_mxfp8(x2, axis=-1, rule=act_quant)
    N, K = packed.shape[0], x2.shape[1]
    bs = BlockSizes(block_m, _fit(block_n, N), _fit(block_k, K))
    return _matmul(x2, packed, scale, bs, schedule, interpret).reshape(*lead, N)
