"""Pallas forward kernel of MLA flash attention (README_flash.md): online softmax over latent key blocks.

Each (row, head, query block) runs an online softmax over its key blocks j in [lo, hi)
(``flash_reference.key_block_bounds``: causal block skipping, and the documents before the block's first query's),
carrying the running max m [bq, 1], sum l [bq, 1] and accumulator [bq, V] in fp32. Each step reads the latent rows
c_kv [bk, R] and k_rope [bk, Hr] of block j and up-projects them with the head's w_uk [R, Hn] / w_uv [R, V]: the
keys and values exist one block at a time, never as an [S, N, ·] buffer. Two schedules:

* loop (GPU / Triton, the CPU interpreter): grid (B, N, nq), all parallel; the block is the row's whole latent (on
  GPU a pointer: each step loads only its bk rows) and j runs in an in-kernel ``fori_loop`` with dynamic bounds;
* grid (TPU): grid (B, N, nq, nk), key blocks on the last axis ("arbitrary"), (m, l, acc) in VMEM scratch across it.
  VMEM holds one key block (double-buffered), so any S fits. Steps outside [lo, hi) run no compute (``pl.when``) and
  their index map clamps j into [lo, hi): the block index does not change, so the pipeline fetches nothing.

Layouts (the API transposes): q_nope [B, N, Tp, Hn], q_rope [B, N, Tp, Hr] (head-major: Mosaic rejects a squeezed
head dim in the second-minor place), c_kv [B, Sp, R], k_rope [B, Sp, Hr], w_uk [N, R, Hn], w_uv [N, R, V]; bounds:
flat int32 [B · nq · 2 + B] (lo, hi) then the B rows' q offsets, read as scalars (SMEM on TPU: scalar prefetch).
Outputs: o [B, N, Tp, V] (q's dtype), lse and the row max m, both [B, N, Tp, 1] fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

NEG = float(jnp.finfo(jnp.float32).min)  # running-max start (as ops.attention: exp(NEG - NEG) = 1, no NaN)


def dots(dtype):
    """(a @ b, a @ bᵀ) in fp32 accumulation; fp32 operands at HIGHEST precision."""
    prec = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def dot(a, b):
        return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32)

    def dot_nt(a, b):  # a @ b.T
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32)
    return dot, dot_nt


def _column(x):
    """Query runs as a [bq, 1] column (GPU layout [bq]; TPU layout already [bq, 1])."""
    return x[:, None] if x.ndim == 1 else x


def _row(x):
    """Key runs as a [1, bk] row (GPU layout [bk]; TPU layout already [1, bk])."""
    return x[None, :] if x.ndim == 1 else x


def _step(qn, qr, c, kr, krun, wuk, wuv, qpos, run, start, carry, *, bk, S, scale):
    """One key block of the online softmax: up-project the block's latent rows c [bk, R] with the head's w_uk / w_uv,
    score it against the query block, mask (causal, key < S, same document: run [bq, 1] vs krun [1, bk]) and
    update (m [bq, 1], l [bq, 1], acc [bq, V]) (fp32)."""
    m, l, acc = carry
    dt = qn.dtype
    dot, dot_nt = dots(dt)
    kn = dot(c, wuk).astype(dt)                                          # [bk, Hn]: this block's keys ...
    v = dot(c, wuv).astype(dt)                                           # [bk, V]  ... and values
    s = (dot_nt(qn, kn) + dot_nt(qr, kr)) * scale                        # [bq, bk]
    kpos = start + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    mask = (kpos <= qpos) & (kpos < S)
    if run is not None:
        mask = mask & (run == krun)
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=1, keepdims=True)
    acc = acc * corr + dot(p.astype(dt), v)
    return m_new, l, acc


def _finish(m, l, acc, o_ref, lse_ref, m_ref):
    l_safe = jnp.where(l > 0.0, l, 1.0)                    # a padded query that sees nothing: o = 0, not NaN
    o_ref[...] = (acc / l_safe).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l_safe)
    m_ref[...] = m


def _init(bq, V):
    return jnp.full((bq, 1), NEG, jnp.float32), jnp.zeros((bq, 1), jnp.float32), jnp.zeros((bq, V), jnp.float32)


def _fwd_kernel(bounds_ref, qn_ref, qr_ref, c_ref, kr_ref, wuk_ref, wuv_ref, *rest, bq, bk, nq, S, scale, segments,
                qoff_at):
    """Loop schedule (GPU, CPU): the row's whole latent is the block; key blocks are sliced in a fori_loop."""
    if segments:
        run_ref, krun_ref, o_ref, lse_ref, m_ref = rest
    else:
        o_ref, lse_ref, m_ref = rest
    b, i = pl.program_id(0), pl.program_id(2)
    at = (b * nq + i) * 2
    lo, hi = bounds_ref[at], bounds_ref[at + 1]
    qoff = bounds_ref[qoff_at + b]
    qn, qr = qn_ref[...], qr_ref[...]                                        # [bq, Hn], [bq, Hr]
    wuk, wuv = wuk_ref[...], wuv_ref[...]                                    # [R, Hn], [R, V]
    qpos = i * bq + qoff + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    run = _column(run_ref[...]) if segments else None

    def body(j, carry):
        start = pl.multiple_of(j * bk, bk)
        krun = None
        if segments:
            krun = _row(krun_ref[pl.ds(start, bk)])
        return _step(qn, qr, c_ref[pl.ds(start, bk), :], kr_ref[pl.ds(start, bk), :], krun, wuk, wuv, qpos, run,
                     start, carry, bk=bk, S=S, scale=scale)

    m, l, acc = jax.lax.fori_loop(lo, hi, body, _init(bq, wuv_ref.shape[-1]))
    _finish(m, l, acc, o_ref, lse_ref, m_ref)


def _fwd_kernel_grid(bounds_ref, qn_ref, qr_ref, c_ref, kr_ref, wuk_ref, wuv_ref, *rest, bq, bk, nq, S, scale,
                     segments, qoff_at):
    """Grid schedule (TPU): key block j is the last grid axis ("arbitrary"); (m, l, acc) live in VMEM scratch across
    it. Steps outside [lo, hi) run no compute, and their index map names an already-fetched block (no DMA)."""
    if segments:
        run_ref, krun_ref, o_ref, lse_ref, m_ref, m_sc, l_sc, acc_sc = rest
    else:
        o_ref, lse_ref, m_ref, m_sc, l_sc, acc_sc = rest
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    at = (b * nq + i) * 2
    lo, hi = bounds_ref[at], bounds_ref[at + 1]

    @pl.when(j == 0)
    def _():
        m0, l0, a0 = _init(bq, acc_sc.shape[-1])
        m_sc[...], l_sc[...], acc_sc[...] = m0, l0, a0

    @pl.when((j >= lo) & (j < hi))
    def _():
        qpos = i * bq + bounds_ref[qoff_at + b] + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
        run = run_ref[...] if segments else None
        krun = krun_ref[...] if segments else None
        m, l, acc = _step(qn_ref[...], qr_ref[...], c_ref[...], kr_ref[...], krun, wuk_ref[...], wuv_ref[...], qpos,
                          run, j * bk, (m_sc[...], l_sc[...], acc_sc[...]), bk=bk, S=S, scale=scale)
        m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        _finish(m_sc[...], l_sc[...], acc_sc[...], o_ref, lse_ref, m_ref)


def pair_flops(bq: int, bk: int, R: int, Hn: int, Hr: int, V: int) -> int:
    """FLOPs of one (query block, key block) body for one head: the block's up-projection (K and V), the scores,
    the probabilities times values."""
    return 2 * bk * R * (Hn + V) + 2 * bq * bk * (Hn + Hr) + 2 * bq * bk * V


def cost(pairs: int, *, B, N, T, S, R, Hn, Hr, V, bq, bk, itemsize: int) -> pl.CostEstimate:
    """The kernel's cost for ``pairs`` visited (row, query block, key block) triples (per head)."""
    latent = pairs * bk * (R + Hr) * itemsize * N                            # each program re-reads its blocks
    rest = (B * N * T * (Hn + Hr + V) + 2 * N * R * (Hn + V)) * itemsize + 2 * B * N * T * 4
    return pl.CostEstimate(flops=N * pairs * pair_flops(bq, bk, R, Hn, Hr, V),
                           transcendentals=N * pairs * bq * bk, bytes_accessed=latent + rest)


def clamped_key_block(bounds_ref, b, i, j, nq: int):
    """The key block grid step j of (row b, query block i) reads: j clamped to its visible range [lo, hi). A step
    outside the range names the block its neighbour step already holds, so the pipeline fetches nothing for it."""
    at = (b * nq + i) * 2
    lo, hi = bounds_ref[at], bounds_ref[at + 1]
    return jnp.clip(j, lo, jnp.maximum(hi - 1, lo))


def _grid_call(kernel, args, *, B, N, nq, nk, bq, bk, R, Hn, Hr, V, segments, interpret, out_shape, kwargs):
    from jax.experimental.pallas import tpu as pltpu

    def key(b, n, i, j, bounds):
        return b, clamped_key_block(bounds, b, i, j, nq), 0

    qspec = lambda h: pl.BlockSpec((None, None, bq, h), lambda b, n, i, j, _: (b, n, i, 0))  # noqa: E731
    weight = lambda h: pl.BlockSpec((None, R, h), lambda b, n, i, j, _: (n, 0, 0))  # noqa: E731
    in_specs = [qspec(Hn), qspec(Hr), pl.BlockSpec((None, bk, R), key), pl.BlockSpec((None, bk, Hr), key),
                weight(Hn), weight(V)]
    if segments:   # [bq, 1] columns and [1, bk] rows (Mosaic: last two block dims (8, 128)-aligned or whole)
        in_specs += [pl.BlockSpec((None, bq, 1), lambda b, n, i, j, _: (b, i, 0)),
                     pl.BlockSpec((None, 1, bk), lambda b, n, i, j, bounds: (b, 0, clamped_key_block(
                         bounds, b, i, j, nq)))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(B, N, nq, nk), in_specs=in_specs,
        out_specs=[qspec(V), qspec(1), qspec(1)],
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, V), jnp.float32)])
    if not interpret:
        kwargs["compiler_params"] = pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    return pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=out_shape, interpret=interpret,
                          name="mla_flash_fwd", **kwargs)(*args)


def flash_fwd_pallas(qn, qr, c_kv, k_rope, w_uk, w_uv, bounds, run=None, krun=None, *, scale: float, S: int,
                     bq: int, bk: int, platform: str, interpret, cost_estimate=None, out_struct=None):
    """Raw launch (layouts in the module docstring; Tp, Sp multiples of bq, bk). run [B, Tp] / krun [B, Sp] int32:
    the document run indices (None: no documents). ``out_struct(shape, dtype)``: the out_shape builder (inside
    shard_map: one that declares the varying mesh axes). Schedule: TPU the grid one (key blocks on a grid axis:
    VMEM holds one key block, any S), else the loop one. Returns o [B, N, Tp, V], lse, m [B, N, Tp, 1] fp32."""
    B, N, Tp, Hn = qn.shape
    Hr = qr.shape[-1]
    Sp, R = c_kv.shape[1], c_kv.shape[2]
    V = w_uv.shape[-1]
    nq = Tp // bq
    tpu = platform == "tpu"
    segments = run is not None
    out_struct = out_struct or jax.ShapeDtypeStruct
    out_shape = [out_struct((B, N, Tp, V), qn.dtype), out_struct((B, N, Tp, 1), jnp.float32),
                 out_struct((B, N, Tp, 1), jnp.float32)]
    kwargs = {} if cost_estimate is None else {"cost_estimate": cost_estimate}
    if tpu:
        kernel = functools.partial(_fwd_kernel_grid, bq=bq, bk=bk, nq=nq, S=S, scale=float(scale),
                                   segments=segments, qoff_at=bounds.shape[0] - B)
        args = [bounds, qn, qr, c_kv, k_rope, w_uk, w_uv]
        if segments:
            args += [run[..., None], krun[:, None, :]]
        return _grid_call(kernel, args, B=B, N=N, nq=nq, nk=Sp // bk, bq=bq, bk=bk, R=R, Hn=Hn, Hr=Hr, V=V,
                          segments=segments, interpret=interpret, out_shape=out_shape, kwargs=kwargs)
    kernel = functools.partial(_fwd_kernel, bq=bq, bk=bk, nq=nq, S=S, scale=float(scale), segments=segments,
                               qoff_at=bounds.shape[0] - B)
    qspec = lambda h: pl.BlockSpec((None, None, bq, h), lambda b, n, i: (b, n, i, 0))  # noqa: E731
    seq = lambda h: pl.BlockSpec((None, Sp, h), lambda b, n, i: (b, 0, 0))  # noqa: E731
    weight = lambda h: pl.BlockSpec((None, R, h), lambda b, n, i: (n, 0, 0))  # noqa: E731
    in_specs = [pl.BlockSpec(bounds.shape, lambda b, n, i: (0,)), qspec(Hn), qspec(Hr), seq(R), seq(Hr),
                weight(Hn), weight(V)]
    args = [bounds, qn, qr, c_kv, k_rope, w_uk, w_uv]
    if segments:
        in_specs += [pl.BlockSpec((None, bq), lambda b, n, i: (b, i)), pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0))]
        args += [run, krun]
    if platform == "gpu" and not interpret:
        from jax.experimental.pallas import triton as pltriton
        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(kernel, grid=(B, N, nq), in_specs=in_specs, out_specs=[qspec(V), qspec(1), qspec(1)],
                          out_shape=out_shape, interpret=interpret, name="mla_flash_fwd", **kwargs)(*args)
