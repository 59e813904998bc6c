"""Public MXFP4-weight matmuls: input checks, grouped-tile metadata, custom_vjp wiring, the interpret flag.

    y = mxfp4_matmul(x, packed, scale)              x [M, K]; W logical torch [N, K]: packed [N, K/2], scale [N, K/32]
    y = mxfp4_gmm(x, packed, scale, group_sizes)    rows of x sorted by expert; packed [G, N, K/2], scale [G, N, K/32]

y = x @ dequant(W)ᵀ, fp32 accumulation, output in x.dtype (bfloat16 or float32). The weights are frozen storage:
the VJP gives dx = g @ dequant(W) and no cotangent for the uint8 arrays — grouped: by the transposed kernel over the
packed bytes (kernel.py, ``mxfp4_gmm_t_*``); dense: from the jnp reference (one matrix dequantized). Inside
``jax.shard_map`` the kernels' outputs declare the inputs' varying mesh axes (``ops.grouped_matmul.varying_struct``).
``act_quant="ceil"`` (or another rule) MXFP8-fake-quantizes x along K first (STE).

Per platform (``platform=``, default ``pallas_kernels.platform.target_platform()``): block sizes default to
``DEFAULT_BLOCKS[platform]``; on TPU both entry points run ``kernel.mxfp4_gmm_tpu`` (see kernel.py for its scale
layout), on GPU the loop schedule, on CPU (interpret mode) the grid / loop schedules.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops import mx
from k3jax.ops.grouped_matmul import match_varying, varying_axes
from pallas_kernels.mxfp4_matmul import cost as _cost
from pallas_kernels.mxfp4_matmul import kernel as _k
from pallas_kernels.mxfp4_matmul import kernel_t as _kt
from pallas_kernels.mxfp4_matmul import reference as _ref
from pallas_kernels.mxfp4_matmul.kernel import BlockSizes
from pallas_kernels.platform import target_platform

# (block_m, block_n, block_k) per platform. GPU / CPU: Triton-sized tiles (the CPU tests interpret them). TPU: bk/2 =
# 256 lanes and bn = 256 (multiples of 128); bk = 512 is the largest power of two dividing K = 3584 (w1 / w3) and
# K = 3072 (w2); bm = 256 rows: each row tile re-reads its expert's weights, so the weights' HBM bytes per call
# are T·N·K·17/32 for T ≈ M/bm tiles (cost.py) — at bm = 128 the forward plan's kernels read 3.8 GB of weights per
# call at K3's shapes, above the rows they multiply (experiments/LOG.md); VMEM at 256: ~6.5 MB of 16 MiB scoped.
DEFAULT_BLOCKS = {"cpu": (16, 128, 256), "gpu": (16, 128, 256), "tpu": (256, 256, 512)}


def check_inputs(x, packed, scale, *, grouped: bool) -> None:
    want_nd = 3 if grouped else 2
    if x.ndim != 2 or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x must be float32/bfloat16 [M, K], got {x.dtype} {x.shape}")
    if packed.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
        raise ValueError(f"packed and scale must be uint8, got packed {packed.dtype} {packed.shape} and "
                         f"scale {scale.dtype} {scale.shape}")
    K = x.shape[1]
    if packed.ndim != want_nd or packed.shape[-1] * 2 != K or not mx.is_mxfp4_pair(packed.shape, scale.shape):
        want = "[G, N, K/2] and [G, N, K/32]" if grouped else "[N, K/2] and [N, K/32]"
        raise ValueError(f"packed {packed.shape} / scale {scale.shape} do not match x {x.shape}; expected {want}")


def _fit(block: int, dim: int) -> int:
    """Largest power of two <= block dividing dim (tiles never straddle the N or K edge)."""
    while block > 1 and dim % block:
        block //= 2
    return block


def block_sizes(platform: str, M: int, N: int, K: int, block_m, block_n, block_k) -> BlockSizes:
    """Platform defaults for the unset sizes; n and k shrink to divide N and K; on TPU, Mosaic's tiling rules."""
    dm, dn, dk = DEFAULT_BLOCKS[platform]
    bm = block_m or dm
    if platform == "tpu" and block_m is None:  # small M: the next power of two >= M, at least 16 (bf16 tile)
        bm = min(bm, max(16, 1 << (max(M, 1) - 1).bit_length()))
    bn, bk = _fit(block_n or dn, N), _fit(block_k or dk, K)
    if platform == "tpu":  # a default that meets no Mosaic tiling (N = 160: bn = 32) takes the whole dim
        bn = N if block_n is None and bn % 128 else bn
        bk = K if block_k is None and (bk // 2) % 128 else bk
    if any(b & (b - 1) for b in (bm, bn, bk)) and platform != "tpu":
        raise ValueError(f"blocks must be powers of two off TPU (Triton), got ({bm}, {bn}, {bk})")
    bs = BlockSizes(bm, bn, bk)
    if platform == "tpu":
        ok_n = bs.block_n % 128 == 0 or bs.block_n == N
        ok_k = (bs.block_k // 2) % 128 == 0 or bs.block_k == K
        if bs.block_m % 16 or not ok_n or not ok_k:
            raise ValueError(f"TPU blocks need block_m % 16 == 0, block_n % 128 == 0 (or = N) and block_k/2 % 128 == "
                             f"0 (or block_k = K); got {bs} for N = {N}, K = {K}")
    return bs


def interpret_mode(interpret, *inputs):
    """``interpret=True``: the generic Pallas interpreter, or inside ``jax.shard_map`` (an input varies over a mesh
    axis) the TPU interpreter (``pltpu.InterpretParams()``): the generic one fails there ("dynamic_slice requires
    varying manual axes to match": its loop carry loses the varying axes), and the TPU one's ordered-IO callbacks
    cannot sit in a ``lax.platform_dependent`` branch beside one without them (the packed experts' "auto" path
    outside shard_map: "Lowering rule for `cond` returns incorrect set of output tokens"). False or an
    ``InterpretParams`` pass through."""
    if interpret is not True:
        return interpret
    return pltpu.InterpretParams() if any(varying_axes(a) for a in inputs) else True


def split_even_odd(x):
    """[M, K] -> (x[:, 0::2], x[:, 1::2]): the columns that meet low and high nibbles. Strided slices, not a reshape
    to [M, K/2, 2]: on TPU a minor dimension of 2 is a relayout, and the reshape form cost 3x the bytes (after the
    row gather, [85760, 3584] bf16: 7.35 GB against 2.43 GB with strided slices and a clipping gather;
    experiments/LOG.md, 2026-12-05 session 21)."""
    return x[:, 0::2], x[:, 1::2]


def interleave_columns(even, odd):
    """(columns 2j, columns 2j+1) [M, n] each → [M, 2n] (the inverse of ``split_even_odd``): two interior pads and
    a sum (x + 0 = x), which XLA:TPU fuses; the stack-and-reshape form relayouts a minor dimension of 2."""
    zero = jnp.zeros((), even.dtype)
    return (jax.lax.pad(even, zero, [(0, 0, 0), (0, 1, 1)]) + jax.lax.pad(odd, zero, [(0, 0, 0), (1, 0, 1)]))


def group_tile_metadata(group_sizes, num_rows: int, block_m: int):
    """Tile layout for rows sorted by group, each group padded to whole row tiles (plain jnp, no Pallas).

    Steps (G groups, M = num_rows, bm = block_m):
      1. starts[g] = first row of group g in x; tiles[g] = ceil(size_g / bm); tile_starts = exclusive cumsum.
      2. T = ceil(M / bm) + min(G, M) + 1 tiles (a static shape): at most min(G, M) groups are non-empty and each
         takes at most one partial tile, so ceil(M / bm) + min(G, M) bound sum(tiles) (few rows over many groups,
         decode's case, pad to far fewer than G tiles: 18 instead of 58 at 16 rows over 56 experts), and the last
         tile is always unused; tile t belongs to group tile_group[t] (-1 if t >= sum(tiles): the kernel skips it and
         writes zeros). Empty groups own no tile.
      3. padded row p = t*bm + q holds x row starts[g] + (t - tile_starts[g])*bm + q when that is inside group g,
         else M (padding: ``pad_rows`` fills it with any row; nothing reads its output)  ->  src_rows [T*bm].
      4. x row r (r < sum(sizes)) lands at dst_rows[r] = tile_starts[g(r)]*bm + r - starts[g(r)]; rows past the
         groups (valid_rows false) get T*bm, one past the padded rows: ``unpad_rows`` fills them with 0 (the
         kernels leave unused tiles unwritten, so no padded row is 0 to read).
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
    T = -(-num_rows // block_m) + min(G, num_rows) + 1
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
    dst_rows = jnp.where(valid_rows, tile_starts[g_of_r] * block_m + r - starts[g_of_r], T * block_m)
    return tile_group, src_rows, dst_rows, valid_rows


def layer_groups(tile_group, packed, scale, layer):
    """One layer of stacked expert weights: packed [L, G, N, K/2] / scale [L, G, N, K/32] and the layer's index
    (int32 scalar) → (tile_group with its used tiles' experts offset by layer·G, packed [L·G, N, K/2], the layer's
    scale [G, N, K/32], G). The packed bytes are read where they lie: merging the two leading dims is a bitcast (TPU
    tiles the two minor ones) and every kernel fetches weight blocks by a tile's expert id, so no copy of the layer's
    bytes is made (a slice fed to a kernel is one: XLA materialises a custom call's operands). The scales, 1/16 of
    the bytes, are sliced: the kernels read scale blocks at expert id mod G (``kernel.scale_block``). The TPU compiler
    stores the scale stacks with N minor (K/32 < 128 lanes), which is the TPU kernels' transposed view
    (``kernel.transposed_scales``), so the slice is one pass in the kernel's layout (in the [N, K/32] orientation it
    was relaid out again: ~1 GB more per chip and decode step on v5p-64). Read whole in place instead, the stacks
    were copied whole into VMEM before every call where they fit (v6e-256 decode: 28 GB per chip and step; 10.0 ms
    against 10.5 ms sliced on v5p-64, where they do not fit; experiments/LOG.md, 2026-12-07 session 33). Packed bytes
    whose minor dim is not a multiple of 128 lanes are sliced too. Unstacked weights (layer None) come back as they
    are. The kernels' grid choice takes ``groups`` = G (the last of the four)."""
    if layer is None:
        return tile_group, packed, scale, packed.shape[0]
    L, G = packed.shape[:2]
    one_scale = jax.lax.dynamic_index_in_dim(scale, layer, keepdims=False)
    if packed.shape[-1] % 128:
        # a minor dim off the 128 lanes (w2's F/2 over tensor 8: 192) is stored in another layout than the kernel's:
        # whole, the stacks would be relaid out outside the layer loop, all at once (+9 GB of temporaries in the 8K
        # prefill on v6e-64); a slice is relaid out one layer at a time
        return tile_group, jax.lax.dynamic_index_in_dim(packed, layer, keepdims=False), one_scale, G
    offset = jnp.asarray(layer, jnp.int32) * G
    return (jnp.where(tile_group >= 0, tile_group + offset, -1), packed.reshape(L * G, *packed.shape[2:]),
            one_scale, G)


def pad_rows(x, src_rows):
    """x [M, K] → its tile-padded rows [T·bm, K] (``group_tile_metadata``'s ``src_rows``) by one clipping gather:
    a padding row (index M) holds a copy of row M - 1. What a padding row holds is never read: the kernels' rows are
    independent, only ``dst_rows`` are gathered back, and rows past the groups read the unused last tile, which the
    kernels write as zeros whatever their input. So no zero row is appended to x (a copy of it) and no fill select
    runs over the padded rows (a second pass)."""
    return jnp.take(x, src_rows, axis=0, mode="clip")


def unpad_rows(y_pad, dst_rows):
    """Tile-padded rows [T·bm, n] → [M, n] by one gather: row r reads y_pad[dst_rows[r]], and a row past the groups
    (index T·bm, out of range) reads 0. The fill is the gather's own bounds select, in one pass; no padded row is
    read for it (an unused tile's rows are never written: the TPU grid does not visit them)."""
    return jnp.take(y_pad, dst_rows, axis=0, mode="fill", fill_value=0)


def charged_tiles(expected: tuple[float, float] | None, bm: int) -> float | None:
    """The used tiles the kernels' cost estimates charge: None (all the static tiles), or from (expected rows,
    expected non-empty groups) per call, ``cost.expected_tiles``."""
    return None if expected is None else _cost.expected_tiles(*expected, bm)


# ---------------------------------------------------------------------------------------------------------------
# grouped


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _gmm(x, packed, scale, group_sizes, bs: BlockSizes, platform: str, interpret: bool, expected=None):
    M = x.shape[0]
    tile_group, src_rows, dst_rows, _ = group_tile_metadata(group_sizes, M, bs.block_m)  # rows past: zeros
    xe, xo = split_even_odd(pad_rows(x, src_rows))
    launch = _k.mxfp4_gmm_tpu if platform == "tpu" else _k.mxfp4_gmm_loop
    y_pad = launch(tile_group, xe, xo, packed, scale, bs, interpret=interpret,
                   expected_tiles=charged_tiles(expected, bs.block_m))  # in x.dtype (fp32 accumulation)
    return unpad_rows(y_pad, dst_rows)  # rows past the groups: 0


def _gmm_fwd(x, packed, scale, group_sizes, bs, platform, interpret, expected):
    # x[:0]: no bytes, only x's type (its varying mesh axes inside shard_map) for the backward's match_varying
    return _gmm(x, packed, scale, group_sizes, bs, platform, interpret, expected), (packed, scale, group_sizes, x[:0])


def _gmm_bwd(bs, platform, interpret, expected, res, g):
    packed, scale, group_sizes, x_type = res
    dx = _gmm_t(g, packed, scale, group_sizes, bs, platform, interpret, expected)
    # inside shard_map with W's N split over a mesh axis (tensor-parallel expert F), each device's dx is a partial
    # sum over its N slice and varies along that axis where x does not: sum it there (what autodiff would do)
    return match_varying(dx, x_type), None, None, None  # uint8 storage and int sizes: no cotangent


def _gmm_t(g, packed, scale, group_sizes, bs: BlockSizes, platform: str, interpret, expected=None):
    """dx [M, K] = g [M, N] @ W_g [N, K] per group, by the transposed kernel over the packed bytes (the tile layout
    of the forward: the same row tiles, the weights re-read once per row tile); output in g.dtype."""
    M = g.shape[0]
    tile_group, src_rows, dst_rows, _ = group_tile_metadata(group_sizes, M, bs.block_m)  # rows past: zeros
    g_rows = pad_rows(g, src_rows)
    launch = _kt.mxfp4_gmm_t_tpu if platform == "tpu" else _kt.mxfp4_gmm_t_loop
    dxe, dxo = launch(tile_group, g_rows, packed, scale, bs, interpret=interpret,
                      expected_tiles=charged_tiles(expected, bs.block_m))  # in g.dtype
    return interleave_columns(unpad_rows(dxe, dst_rows), unpad_rows(dxo, dst_rows))  # past the groups: 0


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def mxfp4_gmm(x, packed, scale, group_sizes, *, block_m: int | None = None, block_n: int | None = None,
              block_k: int | None = None, act_quant: str | None = None, platform: str | None = None,
              interpret: bool = False, expected_rows: float | None = None, expected_groups: float | None = None):
    """Grouped MXFP4 matmul over experts (ragged groups; empty groups and partial tiles allowed).

    Args:
      x: [M, K] float32/bfloat16, rows sorted by expert.
      packed: uint8 [G, N, K/2]; scale: uint8 [G, N, K/32] (per-expert torch orientation, blocks along K).
      group_sizes: int [G], sum <= M; rows past the sum give zeros.
      block_m, block_n, block_k: tile sizes (powers of two; n and k shrink to divide N and K); None: the
        platform's ``DEFAULT_BLOCKS`` (on TPU block_m is capped near the rows per group, M / G).
      act_quant: None, or the MXFP8 scale rule to fake-quantize x with (blocks of 32 along K).
      platform: "cpu", "gpu" ("cuda", "rocm") or "tpu": which kernel and tiles; None = ``target_platform()``.
      interpret: run the chosen platform's kernel in a Pallas interpreter on CPU: True (the one that runs where the
        call is, ``interpret_mode``: inside ``shard_map`` the TPU interpreter), or your own ``pltpu.InterpretParams()``.
      expected_rows, expected_groups: the caller's expectation of sum(group_sizes) and of the non-empty groups per
        call (``cost.expected_load``), for the kernels' cost estimates only: they charge the expected used tiles
        (``cost.expected_tiles``) instead of the static grid. None: every static tile (groups default to
        min(rows, G) when only the rows are given).
    Returns: y [M, N] in x.dtype. Its VJP with respect to x is the transposed kernel (``_gmm_t``): no weight is
    dequantized outside a tile.
    """
    check_inputs(x, packed, scale, grouped=True)
    if group_sizes.shape != (packed.shape[0],):
        raise ValueError(f"group_sizes {group_sizes.shape} must be [G] = [{packed.shape[0]}]")
    if act_quant is not None:
        x = mx.fake_quant_mxfp8(x, axis=-1, rule=act_quant)
    platform = target_platform(platform)
    expected = expected_load_of(expected_rows, expected_groups, packed.shape[0])
    bs = block_sizes(platform, rows_per_group(x.shape[0], packed.shape[0], expected), packed.shape[1], x.shape[1],
                     block_m, block_n, block_k)
    return _gmm(x, packed, scale, group_sizes, bs, platform, interpret_mode(interpret, x, packed, scale), expected)


def rows_per_group(M: int, G: int, expected: tuple[float, float] | None) -> int:
    """The rows per group block_m follows on TPU (``block_sizes``): every group's rows are padded to whole tiles and
    the grid has ceil(M/bm) + min(G, M) + 1 of them, so decode's few rows per expert take small tiles, not 256 (B = 64
    over expert = 16: 1,024 rows on 56 local experts; at 256, 15,616 padded rows, 15x the real ones). Without an
    expectation the worst case's ceil(M / G); with the routing's (``expected_load_of``) its rows per used group:
    the tile-padded buffers shrink with bm (the B = 64 decode: 32-row tiles and 2,848 padded rows for 1,024 → 16 and
    1,936, its expected 1.6 rows per used expert; experiments/LOG.md, 2026-12-07). Any bm is exact: only the padding
    moves."""
    if expected is None or expected[1] <= 0:
        return -(-M // G)
    return max(1, math.ceil(expected[0] / expected[1]))


def expected_load_of(rows: float | None, groups: float | None, G: int) -> tuple[float, float] | None:
    """(expected rows, expected non-empty groups) or None; groups default to min(rows, G), their upper bound."""
    if rows is None:
        if groups is not None:
            raise ValueError("expected_groups needs expected_rows")
        return None
    if rows < 0 or (groups is not None and not 0 <= groups <= G):
        raise ValueError(f"expected_rows must be >= 0 and expected_groups in [0, G = {G}], got {rows}, {groups}")
    return float(rows), float(min(rows, G) if groups is None else groups)


# ---------------------------------------------------------------------------------------------------------------
# dense


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _matmul(x, packed, scale, bs: BlockSizes, schedule: str, platform: str, interpret: bool):
    if schedule == "loop":
        return _gmm(x, packed[None], scale[None], jnp.array([x.shape[0]], jnp.int32), bs, platform, interpret, None)
    M = x.shape[0]
    Mp = -(-M // bs.block_m) * bs.block_m
    xe, xo = split_even_odd(jnp.pad(x, ((0, Mp - M), (0, 0))))
    if platform == "tpu":  # one expert, every row tile used: no row gather; the static (megacore) grid
        tile_group = jnp.zeros((Mp // bs.block_m,), jnp.int32)
        y = _k.mxfp4_gmm_tpu(tile_group, xe, xo, packed[None], scale[None], bs, interpret=interpret, static_grid=True)
    else:
        y = _k.mxfp4_matmul_grid(xe, xo, packed, scale, bs, interpret=interpret)
    return y[:M].astype(x.dtype)


def _matmul_fwd(x, packed, scale, bs, schedule, platform, interpret):
    return _matmul(x, packed, scale, bs, schedule, platform, interpret), (packed, scale)


def _matmul_bwd(bs, schedule, platform, interpret, res, g):
    packed, scale = res
    dx = jnp.dot(g.astype(jnp.float32), _ref.dequantize_packed(packed, scale), precision=jax.lax.Precision.HIGHEST)
    return dx.astype(g.dtype), None, None  # y has x's dtype, so g does too


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def mxfp4_matmul(x, packed, scale, *, block_m: int | None = None, block_n: int | None = None,
                 block_k: int | None = None, schedule: str | None = None, act_quant: str | None = None,
                 platform: str | None = None, interpret: bool = False):
    """y [..., N] = x [..., K] @ dequant(W)ᵀ for one MXFP4 weight W (torch [N, K]: packed [N, K/2], scale [N, K/32]).

    ``schedule``: "grid" (grid (M/bm, N/bn, K/bk), reduction last; CPU / TPU) or "loop" (K loop inside the kernel;
    GPU, CPU). Default: "loop" on GPU, else "grid". On TPU "grid" is ``kernel.mxfp4_gmm_tpu`` with one expert and
    "loop" is refused (it hands the whole weight to the kernel as one block, which VMEM does not hold at K3 sizes).
    Other arguments as for ``mxfp4_gmm``.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    check_inputs(x2, packed, scale, grouped=False)
    platform = target_platform(platform)
    if schedule is None:
        schedule = "loop" if platform == "gpu" else "grid"
    if schedule not in ("grid", "loop") or (platform == "tpu" and schedule == "loop"):
        raise ValueError(f"schedule must be 'grid' or 'loop' ('grid' on TPU), got {schedule!r} for {platform}")
    if act_quant is not None:
        x2 = mx.fake_quant_mxfp8(x2, axis=-1, rule=act_quant)
    N, K = packed.shape[0], x2.shape[1]
    bs = block_sizes(platform, x2.shape[0], N, K, block_m, block_n, block_k)
    y = _matmul(x2, packed, scale, bs, schedule, platform, interpret_mode(interpret, x2, packed, scale))
    return y.reshape(*lead, N)
