"""jnp rungs of the MLA decode kernel, below it on the ladder and above ``k3jax.ops.latent_attention``:

- ``mla_decode_reference``: the absorbed form as one masked softmax over the whole cache (no blocks, no splits);
- ``decode_partials_reference``: what each split of the kernel returns, (õ, m, l) written directly as sums over
  the split's keys (decode_kernel.py's module docstring), no online rescaling.

Both compute in fp32 (or wider) with full-precision products, so a bf16-cache kernel is compared at bf16 tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.norms import acc_dtype

HIGHEST = jax.lax.Precision.HIGHEST


def mla_decode_reference(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, q_pos, kv_len, scale: float, layer=None):
    """→ o [B, T, N, V] in at-least-fp32; the contract of ``latent_attention(absorbed=True)`` (shapes there)."""
    if layer is not None:
        c_kv, k_rope = c_kv[layer], k_rope[layer]
    acc = acc_dtype(q_nope.dtype)
    S = c_kv.shape[1]
    q_lat = jnp.einsum("btnh,rnh->btnr", q_nope.astype(acc), w_uk.astype(acc), precision=HIGHEST)
    s = (jnp.einsum("btnr,bsr->btns", q_lat, c_kv.astype(acc), precision=HIGHEST)
         + jnp.einsum("btnh,bsh->btns", q_rope.astype(acc), k_rope.astype(acc), precision=HIGHEST)) * scale
    j = jnp.arange(S)[None, None, :]
    seen = (j <= jnp.asarray(q_pos)[:, :, None]) & (j < jnp.asarray(kv_len)[:, None, None])                # [B, T, S]
    s = jnp.where(seen[:, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))                  # a query with no key: all p = 0
    l = jnp.sum(p, axis=-1, keepdims=True)
    o_lat = jnp.einsum("btns,bsr->btnr", p, c_kv.astype(acc), precision=HIGHEST) / jnp.where(l > 0, l, 1)
    return jnp.einsum("btnr,rnv->btnv", o_lat, w_uv.astype(acc), precision=HIGHEST)


def decode_partials_reference(q_lat, q_rope, limit, n_blocks, c_kv, k_rope, layer, *, block_kv: int,
                              num_splits: int, scale: float, neg: float):
    """The kernel's per-split outputs. Args as ``decode_kernel.partials_loop`` (limit [B, M], caches [L, B, S, .],
    layer [1]); neg: m of a split with no key. Returns (o [B, P, M, R], m [B, P, M], l [B, P, M]) fp32."""
    c, r = c_kv[layer[0]].astype(jnp.float32), k_rope[layer[0]].astype(jnp.float32)             # [B, S, .]
    S = c.shape[1]
    s = (jnp.einsum("bmr,bsr->bms", q_lat.astype(jnp.float32), c, precision=HIGHEST)
         + jnp.einsum("bmh,bsh->bms", q_rope.astype(jnp.float32), r, precision=HIGHEST)) * scale
    key_block = jnp.arange(S) // block_kv
    per = (n_blocks + num_splits - 1) // num_splits                                               # [B]
    split = jnp.arange(num_splits)
    first = split[None, :] * per[:, None]                                                         # [B, P]
    last = jnp.minimum(first + per[:, None], n_blocks[:, None])                                   # exclusive
    in_split = (key_block[None, None, :] >= first[..., None]) & (key_block[None, None, :] < last[..., None])
    seen = in_split[:, :, None, :] & (jnp.arange(S)[None, None, None, :] <= limit[:, None, :, None])  # [B, P, M, S]
    s = jnp.where(seen, s[:, None], -jnp.inf)
    m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, neg)
    p = jnp.where(seen, jnp.exp(s - m[..., None]), 0.0)
    return jnp.einsum("bpms,bsr->bpmr", p, c, precision=HIGHEST), m, jnp.sum(p, axis=-1)


__all__ = ["decode_partials_reference", "mla_decode_reference"]
