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
    tile reads its expert id from ``tile_group`` (-1 = unused tile: loads and writes nothing; a Triton grid is
    static, so its program still starts and reads one int);
  * ``tpu``: grid (tiles, N/bn, K/bk), reduction last, the expert id of each row tile scalar-prefetched into SMEM and
    read by the weight index maps (dense = one expert). Two grids, chosen at trace time (``static_tpu_grid``):
    when experts dominate (decode) the tile axis has a dynamic extent, the number of used tiles (``visited_tiles``):
    a chip's few rows reach ~1 of its experts, and the static grid's unused tiles would each cost (N/bn)·(K/bk)
    pipeline steps; when row tiles dominate (training) the static grid over all tiles, whose "parallel" tile axis a
    megacore chip splits over its two TensorCores (a dynamic axis cannot be "parallel"). Mosaic wants the last
    two block dims divisible by (8, 128) or equal to the array's, and a scale block (bn, bk/32) meets neither for K3
    (bk/32 = 16 of K/32 = 112 at K = 3584; bk ≥ 4096 does not divide 3584). So the scale block spans the whole K/32
    (fetched once per (tile, j)) and at k == 0 the kernel spreads it into a VMEM scratch [bn, K/2] of fp32 scales
    (``expand_scale_t_by_dot``); each k step then reads the scratch at lane offset k·bk/2, a multiple of 128 (a dynamic
    lane offset of k·bk/32 into the uint8 block is what Mosaic rejects: "cannot statically prove that index in
    dimension 1 is a multiple of 128"). The TPU kernels take the scales transposed, [G, K/32, N] (the wrappers swap
    the last two axes; the block is (K/32, bn) at index (g, 0, j)): the TPU compiler stores a [.., N, K/32] uint8
    array with N as its minor dimension (K/32 = 112 < 128 lanes), so the swap is that storage read as it lies. In the
    [N, K/32] orientation each layer's scales sliced from a stack were relaid out once more before every call (~1 GB
    per chip and decode step of kimi-k3 on v5p-64; experiments/LOG.md, 2026-12-07 session 33).
    The row blocks are a tile's whole x halves [bm, K/2] (index (t, 0)), sliced at the same lane offsets: each row
    tile is fetched once, not once per column tile (at K3's shapes that was 12-14x the rows' bytes, 2 of the
    forward plan's 3.3 TB of kernel traffic per chip; experiments/LOG.md).

The transposed kernels (dx = g @ W_g, the backward with respect to the rows) are in ``kernel_t``.
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
from k3jax.ops.grouped_matmul import varying_axes, varying_struct
from pallas_kernels.mxfp4_matmul import cost

SCALE_GROUP_BYTES = mx.BLOCK_SIZE // 2  # the packed bytes of one scale block (16: two codes per byte)
# the TPU grids' (tiles, N/bn, K/bk) axes, per grid (``static_tpu_grid``). The dynamic grid's tile extent is the
# used tiles (``visited_tiles``), so its tile axis is "arbitrary" (as megablox's num_active_tiles): a "parallel" axis
# must be static (the TPU interpreter refuses a dynamic one) and the parallel axes a prefix of the grid, so none is
# parallel and a megacore chip (v5p) runs the call on one of its two TensorCores. The static grid visits every tile
# and splits the tiles (forward: and the column tiles) over the cores; the transposed kernel's N axis is a reduction.
TPU_SEMANTICS = {"dynamic": ("arbitrary", "arbitrary", "arbitrary"),
                 "static": ("parallel", "parallel", "arbitrary"),
                 "static_t": ("parallel", "arbitrary", "arbitrary")}


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


def estimate(fn, schedule: str, rows: int, bs: BlockSizes, N: int, K: int, itemsize: int,
              expected_tiles: float | None = None, static_grid: bool = False,
              groups: int | None = None) -> pl.CostEstimate:
    """The ``pl.CostEstimate`` of one call (cost.py): ``rows`` = T·bm padded rows (the static grid), charged as
    ``cost.charged_cost`` says: every tile, or ``expected_tiles`` of them (the caller's routing expectation).
    ``groups``: the experts of a call whose weights stay resident (``resident_weights``), None: blocked."""
    c = cost.charged_cost(fn, schedule, rows // bs.block_m, expected_tiles, bs.block_m, bs.block_n, bs.block_k, N, K,
                          itemsize, static_grid=static_grid, resident_groups=groups)
    return pl.CostEstimate(flops=c["flops"], transcendentals=0, bytes_accessed=c["bytes_accessed"])


def expand_scale(scale_u8):
    """Scale bytes [bn, n] -> fp32 scales [bn, 16 n], one per packed byte (from the bit pattern, never exp2)."""
    bn, n = scale_u8.shape
    scale = mx.e8m0_to_float(scale_u8)
    return jnp.broadcast_to(scale[:, :, None], (bn, n, SCALE_GROUP_BYTES)).reshape(bn, n * SCALE_GROUP_BYTES)


def expand_scale_t_by_dot(scale_t_u8):
    """``expand_scale`` of transposed scale bytes [n, bn] (the TPU kernels' orientation) as one matmul with a 0/1
    matrix E[s, c] = (c // 16 == s), contracting the bytes' first axis (Mosaic compiles the transposed left
    operand): [n, bn]ᵀ @ [n, 16 n] → fp32 [bn, 16 n]. Scales already decoded (float powers of two) are taken too.

    For the TPU kernel, where the broadcast + reshape of a whole-K scale block needs more scoped VMEM than the
    default 16 MiB (measured: 19.6 MiB at bn = 256, K = 3584) and unrolling it over static slices took 9 s to
    compile. Exact: each output is one scale times 1, and scales (powers of two) and E are exact in bf16, with fp32
    accumulation; only the subnormal 2^-127 (scale byte 0) may be flushed to 0 by the MXU.
    """
    n = scale_t_u8.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (n, n * SCALE_GROUP_BYTES), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n * SCALE_GROUP_BYTES), 1)
    spread = jnp.where(rows == cols // SCALE_GROUP_BYTES, 1.0, 0.0).astype(jnp.bfloat16)
    decoded = scale_t_u8 if jnp.issubdtype(scale_t_u8.dtype, jnp.floating) else mx.e8m0_to_float(scale_t_u8)
    scale = decoded.astype(jnp.bfloat16)
    return lax.dot_general(scale, spread, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def decode_tile(bytes_u8, scale, dtype):
    """Packed bytes [bn, bk/2] + their fp32 scales [bn, bk/2] -> (even, odd) weight tiles [bn, bk/2] in ``dtype``.

    fp4 x 2^e is exact in fp32 and bf16 (unless subnormal), so the cast to the matmul dtype loses nothing. The bytes
    are widened to int32 before any bit op (Mosaic has no 8-bit vector arithmetic).
    """
    b = bytes_u8.astype(jnp.int32)
    # E2M1 code -> value by arithmetic (no table lookups in the kernel); low nibble = even column
    return (mx.e2m1_decode(b & 15) * scale).astype(dtype), (mx.e2m1_decode(b >> 4) * scale).astype(dtype)


def tile_dot(xe, xo, we, wo):
    """x halves [bm, bk/2] times decoded weight halves [bn, bk/2] (``decode_tile``) -> fp32 [bm, bn]."""
    precision = lax.Precision.HIGHEST if xe.dtype == jnp.float32 else None
    dims = (((1,), (1,)), ((), ()))
    out = lax.dot_general(xe, we, dims, precision=precision, preferred_element_type=jnp.float32)
    return out + lax.dot_general(xo, wo, dims, precision=precision, preferred_element_type=jnp.float32)


def tile_product(xe, xo, bytes_u8, scale):
    """x halves [bm, bk/2], one packed weight tile and its fp32 scales -> fp32 [bm, bn] partial product."""
    return tile_dot(xe, xo, *decode_tile(bytes_u8, scale, xe.dtype))


def _grid_kernel(xe_ref, xo_ref, p_ref, s_ref, o_ref):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    o_ref[...] += tile_product(xe_ref[...], xo_ref[...], p_ref[...], expand_scale(s_ref[...]))


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
        cost_estimate=estimate(cost.gmm_cost, "grid", M, bs, N, 2 * half, xe.dtype.itemsize),
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
            scale = expand_scale(s_ref[g % s_ref.shape[0], rows, ks])  # scales of one layer: ``scale_block``
            return acc + tile_product(xe_ref[:, kh], xo_ref[:, kh], p_ref[g, rows, kh], scale)

        o_ref[...] = lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.float32)).astype(o_ref.dtype)
    # an unused tile (g < 0) loads and writes nothing: its output rows stay unwritten (``api.unpad_rows``)


def mxfp4_gmm_loop(tile_group, xe, xo, packed, scale, bs: BlockSizes, *, interpret: bool,
                   expected_tiles: float | None = None) -> jax.Array:
    """Grouped kernel, loop schedule.

    Args:
      tile_group: int32 [T] expert id of each row tile of bm rows (-1 = unused).
      xe, xo: [T*bm, K/2] even / odd columns of the tile-padded rows.
      packed: uint8 [G, N, K/2]; scale: uint8 [G, N, K/32].
    Returns: [T*bm, N] in x's dtype (fp32 accumulation); an unused tile's rows are left unwritten.
    expected_tiles: the used tiles the cost estimate charges (None: all T; ``cost.charged_cost``).
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
        cost_estimate=estimate(cost.gmm_cost, "loop", Mp, bs, N, 2 * half, xe.dtype.itemsize, expected_tiles),
        interpret=interpret,
        name="mxfp4_gmm_fwd",
    )(tile_group, xe, xo, packed, scale)


def k_lanes(k, bk: int, nk: int):
    """The lanes [k·bk/2, (k+1)·bk/2) of a whole-K/2 VMEM buffer: a dynamic slice at a multiple of bk/2 (of 128 when
    there are several k steps, ``api.block_sizes``), or all of it (static) when bk = K: Mosaic cannot prove a dynamic
    offset aligned when bk/2 is not a multiple of 128 (k3-mini: K = 192)."""
    return slice(None) if nk == 1 else pl.ds(pl.multiple_of(k * (bk // 2), bk // 2), bk // 2)


def static_tpu_grid(tiles: int, groups: int) -> bool:
    """Which grid the TPU kernels run, chosen at trace time from the static shapes: True = the static grid over all
    T tiles, its tile axis "parallel" (a megacore chip splits it over its two TensorCores); False = the dynamic grid
    over the used tiles only (``visited_tiles``), every axis "arbitrary" (one core). T = ceil(M/bm) + min(G, M) + 1
    (``api.group_tile_metadata``), of which at most ceil(M/bm) + min(G, M) are used. When the row tiles dominate,
    ceil(M/bm) > 2·G (training: all but <= G + 1 of the tiles are used), skipping the few unused tiles saves less
    than the second core gives; when the experts dominate (decode: a chip's few rows over many experts, ~1 tile used
    of G + 2) the skipped tiles are the call."""
    return tiles - groups - 1 > 2 * groups


def visited_tiles(tile_group):
    """The dynamic TPU grid's extent over row tiles: the used ones (group >= 0; they come first), at least one.
    Tiles past them are never visited: no DMA, no compute, no write (their output rows stay unwritten, and
    ``api.unpad_rows`` reads none of them). With no tile used the one visit is tile 0 at group -1 (``tile_blocks``)."""
    return jnp.maximum(jnp.sum((tile_group >= 0).astype(jnp.int32)), 1)


def tile_blocks(t, mid, k, tg):
    """(expert, middle, k) block indices of weights and scales at grid step (t, mid, k): a used tile's own, and for
    an unused tile the same block (0, 0, 0) at every step, so the unused tiles together fetch one block (the static
    grid visits them all, the dynamic one only tile 0 when no tile is used)."""
    on = tg[t] >= 0
    return jnp.maximum(tg[t], 0), jnp.where(on, mid, 0), jnp.where(on, k, 0)


def scale_block(blocks, groups: int):
    """The block of the transposed scales [G, K/32, N] that weight block (expert, middle, k) reads: (expert mod
    ``groups``, 0, middle) — the whole K/32 of one expert. Scales come one layer at a time while the packed bytes of
    a stack of layers come flattened, [L·G, N, K/2], addressed by expert ids offset by layer·G (``api.layer_groups``):
    the modulus takes such an id back to the layer's own expert; for unstacked weights (ids < G) it changes
    nothing."""
    return blocks[0] % groups, 0, blocks[1]


def row_tile(t, tg, tiles: int | None):
    """The row block of grid tile t on the static grid (``tiles`` = T): its own, or for an unused tile the last tile
    (T - 1, never used), the same for all of them, so the unused tiles fetch one row block between them. The dynamic
    grid (``tiles`` None) visits an unused tile only when none is used: t itself."""
    return t if tiles is None else jnp.where(tg[t] >= 0, t, tiles - 1)


def interpreter_needs_static_grid(tile_group, interpret) -> bool:
    """True under the TPU interpreter (``pltpu.InterpretParams``, what ``api.interpret_mode`` picks inside
    ``jax.shard_map``) when tile_group varies over mesh axes: the interpreter runs a dynamic grid as a loop whose
    bound (here the used-tile count) varies, so every ``pl.program_id`` and index-map argument varies too, and any
    op mixing one with an unvarying value (``k == 0`` in the body, ``jnp.where(tg[t] >= 0, ...)`` in an index map)
    fails JAX's check ("Primitive eq requires varying manual axes to match"; a 20-line pallas_call with grid
    (n[0],) and ``pl.when(pl.program_id(0) == 0)`` in shard_map repeats it). Such calls run the static grid: the
    same bits for the used tiles. Compiled kernels are unaffected (Mosaic lowers the traced, unvarying jaxprs)."""
    return isinstance(interpret, pltpu.InterpretParams) and bool(varying_axes(tile_group))


def tpu_grid(tile_group, groups: int, static_grid: bool | None, transposed: bool, interpret):
    """(tile extent, dimension_semantics, static?) of a TPU call: ``static_grid`` None = ``static_tpu_grid``; the
    static grid always where ``interpreter_needs_static_grid``."""
    T = tile_group.shape[0]
    static = static_tpu_grid(T, groups) if static_grid is None else static_grid
    if not static and not interpreter_needs_static_grid(tile_group, interpret):
        return visited_tiles(tile_group), TPU_SEMANTICS["dynamic"], False
    return T, TPU_SEMANTICS["static_t" if transposed else "static"], True


# Resident expert weights (``resident_weights``): a tile's whole packed expert [N, K/2] (and its scales [N, K/32]) is
# one block, indexed by the expert alone, so consecutive row tiles of one expert fetch it once between them and the
# kernel slices its (j, k) sub-block in VMEM. Blocked, a [bn, bk/2] weight block changes every grid step and each row
# tile re-reads its expert's weights whole: T·N·K/2 bytes against G·N·K/2 (training: T = 335 row tiles over G = 14
# experts per call at K3's v5p-512 frozen step, where weights were ~60% of the kernels' HBM bytes; experiments/LOG.md).
# Only the static grid (row tiles dominate: training, prefill) keeps them: on the dynamic grid (decode) a used tile
# reads its expert's weights once either way, and the visit it makes when no tile is used would fetch a whole expert
# instead of one block. An expert fits when its packed bytes are at most ``RESIDENT_EXPERT_BYTES``; the call then
# asks Mosaic for ``RESIDENT_VMEM_LIMIT`` of scoped VMEM (default 16 MiB on v5p; the block is double-buffered; v5p
# has 64 MiB of VMEM per core, v6e 128 MiB: jax._src.tpu_info).
RESIDENT_EXPERT_BYTES = 8 * 1024 * 1024
RESIDENT_VMEM_LIMIT = 48 * 1024 * 1024


def resident_weights(N: int, half: int, static: bool, resident: bool | None = None) -> bool:
    """Whether a TPU call whose shapes ask for the static grid or not (``static``: ``static_tpu_grid``, or the
    caller's ``static_grid``) keeps each expert's packed weights [N, K/2 = half] resident (the comment above);
    ``resident``: force it (tests), None: on the static grid when they fit."""
    return static and N * half <= RESIDENT_EXPERT_BYTES if resident is None else resident


def weight_specs(bn: int, bk: int, N: int, half: int, scale_rows: int, groups_of_scale: int, resident: bool, order):
    """(packed, transposed scale) BlockSpecs of a TPU call whose grid step (t, a, b, tg) maps to weight block (expert,
    middle = the N block, k) through ``order(a, b) -> (middle, k)``: blocked [bn, bk/2] / [K/32, bn], or resident
    [N, K/2] / [K/32, N] at (expert, 0, 0)."""
    def blocks(t, a, b, tg):
        return tile_blocks(t, *order(a, b), tg)

    if resident:
        return (pl.BlockSpec((None, N, half), lambda t, a, b, tg: (blocks(t, a, b, tg)[0], 0, 0)),
                pl.BlockSpec((None, scale_rows, N),
                             lambda t, a, b, tg: (scale_block(blocks(t, a, b, tg), groups_of_scale)[0], 0, 0)))
    return (pl.BlockSpec((None, bn, bk // 2), blocks),
            pl.BlockSpec((None, scale_rows, bn),        # whole K/32: see the module docstring
                         lambda t, a, b, tg: scale_block(blocks(t, a, b, tg), groups_of_scale)))


def weight_rows(mid, bn: int, resident: bool):
    """The rows of the weight block (the columns of the transposed scale block) a step reads: the N block ``mid`` of
    a resident expert, or all of a blocked one."""
    return pl.ds(pl.multiple_of(mid * bn, bn), bn) if resident else slice(None)


def transposed_scales(scale):
    """[G, N, K/32] scale bytes → the TPU kernels' [G, K/32, N] (module docstring)."""
    return jnp.swapaxes(scale, 1, 2)


def tpu_params(semantics, resident: bool):
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                **({"vmem_limit_bytes": RESIDENT_VMEM_LIMIT} if resident else {}))


def _tpu_kernel(tile_group_ref, xe_ref, xo_ref, p_ref, s_ref, o_ref, scale_ref, acc_ref, *, bn: int, bk: int,
                nk: int, resident: bool):
    j, k = pl.program_id(1), pl.program_id(2)
    used = tile_group_ref[pl.program_id(0)] >= 0
    rows = weight_rows(j, bn, resident)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    @pl.when(used & (k == 0))
    def _expand():
        scale_ref[...] = expand_scale_t_by_dot(s_ref[:, rows])

    @pl.when(used)
    def _compute():
        kh = k_lanes(k, bk, nk)
        acc_ref[...] += tile_product(xe_ref[:, kh], xo_ref[:, kh], p_ref[rows, kh if resident else slice(None)],
                                     scale_ref[:, kh])

    @pl.when(k == nk - 1)
    def _write():  # after the last k step's _compute (the pl.when blocks run in program order)
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def mxfp4_gmm_tpu(tile_group, xe, xo, packed, scale, bs: BlockSizes, *, interpret: bool,
                  expected_tiles: float | None = None, static_grid: bool | None = None,
                  groups: int | None = None, resident: bool | None = None) -> jax.Array:
    """Grouped kernel, TPU schedule (also the dense kernel on TPU: one expert, every tile used).

    Args as ``mxfp4_gmm_loop``; used tiles must come first (as ``api.group_tile_metadata`` lays them out). Needs
    bm % 16 == 0 (bf16 sublane tiling), bn % 32 == 0 (uint8 tiling) and bk/2 % 128 == 0 (``api`` checks). Two grids
    (``static_grid``; None: ``static_tpu_grid`` from T and G): the dynamic one visits only the used tiles
    (``visited_tiles``) and leaves the other tiles' output rows unwritten; the static one visits every tile with
    the tile and column axes "parallel" (megacore), and an unused tile fetches nothing new (``tile_blocks``,
    ``row_tile``) and writes zeros. The used tiles' outputs are the same bits in both. Accumulates in an fp32 VMEM
    scratch; returns [T*bm, N] in x's dtype. ``expected_tiles``: the used tiles the cost estimate charges (None:
    all T; ``cost.charged_cost``). ``groups``: the experts of one layer when ``packed`` / ``scale`` are a stack of
    layers flattened to [L·G, ...] (``api.layer_groups``; the grid's choice counts one layer's), None: G.
    ``resident``: keep each expert's weights resident in VMEM (``resident_weights``; None: on the static grid when
    they fit).
    """
    Mp, half = xe.shape
    G, N, _ = packed.shape
    G = G if groups is None else groups
    bm, bn, bk = bs.block_m, bs.block_n, bs.block_k
    nj, nk = N // bn, 2 * half // bk
    extent, semantics, static = tpu_grid(tile_group, G, static_grid, False, interpret)
    T = Mp // bm if static else None  # row_tile
    # the grid the shapes ask for (the TPU interpreter inside shard_map runs a decode call on the static grid too)
    res = resident_weights(N, half, static_tpu_grid(tile_group.shape[0], G) if static_grid is None else static_grid,
                           resident)

    def x_map(t, j, k, tg):  # a row tile's whole K/2: resident across j and k, fetched once per tile
        return row_tile(t, tg, T), 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(extent, nj, nk),
        in_specs=[
            pl.BlockSpec((bm, half), x_map),
            pl.BlockSpec((bm, half), x_map),
            *weight_specs(bn, bk, N, half, scale.shape[-1], scale.shape[0], res, lambda j, k: (j, k)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda t, j, k, tg: (t, j)),
        scratch_shapes=[pltpu.VMEM((bn, half), jnp.float32), pltpu.VMEM((bm, bn), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_tpu_kernel, bn=bn, bk=bk, nk=nk, resident=res),
        out_shape=varying_struct((Mp, N), xe.dtype, tile_group, xe, xo, packed, scale),
        grid_spec=grid_spec,
        compiler_params=tpu_params(semantics, res),
        cost_estimate=estimate(cost.gmm_cost, "tpu", Mp, bs, N, 2 * half, xe.dtype.itemsize, expected_tiles, static,
                               groups=G if res else None),
        interpret=interpret,
        name="mxfp4_gmm_tpu_fwd",
    )(tile_group.astype(jnp.int32), xe, xo, packed, transposed_scales(scale))
