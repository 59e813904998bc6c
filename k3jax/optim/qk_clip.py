"""QK-Clip (MuonClip) for the MLA layers (docs/model.md §9.6): a per-head weight rescale after the optimizer update.

    S_max[l, h] = max over the whole step (batch, micro-batches, DP ranks) of the §5.1 score of head h
    for every head with S_max > τ:   γ = τ / S_max
        q_b (or wq)[:, h, :Hn]   *= sqrt(γ)     q^N columns
        q_b (or wq)[:, h, Hn:]   *= γ           q^R (rope-sized) columns
        kv_b[:, h, :Hn]          *= sqrt(γ)     k^N columns
        kv_b v columns, kv_a (shared k^R): untouched

The score is bilinear in (q, k): q^N·k^N scales by sqrt(γ)·sqrt(γ) and q^R·k^R by γ·1, so recomputing the step's
largest logit with the clipped weights gives exactly τ (up to fp rounding). KDA layers need no clip (L2-normed q, k).

    new_params, clip = qk_clip(params, max_logits, cfg, tau=100.0)
    # clip: {"gamma": [L_mla, N], "clipped": [L_mla, N]}
"""

from __future__ import annotations

import jax.numpy as jnp

from k3jax.config import K3Config
from k3jax.model import map_layers, mla_dims


def clip_factors(max_logit_n, tau: float):
    """γ [N] (1 where no clip) and the clipped mask [N] from one layer's step max logit per head."""
    s = max_logit_n.astype(jnp.float32)
    clipped = s > tau
    gamma = jnp.where(clipped, tau / jnp.where(clipped, s, 1.0), 1.0)
    return gamma, clipped


def clip_mla(p, gamma_n, dims):
    """Rescale one MLA layer's query and key columns per head by γ (see module docstring). ``dims``: the model's
    ``mla_dims(cfg)`` (N, Hn, Hr, V)."""
    N, Hn, Hr, V = dims
    sq = jnp.sqrt(gamma_n)
    q_scale = jnp.concatenate([jnp.broadcast_to(sq[:, None], (N, Hn)),
                               jnp.broadcast_to(gamma_n[:, None], (N, Hr))], axis=1)  # [N, Hn + Hr]
    kv_scale = jnp.concatenate([jnp.broadcast_to(sq[:, None], (N, Hn)), jnp.ones((N, V), jnp.float32)], axis=1)
    out = dict(p)
    qkey = "q_b" if "q_b" in p else "wq"
    out[qkey] = (p[qkey] * q_scale[None].astype(p[qkey].dtype)).astype(p[qkey].dtype)
    out["kv_b"] = (p["kv_b"] * kv_scale[None].astype(p["kv_b"].dtype)).astype(p["kv_b"].dtype)
    return out


def qk_clip(params, max_logits, cfg: K3Config, *, tau: float = 100.0):
    """Apply QK-Clip to every MLA layer of ``params``.

    Args:
      params: the k3jax parameter tree (after the optimizer update).
      max_logits: one [N] (or [..., N], reduced with max) array per MLA layer, in layer order — the step's max.
      cfg: the model config (layer layout and MLA dims come from the model).
      tau: the clip threshold τ.
    Returns: (params, {"gamma": [L_mla, N] float32, "clipped": [L_mla, N] bool}).
    """
    idx = list(cfg.mla_layers)
    if len(idx) != len(max_logits):
        raise ValueError(f"{len(max_logits)} max-logit arrays for {len(idx)} MLA layers")
    if not idx:
        return params, {"gamma": jnp.zeros((0, 0), jnp.float32), "clipped": jnp.zeros((0, 0), bool)}
    dims = mla_dims(cfg)
    s = jnp.stack([jnp.max(m.reshape(-1, m.shape[-1]), axis=0) for m in max_logits])
    gamma, clipped = clip_factors(s, tau)
    out = map_layers(params, cfg, idx, lambda lp, g: dict(lp, mla=clip_mla(lp["mla"], g, dims)), gamma)
    return out, {"gamma": gamma, "clipped": clipped}


__all__ = ["qk_clip", "clip_factors", "clip_mla"]
