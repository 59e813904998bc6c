"""Stable LatentMoE (docs/model.md §7.1) and the standard Kimi-Linear MoE (docs/model.md §13), one NNX block.

    s, ids, w, α = route(x)                          router on FULL-width x; bias selects only
    z = x @ W_down                                   latent ℓ (LatentMoE) — or z = x (standard)
    u = Σ_a w_a · E_{ids_a}(z)                       SiTU-GLU / SwiGLU experts, dropless
    y = RMSNorm(u; latent_norm) @ W_up + Shared(x)   (standard MoE: y = u + Shared(x))

Parameters (E routed experts, P their width — the latent ℓ, or D —, F expert hidden): router [D, E];
bias [E] (the Quantile-Balancing buffer, float32, not trained); experts.w1 / w3 [E, P, F], experts.w2 [E, F, P];
shared: a GLU of hidden num_shared · F (absent if 0); down [D, P], up [P, D], latent_norm [P] (LatentMoE only).

``dispatch`` picks the expert computation: "sorted" (ragged_dot, the default), "ragged", "tiled" or "dense"
(reference). A callable ``experts_fn(z, ids, weights, w1, w3, w2, act, act_quant=...)`` may be passed instead
(expert parallelism plugs in here). QAT (docs/numerics.md §10.7) fake-quantizes the expert weights (MXFP4, blocks along
`in`) and the expert GEMM inputs (MXFP8) with straight-through gradients.

Packed experts (frozen, the checkpoint's MXFP4 bytes; the schema in k3jax/layers/experts.py): ``Experts.to_packed()``
swaps the three Params for ``PackedExperts`` variables (not Params: ``nnx.state(model, nnx.Param)``, gradients and
optimizers never see them) w1_packed / w3_packed uint8 [E, F, P/2], w1_scale / w3_scale [E, F, P/32], w2_packed
[E, P, F/2], w2_scale [E, P, F/32] — the torch orientation of ``load(..., keep_experts_packed=True)``. The experts
then run from the bytes
(k3jax/ops/packed_experts.py; the Pallas grouped MXFP4 matmul on GPU/TPU): dispatch "sorted" = platform choice,
"tiled" = the XLA loop, "ragged" = the Pallas kernel, "dense" = dequantize + the dense reference; a callable gets
``PackedWeight`` pairs in its weight slots. QAT leaves packed weights alone (they are on the MXFP4 grid already) and
still fake-quantizes the GEMM inputs.
"""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
from flax import nnx

from k3jax.config import QAT_MODES
from k3jax.layers import backends, lora
from k3jax.layers.common import HFLeaf, normal, param, vec
from k3jax.layers.experts import PACKED_DISPATCH, Experts
from k3jax.layers.ffn import GLU
from k3jax.ops import mx
from k3jax.ops.activations import glu_activation
from k3jax.ops.grouped_matmul import EXPERT_IMPLS
from k3jax.ops.lora_experts import experts_lora
from k3jax.ops.norms import acc_dtype, rms_norm
from k3jax.ops.packed_experts import experts_packed
from k3jax.ops.routing import Routing, route


class MoE(nnx.Module):
    """Routed experts + shared experts (+ the LatentMoE projections); HF module ``block_sparse_moe.``."""

    HF = {
        "router": HFLeaf("gate.weight"),
        "bias": vec("gate.e_score_correction_bias", "F32"),
        "experts": "experts.",
        "shared": "shared_experts.",
        "down": HFLeaf("routed_expert_down_proj.weight"),
        "up": HFLeaf("routed_expert_up_proj.weight"),
        "latent_norm": vec("routed_expert_norm.weight"),
    }

    def __init__(self, *, d: int, num_experts: int, expert_hidden: int, num_shared: int, latent: int | None,
                 latent_norm: bool, dtype=jnp.float32, rngs: nnx.Rngs):
        E, F = num_experts, expert_hidden
        P = latent if latent is not None else d
        self.router = param(normal(rngs, (d, E), dtype), ("embed", "experts"))
        # the QB bias is read whole by every device's top-k and updated replicated (k3jax/sharding/qb.py): split over
        # experts, the scores it is added to were split too and gathered again at every layer
        self.bias = param(jnp.zeros((E,), acc_dtype(dtype)), ("norm",))
        self.experts = Experts(num_experts=E, width=P, hidden=F, width_axis="latent" if latent else "embed",
                               dtype=dtype, rngs=rngs)
        if num_shared:
            self.shared = GLU(d=d, hidden=num_shared * F, dtype=dtype, rngs=rngs)
        if latent is not None:
            self.down = param(normal(rngs, (d, P), dtype), ("embed", "latent"))
            self.up = param(normal(rngs, (P, d), dtype), ("latent", "embed"))
            if latent_norm:
                self.latent_norm = param(jnp.ones((P,), dtype), ("norm",))

    def __call__(self, x, *, top_k: int, act: str, beta1: float = 4.0, beta2: float = 25.0,
                 renormalize: bool = True, scaling_factor: float = 1.0, norm_eps: float = 1e-5, dispatch="sorted",
                 qat: str = "off", qat_weight_rule: str = "even", qat_act_rule: str = "ceil") -> tuple:
        """x [B, T, D] (normed FFN input) → (y [B, T, D], Routing with [B, T, ...] leading axes)."""
        if qat not in QAT_MODES:
            raise ValueError(f"qat must be one of {QAT_MODES}, got {qat!r}")
        B, T, D = x.shape
        cdt = x.dtype
        acc = acc_dtype(cdt)
        x2 = x.reshape(B * T, D)
        router = self.router[...]
        if hasattr(dispatch, "replicate"):                # expert parallelism: the router whole on each device
            router = dispatch.replicate(router)
        r = route(x2, router, self.bias[...], top_k=top_k, renormalize=renormalize,
                  scaling_factor=scaling_factor)
        latent = hasattr(self, "down")
        z = (jnp.einsum("md,dp->mp", x2, self.down[...].astype(cdt), preferred_element_type=acc).astype(cdt)
             if latent else x2)
        w1, w3, w2 = self.experts.weights()
        packed = self.experts.is_packed
        adapted = any(lora.has_adapter(self.experts, n) for n in ("w1", "w3", "w2"))
        act_quant = None
        if qat != "off":
            if not packed:
                w1 = mx.fake_quant_mxfp4(w1, axis=1, rule=qat_weight_rule)
                w3 = mx.fake_quant_mxfp4(w3, axis=1, rule=qat_weight_rule)
                w2 = mx.fake_quant_mxfp4(w2, axis=1, rule=qat_weight_rule)
            if qat == "weights+acts":
                act_quant = backends.act_quant_mxfp8(qat_act_rule)
        if adapted:                                       # per-expert LoRA factors ride in the stacks' slots
            w1, w3, w2 = (w.one_layer() if packed else w for w in (w1, w3, w2))   # over one layer's base
            w1, w3, w2 = lora.expert_stacks(self.experts, (w1, w3, w2))
        if not isinstance(dispatch, str):
            experts_fn = dispatch
        elif adapted:
            experts_fn = partial(experts_lora, gmm=backends.mxfp4_gmm if packed else None)
        elif packed:
            experts_fn = partial(experts_packed, impl=PACKED_DISPATCH[dispatch], gmm=backends.mxfp4_glu_ffn)
        else:
            experts_fn = EXPERT_IMPLS[dispatch]
        glu = partial(glu_activation, act=act, beta1=beta1, beta2=beta2)
        u = experts_fn(z, r.ids, r.weights, w1, w3, w2, glu, act_quant=act_quant)
        if latent:
            if hasattr(self, "latent_norm"):
                u = rms_norm(u, self.latent_norm[...], norm_eps)
            y = jnp.einsum("mp,pd->md", u.astype(cdt), self.up[...].astype(cdt), preferred_element_type=acc)
        else:
            y = u
        if hasattr(self, "shared"):
            y = y + self.shared(x2, act=act, beta1=beta1, beta2=beta2).astype(acc)
        routing = Routing(ids=r.ids.reshape(B, T, -1), weights=r.weights.reshape(B, T, -1),
                          scores=r.scores.reshape(B, T, -1), cutoff=r.cutoff.reshape(B, T))
        return y.reshape(B, T, D).astype(cdt), routing


__all__ = ["MoE"]
