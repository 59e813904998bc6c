"""Causal softmax attention computed blockwise over keys (flash-attention style), with a custom VJP.

Memory is O(T · block) in both directions: the forward pass keeps a running max / sum / accumulator per query
(online softmax) while scanning key blocks; the backward pass recomputes each block's probabilities from the saved
log-sum-exp instead of storing a [T, S] matrix. Scores, softmax and the output accumulate in at-least-fp32.

Shapes (notation.py): q [B, T, N, H], k [B, S, N, H], v [B, S, N, V] → o [B, T, N, V].
Queries are the LAST T of the S key positions (T == S for prefill): query t attends keys τ ≤ t + (S − T); a
context-parallel shard passes its own offset instead (``q_offset``: its queries sit in the middle of the keys).
Also returns the per-(batch, head) maximum causal logit (QK-Clip statistic, docs/model.md §9.6); it carries no gradient.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.ops.grouped_matmul import match_varying, varying_zeros
from k3jax.ops.norms import acc_dtype
from k3jax.ops.segments import runs


def _blocks(x, block: int):
    """[B, S, N, X] → [nb, B, block, N, X], zero-padded on S."""
    B, S, N, X = x.shape
    nb = -(-S // block)
    x = jnp.pad(x, ((0, 0), (0, nb * block - S), (0, 0), (0, 0)))
    return x.reshape(B, nb, block, N, X).transpose(1, 0, 2, 3, 4)


def _mask(j, block, T, S, qoff, run=None, krun_j=None):
    """[1, 1, T, block] bool (or [B, 1, T, block] with documents): key position (j·block + c) is visible to query
    t (at position t + qoff), is not padding and (packed rows) lies in the query's document: ``run`` [B, T] the
    queries' document index, ``krun_j`` [B, block] the block's keys'."""
    kpos = j * block + jnp.arange(block)
    qpos = jnp.arange(T) + qoff
    m = ((kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < S))[None, None]
    if run is None:
        return m
    return m & (run[:, None, :, None] == krun_j[:, None, None, :])


def _key_runs(run, S, block):
    """[B, S] document index → [nb, B, block] per key block (None stays None; padding keys are masked anyway)."""
    if run is None:
        return None
    B = run.shape[0]
    nb = -(-S // block)
    return jnp.pad(run, ((0, 0), (0, nb * block - S))).reshape(B, nb, block).transpose(1, 0, 2)


def _fwd_scan(q, k, v, run, krun, qoff, scale, block):
    B, T, N, _ = q.shape
    S = k.shape[1]
    acc = acc_dtype(q.dtype)
    kb, vb, rb = _blocks(k, block), _blocks(v, block), _key_runs(krun, S, block)
    neg = jnp.finfo(acc).min

    def step(carry, inp):
        m, l, o = carry
        j, k_j, v_j, r_j = inp
        s = jnp.einsum("btnh,bcnh->bntc", q, k_j, preferred_element_type=acc) * scale
        s = jnp.where(_mask(j, block, T, S, qoff, run, r_j), s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        o = o * corr[..., None] + jnp.einsum("bntc,bcnv->bntv", p, v_j.astype(acc))
        return (m_new, l, o), None

    zero = varying_zeros((), acc, q, k, v, run, krun, qoff)        # inside shard_map: carries vary like the inputs
    init = (jnp.full((B, N, T), neg, acc) + zero, jnp.zeros((B, N, T), acc) + zero,
            jnp.zeros((B, N, T, v.shape[-1]), acc) + zero)
    (m, l, o), _ = lax.scan(step, init, (jnp.arange(kb.shape[0]), kb, vb, rb))
    o = o / l[..., None]
    lse = m + jnp.log(l)
    return o, lse, m


@partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, run, krun, qoff, scale, block):
    o, _, m = _fwd_scan(q, k, v, run, krun, qoff, scale, block)
    return o.transpose(0, 2, 1, 3).astype(q.dtype), m.max(-1)


def _attention_fwd(q, k, v, run, krun, qoff, scale, block):
    o, lse, m = _fwd_scan(q, k, v, run, krun, qoff, scale, block)
    out = o.transpose(0, 2, 1, 3).astype(q.dtype)
    return (out, m.max(-1)), (q, k, v, run, krun, qoff, out, lse)


def _attention_bwd(scale, block, res, cts):
    q, k, v, run, krun, qoff, out, lse = res
    d_out, _ = cts  # the max-logit output carries no gradient
    B, T, N, _ = q.shape
    S = k.shape[1]
    acc = acc_dtype(q.dtype)
    do = d_out.astype(acc)
    delta = jnp.einsum("btnv,btnv->bnt", do, out.astype(acc))
    kb, vb, rb = _blocks(k, block), _blocks(v, block), _key_runs(krun, S, block)

    def step(dq, inp):
        j, k_j, v_j, r_j = inp
        s = jnp.einsum("btnh,bcnh->bntc", q, k_j, preferred_element_type=acc) * scale
        p = jnp.where(_mask(j, block, T, S, qoff, run, r_j), jnp.exp(s - lse[..., None]), 0.0)
        dv_j = jnp.einsum("bntc,btnv->bcnv", p, do)
        dp = jnp.einsum("btnv,bcnv->bntc", do, v_j.astype(acc))
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("bntc,bcnh->btnh", ds, k_j.astype(acc))
        dk_j = jnp.einsum("bntc,btnh->bcnh", ds, q.astype(acc))
        return dq, (dk_j, dv_j)

    dq0 = varying_zeros(q.shape, acc, q, k, v, do, run, krun, qoff)
    dq, (dkb, dvb) = lax.scan(step, dq0, (jnp.arange(kb.shape[0]), kb, vb, rb))
    unblock = lambda xb: xb.transpose(1, 0, 2, 3, 4).reshape(B, -1, N, xb.shape[-1])[:, :S]  # noqa: E731
        # inside shard_map: keys / values shared by the shards' queries (context parallelism) sum their cotangents
    dk, dv = match_varying(unblock(dkb), k), match_varying(unblock(dvb), v)
    return match_varying(dq, q).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def causal_attention(q, k, v, *, scale: float, block_size: int = 512, segment_ids=None, q_offset=None,
                     key_segment_ids=None):
    """Blockwise causal attention. Returns (o [B, T, N, V], max_logit [B, N]).

    ``q_offset``: the position of the first query among the S keys (default S - T: the queries are the last T); an
    int or a traced int32 scalar (a context-parallel shard's offset, k3jax/sharding/context_parallel.py); every
    query then attends keys τ ≤ its position. ``segment_ids`` [B, T] (packed rows): a query attends only to keys
    of its own document (``k3jax.ops.segments``); the max logit is then taken over those pairs. Its keys' ids are
    the queries' (T == S) or ``key_segment_ids`` [B, S]: the run index is taken over the keys, and a query's is the
    key's at its position."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"causal_attention: q, k, v must be [B, T, N, H]; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"causal_attention: incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[1] > k.shape[1]:
        raise ValueError(f"causal_attention: more queries ({q.shape[1]}) than keys ({k.shape[1]})")
    T, S = q.shape[1], k.shape[1]
    block = int(min(block_size, S))
    qoff = jnp.asarray(S - T if q_offset is None else q_offset, jnp.int32)
    run = krun = None
    if segment_ids is not None:
        keys = segment_ids if key_segment_ids is None else key_segment_ids
        if tuple(keys.shape) != (q.shape[0], S) or tuple(segment_ids.shape) != (q.shape[0], T) or \
                (key_segment_ids is None and T != S):
            raise ValueError(f"causal_attention: segment_ids {tuple(segment_ids.shape)} need queries = keys "
                             f"[B, T] = {q.shape[:2]} (keys {S}), or key_segment_ids [B, S]")
        krun = runs(keys)
        run = krun if T == S and key_segment_ids is None else \
            lax.dynamic_slice_in_dim(krun, qoff, T, axis=1)
    return _attention(q, k, v, run, krun, qoff, float(scale), block)
