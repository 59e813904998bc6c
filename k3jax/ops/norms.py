"""RMSNorm (docs/model.md §2.3): statistic in at-least-fp32, eps inside the rsqrt on the mean, cast after the gain."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def acc_dtype(dtype):
    """The accumulation dtype: fp32, or wider when the input is wider (float64 tests stay float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(x, w, eps: float, *, out_dtype=None, ms=None):
    """w ⊙ x · (mean_i x_i² + eps)^(-1/2) over the last axis; returns ``out_dtype`` (default x.dtype). ``ms``
    [..., 1]: that mean square when the caller has it already (an AttnRes mix's, ``attn_res(with_ms=True)``)."""
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    ms = jnp.mean(xf * xf, axis=-1, keepdims=True) if ms is None else ms.astype(acc)
    y = xf * lax.rsqrt(ms + eps)
    return (y * w.astype(acc)).astype(out_dtype or x.dtype)
