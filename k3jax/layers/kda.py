"""One KDA token mixer (SPEC §4.1) as a pure function over the ``init_kda`` parameter dict.

    y, cache = kda_layer(p, x_btd, gate_lower_bound=-5.0, eps=1e-5, impl="chunked")

Steps: q/k/v projections -> three separate causal depthwise convs (tap W-1 hits the current token) -> SiLU ->
per-head l2norm of q and k -> forget gate g per head AND key channel from (x f_a) f_b (no activation between),
fp32 -> beta = sigmoid(x w_beta) -> KDA core -> gated RMSNorm per head over K (shared o_norm, eps on the mean)
times sigmoid(x w_gate) (or the low-rank sigmoid((x g_a) g_b)) -> wo.

Cache (SPEC §4.6): ``{"state": [B, N, K, V] K-first fp32, "conv_q"/"conv_k"/"conv_v": [B, W-1, N*K]}``, the last
W-1 pre-conv inputs oldest first. ``cache=None`` runs a full sequence from a zero state; with a cache, T == 1
takes one ``kda_step`` and T > 1 continues the chosen path from the cached state and conv tails. The returned
cache always describes the state after the last token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.layers import backends
from k3jax.ops import kda as kda_ops

IMPLS = ("recurrent", "chunked", "pallas")


def _core(impl, q, k, v, g, beta, *, scale, initial_state, chunk_size, gate_lower_bound):
    if impl == "recurrent":
        return kda_ops.kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    if impl == "chunked":
        return kda_ops.kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   chunk_size=chunk_size, gate_lower_bound=gate_lower_bound)
    if impl == "pallas":
        return backends.kda_chunk_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                         chunk_size=chunk_size, gate_lower_bound=gate_lower_bound)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def kda_layer(p, x, *, gate_lower_bound: float | None, eps: float, impl: str = "chunked",
              chunk_size: int = 64, cache: dict | None = None):
    """KDA token mixer.

    Args:
      p: ``init_kda`` dict: wq/wk/wv [D, N, K], conv_q/k/v [N*K, W], f_a [D, R], f_b [R, N, K], dt_bias [N, K],
        A_log [N], w_beta [D, N], w_gate [D, N, K] or g_a [D, R] + g_b [R, N, K], o_norm [K], wo [N, K, D].
      x: [B, T, D] normed layer input, any float dtype.
      gate_lower_bound: -5.0 for the K3 safe gate, None for the Kimi-Linear softplus gate (SPEC §4.2).
      eps: RMSNorm eps of the gated output norm (``rms_norm_eps``).
      impl: "recurrent" | "chunked" | "pallas" (interpret mode off-GPU).
      cache: None or a cache dict (module docstring).
    Returns: y [B, T, D] in x.dtype, the new cache.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if x.ndim != 3:
        raise ValueError(f"x must be [B, T, D], got shape {tuple(x.shape)}")
    B, T, D = x.shape
    Dw, N, K = p["wq"].shape
    if Dw != D:
        raise ValueError(f"x width {D} does not match wq {tuple(p['wq'].shape)}")
    ct = kda_ops.compute_dtype(x.dtype)
    mm = lambda eq, a, b: jnp.einsum(eq, a, b, preferred_element_type=ct)  # noqa: E731
    cache = cache or {}

    def conv_branch(w_dnk, w_conv, tail):
        u = mm("btd,dnk->btnk", x, w_dnk).reshape(B, T, -1)                # head-major columns (SPEC §2.1)
        return kda_ops.causal_conv_silu(u, w_conv, tail)

    q, tq = conv_branch(p["wq"], p["conv_q"], cache.get("conv_q"))
    k, tk = conv_branch(p["wk"], p["conv_k"], cache.get("conv_k"))
    v, tv = conv_branch(p["wv"], p["conv_v"], cache.get("conv_v"))
    q = kda_ops.l2norm(q.reshape(B, T, N, K))
    k = kda_ops.l2norm(k.reshape(B, T, N, K))
    v = v.reshape(B, T, N, -1)
    raw = mm("btr,rnk->btnk", mm("btd,dr->btr", x, p["f_a"]), p["f_b"])     # no activation between
    if gate_lower_bound is None:
        g = kda_ops.gate_softplus(raw, p["dt_bias"], p["A_log"])
    else:
        g = kda_ops.gate_safe(raw, p["dt_bias"], p["A_log"], gate_lower_bound)
    beta = jax.nn.sigmoid(mm("btd,dn->btn", x, p["w_beta"]))
    scale = K ** -0.5
    state = cache.get("state")
    if state is not None and T == 1:
        o, S = kda_ops.kda_step(q, k, v, g, beta, state, scale=scale)
    else:
        o, S = _core(impl, q, k, v, g, beta, scale=scale, initial_state=state, chunk_size=chunk_size,
                     gate_lower_bound=gate_lower_bound)
    o = o.astype(ct)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps) * p["o_norm"].astype(ct)
    if "w_gate" in p:
        gate = mm("btd,dnk->btnk", x, p["w_gate"])
    else:
        gate = mm("btr,rnk->btnk", mm("btd,dr->btr", x, p["g_a"]), p["g_b"])
    o = o * jax.nn.sigmoid(gate)
    y = mm("btnk,nkd->btd", o, p["wo"])
    return y.astype(x.dtype), {"state": S, "conv_q": tq, "conv_k": tk, "conv_v": tv}
