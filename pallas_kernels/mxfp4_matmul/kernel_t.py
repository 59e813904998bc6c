"""The transposed MXFP4-weight kernels (the backward with respect to the rows): dx [M, K] = g [M, N] @ W_g [N, K],
contracting over N, in the loop (GPU) and TPU schedules of ``kernel``, whose tile math, grids (static / dynamic,
``kernel.static_tpu_grid``) and index maps they share. The outputs are dx's even and odd columns (the low / high
nibbles' columns), each [M, K/2].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops import mx
from k3jax.ops.grouped_matmul import varying_struct
from pallas_kernels.mxfp4_matmul import cost
from pallas_kernels.mxfp4_matmul.kernel import (
    BlockSizes,
    decode_tile,
    estimate,
    expand_scale,
    expand_scale_t_by_dot,
    k_lanes,
    resident_weights,
    row_tile,
    static_tpu_grid,
    tile_blocks,
    tpu_grid,
    tpu_params,
    transposed_scales,
    weight_rows,
    weight_specs,
)


def _tile_product_t(g, bytes_u8, scale):
    """Rows of the cotangent g [bm, bn] and one packed weight tile [bn, bk/2] with its fp32 scales -> the fp32
    partial products with the even and the odd columns of the tile, each [bm, bk/2]."""
    we, wo = decode_tile(bytes_u8, scale, g.dtype)
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
            scale = expand_scale(s_ref[grp % s_ref.shape[0], rows, ks])  # one layer's: ``kernel.scale_block``
            pe, po = _tile_product_t(g_ref[:, rows], p_ref[grp, rows, kh], scale)
            return acc[0] + pe, acc[1] + po

        zero = jnp.zeros(oe_ref.shape, jnp.float32)
        ae, ao = lax.fori_loop(0, nn, body, (zero, zero))
        oe_ref[...], oo_ref[...] = ae.astype(oe_ref.dtype), ao.astype(oo_ref.dtype)
    # an unused tile loads and writes nothing (``api.unpad_rows``)


def mxfp4_gmm_t_loop(tile_group, g, packed, scale, bs: BlockSizes, *, interpret,
                     expected_tiles: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Transposed grouped kernel, loop schedule: grid (tiles, K/bk), a fori_loop over N inside the kernel.

    Args:
      tile_group: int32 [T] expert id of each row tile of bm rows (-1 = unused).
      g: [T*bm, N] the tile-padded cotangent rows.
      packed: uint8 [G, N, K/2]; scale: uint8 [G, N, K/32].
    Returns: (dx_even, dx_odd) [T*bm, K/2] each in g's dtype (fp32 accumulation): dx's even and odd columns (the low
    / high nibbles' columns); an unused tile's rows are left unwritten. expected_tiles: as ``mxfp4_gmm_loop``.
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
        cost_estimate=estimate(cost.gmm_t_cost, "loop", Mp, bs, N, 2 * half, g.dtype.itemsize, expected_tiles),
        interpret=interpret,
        name="mxfp4_gmm_bwd_x",
    )(tile_group, g, packed, scale)


def _tpu_t_kernel(tile_group_ref, g_ref, p_ref, s_ref, oe_ref, oo_ref, scale_ref, ae_ref, ao_ref, *, bn: int,
                  bk: int, nn: int, nk: int, resident: bool):
    n, k = pl.program_id(1), pl.program_id(2)
    used = tile_group_ref[pl.program_id(0)] >= 0
    rows = weight_rows(n, bn, resident)

    @pl.when((n == 0) & (k == 0))
    def _init():
        ae_ref[...] = jnp.zeros(ae_ref.shape, ae_ref.dtype)
        ao_ref[...] = jnp.zeros(ao_ref.shape, ao_ref.dtype)

    @pl.when(used & (k == 0))
    def _expand():
        scale_ref[...] = expand_scale_t_by_dot(s_ref[:, rows])

    @pl.when(used)
    def _compute():
        kh = k_lanes(k, bk, nk)
        pe, po = _tile_product_t(g_ref[...], p_ref[rows, kh if resident else slice(None)], scale_ref[:, kh])
        ae_ref[:, kh] += pe
        ao_ref[:, kh] += po

    @pl.when((n == nn - 1) & (k == nk - 1))
    def _write():  # the tile's last step, after its _compute
        oe_ref[...] = ae_ref[...].astype(oe_ref.dtype)
        oo_ref[...] = ao_ref[...].astype(oo_ref.dtype)


def mxfp4_gmm_t_tpu(tile_group, g, packed, scale, bs: BlockSizes, *, interpret,
                    expected_tiles: float | None = None, static_grid: bool | None = None,
                    groups: int | None = None, resident: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Transposed grouped kernel, TPU schedule: grid (tiles, N/bn, K/bk), both reductions' axes sequential.

    The output blocks are a row tile's whole dx halves [bm, K/2] (index (t, 0): resident across n and k, summed in
    fp32 VMEM scratch from the tile's first step and written in g's dtype at its last), so each weight block [bn,
    bk/2] is fetched once per row tile (resident: each expert once per run of its tiles), the cotangent block [bm,
    bn] once per (tile, n), and the scale block (K/32, bn) once per (tile, n) and spread into the fp32 scratch at k
    == 0 as in ``mxfp4_gmm_tpu`` (the same Mosaic constraint). The two grids as there (``static_grid``): the dynamic
    one visits the used tiles only and leaves the other rows unwritten, the static one splits the tiles over a
    megacore's two cores (N and K are reductions here: "arbitrary") and writes zeros for unused tiles. Args and
    returns as ``mxfp4_gmm_t_loop``; used tiles must come first. ``groups``, ``resident``: as
    ``kernel.mxfp4_gmm_tpu``'s (a flattened stack of layers; each expert's weights resident in VMEM, sliced per (n,
    k) step).
    """
    Mp, N = g.shape
    G, _, half = packed.shape
    G = G if groups is None else groups
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    nn, nk = N // bn, 2 * half // bk
    extent, semantics, static = tpu_grid(tile_group, G, static_grid, True, interpret)
    T = Mp // bm if static else None  # row_tile
    # the grid the shapes ask for (the TPU interpreter inside shard_map runs a decode call on the static grid too)
    res = resident_weights(N, half, static_tpu_grid(tile_group.shape[0], G) if static_grid is None else static_grid,
                           resident)

    def g_map(t, n, k, tg):
        return row_tile(t, tg, T), tile_blocks(t, n, k, tg)[1]

    out_block = pl.BlockSpec((bm, half), lambda t, n, k, tg: (t, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(extent, nn, nk),
        in_specs=[
            pl.BlockSpec((bm, bn), g_map),
            *weight_specs(bn, bk, N, half, scale.shape[-1], scale.shape[0], res, lambda n, k: (n, k)),
        ],
        out_specs=(out_block, out_block),
        scratch_shapes=[pltpu.VMEM((bn, half), jnp.float32), pltpu.VMEM((bm, half), jnp.float32),
                        pltpu.VMEM((bm, half), jnp.float32)],
    )
    out = varying_struct((Mp, half), g.dtype, tile_group, g, packed, scale)
    return pl.pallas_call(
        functools.partial(_tpu_t_kernel, bn=bn, bk=bk, nn=nn, nk=nk, resident=res),
        out_shape=(out, out),
        grid_spec=grid_spec,
        compiler_params=tpu_params(semantics, res),
        cost_estimate=estimate(cost.gmm_t_cost, "tpu", Mp, bs, N, 2 * half, g.dtype.itemsize, expected_tiles, static,
                               groups=G if res else None),
        interpret=interpret,
        name="mxfp4_gmm_tpu_bwd_x",
    )(tile_group.astype(jnp.int32), g, packed, transposed_scales(scale))
