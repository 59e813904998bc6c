"""Stable LatentMoE (SPEC §7.1) and the standard Kimi-Linear MoE (SPEC §13), one function.

    s, ids, w, α = route(x)                          router on FULL-width x; bias selects only
    z = x @ W_down                                   latent ℓ (LatentMoE) — or z = x (standard)
    u = Σ_a w_a · E_{ids_a}(z)                       SiTU-GLU / SwiGLU experts, dropless
    y = RMSNorm(u; latent_norm) @ W_up + Shared(x)   (standard MoE: y = u + Shared(x))

``dispatch`` picks the expert computation: "sorted" (ragged_dot, the default) or "dense" (reference). A callable
``experts_fn(z, ids, weights, w1, w3, w2, act, act_quant=...)`` may be passed instead (expert parallelism plugs in
here). QAT (SPEC §10.7) fake-quantizes the expert weights (MXFP4, blocks along `in`) and the expert GEMM inputs
(MXFP8) with straight-through gradients.
"""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp

from k3jax.layers.ffn import glu_ffn
from k3jax.ops.activations import glu_activation
from k3jax.ops.grouped_matmul import EXPERT_IMPLS
from k3jax.ops.norms import acc_dtype, rms_norm
from k3jax.ops.routing import Routing, route


def moe_layer(p, x, *, top_k: int, act: str, beta1: float = 4.0, beta2: float = 25.0, renormalize: bool = True,
              scaling_factor: float = 1.0, norm_eps: float = 1e-5, dispatch="sorted", qat: str = "off",
              qat_weight_rule: str = "even", qat_act_rule: str = "ceil") -> tuple:
    """x [B, T, D] (normed FFN input) → (y [B, T, D], Routing with [B, T, ...] leading axes)."""
    B, T, D = x.shape
    cdt = x.dtype
    acc = acc_dtype(cdt)
    x2 = x.reshape(B * T, D)
    r = route(x2, p["router"], p["bias"], top_k=top_k, renormalize=renormalize, scaling_factor=scaling_factor)
    latent = "down" in p
    z = jnp.einsum("md,dp->mp", x2, p["down"].astype(cdt), preferred_element_type=acc).astype(cdt) if latent else x2
    w1, w3, w2 = p["experts"]["w1"], p["experts"]["w3"], p["experts"]["w2"]
    act_quant = None
    if qat != "off":
        from k3jax.ops import mx  # imported lazily: the plain model never touches MX code

        w1 = mx.fake_quant_mxfp4(w1, axis=1, rule=qat_weight_rule)
        w3 = mx.fake_quant_mxfp4(w3, axis=1, rule=qat_weight_rule)
        w2 = mx.fake_quant_mxfp4(w2, axis=1, rule=qat_weight_rule)
        if qat == "weights+acts":
            act_quant = partial(mx.fake_quant_mxfp8, axis=-1, rule=qat_act_rule)
    experts_fn = EXPERT_IMPLS[dispatch] if isinstance(dispatch, str) else dispatch
    glu = partial(glu_activation, act=act, beta1=beta1, beta2=beta2)
    u = experts_fn(z, r.ids, r.weights, w1, w3, w2, glu, act_quant=act_quant)
    if latent:
        if "latent_norm" in p:
            u = rms_norm(u, p["latent_norm"], norm_eps)
        y = jnp.einsum("mp,pd->md", u.astype(cdt), p["up"].astype(cdt), preferred_element_type=acc)
    else:
        y = u
    if "shared" in p:
        y = y + glu_ffn(p["shared"], x2, act=act, beta1=beta1, beta2=beta2).astype(acc)
    routing = Routing(ids=r.ids.reshape(B, T, -1), weights=r.weights.reshape(B, T, -1),
                      scores=r.scores.reshape(B, T, -1), cutoff=r.cutoff.reshape(B, T))
    return y.reshape(B, T, D).astype(cdt), routing
