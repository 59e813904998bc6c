"""Sigmoid top-k routing with a selection-only bias (docs/model.md §7.1, "noaux_tc").

    s      = σ(x @ W_r)                      fp32, all E experts
    ids    = top_k(s + b)                    b = e_score_correction_bias, selection only (no gradient)
    cutoff = (k+1)-th largest of (s + b)     Quantile Balancing admission cutoff α (−inf when k == E)
    w      = rsf · s[ids] / Σ s[ids]         renormalized UNBIASED scores (or rsf · s[ids] without renorm)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.ops.norms import acc_dtype


class Routing(NamedTuple):
    ids: jax.Array  # [M, A] int32 selected experts, best first
    weights: jax.Array  # [M, A] combine weights (acc dtype)
    scores: jax.Array  # [M, E] unbiased sigmoid scores s
    cutoff: jax.Array  # [M] (k+1)-th largest biased score α


def route(x_md, router_de, bias_e, *, top_k: int, renormalize: bool = True, scaling_factor: float = 1.0) -> Routing:
    acc = acc_dtype(x_md.dtype)
    E = router_de.shape[-1]
    logits = jnp.einsum("md,de->me", x_md, router_de.astype(x_md.dtype), preferred_element_type=acc)
    s = jax.nn.sigmoid(logits)
    biased = s + lax.stop_gradient(bias_e.astype(acc))
    n_sel = min(top_k + 1, E)
    vals, idx = lax.top_k(lax.stop_gradient(biased), n_sel)
    ids = idx[:, :top_k].astype(jnp.int32)
    cutoff = vals[:, top_k] if top_k < E else jnp.full(vals.shape[:1], -jnp.inf, acc)
    sel = jnp.take_along_axis(s, ids, axis=-1)
    w = sel / jnp.sum(sel, axis=-1, keepdims=True) if renormalize else sel
    return Routing(ids=ids, weights=w * scaling_factor, scores=s, cutoff=cutoff)
