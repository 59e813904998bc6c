"""Expert-load balancing during training (docs/model.md §8): Quantile Balancing (K3), with the DeepSeek sign rule and an
auxiliary loss as ablation baselines.

    mode "qb"    b_new = centre(b̂) from the step's global r-histogram (k3jax.optim.qb, §8.2)      [K3]
                 with qb_ema = ρ > 0: b_new = centre(ρ·b + (1 − ρ)·b̂), an EMA of b̂ across steps (§8.2, optional
                 in K3; k3jax default ρ = 0, off)
    mode "sign"  b_j += γ · sign(mean(load) − load_j), γ = 0.001                                  [DeepSeek-V3]
    mode "aux"   bias frozen; loss += α · Σ_j f_j · P_j  (f_j = E/(k·m) · load_j, P_j = mean_i s_ij/Σ_e s_ie)
    mode "off"   bias frozen, no loss term

Per step: every micro-batch's routing adds into ``step_stats`` (integer counts, so the sum over micro-batches and
data-parallel shards is exact); ``new_biases`` turns them into the next step's biases once, after the update.
The current step's routing always used the old bias (causality, §8.1). Eval never calls this (bias frozen).

Batch size matters for what the per-step load figure means (measured on k3-mini, 32 experts top-4, experiments/LOG.md
session 3). Even with the best single bias, 64-byte windows leave the worst layer's max/mean at ~1.21 on 4096-token
batches, ~1.10 at 16k and ~1.07 at 32k, from batch composition alone. In a from-scratch run at 32k tokens/step every
layer was <= 1.2 from step 43 on, except one layer at 1.202 at step 48.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.model import gather_layers, map_layers
from k3jax.optim.qb import QB_BINS, center, qb_bias_from_hist, qb_histogram

MODES = ("qb", "sign", "aux", "off")


def moe_layer_indices(cfg) -> list[int]:
    """0-based indices of the MoE layers, in the order forward() reports their routing."""
    return [l for l in range(cfg.num_layers) if cfg.is_moe(l)]


def biases(params, cfg):
    """[L_moe, E] float32: the current selection biases, in layer order."""
    return gather_layers(params, cfg, moe_layer_indices(cfg), lambda lp: lp["moe"]["bias"])


def set_biases(params, b_le, cfg):
    """params with the MoE layers' biases replaced by the rows of ``b_le`` [L_moe, E] (layer order)."""

    def one(lp, b):
        return dict(lp, moe=dict(lp["moe"], bias=b.astype(lp["moe"]["bias"].dtype)))

    return map_layers(params, cfg, moe_layer_indices(cfg), one, b_le)


def micro_stats(routing, b_le, num_experts: int, *, mode: str, bins: int = QB_BINS) -> dict:
    """Integer statistics of one micro-batch: loads [L, E] and (qb) histograms [L, E, bins].

    One vmapped computation over the MoE layers (their routing outputs all have one shape), so the train step's
    program does not grow with depth."""
    ids = jnp.stack([r.ids for r in routing])
    loads = jax.vmap(lambda i: jnp.bincount(i.reshape(-1), length=num_experts).astype(jnp.int32))(ids)
    out = {"loads": loads}
    if mode == "qb":
        scores, cutoff = jnp.stack([r.scores for r in routing]), jnp.stack([r.cutoff for r in routing])
        out["hist"] = jax.vmap(lambda s, a, b: qb_histogram(s, a, b, bins=bins))(scores, cutoff, b_le)
    return out


def aux_loss(routing, top_k: int):
    """Σ over MoE layers of Σ_j f_j · P_j (Switch / DeepSeek form; equals 1 per layer when perfectly balanced)."""
    total = jnp.float32(0.0)
    for r in routing:
        E = r.scores.shape[-1]
        s = r.scores.reshape(-1, E).astype(jnp.float32)
        m = s.shape[0]
        f = jnp.bincount(r.ids.reshape(-1), length=E).astype(jnp.float32) * (E / (top_k * m))
        p = jnp.mean(s / jnp.sum(s, axis=-1, keepdims=True), axis=0)
        total = total + jnp.sum(f * p)
    return total


def new_biases(stats: dict, b_le, *, mode: str, top_k: int, sign_gamma: float = 1e-3, qb_ema: float = 0.0):
    """Next step's biases [L, E] from the step's summed statistics.

    qb_ema = ρ in [0, 1): the QB target is averaged with the current bias, which is itself the previous average,
    so the bias is an exponential moving average of the per-step b̂ (ρ = 0: plain QB)."""
    if mode == "qb":
        b_hat = jax.vmap(lambda h, b: qb_bias_from_hist(h, b, top_k))(stats["hist"], b_le)
        if qb_ema:
            b_hat = qb_ema * b_le + (1.0 - qb_ema) * b_hat
        return jax.vmap(center)(b_hat)
    if mode == "sign":
        load = stats["loads"].astype(jnp.float32)
        return b_le + sign_gamma * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return b_le


def load_ratio(loads_le):
    """max/mean expert load per layer [L] (1 = perfectly balanced)."""
    load = loads_le.astype(jnp.float32)
    return jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)


__all__ = ["MODES", "aux_loss", "biases", "load_ratio", "micro_stats", "moe_layer_indices", "new_biases",
           "set_biases"]
