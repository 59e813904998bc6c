"""Pallas forward kernel for chunked KDA (docs/model.md §4.4, §4.5); see README.md for the math and tiling.

Grid (B, N, V / block_v), all parallel. One program owns one (batch, head, value tile) and walks the chunks of
its sequence in an in-kernel ``lax.fori_loop`` carrying the state tile S [K, block_v] in fp32. (A sequential grid
axis would do on TPU, but GPU grid programs run concurrently, so the chunk loop lives inside the kernel.)
Columns of the state are independent, so value tiles only duplicate the cheap A_kk / W work.

On TPU (``_kda_tpu``) the chunks are a sequential fourth grid axis instead, with the state tile in VMEM scratch
and one chunk per block (README.md "Tiling" says why).

Everything is built from 2-D ops that the Triton lowering supports: ``pl.ds`` slices of 16 rows, 2-D dots with
``precision=HIGHEST`` (no TF32), elementwise exp/where and row reductions. Block shapes are the caller's: use powers
of two (K = V = 128, chunk 64) on GPU; interpret mode accepts anything.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.ops.grouped_matmul import varying_struct

HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    chunk: int = 64       # C, tokens per chunk (multiple of sub_chunk)
    sub_chunk: int = 16   # c, rows per factorised sub-block (docs/model.md §4.5)
    block_v: int = 64     # value columns per program


def _dot(a, b):
    return jnp.dot(a, b, precision=HIGHEST, preferred_element_type=jnp.float32)


def _dot_nt(a, b):  # a @ b.T
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)


def _dot_tn(a, b):  # a.T @ b
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)


def _exp_flushed(x):
    # fp32 only in the kernel: see _exp_flushed in k3jax/ops/kda/chunked.py (subnormal products).
    return jnp.exp(jnp.where(x < -20.0, -jnp.inf, x))


def _invert_unit_lower(L, c):
    """(I + L)^-1 for strictly lower [c, c] L: (I - L)(I + L^2)(I + L^4)... (exact, L^c = 0)."""
    r = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye = jnp.where(r == col, 1.0, 0.0).astype(jnp.float32)
    T = eye - L
    P = L
    span = 2
    while span < c:
        P = _dot(P, P)
        T = _dot(T, eye + P)
        span *= 2
    return T


def _column(b):
    """beta rows as a [c, 1] column: the GPU layout reads [c], the TPU layout (trailing unit dim) already [c, 1]."""
    return b[:, None] if b.ndim == 1 else b


def _load_chunk(in_refs, ic, bs: BlockSizes):
    """Chunk ``ic`` as fp32 lists over its n sub-chunks (rows [c, K] / [c, V], beta [c, 1], g_r0 and tot [1, K]),
    plus the row factors a = exp(lr) and the column factors kf = k exp(rex). With document masks (three more refs
    after tot, see ``kda_fwd_pallas``): run / carry / last as [c, 1] columns and run_row, the run as a [1, c] row."""
    q_ref, k_ref, v_ref, g_ref, beta_ref, lr_ref, rex_ref, gcs_ref, tot_ref = in_refs[:9]
    C, c = bs.chunk, bs.sub_chunk
    n = C // c
    base = ic * C
    rows = lambda ref, I: ref[pl.ds(base + I * c, c), :].astype(jnp.float32)  # noqa: E731
    x = {name: [rows(ref, I) for I in range(n)]
         for name, ref in (("qs", q_ref), ("ks", k_ref), ("vs", v_ref), ("lr", lr_ref), ("rex", rex_ref),
                           ("gcs", gcs_ref))}
    x["bts"] = [_column(beta_ref[pl.ds(base + I * c, c)].astype(jnp.float32)) for I in range(n)]
    x["g_r0"] = [g_ref[pl.ds(base + I * c, 1), :].astype(jnp.float32) for I in range(n)]      # [1, K]
    x["tot"] = [tot_ref[pl.ds(ic * n + M, 1), :].astype(jnp.float32) for M in range(n)]      # [1, K]
    x["a"] = [_exp_flushed(lr) for lr in x["lr"]]
    x["kf"] = [x["ks"][J] * _exp_flushed(x["rex"][J]) for J in range(n)]
    if len(in_refs) > 9:
        for name, ref in zip(("run", "carry", "last"), in_refs[9:], strict=True):
            x[name] = [_column(ref[pl.ds(base + I * c, c)]) for I in range(n)]
        # The run as a [1, c] row without a transpose: the diagonal of a broadcast, summed over rows (exact).
        eye = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0) == jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
        x["run_row"] = [jnp.sum(jnp.where(eye, r, 0.0), axis=0, keepdims=True) for r in x["run"]]
    return base, x


def _pairwise_by_column(k_sub, q_sub, lr_sub):
    """The unbounded-gate diagonal sums one column j at a time ([c, K] tiles, no [c, c, K] one):
    d[i, j] = sum_K x_i k_j exp(lr_i - lr_j) for j <= i, x = k and x = q. The TPU formulation: Mosaic aborts the
    process on the [c, c, K] broadcast (libtpu 0.0.51: "layout.h:253 Check failed: rem == 0 (1024 vs. 0)"). Same
    products as the 3-D form; the K sums are separate 2-D reductions (rounding may differ in the last place)."""
    c = k_sub.shape[0]
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
    dkk = dqk = jnp.zeros((c, c), jnp.float32)
    for j in range(c):
        kk = k_sub[j:j + 1, :] * _exp_flushed(jnp.where(rows >= j, lr_sub - lr_sub[j:j + 1, :], -jnp.inf))
        dkk = jnp.where(col == j, jnp.sum(k_sub * kk, axis=-1, keepdims=True), dkk)
        dqk = jnp.where(col == j, jnp.sum(q_sub * kk, axis=-1, keepdims=True), dqk)
    return dkk, dqk


def _a_blocks(x, n: int, c: int, scale: float, gate_lower_bound, strict, incl, by_column: bool = False):
    """A_kk and A_qk blocks (row sub-chunk I, column sub-chunk J <= I) as dicts keyed (I, J), anchored at r0(I).
    With document masks, pairs (i, j) of different documents are zero (every factor is finite: K3's gates are)."""
    qs, ks, bts, lr, tot = x["qs"], x["ks"], x["bts"], x["lr"], x["tot"]
    docs = "run" in x
    Akk, Aqk = {}, {}
    for I in range(n):
        ka, qa = ks[I] * x["a"][I], qs[I] * x["a"][I]
        for J in range(I):
            between = x["g_r0"][I]
            for M in range(J + 1, I):
                between = between + tot[M]
            y = x["kf"][J] * _exp_flushed(between)                   # k_j exp(G_r0(I) - G_j)
            Akk[I, J] = bts[I] * _dot_nt(ka, y)
            Aqk[I, J] = scale * _dot_nt(qa, y)
            if docs:
                same = x["run"][I] == x["run_row"][J]                  # [c, c]: one document
                Akk[I, J] = jnp.where(same, Akk[I, J], 0.0)
                Aqk[I, J] = jnp.where(same, Aqk[I, J], 0.0)
        if gate_lower_bound is not None:
            delta = gate_lower_bound * (c - 1) / 2.0             # past-row anchor G_r0 + delta
            right = ks[I] * jnp.exp(delta - lr[I])
            left = jnp.exp(lr[I] - delta)
            dkk = _dot_nt(ks[I] * left, right)
            dqk = _dot_nt(qs[I] * left, right)
        elif by_column:                                           # exact pairwise decays, TPU
            dkk, dqk = _pairwise_by_column(ks[I], qs[I], lr[I])
        else:                                                     # exact pairwise decays
            diff = lr[I][:, None, :] - lr[I][None, :, :]          # [c, c, K]
            decay = _exp_flushed(jnp.where(incl[:, :, None], diff, -jnp.inf))
            kk = ks[I][None, :, :] * decay
            dkk = jnp.sum(ks[I][:, None, :] * kk, axis=-1)
            dqk = jnp.sum(qs[I][:, None, :] * kk, axis=-1)
        strict_I, incl_I = strict, incl
        if docs:
            same = x["run"][I] == x["run_row"][I]
            strict_I, incl_I = strict & same, incl & same
        Akk[I, I] = jnp.where(strict_I, bts[I] * dkk, 0.0)
        Aqk[I, I] = jnp.where(incl_I, scale * dqk, 0.0)
    return Akk, Aqk


def _solve_and_write(x, Akk, Aqk, S, o_ref, base, n: int, c: int, scale: float):
    """W, U by block forward substitution, Ṽ = U - W S, and O = s (Q ⊙ Γ) S + A_qk Ṽ written to o_ref.
    Returns Ṽ as a list over sub-chunks. With document masks Γ is zero on rows outside the incoming state's
    document (carry = 0): they see no state, in O and in W."""
    qs, ks, vs, bts = x["qs"], x["ks"], x["vs"], x["bts"]
    W, U, v_new = [], [], []
    for I in range(n):
        gam = _exp_flushed(x["gcs"][I])                            # exp(G_i)
        if "carry" in x:
            gam = gam * x["carry"][I]
        r_w = bts[I] * ks[I] * gam
        r_u = bts[I] * vs[I]
        for M in range(I):
            r_w = r_w - _dot(Akk[I, M], W[M])
            r_u = r_u - _dot(Akk[I, M], U[M])
        Tinv = _invert_unit_lower(Akk[I, I], c)
        W.append(_dot(Tinv, r_w))
        U.append(_dot(Tinv, r_u))
        v_new.append(U[I] - _dot(W[I], S))
        o = _dot(scale * qs[I] * gam, S)
        for J in range(I + 1):
            o = o + _dot(Aqk[I, J], v_new[J])
        o_ref[pl.ds(base + I * c, c), :] = o.astype(o_ref.dtype)
    return v_new


def _next_state(x, v_new, S, n: int, kr, kc):
    """S <- exp(G_last) ⊙ S + sum_I (K_I ⊙ exp(G_last - G))ᵀ Ṽ_I. With document masks: the decay is zero when the
    chunk's last row starts or is in a later document than the incoming state's (carry = 0 there), and only rows
    of the chunk's last document write (last = 1)."""
    tot = x["tot"]
    g_last = tot[0]
    for M in range(1, n):
        g_last = g_last + tot[M]
    # Column vector exp(G_last)[K, 1] without a transpose: pick the diagonal of a broadcast.
    decay_col = jnp.sum(jnp.where(kr == kc, _exp_flushed(g_last), 0.0), axis=1, keepdims=True)
    if "carry" in x:
        carry = x["carry"][n - 1]                                  # [c, 1]
        rows = jax.lax.broadcasted_iota(jnp.int32, carry.shape, 0)
        decay_col = decay_col * jnp.sum(jnp.where(rows == carry.shape[0] - 1, carry, 0.0), axis=0, keepdims=True)
    S_new = decay_col * S
    for I in range(n):
        suf = jnp.zeros_like(g_last)
        for M in range(I + 1, n):
            suf = suf + tot[M]
        kd = x["ks"][I] * _exp_flushed(x["rex"][I] + suf)          # k_j exp(G_last - G_j)
        if "last" in x:
            kd = kd * x["last"][I]
        S_new = S_new + _dot_tn(kd, v_new[I])
    return S_new


def _chunk_step(in_refs, o_ref, ic, S, *, bs: BlockSizes, K: int, scale: float, gate_lower_bound,
                by_column: bool = False):
    """Chunk ``ic`` of the refs' rows: writes its outputs to o_ref and returns the next state tile [K, block_v]."""
    C, c = bs.chunk, bs.sub_chunk
    n = C // c
    ri = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    strict = ri > ci
    incl = ri >= ci
    kr = jax.lax.broadcasted_iota(jnp.int32, (K, K), 0)
    kc = jax.lax.broadcasted_iota(jnp.int32, (K, K), 1)
    base, x = _load_chunk(in_refs, ic, bs)
    Akk, Aqk = _a_blocks(x, n, c, scale, gate_lower_bound, strict, incl, by_column)
    v_new = _solve_and_write(x, Akk, Aqk, S, o_ref, base, n, c, scale)
    return _next_state(x, v_new, S, n, kr, kc)


def _kda_fwd_kernel(*refs, num_chunks, **consts):
    """One (batch, head, value tile): a fori_loop over the chunks, carrying the state tile S [K, block_v].
    refs: q, k, v, g, beta, lr, rex, gcs, tot, [run, carry, last,] h0, then the outputs o, ht."""
    *in_refs, h0_ref, o_ref, ht_ref = refs
    S0 = h0_ref[...].astype(jnp.float32)
    S = jax.lax.fori_loop(0, num_chunks, lambda ic, S: _chunk_step(in_refs, o_ref, ic, S, **consts), S0)
    ht_ref[...] = S.astype(ht_ref.dtype)


def _kda_tpu_kernel(*refs, **consts):
    """One (batch, head, value tile, chunk) step: the blocks hold one chunk; the state tile lives in VMEM scratch
    across the sequential chunk axis (grid axis 3). refs as in ``_kda_fwd_kernel``, then the scratch."""
    *in_refs, h0_ref, o_ref, ht_ref, state_ref = refs
    ic = pl.program_id(3)

    @pl.when(ic == 0)
    def _init():
        state_ref[...] = h0_ref[...].astype(jnp.float32)

    state_ref[...] = _chunk_step(in_refs, o_ref, 0, state_ref[...], **consts)

    @pl.when(ic == pl.num_programs(3) - 1)
    def _final():
        ht_ref[...] = state_ref[...].astype(ht_ref.dtype)


def kda_fwd_pallas(q, k, v, g, beta, lr, rex, gcs, tot, h0, *, scale, gate_lower_bound, bs: BlockSizes,
                   platform: str, interpret: bool, docs=None):
    """Raw kernel launch. All time axes are padded to a multiple of bs.chunk.

    q, k, g, lr, rex, gcs: [B, Tp, N, K]; v: [B, Tp, N, V]; beta: [B, Tp, N]; tot: [B, Tp / c, N, K];
    h0: [B, N, K, V] fp32. lr / rex / gcs / tot are the in-chunk sums of g (see api.py). docs: None, or the
    document masks of packed rows (run, carry, last), each [B, Tp] fp32 holding exact integers
    (``k3jax.ops.kda.chunked.doc_masks``); None compiles the kernel without them. Returns o [B, Tp, N, V]
    (q.dtype) and the final state [B, N, K, V] fp32. ``platform`` picks the schedule: "tpu" -> ``_kda_tpu``; else
    grid (B, N, V / block_v) with the chunk loop in the kernel (Triton compiler params on "gpu" when compiled).
    """
    docs = () if docs is None else tuple(docs)
    if platform == "tpu":
        return _kda_tpu(q, k, v, g, beta, lr, rex, gcs, tot, h0, scale=scale, gate_lower_bound=gate_lower_bound,
                        bs=bs, interpret=interpret, docs=docs)
    B, Tp, N, K = q.shape
    V = v.shape[-1]
    bv = min(bs.block_v, V)
    if V % bv:
        raise ValueError(f"V = {V} must be a multiple of block_v = {bv}")
    nsub = Tp // bs.sub_chunk
    ins = (q, k, v, g, beta, lr, rex, gcs, tot, *docs, h0)
    kernel = functools.partial(_kda_fwd_kernel, num_chunks=Tp // bs.chunk, bs=bs, K=K, scale=float(scale),
                               gate_lower_bound=gate_lower_bound)
    tk = pl.BlockSpec((None, Tp, None, K), lambda b, n, j: (b, 0, n, 0))
    tv = pl.BlockSpec((None, Tp, None, bv), lambda b, n, j: (b, 0, n, j))
    kwargs = {}
    if platform == "gpu" and not interpret:
        from jax.experimental.pallas import triton as pltriton
        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=4, num_stages=1)
    return pl.pallas_call(
        kernel,
        grid=(B, N, V // bv),
        in_specs=[tk, tk, tv, tk,
                  pl.BlockSpec((None, Tp, None), lambda b, n, j: (b, 0, n)),
                  tk, tk, tk,
                  pl.BlockSpec((None, nsub, None, K), lambda b, n, j: (b, 0, n, 0)),
                  *[pl.BlockSpec((None, Tp), lambda b, n, j: (b, 0))] * len(docs),        # run, carry, last
                  pl.BlockSpec((None, None, K, bv), lambda b, n, j: (b, n, 0, j))],
        out_specs=[tv, pl.BlockSpec((None, None, K, bv), lambda b, n, j: (b, n, 0, j))],
        out_shape=[varying_struct((B, Tp, N, V), q.dtype, *ins), varying_struct((B, N, K, V), jnp.float32, *ins)],
        interpret=interpret,
        name="kda_chunk_fwd",
        **kwargs,
    )(q, k, v, g, beta, lr, rex, gcs, tot, *docs, h0)


def _kda_tpu(q, k, v, g, beta, lr, rex, gcs, tot, h0, *, scale, gate_lower_bound, bs: BlockSizes, interpret: bool,
             docs=()):
    """TPU schedule: grid (B, N, V / block_v, Tp / C), chunk axis sequential ("arbitrary"), state in VMEM scratch.

    Blocks hold one chunk (C rows), not the whole sequence as on GPU: Mosaic copies each block into VMEM, and whole
    sequences (T = 8192 x K = 128 x fp32 = 4 MiB per input) would not fit. Mosaic wants every block's last two dims
    divisible by (8, 128) or whole, and rejects a squeezed head dim in the second-minor place of [B, Tp, N, K]
    ("last two dimensions of your block shape ... divisible by 8 and 128"), so the inputs go head-major
    [B, N, Tp, K] here (XLA transposes: one more HBM pass over the inputs and o), beta gets a trailing unit dim and
    tot is split [B, N, Tp / C, n, K] (its n = 4 rows per chunk would break the rule as a [.., Tp / c, K] block).
    The document masks (docs) go [B, Tp, 1] like beta, one [C, 1] block per chunk, shared by the heads.
    """
    from jax.experimental.pallas import tpu as pltpu

    B, Tp, N, K = q.shape
    V = v.shape[-1]
    C, n = bs.chunk, bs.chunk // bs.sub_chunk
    bv = min(bs.block_v, V)
    if V % bv or (bv % 128 and bv != V):
        raise ValueError(f"TPU: block_v = {bv} must divide V = {V} and be a multiple of 128 (or V)")
    ins = (q, k, v, g, beta, lr, rex, gcs, tot, *docs, h0)
    kernel = functools.partial(_kda_tpu_kernel, bs=bs, K=K, scale=float(scale), gate_lower_bound=gate_lower_bound,
                               by_column=True)
    tk = pl.BlockSpec((None, None, C, K), lambda b, h, j, c: (b, h, c, 0))
    tv = pl.BlockSpec((None, None, C, bv), lambda b, h, j, c: (b, h, c, j))
    state = pl.BlockSpec((None, None, K, bv), lambda b, h, j, c: (b, h, 0, j))
    heads_major = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, T, N, ...] -> [B, N, T, ...]
    o, ht = pl.pallas_call(
        kernel,
        grid=(B, N, V // bv, Tp // C),
        in_specs=[tk, tk, tv, tk,
                  pl.BlockSpec((None, None, C, 1), lambda b, h, j, c: (b, h, c, 0)),
                  tk, tk, tk,
                  pl.BlockSpec((None, None, None, n, K), lambda b, h, j, c: (b, h, c, 0, 0)),
                  *[pl.BlockSpec((None, C, 1), lambda b, h, j, c: (b, c, 0))] * len(docs),
                  state],
        out_specs=[tv, state],
        out_shape=[varying_struct((B, N, Tp, V), q.dtype, *ins), varying_struct((B, N, K, V), jnp.float32, *ins)],
        scratch_shapes=[pltpu.VMEM((K, bv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="kda_chunk_tpu_fwd",
    )(*map(heads_major, (q, k, v, g, beta[..., None], lr, rex, gcs)),
      heads_major(tot).reshape(B, N, Tp // C, n, K), *(d[..., None] for d in docs), h0)
    return heads_major(o), ht
