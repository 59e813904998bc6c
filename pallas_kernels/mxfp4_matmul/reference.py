"""jnp rungs for the MXFP4 matmul kernels: dequantize, then matmul (docs/numerics.md §10.8).

Ladder (docs/design.md §3.2): ``mxfp4_gmm_loop_reference`` (a masked loop over experts) -> ``mxfp4_gmm_reference``
(``lax.ragged_dot`` on the dequantized stack) -> the ``mxfp4_gmm`` kernel; dense: ``mxfp4_matmul_reference``; the
small-batch routed FFN (rows.py): ``glu_ffn_rows_reference`` (every expert on every row, gated).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from k3jax.ops import mx


def dequantize_packed(packed, scale, dtype=jnp.float32):
    """Packed [..., N, K/2] + scale [..., N, K/32] -> W [..., N, K] (exact)."""
    return mx.mxfp4_dequantize(mx.unpack_codes(packed), scale, axis=-1, dtype=dtype)


def mxfp4_matmul_reference(x, packed, scale):
    """y [M, N] = x [M, K] @ W[N, K]ᵀ with W = dequant(packed, scale); fp32 accumulation, output in x.dtype."""
    w = dequantize_packed(packed, scale)
    y = jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def mxfp4_gmm_reference(x, packed, scale, group_sizes):
    """Grouped: rows of x sorted by expert, group_sizes [G]; W_g = dequant(packed[g], scale[g]) [N, K].

    y[r] = x[r] @ W_{g(r)}ᵀ for r < sum(group_sizes); rows past the groups are 0. Output in x.dtype.
    """
    w_gkn = jnp.swapaxes(dequantize_packed(packed, scale), 1, 2)
    y = lax.ragged_dot(x.astype(jnp.float32), w_gkn, group_sizes.astype(jnp.int32),
                       precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def mxfp4_gmm_loop_reference(x, packed, scale, group_sizes):
    """The slowest rung: one full matmul per expert, rows selected by mask."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    rows = jnp.arange(x.shape[0])[:, None]
    y = jnp.zeros((x.shape[0], packed.shape[1]), jnp.float32)
    for g in range(packed.shape[0]):
        yg = mxfp4_matmul_reference(x.astype(jnp.float32), packed[g], scale[g])
        y = jnp.where((rows >= starts[g]) & (rows < ends[g]), yg, y)
    return y.astype(x.dtype)


def glu_ffn_rows_reference(x, ids, weights, w1, w3, w2, act, rule=None):
    """Σ_a weights[n, a] · FFN_{ids[n, a]}(x[n]) → fp32 [N, P], each expert's FFN in the kernels' roundings: a, b and
    y_e rounded to x.dtype, h = act(a, b) in fp32 rounded to x.dtype, then MXFP8 (``rule``; None: none). w1, w3, w2:
    (packed, scale) stacks [G, ...]; ids ≥ G: no expert."""
    dt, G = x.dtype, w1[0].shape[0]
    out = jnp.zeros(x.shape, jnp.float32)
    for e in range(G):
        a = mxfp4_matmul_reference(x, w1[0][e], w1[1][e])
        b = mxfp4_matmul_reference(x, w3[0][e], w3[1][e])
        h = act(a.astype(jnp.float32), b.astype(jnp.float32)).astype(dt)
        h = h if rule is None else mx.fake_quant_mxfp8(h, axis=-1, rule=rule)
        y = mxfp4_matmul_reference(h, w2[0][e], w2[1][e]).astype(jnp.float32)
        gate = jnp.sum(jnp.where(ids == e, weights.astype(jnp.float32), 0.0), axis=1)
        out = out + gate[:, None] * y
    return out


__all__ = ["dequantize_packed", "glu_ffn_rows_reference", "mxfp4_gmm_loop_reference", "mxfp4_gmm_reference",
           "mxfp4_matmul_reference"]
