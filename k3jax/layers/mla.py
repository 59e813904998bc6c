"""Gated MLA token mixer (SPEC §5.1) as an NNX block: NoPE, optional q-LoRA, an unrotated shared key slice k^R,
scale 1/√(Hn+Hr), element-wise sigmoid output gate before o_proj, causal attention computed blockwise
(k3jax.ops.attention).

Parameters (N heads, Hn nope, Hr rope-sized slice, V value, Rq / Rkv the q / kv LoRA ranks):
q_a [D, Rq], q_a_norm [Rq], q_b [Rq, N, Hn+Hr] (q-LoRA) or wq [D, N, Hn+Hr]; kv_a [D, Rkv+Hr]; kv_a_norm [Rkv];
kv_b [Rkv, N, Hn+V]; w_gate [D, N, V] (output gate); wo [N, V, D].
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import HFLeaf, normal, param, vec
from k3jax.ops.attention import causal_attention
from k3jax.ops.norms import acc_dtype, rms_norm

_QKV = ("embed", "heads", "head_dim")


class MLADims(NamedTuple):
    num_heads: int  # N
    nope: int  # Hn
    rope: int  # Hr (the shared, unrotated key slice)
    value: int  # V


class MLA(nnx.Module):
    """Gated multi-head latent attention; HF module ``self_attn.``."""

    HF = {
        "q_a": HFLeaf("q_a_proj.weight"),
        "q_a_norm": vec("q_a_layernorm.weight"),
        "q_b": HFLeaf("q_b_proj.weight"),
        "wq": HFLeaf("q_proj.weight"),
        "kv_a": HFLeaf("kv_a_proj_with_mqa.weight"),
        "kv_a_norm": vec("kv_a_layernorm.weight"),
        "kv_b": HFLeaf("kv_b_proj.weight"),
        "w_gate": HFLeaf("g_proj.weight"),
        "wo": HFLeaf("o_proj.weight", in_axes=2),
    }

    def __init__(self, *, d: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, output_gate: bool,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        N, Hn, Hr, V = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.dims = MLADims(N, Hn, Hr, V)
        if q_lora_rank:
            self.q_a = param(normal(rngs, (d, q_lora_rank), dtype), ("embed", "q_lora"))
            self.q_a_norm = param(jnp.ones((q_lora_rank,), dtype), ("norm",))
            self.q_b = param(normal(rngs, (q_lora_rank, N, Hn + Hr), dtype), ("q_lora", "heads", "head_dim"))
        else:
            self.wq = param(normal(rngs, (d, N, Hn + Hr), dtype), _QKV)
        self.kv_a = param(normal(rngs, (d, kv_lora_rank + Hr), dtype), ("embed", "kv_lora"))
        self.kv_a_norm = param(jnp.ones((kv_lora_rank,), dtype), ("norm",))
        self.kv_b = param(normal(rngs, (kv_lora_rank, N, Hn + V), dtype), ("kv_lora", "heads", "head_dim"))
        if output_gate:
            self.w_gate = param(normal(rngs, (d, N, V), dtype), _QKV)
        self.wo = param(normal(rngs, (N, V, d), dtype), ("heads", "head_dim", "embed"))

    def __call__(self, x, *, norm_eps: float, block_size: int = 512):
        """x [B, T, D] (normed layer input) → (y [B, T, D], max_logit [B, N]) — max_logit feeds QK-Clip."""
        acc = acc_dtype(x.dtype)
        cdt = x.dtype
        N, Hn, Hr, V = self.dims
        rkv = self.kv_a_norm.shape[0]
        if hasattr(self, "q_a"):
            c_q = jnp.einsum("btd,dr->btr", x, self.q_a[...].astype(cdt), preferred_element_type=acc)
            c_q = rms_norm(c_q, self.q_a_norm[...], norm_eps, out_dtype=cdt)
            q = jnp.einsum("btr,rnh->btnh", c_q, self.q_b[...].astype(cdt), preferred_element_type=acc)
        else:
            q = jnp.einsum("btd,dnh->btnh", x, self.wq[...].astype(cdt), preferred_element_type=acc)
        ckv = jnp.einsum("btd,dr->btr", x, self.kv_a[...].astype(cdt), preferred_element_type=acc)
        c_kv = rms_norm(ckv[..., :rkv], self.kv_a_norm[...], norm_eps, out_dtype=cdt)
        k_rope = ckv[..., rkv:]  # [B, T, Hr]: ONE slice shared by all heads, not rotated (NoPE)
        kv = jnp.einsum("btr,rnh->btnh", c_kv, self.kv_b[...].astype(cdt), preferred_element_type=acc)
        k_nope, v = kv[..., :Hn], kv[..., Hn:]
        B, T = x.shape[:2]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (B, T, N, Hr))], axis=-1)
        o, max_logit = causal_attention(q.astype(acc), k.astype(acc), v.astype(acc),
                                        scale=1.0 / math.sqrt(Hn + Hr), block_size=block_size)
        if hasattr(self, "w_gate"):
            gate = jnp.einsum("btd,dnv->btnv", x, self.w_gate[...].astype(cdt), preferred_element_type=acc)
            o = jax.nn.sigmoid(gate) * o
        y = jnp.einsum("btnv,nvd->btd", o.astype(cdt), self.wo[...].astype(cdt), preferred_element_type=acc)
        return y.astype(cdt), max_logit


__all__ = ["MLA", "MLADims"]
