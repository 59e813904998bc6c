"""SiTU-GLU and SwiGLU (docs/model.md §6), element-wise math in at-least-fp32.

SiTU(a; β1) = β1·tanh(a/β1)·σ(a)   (gate branch, bounded Swish)
SiTU-GLU(a, b) = SiTU(a; β1) ⊙ β2·tanh(b/β2)   |·| < β1·β2 = 100 for K3
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.norms import acc_dtype


def situ(a, beta: float):
    af = a.astype(acc_dtype(a.dtype))
    return beta * jnp.tanh(af / beta) * jax.nn.sigmoid(af)


def situ_glu(a, b, beta1: float, beta2: float):
    """SiTU-GLU hidden activation from gate pre-activation ``a`` and up pre-activation ``b``."""
    bf = b.astype(acc_dtype(b.dtype))
    return situ(a, beta1) * (beta2 * jnp.tanh(bf / beta2))


def swiglu(a, b):
    """Kimi-Linear's SiLU-GLU: silu(a) ⊙ b."""
    acc = acc_dtype(a.dtype)
    return jax.nn.silu(a.astype(acc)) * b.astype(acc)


def glu_activation(a, b, *, act: str, beta1: float = 4.0, beta2: float = 25.0, remat: bool = True):
    """The GLU hidden activation of gate / up pre-activations ``a`` / ``b``, under ``jax.checkpoint``: its backward
    keeps the two inputs and recomputes the element-wise math, where autodiff kept every intermediate — SiTU-GLU's
    tanh, sigmoid and products are eight fp32 arrays of the expert rows (8 GB per MoE layer and chip of the full
    model's QAT step on v5p-512, experiments/LOG.md). Same values; the recompute is element-wise. ``remat=False``
    leaves the checkpoint out: inside a kernel body, which differentiates nothing and cannot lower it."""
    fns = {"situ": lambda a, b: situ_glu(a, b, beta1, beta2), "silu": swiglu}
    if act in fns:
        return jax.checkpoint(fns[act])(a, b) if remat else fns[act](a, b)
    raise ValueError(f"unknown GLU activation {act!r} (expected 'situ' or 'silu')")


def glu_hidden(a, b, act, dtype, *, act_quant=None, acc=jnp.float32):
    """The GLU hidden of the expert FFNs: h = act(a, b) in ``acc``, rounded to ``dtype`` (the rows' dtype), then
    ``act_quant`` (the MXFP8 fake-quant of w2's input, straight-through) when given. An ``act_quant`` that carries a
    fused form (``mx.ActQuant.glu``: a kernel that writes h already quantized, from a and b in one pass) runs that
    instead where it has one for the target (it returns None where not): the same values and gradients, without XLA
    materialising the quant's per-block terms between them."""
    fused = getattr(act_quant, "glu", None)
    h = None if fused is None else fused(a, b, act, dtype, act_quant.rule, acc=acc)
    if h is not None:
        return h
    h = act(a.astype(acc), b.astype(acc)).astype(dtype)
    return h if act_quant is None else act_quant(h)
