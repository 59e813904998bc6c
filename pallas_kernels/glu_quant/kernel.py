"""The fused GLU + MXFP8 kernel body (TPU schedule; the CPU tests run it in the Pallas interpreter).

One [bm, bf] tile of a and b in, one tile of h out: h = act(a, b) rounded to h's dtype, then the MXFP8 (E4M3)
quantize-dequantize of each aligned block of 32 columns. A block never straddles a tile (bf is a multiple of 32),
so each tile quantizes alone. The block max is found in place by a butterfly over lane rolls (``block_max``), and
``mx.mxfp8_qdq_elementwise`` does the rest with element-wise integer / float32 arithmetic: nothing is reshaped to
[.., 32] (a 32-wide minor dimension is padded to 128 lanes on TPU) and no float8 dtype is needed.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops import mx
from k3jax.ops.fp32_bits import flush_subnormals


def block_max(x):
    """Each element's max over its aligned group of 32 along the last axis (a multiple of 32 long): five xor steps,
    lane l meeting lane l ^ s through a roll by +s or -s. ``jnp.maximum`` propagates NaN, so a block holding one
    is NaN throughout (``mx``'s documented block semantics)."""
    n = x.shape[-1]
    lane = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    for s in (1, 2, 4, 8, 16):
        below = pltpu.roll(x, s, x.ndim - 1)         # below[l] = x[l - s]
        above = pltpu.roll(x, n - s, x.ndim - 1)     # above[l] = x[l + s]
        x = jnp.maximum(x, jnp.where((lane & s) != 0, below, above))
    return x


def glu_mxfp8_tile(a, b, act, rule: str | None, dtype, acc):
    """h of one VMEM tile: act(a, b) in ``acc`` rounded to ``dtype``, then the MXFP8 qdq of its aligned 32-column
    blocks (``rule``; None: no quant). Also the small-batch routed FFN's hidden (mxfp4_matmul/rows.py)."""
    h = act(a.astype(acc), b.astype(acc), remat=False).astype(dtype)  # no checkpoint in a kernel body
    if rule is None:
        return h
    x = flush_subnormals(h.astype(jnp.float32))
    return mx.mxfp8_qdq_elementwise(x, block_max(jnp.abs(x)), rule=rule, dtype=dtype)


def glu_mxfp8_kernel(a_ref, b_ref, h_ref, *, act, rule: str, acc):
    h_ref[...] = glu_mxfp8_tile(a_ref[...], b_ref[...], act, rule, h_ref.dtype, acc)


def estimate(rows: int, cols: int, in_itemsize: int, out_itemsize: int) -> pl.CostEstimate:
    """One read of a and b, one write of h; no matmul FLOPs (the plans' FLOPs are the MXU's), three transcendentals
    per element (SiTU-GLU's two tanh and a sigmoid)."""
    n = rows * cols
    return pl.CostEstimate(flops=0, transcendentals=3 * n, bytes_accessed=n * (2 * in_itemsize + out_itemsize))
