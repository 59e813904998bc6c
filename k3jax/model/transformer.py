"""The K3 network forward pass — the only reader of ``K3Config`` (STYLE.md §3.4).

With AttnRes (K3, SPEC §1.3 / §3.2) there is no classic residual: sublayer outputs accumulate into the running
block sum ``part``; committed block sums form ``blocks``; every sublayer input is an AttnRes mix of
``blocks ++ [part]``. Sources and partial sums are kept in at-least-fp32. Without AttnRes (Kimi-Linear) the
standard pre-norm residual is used.

    logits = forward(params, tokens, cfg)                       # [B, T, W] float32 (or wider)
    logits, aux = forward(params, tokens, cfg, return_aux=True) # aux["routing"]: one Routing per MoE layer
                                                                # aux["mla_max_logit"]: [B, N] per MLA layer
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from k3jax.config import K3Config
from k3jax.layers.ffn import glu_ffn
from k3jax.layers.mla import mla_layer
from k3jax.layers.moe import moe_layer
from k3jax.ops.attn_res import attn_res
from k3jax.ops.norms import acc_dtype, rms_norm


def _layer_fns(cfg: K3Config):
    """Unpack the config once into per-sublayer closures that take plain arrays."""
    from k3jax.layers.kda import kda_layer

    eps = cfg.rms_norm_eps
    ffn_kw = dict(act=cfg.hidden_act, beta1=cfg.situ_beta, beta2=cfg.situ_linear_beta)

    def mixer(lp, h):
        if "mla" in lp:
            y, max_logit = mla_layer(lp["mla"], h, norm_eps=cfg.mla_norm_eps, block_size=cfg.mla_block_size)
            return y, {"mla_max_logit": max_logit}
        y, _ = kda_layer(lp["kda"], h, gate_lower_bound=cfg.kda_gate_lower_bound, eps=eps, impl=cfg.kda_impl,
                         chunk_size=cfg.kda_chunk_size)
        return y, {}

    def ffn(lp, h, dispatch):
        if "moe" in lp:
            y, routing = moe_layer(lp["moe"], h, top_k=cfg.num_experts_per_token, renormalize=cfg.moe_renormalize,
                                   scaling_factor=cfg.routed_scaling_factor, norm_eps=eps, dispatch=dispatch,
                                   qat=cfg.qat, qat_weight_rule=cfg.qat_weight_rule, qat_act_rule=cfg.qat_act_rule,
                                   **ffn_kw)
            return y, {"routing": routing}
        return glu_ffn(lp["mlp"], h, **ffn_kw), {}

    return mixer, ffn


def hidden_states(params, tokens, cfg: K3Config, *, dispatch=None):
    """Final hidden state before the output norm [B, T, D] (acc dtype) and the aux dict."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T] integer ids, got shape {tokens.shape}")
    cdt = jnp.dtype(cfg.compute_dtype)
    acc = acc_dtype(cdt)
    eps = cfg.rms_norm_eps
    dispatch = dispatch or cfg.moe_impl
    mixer, ffn = _layer_fns(cfg)
    aux = {"routing": [], "mla_max_logit": []}

    def collect(a):
        for k, v in a.items():
            aux[k].append(v)

    emb = params["embed"][tokens]
    layers = params["layers"]
    if cfg.uses_attn_res:
        S = cfg.attn_res_block_size
        ar = lambda srcs, q: attn_res(srcs, q["query"], q["gain"], eps)  # noqa: E731
        blocks: list = []
        part = emb.astype(acc)
        for l, lp in enumerate(layers):
            h = part if not blocks else ar(blocks + [part], lp["attn_res"])
            if l % S == 0:
                blocks.append(part)
                part = None
            a, ax = mixer(lp, rms_norm(h, lp["input_norm"], eps, out_dtype=cdt))
            collect(ax)
            part = a.astype(acc) if part is None else part + a.astype(acc)
            h = ar(blocks + [part], lp["mlp_res"])
            f, fx = ffn(lp, rms_norm(h, lp["post_norm"], eps, out_dtype=cdt), dispatch)
            collect(fx)
            part = part + f.astype(acc)
        h = ar(blocks + [part], params["out_res"])
    else:
        h = emb.astype(acc)
        for lp in layers:
            a, ax = mixer(lp, rms_norm(h, lp["input_norm"], eps, out_dtype=cdt))
            collect(ax)
            h = h + a.astype(acc)
            f, fx = ffn(lp, rms_norm(h, lp["post_norm"], eps, out_dtype=cdt), dispatch)
            collect(fx)
            h = h + f.astype(acc)
    return h, aux


def forward(params, tokens, cfg: K3Config, *, return_aux: bool = False, dispatch=None):
    """tokens [B, T] int → logits [B, T, W] in at-least-fp32 (and the aux dict if ``return_aux``)."""
    h, aux = hidden_states(params, tokens, cfg, dispatch=dispatch)
    acc = h.dtype
    cdt = jnp.dtype(cfg.compute_dtype)
    hn = rms_norm(h, params["final_norm"], cfg.rms_norm_eps, out_dtype=cdt)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    logits = jnp.einsum("btd,dw->btw", hn, head.astype(cdt), preferred_element_type=acc)
    return (logits, aux) if return_aux else logits


def lm_loss(params, tokens, targets, cfg: K3Config, *, mask=None, dispatch=None):
    """Mean next-token cross-entropy (fp32) over ``mask`` (default all positions)."""
    logits = forward(params, tokens, cfg, dispatch=dispatch)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if mask is None:
        return jnp.mean(ce)
    mask = mask.astype(ce.dtype)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


__all__ = ["forward", "hidden_states", "lm_loss"]
