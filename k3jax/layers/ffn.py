"""Gated FFN block (SiTU-GLU for K3, SwiGLU for Kimi-Linear): dense layer-0 MLP and the fused shared experts."""

from __future__ import annotations

import jax.numpy as jnp

from k3jax.ops.activations import glu_activation
from k3jax.ops.norms import acc_dtype


def glu_ffn(p, x, *, act: str, beta1: float = 4.0, beta2: float = 25.0):
    """p = {w_gate [D, F], w_up [D, F], w_down [F, D]}; x [..., D] → [..., D] (x.dtype)."""
    acc = acc_dtype(x.dtype)
    a = jnp.einsum("...d,df->...f", x, p["w_gate"].astype(x.dtype), preferred_element_type=acc)
    b = jnp.einsum("...d,df->...f", x, p["w_up"].astype(x.dtype), preferred_element_type=acc)
    h = glu_activation(a, b, act=act, beta1=beta1, beta2=beta2).astype(x.dtype)
    return jnp.einsum("...f,fd->...d", h, p["w_down"].astype(x.dtype), preferred_element_type=acc).astype(x.dtype)
