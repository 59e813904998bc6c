"""Attention over an MLA latent cache (docs/model.md §5.2): queries of the new tokens against the cached ``c_kv`` (the
normed KV latent) and the shared rope-sized key slice, in key blocks with an online softmax, reading only the
blocks that hold real keys.

Two exact forms of the same sum, selected by ``absorbed``:

- materialized: per key block, k^N = c_kv W_UK and v = c_kv W_UV are built for every head, then
  s = q^N·k^N + q^R·k^R and o = Σ p v — what the training forward computes (the reference);
- absorbed: the key up-projection is folded into the query, q̃ = q^N W_UK^T ∈ R^{R_kv} per head, so
  s = q̃·c_kv + q^R·k^R, the probabilities weight the latents themselves, õ = Σ p c_kv, and the per-head value
  up-projection runs once at the end, o = õ W_UV. Per cached token this reads R_kv + Hr values instead of
  N (Hn + Hr + V), which is why decode reads the latent.

Shapes (notation.py): q_nope [B, T, N, Hn], q_rope [B, T, N, Hr]; c_kv [B, S, R]; k_rope [B, S, Hr] (or both
stacked over layers with a ``layer`` index; the rope-slice score is taken in c_kv's dtype);
w_uk [R, N, Hn], w_uv [R, N, V] (the two halves of ``kv_b``); q_pos [B, T] the absolute position of each query;
kv_len [B] the number of real cached keys per row. Query (b, t) sees keys j <= q_pos[b, t] and j < kv_len[b]. S
must be a multiple of ``block`` (caches are allocated that way); only the blocks up to max(kv_len) are read
(``while_loop``s with that trip count), so a large preallocated cache costs nothing until it fills.
Keys at j >= kv_len get probability exactly 0, so their entries must only be finite (``init_cache`` zeroes them,
``restore`` zeroes the row it writes, and the cache is written only with the model's own latents); they are not
masked by a copy of each block, which would add a pass over the cache per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.ops.grouped_matmul import varying_zeros
from k3jax.ops.norms import acc_dtype

# Key block of one-token decode steps. A decode query is one row per head, so each block is two skinny matmuls; on
# XLA:CPU their per-block overhead dominates small blocks: k3-mini's shapes at B = 8, 16K keys read 2.6 / 4.3 / 7.1
# / 2.2 GB/s with blocks of 128 / 512 / 2048 / 8192 (experiments/LOG.md, 2026-12-01 session 6).
DECODE_BLOCK = 2048

# Named scopes of the two key-block loops (big blocks, then blocks of ``block``), read by k3jax.plan.hlo.
LOOP_SCOPES = ("latent_keys_big", "latent_keys")


def key_loop_trips(n_keys: int, block: int, big_block: int | None, S: int) -> dict[str, int]:
    """{scope: trip count} of the two key loops when the longest row holds ``n_keys`` keys (as ``latent_attention``
    runs them; S: the cache length)."""
    big = block if big_block is None or big_block > S else big_block
    n_big = n_keys // big if big != block else 0
    return {LOOP_SCOPES[0]: n_big, LOOP_SCOPES[1]: -(-n_keys // block) - n_big * (big // block)}


def latent_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, q_pos, kv_len, scale: float, block: int,
                     big_block: int | None = None, absorbed: bool, layer=None):
    """→ o [B, T, N, V] in at-least-fp32 (module docstring). Inference only: no custom VJP, no max-logit.

    block: the key block (a divisor of S). big_block (a multiple of block, e.g. ``DECODE_BLOCK`` for decode): the
    keys are first read in blocks of that size as far as they fill whole ones, the rest in blocks of ``block`` —
    large blocks where there are many keys, at most big_block - block keys read past the last real one.
    layer: None, or an int32 index into caches stacked over layers (c_kv [L, B, S, R], k_rope [L, B, S, Hr]; the
    scanned stack's cache, ``model.cache``): each key block is read straight from the stack, never a copy of the
    layer's whole cache."""
    B, T, N, Hn = q_nope.shape
    S, R = c_kv.shape[-2], c_kv.shape[-1]
    if layer is None:   # read blocks of the [B, S, .] arrays themselves (an expanded view was copied whole per step)
        def read(x, start, size):
            return lax.dynamic_slice_in_dim(x, start, size, axis=1)
    else:
        layer, zero = jnp.asarray(layer, jnp.int32), jnp.int32(0)  # one index type (int64 under x64 otherwise)

        def read(x, start, size):
            return lax.dynamic_slice(x, (layer, zero, start.astype(jnp.int32), zero), (1, B, size, x.shape[-1]))[0]
    V = w_uv.shape[-1]
    if S % block:
        raise ValueError(f"latent_attention: cache length {S} must be a multiple of the key block {block}")
    big = block if big_block is None or big_block > S else big_block    # a cache shorter than one big block
    if big % block:
        raise ValueError(f"latent_attention: big_block {big_block} must be a multiple of block {block}")
    if w_uk.shape != (R, N, Hn) or w_uv.shape[:2] != (R, N) or k_rope.shape[-3:-1] != (B, S):
        raise ValueError(f"latent_attention: incompatible shapes q_nope {q_nope.shape}, c_kv {c_kv.shape}, "
                         f"k_rope {k_rope.shape}, w_uk {w_uk.shape}, w_uv {w_uv.shape}")
    acc = acc_dtype(q_nope.dtype)
    cdt = c_kv.dtype
    kv_len = jnp.asarray(kv_len, jnp.int32)
    q_pos = jnp.asarray(q_pos, jnp.int32)
    q_rope = q_rope.astype(cdt)
    if absorbed:
        q_lat = jnp.einsum("btnh,rnh->btnr", q_nope.astype(acc), w_uk.astype(acc))       # q̃ = q^N W_UK^T
        width = R
    else:
        q_nope = q_nope.astype(acc)
        width = V

    def body(size):
        def step(carry):
            j, m, l, o = carry
            kpos = j * size + jnp.arange(size, dtype=jnp.int32)
            real = kpos[None, :] < kv_len[:, None]                                           # [B, c]
            c_blk = read(c_kv, j * size, size)
            r_blk = read(k_rope, j * size, size)
            # the score of the shared key slice in the latent's dtype (the cache holds both in it, model.cache): an
            # fp32 slice ran its default-precision TPU product in bf16 through a convert of the whole stacked
            # k_rope that XLA hoisted out of this loop, once per layer (97 GB per decode step at B = 64, 128K on
            # v5p-64; experiments/LOG.md); HIGHEST instead slowed XLA:CPU's decode at 16K keys 1.34 -> 1.82x
            s = jnp.einsum("btnh,bch->bntc", q_rope, r_blk.astype(cdt), preferred_element_type=acc)
            if absorbed:
                s = s + jnp.einsum("btnr,bcr->bntc", q_lat, c_blk.astype(acc))
            else:
                k_blk = jnp.einsum("bcr,rnh->bcnh", c_blk, w_uk.astype(cdt), preferred_element_type=acc)
                v_blk = jnp.einsum("bcr,rnv->bcnv", c_blk, w_uv.astype(cdt), preferred_element_type=acc)
                s = s + jnp.einsum("btnh,bcnh->bntc", q_nope, k_blk)
            s = s * scale
            seen = real[:, None, None, :] & (kpos[None, None, None, :] <= q_pos[:, None, :, None])  # [B, 1, T, c]
            s = jnp.where(seen, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            l = l * corr + p.sum(-1)
            if absorbed:
                upd = jnp.einsum("bntc,bcr->bntr", p, c_blk.astype(acc))
            else:
                upd = jnp.einsum("bntc,bcnv->bntv", p, v_blk)
            return j + 1, m_new, l, o * corr[..., None] + upd
        return step

    neg = jnp.finfo(acc).min
    n_keys = jnp.max(kv_len)
    n_big = n_keys // big                                                 # whole big blocks
    vz = varying_zeros((), acc, q_nope, q_rope, c_kv, q_pos, kv_len)     # inside shard_map: vary like the inputs
    init = (jnp.int32(0), jnp.full((B, N, T), neg, acc) + vz, jnp.zeros((B, N, T), acc) + vz,
            jnp.zeros((B, N, T, width), acc) + vz)
    carry = init
    # The loops' trip counts depend on the data (the filled keys): a compiled plan cannot see them, so each loop sits
    # in a named scope that ``k3 plan`` gives the trip count of the cache it plans for (``LOOP_SCOPES``).
    if big != block:
        with jax.named_scope(LOOP_SCOPES[0]):
            _, m, l, o = lax.while_loop(lambda c: c[0] < n_big, body(big), init)
        carry = (n_big * (big // block), m, l, o)                         # continue in small blocks from there
    with jax.named_scope(LOOP_SCOPES[1]):
        _, _, l, o = lax.while_loop(lambda c: c[0] < (n_keys + block - 1) // block, body(block), carry)
    o = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1)[..., None], 0)                # a query with no key: 0
    if absorbed:
        return jnp.einsum("bntr,rnv->btnv", o, w_uv.astype(acc))                              # o = õ W_UV
    return o.transpose(0, 2, 1, 3)


__all__ = ["DECODE_BLOCK", "LOOP_SCOPES", "key_loop_trips", "latent_attention"]
