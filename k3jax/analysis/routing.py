"""Routing statistics over the per-layer ``Routing`` records that ``forward(..., return_aux=True)`` returns.

    summary = routing_summary(aux["routing"], num_experts=cfg.num_experts, moe_layers=[...])
"""

from __future__ import annotations

import numpy as np


def expert_load(ids, num_experts: int) -> np.ndarray:
    """Tokens routed to each expert: bincount of the [..., A] selected ids → [E]."""
    return np.bincount(np.asarray(ids).reshape(-1), minlength=num_experts)


def layer_summary(routing, num_experts: int) -> dict:
    """Load balance and score statistics for one MoE layer."""
    ids = np.asarray(routing.ids)
    load = expert_load(ids, num_experts).astype(np.float64)
    mean = load.mean()
    p = load / max(load.sum(), 1.0)
    nz = p[p > 0]
    w = np.asarray(routing.weights, np.float64)
    return {
        "tokens": int(np.prod(ids.shape[:-1])),
        "max_over_mean_load": float(load.max() / mean) if mean > 0 else float("nan"),
        "load_cv": float(load.std() / mean) if mean > 0 else float("nan"),
        "experts_unused": int(np.sum(load == 0)),
        "load_entropy_bits": float(-(nz * np.log2(nz)).sum()),
        "max_entropy_bits": float(np.log2(num_experts)),
        "top1_weight_mean": float(w[..., 0].mean()),
        "score_mean": float(np.asarray(routing.scores, np.float64).mean()),
        "cutoff_mean": float(np.asarray(routing.cutoff, np.float64).mean()),
    }


def routing_summary(routings, num_experts: int, moe_layers) -> list[dict]:
    return [dict(layer=int(l), **layer_summary(r, num_experts)) for l, r in zip(moe_layers, routings)]
