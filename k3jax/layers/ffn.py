"""Gated FFN block (SiTU-GLU for K3, SwiGLU for Kimi-Linear): the dense layer-0 MLP and the fused shared experts.

Parameters: w_gate [D, F], w_up [D, F], w_down [F, D].
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from k3jax.layers import lora
from k3jax.layers.common import HFLeaf, normal, param
from k3jax.ops.activations import glu_activation
from k3jax.ops.norms import acc_dtype


class GLU(nnx.Module):
    """HF module ``mlp.`` (dense) or ``shared_experts.`` (inside the MoE)."""

    LORA = ("w_gate", "w_up", "w_down")  # adapter targets (k3jax/layers/lora.py)
    HF = {"w_gate": HFLeaf("gate_proj.weight"), "w_up": HFLeaf("up_proj.weight"),
          "w_down": HFLeaf("down_proj.weight")}

    def __init__(self, *, d: int, hidden: int, dtype=jnp.float32, rngs: nnx.Rngs):
        self.w_gate = param(normal(rngs, (d, hidden), dtype), ("embed", "mlp"))
        self.w_up = param(normal(rngs, (d, hidden), dtype), ("embed", "mlp"))
        self.w_down = param(normal(rngs, (hidden, d), dtype), ("mlp", "embed"))

    def __call__(self, x, *, act: str, beta1: float = 4.0, beta2: float = 25.0):
        """x [..., D] → [..., D] (x.dtype)."""
        acc = acc_dtype(x.dtype)
        a = lora.proj(self, "w_gate", "...d,df->...f", x, self.w_gate[...].astype(x.dtype), acc)
        b = lora.proj(self, "w_up", "...d,df->...f", x, self.w_up[...].astype(x.dtype), acc)
        h = glu_activation(a, b, act=act, beta1=beta1, beta2=beta2).astype(x.dtype)
        return lora.proj(self, "w_down", "...f,fd->...d", h, self.w_down[...].astype(x.dtype), acc).astype(x.dtype)


__all__ = ["GLU"]
