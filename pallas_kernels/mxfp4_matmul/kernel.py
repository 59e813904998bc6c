"""pallas_call bodies for the MXFP4-weight matmul (SPEC §10.8) and the BlockSizes dataclass.

Weights stay packed in memory: per tile the kernel loads bytes [bn, bk/2] and scale bytes [bn, bk/32] and decodes
them in registers. The contraction is split into even and odd columns, because the low nibble of byte j is column 2j
and the high nibble column 2j+1 (SPEC §10.3): with x_even = x[:, 0::2], x_odd = x[:, 1::2] (split once outside),

    y_tile += x_even_tile @ decode(lo)ᵀ + x_odd_tile @ decode(hi)ᵀ        (fp32 accumulation)

so no nibble interleave is needed in the kernel. Each group of 16 bytes along K shares one scale byte.

Two schedules share the tile math:
  * ``grid``: grid (M/bm, N/bn, K/bk), reduction axis last, the fp32 output block stays resident across k and is
    zeroed at k == 0 (the TPU-style pipeline of SPEC §10.8; also what interpret mode runs by default);
  * ``loop``: grid (tiles, N/bn) and a fori_loop over K inside the kernel. A GPU (Triton) grid has no sequential
    reduction axis, so this is the schedule for GPUs; it is also the grouped (per-expert) kernel, where each row
    tile reads its expert id from ``tile_group`` (-1 = unused tile: writes zeros, loads no weights).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from k3jax.ops import mx

SCALE_GROUP_BYTES = 16  # 32 elements per scale = 16 packed bytes


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (powers of two for Triton). bm rows of x, bn output features, bk contraction (multiple of 32)."""

    block_m: int = 16
    block_n: int = 128
    block_k: int = 256

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"{name} must be a positive power of two, got {v}")
        if self.block_k < 32:
            raise ValueError(f"block_k must be >= 32 (one scale block), got {self.block_k}")


def _decode_tile(bytes_u8, scale_u8, dtype):
    """Packed bytes [bn, bk/2] + scale bytes [bn, bk/32] -> (even, odd) weight tiles [bn, bk/2] in ``dtype``.

    fp4 x 2^e is exact in fp32 and bf16 (unless subnormal), so the cast to the matmul dtype loses nothing.
    """
    bn, half = bytes_u8.shape
    b = bytes_u8.astype(jnp.int32)
    scale = mx.e8m0_to_float(scale_u8)  # [bn, bk/32] float32, from the bit pattern
    scale = jnp.broadcast_to(scale[:, :, None], (bn, half // SCALE_GROUP_BYTES, SCALE_GROUP_BYTES)).reshape(bn, half)
    # E2M1 code -> value by arithmetic (no table lookups in the kernel); low nibble = even column
    return (mx.e2m1_decode(b & 15) * scale).astype(dtype), (mx.e2m1_decode(b >> 4) * scale).astype(dtype)


def _tile_product(xe, xo, bytes_u8, scale_u8):
    """x halves [bm, bk/2] and one packed weight tile -> fp32 [bm, bn] partial product."""
    we, wo = _decode_tile(bytes_u8, scale_u8, xe.dtype)
    precision = lax.Precision.HIGHEST if xe.dtype == jnp.float32 else None
    dims = (((1,), (1,)), ((), ()))
    out = lax.dot_general(xe, we, dims, precision=precision, preferred_element_type=jnp.float32)
    return out + lax.dot_general(xo, wo, dims, precision=precision, preferred_element_type=jnp.float32)


def _grid_kernel(xe_ref, xo_ref, p_ref, s_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    o_ref[...] += _tile_product(xe_ref[...], xo_ref[...], p_ref[...], s_ref[...])


def mxfp4_matmul_grid(xe, xo, packed, scale, bs: BlockSizes, *, interpret: bool) -> jax.Array:
    """Dense kernel, grid schedule. xe, xo [M, K/2] (M % bm == 0); packed [N, K/2]; scale [N, K/32] -> fp32 [M, N]."""
    M, half = xe.shape
    N = packed.shape[0]
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    grid = (M // bm, N // bn, 2 * half // bk)
    return pl.pallas_call(
        _grid_kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        grid=grid,
        in_specs=[
            pl.BlockSpec((bm, bk // 2), lambda i, j, k: (i, k)),
            pl.BlockSpec((bm, bk // 2), lambda i, j, k: (i, k)),
            pl.BlockSpec((bn, bk // 2), lambda i, j, k: (j, k)),
            pl.BlockSpec((bn, bk // 32), lambda i, j, k: (j, k)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
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
            ks = pl.ds(k * (bk // 32), bk // 32)
            return acc + _tile_product(xe_ref[:, kh], xo_ref[:, kh], p_ref[g, rows, kh], s_ref[g, rows, ks])

        o_ref[...] = lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.float32))

    @pl.when(g < 0)
    def _unused():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def mxfp4_gmm_loop(tile_group, xe, xo, packed, scale, bs: BlockSizes, *, interpret: bool) -> jax.Array:
    """Grouped kernel, loop schedule.

    Args:
      tile_group: int32 [T] expert id of each row tile of bm rows (-1 = unused).
      xe, xo: [T*bm, K/2] even / odd columns of the tile-padded rows.
      packed: uint8 [G, N, K/2]; scale: uint8 [G, N, K/32].
    Returns: fp32 [T*bm, N].
    """
    Mp, half = xe.shape
    _, N, _ = packed.shape
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    kernel = functools.partial(_loop_kernel, bn=bn, bk=bk, nk=2 * half // bk)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, N), jnp.float32),
        grid=(Mp // bm, N // bn),
        in_specs=[
            pl.BlockSpec(tile_group.shape, lambda i, j: (0,)),
            pl.BlockSpec((bm, half), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, half), lambda i, j: (i, 0)),
            pl.BlockSpec(packed.shape, lambda i, j: (0, 0, 0)),  # whole stack; the kernel indexes [g, rows, k]
            pl.BlockSpec(scale.shape, lambda i, j: (0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        name="mxfp4_gmm_fwd",
    )(tile_group, xe, xo, packed, scale)
