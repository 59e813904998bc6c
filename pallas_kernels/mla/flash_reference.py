"""The jnp rungs of the MLA flash kernel (README_flash.md): the dense twin, the block bounds, the tiled backward.

Shapes (k3jax/notation.py): q [B, T, N, Hn+Hr] (the rope-sized slice last), c_kv [B, S, R] (the normed latent),
k_rope [B, S, Hr] (ONE unrotated slice shared by the heads), w_uk [R, N, Hn], w_uv [R, N, V] (kv_b split). The keys
and values the latent stands for are k = concat(c_kv · w_uk, broadcast(k_rope)) [B, S, N, Hn+Hr] and
v = c_kv · w_uv [B, S, N, V]; attention over them is ``k3jax.ops.attention.causal_attention``'s.

  * ``mla_attention_dense``: builds k / v whole and takes one [T, S] softmax (the obviously correct twin; tests);
  * ``key_block_bounds``: per (row, query block) the key blocks [lo, hi) that can hold a visible key (causal, and
    with packed documents the query block's first document onward): the kernel and the backward visit only those;
  * ``flash_backward``: the gradients from the saved log-sum-exp, key block by key block, each up-projected from
    its latent rows once and its dk / dv folded back into dc_kv / dk_rope / dw_uk / dw_uv (no [S, N, ·] buffer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.ops.grouped_matmul import match_varying, varying_zeros
from k3jax.ops.norms import acc_dtype


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build_kv(c_kv, k_rope, w_uk, w_uv, dtype):
    """The keys [B, S, N, Hn+Hr] and values [B, S, N, V] the latent stands for, in ``dtype``."""
    B, S, _ = c_kv.shape
    N = w_uk.shape[1]
    k_nope = jnp.einsum("bsr,rnh->bsnh", c_kv, w_uk, preferred_element_type=dtype)
    v = jnp.einsum("bsr,rnv->bsnv", c_kv, w_uv, preferred_element_type=dtype)
    k_r = jnp.broadcast_to(k_rope[:, :, None, :].astype(dtype), (B, S, N, k_rope.shape[-1]))
    return jnp.concatenate([k_nope.astype(dtype), k_r], axis=-1), v.astype(dtype)


def visible(T: int, S: int, qoff, run=None, krun=None):
    """[B or 1, T, S] bool: query t (at position t + qoff) sees key s ≤ its position, of its document. ``qoff``: a
    scalar, or [B] (row b's query t sits at t + qoff[b])."""
    off = jnp.reshape(jnp.asarray(qoff), (-1, 1, 1))
    m = jnp.arange(S)[None, None, :] <= jnp.arange(T)[None, :, None] + off
    if run is None:
        return m
    return m & (run[:, :, None] == krun[:, None, :])


def mla_attention_dense(q, c_kv, k_rope, w_uk, w_uv, *, scale: float, run=None, krun=None, q_offset=None):
    """One dense softmax over the built k / v in acc dtype: (o [B, T, N, V] in q.dtype, max_logit [B, N]).
    ``run`` [B, T] / ``krun`` [B, S]: the queries' and keys' document run indices (``k3jax.ops.segments.runs``);
    ``q_offset``: None (S - T), a scalar, or [B] per-row offsets."""
    T, S = q.shape[1], c_kv.shape[1]
    acc = acc_dtype(q.dtype)
    k, v = build_kv(c_kv, k_rope, w_uk, w_uv, acc)
    qoff = S - T if q_offset is None else q_offset
    s = jnp.einsum("btnh,bsnh->bnts", q.astype(acc), k) * scale
    mask = visible(T, S, qoff, run, krun)[:, None]
    s = jnp.where(mask, s, -jnp.inf)
    max_logit = jnp.max(jnp.where(mask, s, jnp.finfo(acc).min), axis=(2, 3))
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bnts,bsnv->btnv", p, v)
    return o.astype(q.dtype), max_logit


def key_block_bounds(B: int, T: int, S: int, bq: int, bk: int, qoff, run=None, krun=None):
    """[B, nq, 2] int32: query block i of row b visits key blocks lo ≤ j < hi. ``qoff``: a scalar, or [B] (the
    rows' own offsets: the bounds follow each row's diagonal).

    hi: one past the block of the block's last real query's position (causal: later blocks are fully above the
    diagonal); lo: 0, or with documents the block holding the first key of the block's FIRST query's document
    (runs never decrease along a row, so every query of the block is in that document or a later one)."""
    nq, nk = cdiv(T, bq), cdiv(S, bk)
    i = jnp.arange(nq, dtype=jnp.int32)
    off = jnp.reshape(jnp.asarray(qoff, jnp.int32), (-1, 1))                             # [B or 1, 1]
    last = jnp.minimum(i * bq + bq - 1, T - 1)[None] + off
    hi = jnp.broadcast_to(jnp.clip(last // bk + 1, 0, nk), (B, nq))
    if run is None:
        lo = jnp.zeros_like(hi)
    else:
        first_run = run[:, i * bq]                                                       # [B, nq]
        start = jax.vmap(lambda kr, r: jnp.searchsorted(kr, r, side="left"))(krun, first_run)
        lo = jnp.minimum(start.astype(jnp.int32) // bk, hi)
    return jnp.stack([lo, hi], axis=-1).astype(jnp.int32)


def pairs_visited(bounds) -> int:
    """The (row, query block, key block) triples the kernel runs a body for (host ints; concrete bounds only)."""
    return int(jnp.sum(bounds[..., 1] - bounds[..., 0]))


def _pad_rows(x, n: int, axis: int = 1, mode="constant"):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad, mode=mode)


def flash_backward(q, c_kv, k_rope, w_uk, w_uv, run, krun, qoff, out, lse, d_out, *, scale: float, bq: int,
                   bk: int):
    """Gradients (dq, dc_kv, dk_rope, dw_uk, dw_uv) of ``causal_attention`` over the built keys, from the forward's
    output ``out`` [B, T, N, V] and log-sum-exp ``lse`` [B, N, T] (fp32), cotangent ``d_out`` [B, T, N, V];
    ``qoff`` a scalar or [B] (per-row offsets).

    Loop: a scan over the key blocks j; each is up-projected once (k_j [B, bk, N, Hn+Hr], v_j [B, bk, N, V]) and
    an inner loop visits only the query blocks that see it (``key_block_bounds``: the union over the rows), adding
    to dq and to the block's dk_j / dv_j; then dk_j / dv_j fold into the latent: dc_kv_j = dk_nope_j · w_ukᵀ +
    dv_j · w_uvᵀ, dk_rope_j = Σ_n dk_rope part, dw_uk += c_kvᵀ_j dk_nope_j, dw_uv += c_kvᵀ_j dv_j."""
    B, T, N, H = q.shape
    S, R = c_kv.shape[1], c_kv.shape[2]
    Hn, V = w_uk.shape[-1], w_uv.shape[-1]
    acc = acc_dtype(q.dtype)
    nq, nk = cdiv(T, bq), cdiv(S, bk)
    Tp, Sp = nq * bq, nk * bk
    bounds = key_block_bounds(B, T, S, bq, bk, qoff, run, krun)
    off = jnp.reshape(jnp.asarray(qoff, jnp.int32), (-1, 1))                  # scalar or per-row [B] offsets
    qp = _pad_rows(q.astype(acc), Tp)
    dop = _pad_rows(d_out.astype(acc), Tp)                       # padded queries: zero cotangent, no gradient
    delta = jnp.einsum("btnv,btnv->bnt", dop, _pad_rows(out.astype(acc), Tp))
    lsep = _pad_rows(lse.astype(acc), Tp, axis=2)
    runp = None if run is None else _pad_rows(run, Tp, mode="edge")
    cb = _pad_rows(c_kv, Sp).reshape(B, nk, bk, R).swapaxes(0, 1)
    rb = _pad_rows(k_rope, Sp).reshape(B, nk, bk, -1).swapaxes(0, 1)
    krb = None if krun is None else _pad_rows(krun, Sp, mode="edge").reshape(B, nk, bk).swapaxes(0, 1)
    zero = varying_zeros((), acc, q, c_kv, k_rope, w_uk, w_uv, d_out, run, krun, qoff)

    def q_block(i, carry, j, k_j, v_j, kr_j):
        dq, dk_j, dv_j = carry
        rows = lambda x, axis=1: lax.dynamic_slice_in_dim(x, i * bq, bq, axis=axis)  # noqa: E731
        q_i, do_i, lse_i, dl_i = rows(qp), rows(dop), rows(lsep, 2), rows(delta, 2)
        qpos = (i * bq + jnp.arange(bq))[None, :] + off                                  # [B or 1, bq]
        kpos = j * bk + jnp.arange(bk)
        mask = ((kpos[None, None, :] <= qpos[:, :, None]) & (kpos < S)
                & (qpos[:, :, None] < T + off[:, :, None]))[:, None]                     # [B or 1, 1, bq, bk]
        if run is not None:
            mask = mask & (rows(runp)[:, None, :, None] == kr_j[:, None, None, :])
        s = jnp.einsum("btnh,bcnh->bntc", q_i, k_j, preferred_element_type=acc) * scale
        p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
        dv_j = dv_j + jnp.einsum("bntc,btnv->bcnv", p, do_i)
        dp = jnp.einsum("btnv,bcnv->bntc", do_i, v_j)
        ds = p * (dp - dl_i[..., None]) * scale
        dq = lax.dynamic_update_slice_in_dim(dq, rows(dq) + jnp.einsum("bntc,bcnh->btnh", ds, k_j), i * bq, axis=1)
        dk_j = dk_j + jnp.einsum("bntc,btnh->bcnh", ds, q_i)
        return dq, dk_j, dv_j

    def k_block(carry, inp):
        j, c_j, r_j, kr_j = inp
        active = jnp.any((bounds[..., 0] <= j) & (j < bounds[..., 1]), axis=0)          # [nq]: an interval
        i0, i1 = jnp.argmax(active), nq - jnp.argmax(active[::-1])

        def visit(carry):
            dq, dwk, dwv = carry
            k_j, v_j = build_kv(c_j, r_j, w_uk, w_uv, acc)
            dk0 = jnp.zeros((B, bk, N, H), acc) + zero
            dv0 = jnp.zeros((B, bk, N, V), acc) + zero
            body = lambda i, c: q_block(i, c, j, k_j, v_j, kr_j)  # noqa: E731
            dq, dk_j, dv_j = lax.fori_loop(i0, i1, body, (dq, dk0, dv0))
            dkn = dk_j[..., :Hn]
            dc_j = (jnp.einsum("bcnh,rnh->bcr", dkn, w_uk.astype(acc))
                    + jnp.einsum("bcnv,rnv->bcr", dv_j, w_uv.astype(acc)))
            c32 = c_j.astype(acc)
            dwk = dwk + jnp.einsum("bcr,bcnh->rnh", c32, dkn)
            dwv = dwv + jnp.einsum("bcr,bcnv->rnv", c32, dv_j)
            return (dq, dwk, dwv), (dc_j, dk_j[..., Hn:].sum(2))

        def skip(carry):  # a key block no query sees (above every diagonal, or before every document): no work
            return carry, (jnp.zeros((B, bk, R), acc) + zero, jnp.zeros((B, bk, H - Hn), acc) + zero)

        return lax.cond(jnp.any(active), visit, skip, carry)

    init = (jnp.zeros((B, Tp, N, H), acc) + zero, jnp.zeros((R, N, Hn), acc) + zero,
            jnp.zeros((R, N, V), acc) + zero)
    krb_in = jnp.zeros((nk, B, bk), jnp.int32) if krb is None else krb
    (dq, dwk, dwv), (dcb, drb) = lax.scan(k_block, init, (jnp.arange(nk), cb, rb, krb_in))
    dc = dcb.swapaxes(0, 1).reshape(B, Sp, R)[:, :S]
    dr = drb.swapaxes(0, 1).reshape(B, Sp, -1)[:, :S]
    # inside shard_map: latent rows / weights shared by the shards' queries sum their cotangents
    return (match_varying(dq[:, :T], q).astype(q.dtype), match_varying(dc, c_kv).astype(c_kv.dtype),
            match_varying(dr, k_rope).astype(k_rope.dtype), match_varying(dwk, w_uk).astype(w_uk.dtype),
            match_varying(dwv, w_uv).astype(w_uv.dtype))


__all__ = ["build_kv", "cdiv", "flash_backward", "key_block_bounds", "mla_attention_dense", "pairs_visited",
           "visible"]
