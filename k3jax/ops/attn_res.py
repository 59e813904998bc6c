"""Attention Residuals operator (docs/model.md §3.1): a per-token softmax over depth of RMS-normalized sources.

    κ_i = v_i · (mean_c v_i[c]² + eps)^(-1/2)
    z_i = Σ_c κ_i[c] · γ[c] · w[c]          (no temperature)
    AR  = Σ_i softmax_i(z)_i · v_i          (mixes the RAW sources)

Computed in at-least-fp32; returns that dtype (sources and partial sums stay fp32, docs/model.md §2.2).

``with_ms=True`` also returns the mix's mean square over D, for the RMS norm that reads the mix next, from the
sources' Gram matrix G_ij = Σ_c v_i[c] v_j[c], reduced beside the logits (the mix itself is the plain form's, bit
for bit):

    mean_c AR[c]² = α^T G α / D

The same value in exact arithmetic. With the width split over devices (the ``serve`` layout) the logits' reductions
and G meet in one all-reduce per mix, where the norm's own sum of squares over the mix was a second all-reduce that
had to wait for the first: two fewer per layer at decode. G costs N² products per position instead of N, so only
short pieces take it (``K3Model.extend``: decode and speculative verify).
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


def _mixed(z, v, gram, with_ms: bool):
    """The mix Σ_i softmax(z)_i v_i — and with ``with_ms`` its mean square α^T G α / D [..., 1] (clamped at 0: f32
    rounding of nearly cancelling sources must not make it negative)."""
    alpha = jax.nn.softmax(z, axis=0)
    h = jnp.einsum("n...,n...d->...d", alpha, v)
    if not with_ms:
        return h
    ms = jnp.einsum("n...,nm...,m...->...", alpha, gram, alpha)[..., None]
    return h, jnp.maximum(ms, 0) / v.shape[-1]


def attn_res(sources, query, gain, eps: float, *, with_ms: bool = False):
    """sources: sequence of N arrays [..., D] (or one stacked [N, ..., D]); query, gain: [D] → [..., D] (with
    ``with_ms``: and its mean square over D [..., 1], the module docstring)."""
    if isinstance(sources, list | tuple):
        if len(sources) == 1:
            h = sources[0].astype(acc_dtype(sources[0].dtype))
            return (h, jnp.mean(h * h, axis=-1, keepdims=True)) if with_ms else h
        v = jnp.stack(sources)
    else:
        v = sources
    acc = acc_dtype(v.dtype)
    v = v.astype(acc)
    gw = gain.astype(acc) * query.astype(acc)
    gram = jnp.einsum("n...d,m...d->nm...", v, v) if with_ms else None
    return _mixed(_logits(v, gw, eps), v, gram, with_ms)


def attn_res_masked(blocks, count, part, query, gain, eps: float, *, with_ms: bool = False):
    """``attn_res(blocks[:count] + [part], ...)`` with a traced ``count``, for a scanned layer stack: blocks
    [NB, ..., D] is a fixed-size buffer of which the first ``count`` entries are committed block sums (the rest
    zeros), part [..., D] the running sum. The unused slots get logit -inf, hence weight exactly 0 and, holding
    zeros, add exact zeros to the mix (and to α^T G α); only the length of the reductions differs from the unmasked
    form."""
    acc = acc_dtype(part.dtype)
    v = jnp.concatenate([blocks.astype(acc), part.astype(acc)[None]], axis=0)
    gw = gain.astype(acc) * query.astype(acc)
    z = _logits(v, gw, eps)
    gram = jnp.einsum("n...d,m...d->nm...", v, v) if with_ms else None
    nb = blocks.shape[0]
    used = (jnp.arange(nb + 1) < count) | (jnp.arange(nb + 1) == nb)
    z = jnp.where(used.reshape((nb + 1,) + (1,) * (z.ndim - 1)), z, -jnp.inf)
    return _mixed(z, v, gram, with_ms)

