"""The jnp rung of the fused GLU + MXFP8 kernel: what ``glu_mxfp8`` computes, as XLA runs it unfused."""

from __future__ import annotations

import jax.numpy as jnp

from k3jax.ops import mx


def glu_mxfp8_reference(a, b, act, dtype, rule: str = "ceil", acc=jnp.float32):
    """h = qdq_E4M3(act(a, b) in ``acc`` rounded to ``dtype``) in blocks of 32 along the last axis, straight-through
    (``mx.fake_quant_mxfp8``)."""
    h = act(a.astype(acc), b.astype(acc)).astype(dtype)
    return mx.fake_quant_mxfp8(h, axis=-1, rule=rule)
