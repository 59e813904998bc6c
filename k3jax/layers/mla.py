"""Gated MLA token mixer (SPEC §5.1): NoPE, optional q-LoRA, an unrotated shared key slice k^R, scale 1/√(Hn+Hr),
element-wise sigmoid output gate before o_proj, causal attention computed blockwise (k3jax.ops.attention).

Dims are read from the parameter shapes: Hr = kv_a.shape[1] − kv_a_norm.shape[0], Hn = q.shape[-1] − Hr,
V = kv_b.shape[-1] − Hn.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3jax.ops.attention import causal_attention
from k3jax.ops.norms import acc_dtype, rms_norm


def mla_dims(p) -> tuple[int, int, int, int]:
    """(num_heads N, nope Hn, rope-sized slice Hr, value V) from the parameter shapes."""
    rkv = p["kv_a_norm"].shape[0]
    hr = p["kv_a"].shape[1] - rkv
    wq = p["q_b"] if "q_b" in p else p["wq"]
    n, hqk = wq.shape[1], wq.shape[2]
    hn = hqk - hr
    return n, hn, hr, p["kv_b"].shape[-1] - hn


def mla_layer(p, x, *, norm_eps: float, block_size: int = 512):
    """x [B, T, D] (normed layer input) → (y [B, T, D], max_logit [B, N]) — max_logit feeds QK-Clip."""
    acc = acc_dtype(x.dtype)
    cdt = x.dtype
    N, Hn, Hr, V = mla_dims(p)
    rkv = p["kv_a_norm"].shape[0]
    if "q_a" in p:
        c_q = jnp.einsum("btd,dr->btr", x, p["q_a"].astype(cdt), preferred_element_type=acc)
        c_q = rms_norm(c_q, p["q_a_norm"], norm_eps, out_dtype=cdt)
        q = jnp.einsum("btr,rnh->btnh", c_q, p["q_b"].astype(cdt), preferred_element_type=acc)
    else:
        q = jnp.einsum("btd,dnh->btnh", x, p["wq"].astype(cdt), preferred_element_type=acc)
    ckv = jnp.einsum("btd,dr->btr", x, p["kv_a"].astype(cdt), preferred_element_type=acc)
    c_kv = rms_norm(ckv[..., :rkv], p["kv_a_norm"], norm_eps, out_dtype=cdt)
    k_rope = ckv[..., rkv:]  # [B, T, Hr]: ONE slice shared by all heads, not rotated (NoPE)
    kv = jnp.einsum("btr,rnh->btnh", c_kv, p["kv_b"].astype(cdt), preferred_element_type=acc)
    k_nope, v = kv[..., :Hn], kv[..., Hn:]
    B, T = x.shape[:2]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (B, T, N, Hr))], axis=-1)
    o, max_logit = causal_attention(q.astype(acc), k.astype(acc), v.astype(acc), scale=1.0 / math.sqrt(Hn + Hr),
                                    block_size=block_size)
    if "w_gate" in p:
        gate = jnp.einsum("btd,dnv->btnv", x, p["w_gate"].astype(cdt), preferred_element_type=acc)
        o = jax.nn.sigmoid(gate) * o
    y = jnp.einsum("btnv,nvd->btd", o.astype(cdt), p["wo"].astype(cdt), preferred_element_type=acc)
    return y.astype(cdt), max_logit
