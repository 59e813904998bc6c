"""Pallas backward of MLA flash attention (README_flash.md "Backward"): two grid kernels, TPU layout (the CPU
interpreter runs them with ``platform="tpu"``), recomputing from the forward's log-sum-exp.

Notation per head: c [bk, R] a key block's latent rows, kn = c · w_uk, v = c · w_uv, s = (qn knᵀ + qr krᵀ) · scale,
p = exp(s − lse) (masked), ds = p ⊙ (do vᵀ − Δ) · scale, Δ = rowsum(do ⊙ o).

* ``mla_flash_dq``, grid (N, B, nq, nk): head parallel, the rest sequential. Query block i walks key blocks j in
  [lo, hi) (``key_block_bounds``; index maps clamp j into the range, so skipped steps fetch nothing). It accumulates,
  in VMEM, the latent-side sums g = Σ_j ds · c_j and u = Σ_j p · c_j ([bq, R] fp32 each) and dq_rope = Σ_j ds · kr_j.
  At the last j: dq_nope = g · w_uk, and the head's weight gradients, resident outputs across (b, i, j):
  dw_uk += gᵀ · qn, dw_uv += uᵀ · do (Σ_s c_sᵀ dk_nope_s = Σ_t g_tᵀ qn_t, Σ_s c_sᵀ dv_s = Σ_t u_tᵀ do_t).
* ``mla_flash_dkv``, grid (B, nk, N, nq): (row, key block) parallel, heads and query blocks sequential. Key block j
  is up-projected once per head (kn, v in VMEM scratch), walks the query blocks that see it [i0, i1), accumulates
  dk_nope, dv [bk, ·] fp32, and folds them into dc_kv += dk_nope · w_ukᵀ + dv · w_uvᵀ at the head's last step; dc_kv
  and dk_rope (Σ over heads of dsᵀ · qr) are outputs resident across (n, i).

Materialised: dq [B, N, Tp, Hn+Hr] fp32, dc_kv [B, Sp, R] fp32, dk_rope [B, Sp, Hr] fp32, dw_uk / dw_uv [N, R, ·] fp32
(whole, once); no [S, N, ·] and no [T, S] buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.mla.flash_kernel import clamped_key_block, dots


def _dot_tn(dt):
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None

    def dot_tn(a, b):  # aᵀ @ b
        return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32)
    return dot_tn


def _probs(qn, qr, kn, kr, lse, qpos, kpos, S, scale, run, krun):
    _, dot_nt = dots(qn.dtype)
    s = (dot_nt(qn, kn) + dot_nt(qr, kr)) * scale
    mask = (kpos <= qpos) & (kpos < S)
    if run is not None:
        mask = mask & (run == krun)
    return jnp.where(mask, jnp.exp(s - lse), 0.0)


def _dq_kernel(bounds_ref, qn_ref, qr_ref, do_ref, lse_ref, dl_ref, c_ref, kr_ref, wuk_ref, wuv_ref, *rest, bq, bk,
               nq, S, scale, segments, qoff_at):
    if segments:
        run_ref, krun_ref, *rest = rest
    dqn_ref, dqr_ref, dwk_ref, dwv_ref, g_sc, u_sc, dqr_sc = rest
    b, i, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    at = (b * nq + i) * 2
    lo, hi = bounds_ref[at], bounds_ref[at + 1]
    dt = qn_ref.dtype
    dot, dot_nt = dots(dt)
    dot_tn = _dot_tn(dt)

    @pl.when((b == 0) & (i == 0) & (j == 0))
    def _():
        dwk_ref[...] = jnp.zeros(dwk_ref.shape, dwk_ref.dtype)
        dwv_ref[...] = jnp.zeros(dwv_ref.shape, dwv_ref.dtype)

    @pl.when(j == 0)
    def _():
        g_sc[...] = jnp.zeros(g_sc.shape, jnp.float32)
        u_sc[...] = jnp.zeros(u_sc.shape, jnp.float32)
        dqr_sc[...] = jnp.zeros(dqr_sc.shape, jnp.float32)

    @pl.when((j >= lo) & (j < hi))
    def _():
        c, kr = c_ref[...], kr_ref[...]
        kn, v = dot(c, wuk_ref[...]).astype(dt), dot(c, wuv_ref[...]).astype(dt)
        qpos = i * bq + bounds_ref[qoff_at + b] + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
        kpos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        p = _probs(qn_ref[...], qr_ref[...], kn, kr, lse_ref[...], qpos, kpos, S, scale,
                   run_ref[...] if segments else None, krun_ref[...] if segments else None)
        ds = (p * (dot_nt(do_ref[...], v) - dl_ref[...]) * scale).astype(dt)
        g_sc[...] += dot(ds, c)
        u_sc[...] += dot(p.astype(dt), c)
        dqr_sc[...] += dot(ds, kr)

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        g = g_sc[...].astype(dt)
        dqn_ref[...] = dot(g, wuk_ref[...])
        dqr_ref[...] = dqr_sc[...]
        dwk_ref[...] += dot_tn(g, qn_ref[...])
        dwv_ref[...] += dot_tn(u_sc[...].astype(dt), do_ref[...])


def _dkv_kernel(kb_ref, qn_ref, qr_ref, do_ref, lse_ref, dl_ref, c_ref, kr_ref, wuk_ref, wuv_ref, *rest, bq, bk, nk,
                S, scale, segments, qoff_at):
    if segments:
        run_ref, krun_ref, *rest = rest
    dc_ref, dkr_ref, kn_sc, v_sc, dkn_sc, dv_sc = rest
    b, j, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    at = (b * nk + j) * 2
    i0, i1 = kb_ref[at], kb_ref[at + 1]
    dt = qn_ref.dtype
    dot, dot_nt = dots(dt)
    dot_tn = _dot_tn(dt)

    @pl.when((n == 0) & (i == 0))
    def _():
        dc_ref[...] = jnp.zeros(dc_ref.shape, dc_ref.dtype)
        dkr_ref[...] = jnp.zeros(dkr_ref.shape, dkr_ref.dtype)

    @pl.when(i == 0)
    def _():
        dkn_sc[...] = jnp.zeros(dkn_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when((i == 0) & (i0 < i1))       # the block's keys and values for this head, once
    def _():
        c = c_ref[...]
        kn_sc[...] = dot(c, wuk_ref[...]).astype(dt)
        v_sc[...] = dot(c, wuv_ref[...]).astype(dt)

    @pl.when((i >= i0) & (i < i1))
    def _():
        qn, qr, do = qn_ref[...], qr_ref[...], do_ref[...]
        qpos = i * bq + kb_ref[qoff_at + b] + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
        kpos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        p = _probs(qn, qr, kn_sc[...], kr_ref[...], lse_ref[...], qpos, kpos, S, scale,
                   run_ref[...] if segments else None, krun_ref[...] if segments else None)
        dv_sc[...] += dot_tn(p.astype(dt), do)
        ds = (p * (dot_nt(do, v_sc[...]) - dl_ref[...]) * scale).astype(dt)
        dkn_sc[...] += dot_tn(ds, qn)
        dkr_ref[...] += dot_tn(ds, qr)

    @pl.when(i == pl.num_programs(3) - 1)
    def _():
        dc_ref[...] += (dot_nt(dkn_sc[...].astype(dt), wuk_ref[...]) + dot_nt(dv_sc[...].astype(dt), wuv_ref[...]))


# The backward's score-tile budget: operand bytes of one [bq, bk] tile. Its two kernels keep about a dozen [bq, ·] /
# [bk, ·] blocks, their double buffers and four [bq, bk] fp32 temporaries in VMEM; at K3's sizes the bf16 (512, 512)
# tile (512 KiB) compiles within the 16 MiB default scoped VMEM of v5p (libtpu 0.0.51, deviceless), fp32 (512, 512)
# does not (21.2 MiB: `CompileTimeScopedVmemOom` in mla_flash_dq), fp32 (256, 512) and (512, 256) do.
BWD_TILE_BYTES = 512 * 512 * 2


def backward_blocks(bq: int, bk: int, itemsize: int) -> tuple[int, int]:
    """The backward's (block_q, block_k): the forward's, with block_q halved (while it stays a multiple of 8) until a
    [bq, bk] tile of the operand dtype fits ``BWD_TILE_BYTES``. The backward recomputes from the per-query
    log-sum-exp, so its blocks need not be the forward's."""
    while bq * bk * itemsize > BWD_TILE_BYTES and bq % 16 == 0:
        bq //= 2
    return bq, bk


def backward_costs(pairs: int, *, B, N, T, S, R, Hn, Hr, V, bq, bk, itemsize: int, qoff: int) -> tuple:
    """The ``pl.CostEstimate`` of ``mla_flash_dq`` and of ``mla_flash_dkv`` for ``pairs`` visited (row, query block,
    key block) triples (per head) at the backward's blocks, counted from each kernel's body and index maps:

    dq, per pair and head: the key block's up-projection (kn, v), the scores, do·vᵀ, the latent sums g += ds·c and
    u += p·c, dq_rope += ds·k_rope; per (row, query block, head): dq_nope = g·w_uk and the two weight gradients.
    Bytes: the key block's latent rows re-read per pair and head; q, do, lse and Δ once per (row, query block, head);
    each head's weights read once and its dw written once (index maps constant across (b, i, j)).
    dkv, per (row, key block, head): the up-projection once, the fold into dc_kv at its last step; per pair and head:
    the scores, dv += pᵀ·do, do·vᵀ, dk_nope += dsᵀ·qn, dk_rope += dsᵀ·qr. Bytes: q, do, lse and Δ re-read per pair
    and head; the latent block read once per (row, key block); the head's weights per (row, key block, head) (the
    pipeline fetches them for a key block no query sees too); dc_kv and dk_rope written once. The key blocks visited
    are those up to the last query's position ``qoff`` + T - 1 (as ``pairs``, documents not counted)."""
    nq, nk = -(-T // bq), -(-S // bk)
    seen = min(max((T - 1 + qoff) // bk + 1, 0), nk)                         # key blocks some query block visits
    up = 2 * bk * R * (Hn + V)
    q_rows = bq * (Hn + Hr + V) * itemsize + 2 * bq * 4                     # qn, qr, do, lse, Δ of one query block
    dq = pl.CostEstimate(
        flops=N * (pairs * (up + 2 * bq * bk * (Hn + Hr + V + 2 * R + Hr)) + B * nq * 2 * bq * R * (2 * Hn + V)),
        transcendentals=N * pairs * bq * bk,
        bytes_accessed=N * (pairs * bk * (R + Hr) * itemsize + B * nq * (q_rows + bq * (Hn + Hr) * 4)
                            + R * (Hn + V) * (itemsize + 4)))
    dkv = pl.CostEstimate(
        flops=N * (B * seen * 2 * up + pairs * 2 * bq * bk * (Hn + Hr + 2 * V + Hn + Hr)),
        transcendentals=N * pairs * bq * bk,
        bytes_accessed=N * (pairs * q_rows + B * nk * R * (Hn + V) * itemsize)
        + B * nk * bk * (R + Hr) * (itemsize + 4))
    return dq, dkv


def query_block_bounds(bounds, nk: int):
    """[B, nk, 2] int32 from ``key_block_bounds`` [B, nq, 2]: key block j is visited by query blocks i0 ≤ i < i1
    (an interval: lo and hi never decrease with i). i0 = i1 when no query block sees it."""
    nq = bounds.shape[1]
    j = jnp.arange(nk, dtype=jnp.int32)[None, :, None]
    active = (bounds[:, None, :, 0] <= j) & (j < bounds[:, None, :, 1])             # [B, nk, nq]
    any_ = jnp.any(active, axis=-1)
    i0 = jnp.where(any_, jnp.argmax(active, axis=-1), 0)
    i1 = jnp.where(any_, nq - jnp.argmax(active[..., ::-1], axis=-1), 0)
    return jnp.stack([i0, i1], axis=-1).astype(jnp.int32)


def flash_bwd_pallas(qn, qr, do, lse, delta, c_kv, k_rope, w_uk, w_uv, bounds, kbounds, run=None, krun=None, *,
                     scale: float, S: int, bq: int, bk: int, interpret, out_struct=None, cost_estimates=(None, None)):
    """Raw launch of both kernels. qn [B, N, Tp, Hn], qr [B, N, Tp, Hr], do [B, N, Tp, V] (operand dtype), lse and
    delta [B, N, Tp, 1] fp32, c_kv [B, Sp, R], k_rope [B, Sp, Hr], w_uk [N, R, Hn], w_uv [N, R, V]; bounds: the
    forward's flat (lo, hi) per (row, query block) then the B rows' q offsets; kbounds: flat (i0, i1) per (row,
    key block) then the same B offsets.
    run [B, Tp] / krun [B, Sp]: document runs or None. ``cost_estimates``: the two kernels' (``backward_costs``).
    Returns fp32 dq_nope [B, N, Tp, Hn], dq_rope [B, N, Tp, Hr],
    dw_uk [N, R, Hn], dw_uv [N, R, V], dc_kv [B, Sp, R], dk_rope [B, Sp, Hr]."""
    from jax.experimental.pallas import tpu as pltpu

    B, N, Tp, Hn = qn.shape
    Hr, V = qr.shape[-1], w_uv.shape[-1]
    Sp, R = c_kv.shape[1], c_kv.shape[2]
    nq, nk = Tp // bq, Sp // bk
    segments = run is not None
    out_struct = out_struct or jax.ShapeDtypeStruct
    f32 = jnp.float32
    kw = dict(bq=bq, bk=bk, S=S, scale=float(scale), segments=segments)
    seg_args = [run[..., None], krun[:, None, :]] if segments else []
    args = [qn, qr, do, lse, delta, c_kv, k_rope, w_uk, w_uv, *seg_args]

    def params(est, *sem):
        kw = {} if est is None else {"cost_estimate": est}
        return kw if interpret else kw | {"compiler_params": pltpu.CompilerParams(dimension_semantics=sem)}

    # dq: grid (n, b, i, j)
    def key(n, b, i, j, bd):
        return b, clamped_key_block(bd, b, i, j, nq), 0

    qs = lambda h: pl.BlockSpec((None, None, bq, h), lambda n, b, i, j, _: (b, n, i, 0))  # noqa: E731
    ws = lambda h: pl.BlockSpec((None, R, h), lambda n, b, i, j, _: (n, 0, 0))  # noqa: E731
    specs = [qs(Hn), qs(Hr), qs(V), qs(1), qs(1), pl.BlockSpec((None, bk, R), key), pl.BlockSpec((None, bk, Hr), key),
             ws(Hn), ws(V)]
    if segments:
        specs += [pl.BlockSpec((None, bq, 1), lambda n, b, i, j, _: (b, i, 0)),
                  pl.BlockSpec((None, 1, bk), lambda n, b, i, j, bd: (b, 0, clamped_key_block(bd, b, i, j, nq)))]
    dqn, dqr, dwk, dwv = pl.pallas_call(
        functools.partial(_dq_kernel, nq=nq, qoff_at=bounds.shape[0] - B, **kw),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(N, B, nq, nk), in_specs=specs,
            out_specs=[qs(Hn), qs(Hr), ws(Hn), ws(V)],
            scratch_shapes=[pltpu.VMEM((bq, R), f32), pltpu.VMEM((bq, R), f32), pltpu.VMEM((bq, Hr), f32)]),
        out_shape=[out_struct((B, N, Tp, Hn), f32), out_struct((B, N, Tp, Hr), f32), out_struct((N, R, Hn), f32),
                   out_struct((N, R, V), f32)],
        interpret=interpret, name="mla_flash_dq",
        **params(cost_estimates[0], "parallel", "arbitrary", "arbitrary", "arbitrary"),
    )(bounds, *args)

    # dkv: grid (b, j, n, i)
    def qblock(kb, b, j, i):
        at = (b * nk + j) * 2
        i0, i1 = kb[at], kb[at + 1]
        return jnp.clip(i, i0, jnp.maximum(i1 - 1, i0))

    qs2 = lambda h: pl.BlockSpec((None, None, bq, h),  # noqa: E731
                                 lambda b, j, n, i, kb: (b, n, qblock(kb, b, j, i), 0))
    ks2 = lambda h: pl.BlockSpec((None, bk, h), lambda b, j, n, i, _: (b, j, 0))  # noqa: E731
    ws2 = lambda h: pl.BlockSpec((None, R, h), lambda b, j, n, i, _: (n, 0, 0))  # noqa: E731
    specs = [qs2(Hn), qs2(Hr), qs2(V), qs2(1), qs2(1), ks2(R), ks2(Hr), ws2(Hn), ws2(V)]
    if segments:
        specs += [pl.BlockSpec((None, bq, 1), lambda b, j, n, i, kb: (b, qblock(kb, b, j, i), 0)),
                  pl.BlockSpec((None, 1, bk), lambda b, j, n, i, _: (b, 0, j))]
    dc, dkr = pl.pallas_call(
        functools.partial(_dkv_kernel, nk=nk, qoff_at=kbounds.shape[0] - B, **kw),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B, nk, N, nq), in_specs=specs, out_specs=[ks2(R), ks2(Hr)],
            scratch_shapes=[pltpu.VMEM((bk, Hn), qn.dtype), pltpu.VMEM((bk, V), qn.dtype), pltpu.VMEM((bk, Hn), f32),
                            pltpu.VMEM((bk, V), f32)]),
        out_shape=[out_struct((B, Sp, R), f32), out_struct((B, Sp, Hr), f32)],
        interpret=interpret, name="mla_flash_dkv",
        **params(cost_estimates[1], "parallel", "parallel", "arbitrary", "arbitrary"),
    )(kbounds, *args)
    return dqn, dqr, dwk, dwv, dc, dkr


__all__ = ["BWD_TILE_BYTES", "backward_blocks", "backward_costs", "flash_bwd_pallas", "query_block_bounds"]
