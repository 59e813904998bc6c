"""Featurisation before the KDA core (docs/model.md §4.1, §4.2): the two decay gates, the short conv and the q/k L2
norm.

Parameter-free math shared by ``k3jax.layers.kda``; everything is computed in ``acc_dtype`` (fp32 or wider).
Float64 twins: ``k3jax.reference.kda`` (``gate_safe``, ``gate_softplus``, ``short_conv``, ``l2norm``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.norms import acc_dtype


def gate_safe(raw, dt_bias, A_log, lower_bound: float):
    """K3 safe gate: lb * sigmoid(exp(A_log[n]) * (raw + dt_bias[n, k])). raw [..., N, K]; dtype >= fp32."""
    ct = acc_dtype(raw.dtype)
    a = jnp.exp(A_log.astype(ct))[:, None]
    return lower_bound * jax.nn.sigmoid(a * (raw.astype(ct) + dt_bias.astype(ct)))


def gate_softplus(raw, dt_bias, A_log):
    """Kimi-Linear gate: -exp(A_log[n]) * softplus(raw + dt_bias[n, k]); jax.nn.softplus is overflow-safe."""
    ct = acc_dtype(raw.dtype)
    a = jnp.exp(A_log.astype(ct))[:, None]
    return -a * jax.nn.softplus(raw.astype(ct) + dt_bias.astype(ct))


def causal_conv_silu(u, w, tail=None, lengths=None, run=None):
    """Causal depthwise conv (tap Wc-1 hits the current token) + SiLU, with an optional cache.

    u: [B, T, X] pre-conv inputs, X channels (N K or N V, head-major); w: [X, Wc], Wc taps; tail: [B, Wc-1, X] the
    previous Wc-1 inputs, oldest first (zeros when None); lengths: [B] int, the number of real (not right-padding)
    tokens of each row (default T): the new tail then ends at each row's last real token. run: None, or [B, T] the
    packed row's document index (``k3jax.ops.segments.runs``): a tap reaching into another document reads zero, as
    at a sequence start (the tail continues run 0).
    Returns (y [B, T, X] in >= fp32, new tail [B, Wc-1, X]: the last Wc-1 inputs of tail ++ u[:, :lengths]).
    """
    ct = acc_dtype(jnp.promote_types(u.dtype, w.dtype))
    B, T, X = u.shape
    Wc = w.shape[1]
    if tail is None:
        tail = jnp.zeros((B, Wc - 1, X), ct)
    elif tuple(tail.shape) != (B, Wc - 1, X):
        raise ValueError(f"conv cache shape {tuple(tail.shape)} must be [B, Wc-1, X] = {(B, Wc - 1, X)}")
    ext = jnp.concatenate([tail.astype(ct), u.astype(ct)], axis=1)   # [B, T + Wc - 1, X]
    w = w.astype(ct)
    if run is not None:                                              # zero the taps of earlier documents
        run = jnp.asarray(run, jnp.int32)
        run_ext = jnp.concatenate([jnp.zeros((B, Wc - 1), jnp.int32), run], axis=1)
        taps = [jnp.where((run_ext[:, i:i + T] == run)[..., None], ext[:, i:i + T, :], 0.0) for i in range(Wc)]
    else:
        taps = [ext[:, i:i + T, :] for i in range(Wc)]
    y = sum(w[:, i] * tap for i, tap in enumerate(taps))
    if lengths is None:
        return jax.nn.silu(y), ext[:, T:, :]
    idx = jnp.asarray(lengths, jnp.int32)[:, None] + jnp.arange(Wc - 1, dtype=jnp.int32)[None, :]   # ext rows
    return jax.nn.silu(y), jnp.take_along_axis(ext, idx[:, :, None], axis=1)


def l2norm(z, eps: float = 1e-6):
    """z / sqrt(sum z^2 + eps) over the last axis, in >= fp32."""
    z = z.astype(acc_dtype(z.dtype))
    return z * jax.lax.rsqrt(jnp.sum(z * z, axis=-1, keepdims=True) + eps)
