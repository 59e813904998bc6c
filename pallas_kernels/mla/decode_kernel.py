"""pallas_calls of the absorbed MLA decode kernel (README_decode.md): split-KV partial sums over the latent cache.

Every schedule computes, for one batch row b, one split s of its real key blocks and a tile of query rows (the T·N
(token, head) pairs flattened to M rows, row t·N + n), the unnormalised online-softmax state

    s_mj = scale · (q̃_m · c_j + q^R_m · k^R_j)      for the split's keys j with j <= limit_m, else -inf
    m_m  = max_j s_mj (finfo.min when the split holds no key of the row),   l_m = Σ_j exp(s_mj - m_m)
    õ_m  = Σ_j exp(s_mj - m_m) c_j   [R]

with limit_m = min(q_pos[b, t], kv_len[b] - 1) (a column input, computed by the caller). The split of a row is
data-dependent, FlashMLA style: the row's real blocks n_blocks[b] = ceil(keys / block_kv) are dealt out to the
``num_splits`` splits in contiguous runs of ceil(n_blocks[b] / num_splits) blocks, so a short row's work is spread
over all splits and blocks at or beyond its keys are never read. Splits past the end get no block (m = finfo.min,
l = 0, õ = 0, which the combine weighs by exactly 0).

Caches enter stacked, c_kv [L, B, S, R] and k_rope [L, B, S, Hr] (an unstacked cache is the L = 1 reshape, free),
with the layer as an int32 [1] array: the kernels read the layer's blocks in place, never a copy of its cache.

Two schedules:
  * ``tpu``: grid (B · splits, kb), kb = ceil(S / block_kv / splits) the longest possible run, last axis sequential;
    (row, split) pairs are one parallel axis, meant to let a megacore chip share them out when B = 1 (untested).
    The row's block count and the layer are scalar-prefetched (SMEM) and read by the cache's index maps; a step
    past its split's run names the run's last block (the pipeline skips the fetch of an unchanged block index) and
    ``pl.when`` skips its compute. All M rows of a row share each fetched block. Outputs are fp32 and their block
    index is constant along the split's steps, so they are the accumulators (no scratch).
  * ``loop`` (GPU / Triton, and the CPU interpreter): grid (M / block_m, splits, B), the split's run is an in-kernel
    ``fori_loop`` with data-dependent bounds; the whole stacked cache is the block (Triton blocks are pointer
    offsets: nothing is copied) and the kernel indexes [layer, b, keys]. The row-tile axis comes first (fastest
    varying launch index), so the tiles of one (split, b) run side by side and re-read the same latent blocks.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from k3jax.ops.grouped_matmul import varying_struct

SCHEDULES = ("tpu", "loop")
NEG = float(jnp.finfo(jnp.float32).min)   # m of a row with no key yet (finite: exp(s - m) stays 0, never NaN)
# Triton launch parameters of the loop schedule: 8 warps spread the [block_m, R] fp32 accumulator (32 x 512 at K3:
# 64 registers a thread); two stages double-buffer the latent blocks. Chosen from the register arithmetic, not
# measured (no GPU run yet).
GPU_NUM_WARPS, GPU_NUM_STAGES = 8, 2
TPU_LANES = 128


def decode_cost(B: int, M: int, S: int, R: int, Hr: int, splits: int, itemsize: int) -> dict:
    """{"flops", "transcendentals", "bytes_accessed"} of one partials call, charging the full cache length S for
    every row: kv_len is data, and the planner passes the cache length it plans for. Bytes: each row's latents
    [S, R + Hr] once, the queries [M, R + Hr] (cache dtype) and limits (int32) once per row, the partials
    [splits, M, R + 2] fp32 once. On the loop schedule the row tiles re-load the same latent blocks; they are
    counted once (the tiles of one split run side by side, so the re-reads are meant to hit L2; not measured)."""
    flops = 2 * B * M * S * (R + Hr) + 2 * B * M * S * R
    latents = B * S * (R + Hr) * itemsize
    queries = B * M * ((R + Hr) * itemsize + 4)
    partials = B * splits * M * (R + 2) * 4
    return {"flops": flops, "transcendentals": B * M * S, "bytes_accessed": latents + queries + partials}


def _estimate(B, M, S, R, Hr, splits, itemsize) -> pl.CostEstimate:
    return pl.CostEstimate(**decode_cost(B, M, S, R, Hr, splits, itemsize))


def _dot_nt(a, b, precision):   # a @ b.T, fp32 accumulation
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _dot(a, b, precision):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _block_update(q, q_rope, limit, c, r, first_key, m, l, o, *, scale: float, precision, rope_keys_minor=False):
    """One key block of the online softmax. q [bm, R], q_rope [bm, Hr] (cache dtype); limit [bm, 1] int32;
    c [bk, R], r [bk, Hr] (or [Hr, bk] with rope_keys_minor); first_key: the block's first key position; m, l
    [bm, 1], o [bm, R] fp32."""
    rope = _dot(q_rope, r, precision) if rope_keys_minor else _dot_nt(q_rope, r, precision)
    s = (_dot_nt(q, c, precision) + rope) * scale                                                # [bm, bk]
    kpos = first_key + lax.broadcasted_iota(jnp.int32, (1, c.shape[0]), 1)
    s = jnp.where(kpos <= limit, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    corr = jnp.exp(m - m_new)
    l_new = l * corr + jnp.sum(p, axis=1, keepdims=True)
    o_new = o * corr + _dot(p.astype(c.dtype), c, precision)
    return m_new, l_new, o_new


def _split_run(n_blocks, split, num_splits: int):
    """(first block, blocks) of split ``split`` when a row's n_blocks real blocks are dealt out in contiguous runs."""
    per = (n_blocks + num_splits - 1) // num_splits
    start = split * per
    return start, jnp.clip(n_blocks - start, 0, per)


def _precision(dtype):
    # fp32 caches: full fp32 products (no TF32 / bf16 passes), as the jnp rung computes; bf16: the MXU / tensor core
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


# ---------------------------------------------------------------------------------------------------------------
# TPU schedule


def _tpu_kernel(n_blocks_ref, layer_ref, q_ref, qr_ref, lim_ref, c_ref, r_ref, o_ref, m_ref, l_ref, *,
                block_kv: int, num_splits: int, scale: float, precision, rope_keys_minor: bool):
    del layer_ref  # read by the index maps only
    row_split, k = pl.program_id(0), pl.program_id(1)
    b, split = row_split // num_splits, row_split % num_splits
    start, count = _split_run(n_blocks_ref[b], split, num_splits)

    @pl.when(k == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)

    @pl.when(k < count)
    def _compute():
        m, l, o = _block_update(q_ref[...], qr_ref[...], lim_ref[...], c_ref[...], r_ref[...],
                                (start + k) * block_kv, m_ref[...], l_ref[...], o_ref[...], scale=scale,
                                precision=precision, rope_keys_minor=rope_keys_minor)
        m_ref[...], l_ref[...], o_ref[...] = m, l, o


def partials_tpu(q_lat, q_rope, limit, n_blocks, c_kv, k_rope, layer, *, block_kv: int, num_splits: int,
                 scale: float, interpret: bool):
    """TPU schedule (module docstring).

    Args:
      q_lat: [B, M, R] absorbed queries in the cache dtype; q_rope: [B, M, Hr] same dtype; limit: [B, M, 1] int32.
      n_blocks: [B] int32 real key blocks per row; layer: [1] int32.
      c_kv: [L, B, S, R]; k_rope: [L, B, S, Hr].
    Returns (o [B, splits, M, R], m [B, splits, M, 1], l [B, splits, M, 1]) fp32.

    k_rope with Hr < 128 is read as its swapaxes [L, B, Hr, S] (blocks [Hr, block_kv]): TPU gives an array whose
    minor dim is under the 128-lane width the layout with its last two dims swapped (major_to_minor (0, 1, 3, 2)
    for bf16 [L, B, 8192, 64], v5p and v6e, libtpu 0.0.51), so the swapaxes is free where a row-major block had
    XLA copy the whole stacked k_rope before every call (16.7 MB of temporaries at L = 2, B = 8, S = 8192).
    """
    from jax.experimental.pallas import tpu as pltpu

    B, M, R = q_lat.shape
    S, Hr = c_kv.shape[2], k_rope.shape[-1]
    kb = -(-(S // block_kv) // num_splits)
    rope_keys_minor = Hr < TPU_LANES

    def cache_map(i, k, nb, lay):
        # a step past its run (or in an empty run, or of a row with no key) names the run's last block, or the last
        # real block of the row = the previous split's last: an unchanged block index, so nothing is fetched
        b = i // num_splits
        start, count = _split_run(nb[b], i % num_splits, num_splits)
        return lay[0], b, jnp.clip(start + jnp.minimum(k, count - 1), 0, jnp.maximum(nb[b] - 1, 0)), 0

    def rope_t_map(i, k, nb, lay):
        lay_, b, blk, _ = cache_map(i, k, nb, lay)
        return lay_, b, 0, blk

    def row_map(i, k, nb, lay):
        return i // num_splits, 0, 0

    def out_map(i, k, nb, lay):
        return i // num_splits, i % num_splits, 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B * num_splits, kb),
        in_specs=[pl.BlockSpec((None, M, R), row_map), pl.BlockSpec((None, M, Hr), row_map),
                  pl.BlockSpec((None, M, 1), row_map),
                  pl.BlockSpec((None, None, block_kv, R), cache_map),
                  pl.BlockSpec((None, None, Hr, block_kv), rope_t_map) if rope_keys_minor
                  else pl.BlockSpec((None, None, block_kv, Hr), cache_map)],
        out_specs=[pl.BlockSpec((None, None, M, R), out_map), pl.BlockSpec((None, None, M, 1), out_map),
                   pl.BlockSpec((None, None, M, 1), out_map)],
    )
    ins = (q_lat, q_rope, limit, c_kv, jnp.swapaxes(k_rope, -1, -2) if rope_keys_minor else k_rope)
    out_shape = [varying_struct((B, num_splits, M, R), jnp.float32, *ins),
                 varying_struct((B, num_splits, M, 1), jnp.float32, *ins),
                 varying_struct((B, num_splits, M, 1), jnp.float32, *ins)]
    kernel = functools.partial(_tpu_kernel, block_kv=block_kv, num_splits=num_splits, scale=scale,
                               precision=_precision(c_kv.dtype), rope_keys_minor=rope_keys_minor)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=_estimate(B, M, S, R, Hr, num_splits, c_kv.dtype.itemsize),
        interpret=interpret,
        name="mla_decode_tpu",
    )(n_blocks, layer, *ins)


# ---------------------------------------------------------------------------------------------------------------
# loop schedule (GPU / Triton; the CPU interpreter)


def _loop_kernel(n_blocks_ref, layer_ref, q_ref, qr_ref, lim_ref, c_ref, r_ref, o_ref, m_ref, l_ref, *,
                 block_kv: int, num_splits: int, scale: float, precision):
    split, b = pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    start, count = _split_run(n_blocks_ref[b], split, num_splits)
    q, q_rope = q_ref[...], qr_ref[...]
    limit = lim_ref[...][:, None]                                                           # [bm, 1]

    def body(j, carry):
        keys = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
        return _block_update(q, q_rope, limit, c_ref[layer, keys, :], r_ref[layer, keys, :], j * block_kv, *carry,
                             scale=scale, precision=precision)

    bm, R = q.shape
    init = (jnp.full((bm, 1), NEG, jnp.float32), jnp.zeros((bm, 1), jnp.float32), jnp.zeros((bm, R), jnp.float32))
    m, l, o = lax.fori_loop(start, start + count, body, init)
    o_ref[...] = o
    m_ref[...] = m[:, 0]
    l_ref[...] = l[:, 0]


def partials_loop(q_lat, q_rope, limit, n_blocks, c_kv, k_rope, layer, *, block_kv: int, block_m: int,
                  num_splits: int, scale: float, platform: str, interpret: bool):
    """Loop schedule (module docstring). Args as ``partials_tpu`` except limit [B, M] int32 and block_m (a divisor
    of M: rows per program). Returns (o [B, splits, M, R], m [B, splits, M], l [B, splits, M]) fp32."""
    B, M, R = q_lat.shape
    L, _, S, _ = c_kv.shape
    Hr = k_rope.shape[-1]
    row = lambda w: pl.BlockSpec((None, block_m, w), lambda g, s, b: (b, g, 0))  # noqa: E731
    cache = lambda w: pl.BlockSpec((L, None, S, w), lambda g, s, b: (0, b, 0, 0))  # noqa: E731
    whole = lambda n: pl.BlockSpec((n,), lambda g, s, b: (0,))  # noqa: E731
    ins = (q_lat, q_rope, limit, c_kv, k_rope)
    out_shape = [varying_struct((B, num_splits, M, R), jnp.float32, *ins),
                 varying_struct((B, num_splits, M), jnp.float32, *ins),
                 varying_struct((B, num_splits, M), jnp.float32, *ins)]
    kwargs = {}
    if platform == "gpu" and not interpret:
        from jax.experimental.pallas import triton as pltriton
        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=GPU_NUM_WARPS, num_stages=GPU_NUM_STAGES)
    kernel = functools.partial(_loop_kernel, block_kv=block_kv, num_splits=num_splits, scale=scale,
                               precision=_precision(c_kv.dtype))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(M // block_m, num_splits, B),
        in_specs=[whole(B), whole(1), row(R), row(Hr),
                  pl.BlockSpec((None, block_m), lambda g, s, b: (b, g)), cache(R), cache(Hr)],
        out_specs=[pl.BlockSpec((None, None, block_m, R), lambda g, s, b: (b, s, g, 0)),
                   pl.BlockSpec((None, None, block_m), lambda g, s, b: (b, s, g)),
                   pl.BlockSpec((None, None, block_m), lambda g, s, b: (b, s, g))],
        cost_estimate=_estimate(B, M, S, R, Hr, num_splits, c_kv.dtype.itemsize),
        interpret=interpret,
        name="mla_decode_fwd",
        **kwargs,
    )(n_blocks, layer, *ins)


__all__ = ["NEG", "SCHEDULES", "TPU_LANES", "decode_cost", "partials_loop", "partials_tpu"]
