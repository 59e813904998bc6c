"""Attention Residuals operator (docs/model.md §3.1): a per-token softmax over depth of RMS-normalized sources.

    κ_i = v_i · (mean_c v_i[c]² + eps)^(-1/2)
    z_i = Σ_c κ_i[c] · γ[c] · w[c]          (no temperature)
    AR  = Σ_i softmax_i(z)_i · v_i          (mixes the RAW sources)

Computed in at-least-fp32; returns that dtype (sources and partial sums stay fp32, docs/model.md §2.2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.ops.norms import acc_dtype


def _logits(v, gw, eps: float):
    """z_i = Σ_c κ_i[c] · gw[c] for sources v [N, ..., D], computed as (Σ_c v_i[c] · gw[c]) · (mean_c v_i[c]² +
    eps)^(-1/2): two reductions of v that do not depend on each other (κ = v · rsqrt(…) is never materialised; the
    same value in exact arithmetic, fp32 rounding aside). With the width split over devices (the serving layout
    splits D) XLA combines their all-reduces into one per mix, where κ's form needed two in a row: 8 fewer per
    4-layer group of the v5p-64 decode step; and prefill reads the sources less (experiments/LOG.md, session 30:
    one reduction over a stacked [2, N, …, D] instead cost prefill 1.5 TB of HBM traffic per chip)."""
    num = jnp.einsum("n...d,d->n...", v, gw)
    return num * lax.rsqrt(jnp.mean(v * v, axis=-1) + eps)


def attn_res(sources, query, gain, eps: float):
    """sources: sequence of N arrays [..., D] (or one stacked [N, ..., D]); query, gain: [D] → [..., D]."""
    if isinstance(sources, list | tuple):
        if len(sources) == 1:
            return sources[0].astype(acc_dtype(sources[0].dtype))
        v = jnp.stack(sources)
    else:
        v = sources
    acc = acc_dtype(v.dtype)
    v = v.astype(acc)
    z = _logits(v, gain.astype(acc) * query.astype(acc), eps)
    alpha = jax.nn.softmax(z, axis=0)
    return jnp.einsum("n...,n...d->...d", alpha, v)


def attn_res_masked(blocks, count, part, query, gain, eps: float):
    """``attn_res(blocks[:count] + [part], ...)`` with a traced ``count``, for a scanned layer stack: blocks
    [NB, ..., D] is a fixed-size buffer of which the first ``count`` entries are committed block sums (the rest
    zeros), part [..., D] the running sum. The unused slots get logit -inf, hence weight exactly 0 and, holding
    zeros, add exact zeros to the mix; only the length of the reductions differs from the unmasked form."""
    acc = acc_dtype(part.dtype)
    v = jnp.concatenate([blocks.astype(acc), part.astype(acc)[None]], axis=0)
    z = _logits(v, gain.astype(acc) * query.astype(acc), eps)
    nb = blocks.shape[0]
    used = (jnp.arange(nb + 1) < count) | (jnp.arange(nb + 1) == nb)
    z = jnp.where(used.reshape((nb + 1,) + (1,) * (z.ndim - 1)), z, -jnp.inf)
    alpha = jax.nn.softmax(z, axis=0)
    return jnp.einsum("n...,n...d->...d", alpha, v)

