"""pallas_call bodies for the MXFP4-weight matmul (docs/numerics.md §10.8) and the BlockSizes dataclass.

Weights stay packed in memory: per tile the kernel loads bytes [bn, bk/2] and scale bytes [bn, bk/32] and decodes
them in registers. The contraction is split into even and odd columns, because the low nibble of byte j is column 2j
and the high nibble column 2j+1 (docs/numerics.md §10.3): with x_even = x[:, 0::2], x_odd = x[:, 1::2] (split once
outside),

    y_tile += x_even_tile @ decode(lo)ᵀ + x_odd_tile @ decode(hi)ᵀ        (fp32 accumulation)

so no nibble interleave is needed in the kernel. Each group of 16 bytes along K shares one scale byte.

Two schedules share the tile math:
  * ``grid``: grid (M/bm, N/bn, K/bk), reduction axis last, the fp32 output block stays resident across k and is
    zeroed at k == 0 (the TPU-style pipeline of docs/numerics.md §10.8; also what interpret mode runs by default);
  * ``loop``: grid (tiles, N/bn) and a fori_loop over K inside the kernel. A GPU (Triton) grid has no sequential
    reduction axis, so this is the schedule for GPUs; it is also the grouped (per-expert) kernel, where each row
    tile reads its expert id from ``tile_group`` (-1 = unused tile: writes zeros, loads no weights);
  * ``tpu``: grid (tiles, N/bn, K/bk), reduction last, the expert id of each row tile scalar-prefetched into SMEM and
    read by the weight index maps (dense = one expert). Mosaic wants the last two block dims divisible by (8, 128) or
    equal to the array's, and a scale block (bn, bk/32) meets neither for K3 (bk/32 = 16 of K/32 = 112 at K = 3584;
    bk ≥ 4096 does not divide 3584). So the scale block spans the whole K/32 (index (g, j, 0), fetched once per
    (tile, j)) and at k == 0 the kernel spreads it into a VMEM scratch [bn, K/2] of fp32 scales
    (``_expand_scale_by_dot``); each k step then reads the scratch at lane offset k·bk/2, a multiple of 128 (a
    dynamic lane offset of k·bk/32 into the uint8 block is what Mosaic rejects: "cannot statically prove that index
    in dimension 1 is a multiple of 128"). The scales stay uint8 in HBM (no wrapper-side relayout of the weights).
    The row blocks are a tile's whole x halves [bm, K/2] (index (t, 0)), sliced at the same lane offsets: each row
    tile is fetched once, not once per column tile (at K3's shapes that was 12-14x the rows' bytes, 2 of the
    forward plan's 3.3 TB of kernel traffic per chip; experiments/LOG.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops import mx
from k3jax.ops.grouped_matmul import varying_struct
from pallas_kernels.mxfp4_matmul import cost

SCALE_GROUP_BYTES = mx.BLOCK_SIZE // 2  # the packed bytes of one scale block (16: two codes per byte)


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. bm rows of x, bn output features, bk contraction (a multiple of 32: whole scale blocks). Powers of
    two except where a TPU block spans a whole dimension that no power-of-two Mosaic tile divides
    (``api.block_sizes``)."""

    block_m: int = 16
    block_n: int = 128
    block_k: int = 256

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_k % mx.BLOCK_SIZE:
            raise ValueError(f"block_k must be a multiple of {mx.BLOCK_SIZE} (whole scale blocks), got {self.block_k}")


def _estimate(fn, schedule: str, rows: int, bs: BlockSizes, N: int, K: int, itemsize: int) -> pl.CostEstimate:
    """The ``pl.CostEstimate`` of one call (cost.py): ``rows`` = T·bm padded rows."""
    c = fn(schedule, rows // bs.block_m, bs.block_m, bs.block_n, bs.block_k, N, K, itemsize)
    return pl.CostEstimate(flops=c["flops"], transcendentals=0, bytes_accessed=c["bytes_accessed"])


def _expand_scale(scale_u8):
    """Scale bytes [bn, n] -> fp32 scales [bn, 16 n], one per packed byte (from the bit pattern, never exp2)."""
    bn, n = scale_u8.shape
    scale = mx.e8m0_to_float(scale_u8)
    return jnp.broadcast_to(scale[:, :, None], (bn, n, SCALE_GROUP_BYTES)).reshape(bn, n * SCALE_GROUP_BYTES)


def _expand_scale_by_dot(scale_u8):
    """``_expand_scale`` as one matmul with a 0/1 matrix E[s, c] = (c // 16 == s): [bn, n] @ [n, 16 n].

    For the TPU kernel, where the broadcast + reshape of a whole-K scale block needs more scoped VMEM than the
    default 16 MiB (measured: 19.6 MiB at bn = 256, K = 3584) and unrolling it over static slices took 9 s to
    compile. Exact: each output is one scale times 1, and scales (powers of two) and E are exact in bf16, with fp32
    accumulation; only the subnormal 2^-127 (scale byte 0) may be flushed to 0 by the MXU.
    """
    n = scale_u8.shape[1]
    rows = lax.broadcasted_iota(jnp.int32, (n, n * SCALE_GROUP_BYTES), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n * SCALE_GROUP_BYTES), 1)
    spread = jnp.where(rows == cols // SCALE_GROUP_BYTES, 1.0, 0.0).astype(jnp.bfloat16)
    scale = mx.e8m0_to_float(scale_u8).astype(jnp.bfloat16)
    return lax.dot_general(scale, spread, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _decode_tile(bytes_u8, scale, dtype):
    """Packed bytes [bn, bk/2] + their fp32 scales [bn, bk/2] -> (even, odd) weight tiles [bn, bk/2] in ``dtype``.

    fp4 x 2^e is exact in fp32 and bf16 (unless subnormal), so the cast to the matmul dtype loses nothing. The bytes
    are widened to int32 before any bit op (Mosaic has no 8-bit vector arithmetic).
    """
    b = bytes_u8.astype(jnp.int32)
    # E2M1 code -> value by arithmetic (no table lookups in the kernel); low nibble = even column
    return (mx.e2m1_decode(b & 15) * scale).astype(dtype), (mx.e2m1_decode(b >> 4) * scale).astype(dtype)


def _tile_product(xe, xo, bytes_u8, scale):
    """x halves [bm, bk/2], one packed weight tile and its fp32 scales -> fp32 [bm, bn] partial product."""
    we, wo = _decode_tile(bytes_u8, scale, xe.dtype)
    precision = lax.Precision.HIGHEST if xe.dtype == jnp.float32 else None
    dims = (((1,), (1,)), ((), ()))
    out = lax.dot_general(xe, we, dims, precision=precision, preferred_element_type=jnp.float32)
    return out + lax.dot_general(xo, wo, dims, precision=precision, preferred_element_type=jnp.float32)


def _grid_kernel(xe_ref, xo_ref, p_ref, s_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    o_ref[...] += _tile_product(xe_ref[...], xo_ref[...], p_ref[...], _expand_scale(s_ref[...]))


def mxfp4_matmul_grid(xe, xo, packed, scale, bs: BlockSizes, *, interpret: bool) -> jax.Array:
    """Dense kernel, grid schedule. xe, xo [M, K/2] (M % bm == 0); packed [N, K/2]; scale [N, K/32] -> fp32 [M, N]."""
    M, half = xe.shape
    N = packed.shape[0]
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    grid = (M // bm, N // bn, 2 * half // bk)
    return pl.pallas_call(
        _grid_kernel,
        out_shape=varying_struct((M, N), jnp.float32, xe, xo, packed, scale),
        grid=grid,
        in_specs=[
            pl.BlockSpec((bm, bk // 2), lambda i, j, k: (i, k)),
            pl.BlockSpec((bm, bk // 2), lambda i, j, k: (i, k)),
            pl.BlockSpec((bn, bk // 2), lambda i, j, k: (j, k)),
            pl.BlockSpec((bn, bk // mx.BLOCK_SIZE), lambda i, j, k: (j, k)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
        cost_estimate=_estimate(cost.gmm_cost, "grid", M, bs, N, 2 * half, xe.dtype.itemsize),
        interpret=interpret,
        name="mxfp4_matmul_fwd",
    )(xe, xo, packed, scale)


def _loop_kernel(group_ref, xe_ref, xo_ref, p_ref, s_ref, o_ref, *, bn: int, bk: int, nk: int):
    i, j = pl.program_id(0), pl.program_id(1)
    g = group_ref[i]
    rows = pl.ds(j * bn, bn)

    @pl.when(g >= 0)
    def _compute():
        def body(k, acc):
            kh = pl.ds(k * (bk // 2), bk // 2)
            ks = pl.ds(k * (bk // mx.BLOCK_SIZE), bk // mx.BLOCK_SIZE)
            scale = _expand_scale(s_ref[g, rows, ks])
            return acc + _tile_product(xe_ref[:, kh], xo_ref[:, kh], p_ref[g, rows, kh], scale)

        o_ref[...] = lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.float32)).astype(o_ref.dtype)

    @pl.when(g < 0)
    def _unused():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def mxfp4_gmm_loop(tile_group, xe, xo, packed, scale, bs: BlockSizes, *, interpret: bool) -> jax.Array:
    """Grouped kernel, loop schedule.

    Args:
      tile_group: int32 [T] expert id of each row tile of bm rows (-1 = unused).
      xe, xo: [T*bm, K/2] even / odd columns of the tile-padded rows.
      packed: uint8 [G, N, K/2]; scale: uint8 [G, N, K/32].
    Returns: [T*bm, N] in x's dtype (fp32 accumulation).
    """
    Mp, half = xe.shape
    _, N, _ = packed.shape
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    kernel = functools.partial(_loop_kernel, bn=bn, bk=bk, nk=2 * half // bk)
    return pl.pallas_call(
        kernel,
        out_shape=varying_struct((Mp, N), xe.dtype, tile_group, xe, xo, packed, scale),
        grid=(Mp // bm, N // bn),
        in_specs=[
            pl.BlockSpec(tile_group.shape, lambda i, j: (0,)),
            pl.BlockSpec((bm, half), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, half), lambda i, j: (i, 0)),
            pl.BlockSpec(packed.shape, lambda i, j: (0, 0, 0)),  # whole stack; the kernel indexes [g, rows, k]
            pl.BlockSpec(scale.shape, lambda i, j: (0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        cost_estimate=_estimate(cost.gmm_cost, "loop", Mp, bs, N, 2 * half, xe.dtype.itemsize),
        interpret=interpret,
        name="mxfp4_gmm_fwd",
    )(tile_group, xe, xo, packed, scale)


def _k_lanes(k, bk: int, nk: int):
    """The lanes [k·bk/2, (k+1)·bk/2) of a whole-K/2 VMEM buffer: a dynamic slice at a multiple of bk/2 (of 128 when
    there are several k steps, ``api.block_sizes``), or all of it (static) when bk = K: Mosaic cannot prove a dynamic
    offset aligned when bk/2 is not a multiple of 128 (k3-mini: K = 192)."""
    return slice(None) if nk == 1 else pl.ds(pl.multiple_of(k * (bk // 2), bk // 2), bk // 2)


def _unused_tiles(tile_group, n_mid: int, nk: int):
    """The TPU schedules' way past unused tiles (group -1, after the used ones): (dma_tile [T], steps). An unused
    tile's index maps name the blocks of the last used tile (``dma_tile``) at its last step (``steps(t, a, k, tg)``
    -> the (middle, k) grid indices whose blocks tile t names), so the pipeline fetches nothing for it."""
    used = tile_group >= 0
    last = jnp.maximum(jnp.sum(used.astype(jnp.int32)) - 1, 0)
    dma_tile = jnp.where(used, jnp.arange(tile_group.shape[0], dtype=jnp.int32), last).astype(jnp.int32)

    def steps(t, a, k, tg):
        on = tg[t] >= 0
        return jnp.where(on, a, n_mid - 1), jnp.where(on, k, nk - 1)

    return dma_tile, steps


def _tpu_kernel(tile_group_ref, dma_tile_ref, xe_ref, xo_ref, p_ref, s_ref, o_ref, scale_ref, acc_ref, *, bk: int,
                nk: int):
    del dma_tile_ref  # read by the index maps only
    k = pl.program_id(2)
    used = tile_group_ref[pl.program_id(0)] >= 0

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    @pl.when(used & (k == 0))
    def _expand():
        scale_ref[...] = _expand_scale_by_dot(s_ref[...])

    @pl.when(used)
    def _compute():
        kh = _k_lanes(k, bk, nk)
        acc_ref[...] += _tile_product(xe_ref[:, kh], xo_ref[:, kh], p_ref[...], scale_ref[:, kh])

    @pl.when(k == nk - 1)
    def _write():  # after the last k step's _compute (the pl.when blocks run in program order)
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def mxfp4_gmm_tpu(tile_group, xe, xo, packed, scale, bs: BlockSizes, *, interpret: bool) -> jax.Array:
    """Grouped kernel, TPU schedule (also the dense kernel on TPU: one expert, every tile used).

    Args as ``mxfp4_gmm_loop``; used tiles must come first (as ``api.group_tile_metadata`` lays them out). Needs
    bm % 16 == 0 (bf16 sublane tiling), bn % 32 == 0 (uint8 tiling) and bk/2 % 128 == 0 (``api`` checks). An unused
    tile (group -1) names the blocks of the last used tile's last step, so the pipeline fetches nothing for it, and
    writes zeros. Accumulates in an fp32 VMEM scratch; returns [T*bm, N] in x's dtype.
    """
    Mp, half = xe.shape
    _, N, _ = packed.shape
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    nj, nk = N // bn, 2 * half // bk
    dma_tile, steps = _unused_tiles(tile_group, nj, nk)

    def x_map(t, j, k, tg, dt):  # a row tile's whole K/2: resident across j and k, fetched once per tile
        return dt[t], 0

    def w_map(t, j, k, tg, dt):
        return (jnp.maximum(tg[dt[t]], 0), *steps(t, j, k, tg))

    def s_map(t, j, k, tg, dt):
        return jnp.maximum(tg[dt[t]], 0), steps(t, j, k, tg)[0], 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(Mp // bm, nj, nk),
        in_specs=[
            pl.BlockSpec((bm, half), x_map),
            pl.BlockSpec((bm, half), x_map),
            pl.BlockSpec((None, bn, bk // 2), w_map),
            pl.BlockSpec((None, bn, scale.shape[-1]), s_map),  # whole K/32: see the module docstring
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda t, j, k, tg, dt: (t, j)),
        scratch_shapes=[pltpu.VMEM((bn, half), jnp.float32), pltpu.VMEM((bm, bn), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_tpu_kernel, bk=bk, nk=nk),
        out_shape=varying_struct((Mp, N), xe.dtype, tile_group, xe, xo, packed, scale),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=_estimate(cost.gmm_cost, "tpu", Mp, bs, N, 2 * half, xe.dtype.itemsize),
        interpret=interpret,
        name="mxfp4_gmm_tpu_fwd",
    )(tile_group.astype(jnp.int32), dma_tile, xe, xo, packed, scale)


# ---------------------------------------------------------------------------------------------------------------
# transposed (the backward with respect to the rows): dx [M, K] = g [M, N] @ W_g [N, K], contracting over N


def _tile_product_t(g, bytes_u8, scale):
    """Rows of the cotangent g [bm, bn] and one packed weight tile [bn, bk/2] with its fp32 scales -> the fp32
    partial products with the even and the odd columns of the tile, each [bm, bk/2]."""
    we, wo = _decode_tile(bytes_u8, scale, g.dtype)
    precision = lax.Precision.HIGHEST if g.dtype == jnp.float32 else None
    dims = (((1,), (0,)), ((), ()))
    return (lax.dot_general(g, we, dims, precision=precision, preferred_element_type=jnp.float32),
            lax.dot_general(g, wo, dims, precision=precision, preferred_element_type=jnp.float32))


def _loop_t_kernel(group_ref, g_ref, p_ref, s_ref, oe_ref, oo_ref, *, bn: int, bk: int, nn: int):
    i, j = pl.program_id(0), pl.program_id(1)
    grp = group_ref[i]
    kh = pl.ds(j * (bk // 2), bk // 2)
    ks = pl.ds(j * (bk // mx.BLOCK_SIZE), bk // mx.BLOCK_SIZE)

    @pl.when(grp >= 0)
    def _compute():
        def body(n, acc):
            rows = pl.ds(n * bn, bn)
            pe, po = _tile_product_t(g_ref[:, rows], p_ref[grp, rows, kh], _expand_scale(s_ref[grp, rows, ks]))
            return acc[0] + pe, acc[1] + po

        zero = jnp.zeros(oe_ref.shape, jnp.float32)
        ae, ao = lax.fori_loop(0, nn, body, (zero, zero))
        oe_ref[...], oo_ref[...] = ae.astype(oe_ref.dtype), ao.astype(oo_ref.dtype)

    @pl.when(grp < 0)
    def _unused():
        oe_ref[...] = jnp.zeros(oe_ref.shape, oe_ref.dtype)
        oo_ref[...] = jnp.zeros(oo_ref.shape, oo_ref.dtype)


def mxfp4_gmm_t_loop(tile_group, g, packed, scale, bs: BlockSizes, *, interpret) -> tuple[jax.Array, jax.Array]:
    """Transposed grouped kernel, loop schedule: grid (tiles, K/bk), a fori_loop over N inside the kernel.

    Args:
      tile_group: int32 [T] expert id of each row tile of bm rows (-1 = unused).
      g: [T*bm, N] the tile-padded cotangent rows.
      packed: uint8 [G, N, K/2]; scale: uint8 [G, N, K/32].
    Returns: (dx_even, dx_odd) [T*bm, K/2] each in g's dtype (fp32 accumulation): dx's even and odd columns (the low
    / high nibbles' columns).
    """
    Mp, N = g.shape
    half = packed.shape[2]
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    out = varying_struct((Mp, half), g.dtype, tile_group, g, packed, scale)
    return pl.pallas_call(
        functools.partial(_loop_t_kernel, bn=bn, bk=bk, nn=N // bn),
        out_shape=(out, out),
        grid=(Mp // bm, 2 * half // bk),
        in_specs=[
            pl.BlockSpec(tile_group.shape, lambda i, j: (0,)),
            pl.BlockSpec((bm, N), lambda i, j: (i, 0)),
            pl.BlockSpec(packed.shape, lambda i, j: (0, 0, 0)),  # whole stack; the kernel indexes [g, rows, k]
            pl.BlockSpec(scale.shape, lambda i, j: (0, 0, 0)),
        ],
        out_specs=(pl.BlockSpec((bm, bk // 2), lambda i, j: (i, j)), pl.BlockSpec((bm, bk // 2), lambda i, j: (i, j))),
        cost_estimate=_estimate(cost.gmm_t_cost, "loop", Mp, bs, N, 2 * half, g.dtype.itemsize),
        interpret=interpret,
        name="mxfp4_gmm_bwd_x",
    )(tile_group, g, packed, scale)


def _tpu_t_kernel(tile_group_ref, dma_tile_ref, g_ref, p_ref, s_ref, oe_ref, oo_ref, scale_ref, ae_ref, ao_ref, *,
                  bk: int, nn: int, nk: int):
    del dma_tile_ref  # read by the index maps only
    n, k = pl.program_id(1), pl.program_id(2)
    used = tile_group_ref[pl.program_id(0)] >= 0

    @pl.when((n == 0) & (k == 0))
    def _init():
        ae_ref[...] = jnp.zeros(ae_ref.shape, ae_ref.dtype)
        ao_ref[...] = jnp.zeros(ao_ref.shape, ao_ref.dtype)

    @pl.when(used & (k == 0))
    def _expand():
        scale_ref[...] = _expand_scale_by_dot(s_ref[...])

    @pl.when(used)
    def _compute():
        kh = _k_lanes(k, bk, nk)
        pe, po = _tile_product_t(g_ref[...], p_ref[...], scale_ref[:, kh])
        ae_ref[:, kh] += pe
        ao_ref[:, kh] += po

    @pl.when((n == nn - 1) & (k == nk - 1))
    def _write():  # the tile's last step, after its _compute
        oe_ref[...] = ae_ref[...].astype(oe_ref.dtype)
        oo_ref[...] = ao_ref[...].astype(oo_ref.dtype)


def mxfp4_gmm_t_tpu(tile_group, g, packed, scale, bs: BlockSizes, *, interpret) -> tuple[jax.Array, jax.Array]:
    """Transposed grouped kernel, TPU schedule: grid (tiles, N/bn, K/bk), both reductions' axes sequential.

    The output blocks are a row tile's whole dx halves [bm, K/2] (index (t, 0): resident across n and k, summed in
    fp32 VMEM scratch from the tile's first step and written in g's dtype at its last), so each weight block
    [bn, bk/2] is fetched once per row tile, the cotangent block [bm, bn] once per (tile, n), and the scale block
    (bn, K/32) once per (tile, n) and spread into the fp32 scratch at k == 0 as in ``mxfp4_gmm_tpu`` (the same
    Mosaic constraint). Unused tiles fetch nothing (``_unused_tiles``) and write zeros. Args and returns as
    ``mxfp4_gmm_t_loop``; used tiles must come first.
    """
    Mp, N = g.shape
    half = packed.shape[2]
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    nn, nk = N // bn, 2 * half // bk
    dma_tile, steps = _unused_tiles(tile_group, nn, nk)

    def g_map(t, n, k, tg, dt):
        return dt[t], steps(t, n, k, tg)[0]

    def w_map(t, n, k, tg, dt):
        return (jnp.maximum(tg[dt[t]], 0), *steps(t, n, k, tg))

    def s_map(t, n, k, tg, dt):
        return jnp.maximum(tg[dt[t]], 0), steps(t, n, k, tg)[0], 0

    out_block = pl.BlockSpec((bm, half), lambda t, n, k, tg, dt: (t, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(Mp // bm, nn, nk),
        in_specs=[
            pl.BlockSpec((bm, bn), g_map),
            pl.BlockSpec((None, bn, bk // 2), w_map),
            pl.BlockSpec((None, bn, scale.shape[-1]), s_map),  # whole K/32, as in mxfp4_gmm_tpu
        ],
        out_specs=(out_block, out_block),
        scratch_shapes=[pltpu.VMEM((bn, half), jnp.float32), pltpu.VMEM((bm, half), jnp.float32),
                        pltpu.VMEM((bm, half), jnp.float32)],
    )
    out = varying_struct((Mp, half), g.dtype, tile_group, g, packed, scale)
    return pl.pallas_call(
        functools.partial(_tpu_t_kernel, bk=bk, nn=nn, nk=nk),
        out_shape=(out, out),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=_estimate(cost.gmm_t_cost, "tpu", Mp, bs, N, 2 * half, g.dtype.itemsize),
        interpret=interpret,
        name="mxfp4_gmm_tpu_bwd_x",
    )(tile_group.astype(jnp.int32), dma_tile, g, packed, scale)
