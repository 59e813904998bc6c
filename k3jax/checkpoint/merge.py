"""A LoRA adapter merged into its base for export (`k3 export OUT --from BASE --merge-adapter DIR`).

    merged, report = merge_adapter(params, lora, expert_format="mxfp4")     # params: base + adapter leaves

Every adapted leaf W becomes W + (alpha / r) A B (``ops.lora.lora_weight``, at least fp32); the result is a plain
base tree the writer stores in the official layout. Routed experts stored as MXFP4 are re-quantized by the writer
(compressed-tensors' "even" scale rule, blocks of 32 along ``in``), and the rounding can erase a small delta, so the
report says per layer and stack how much of it survives on the grid:

    delta_rel    ||Δ|| / ||W||                                  the adapter's change, relative to the weight
    requant_rel  ||Q(W + Δ) − (W + Δ)|| / ||W + Δ||             the re-quantization error
    delta_kept   <Q(W + Δ) − Q(W), Δ> / ||Δ||²                  the share of Δ the stored weights carry
                                                                (1: all of it; 0: nothing moved on the grid)
    moved        the fraction of weights whose stored value changed

(Q(W) is W itself for a base read from MXFP4 bytes.) Dense leaves are written in the checkpoint's float dtype; their
rounding is the dtype's and is not reported.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import K3Config, LoRAConfig
from k3jax.layers.lora import adapter_names, is_adapter
from k3jax.model.layout import restack, unstack
from k3jax.ops import mx
from k3jax.ops.lora import lora_weight


def _merge_dict(node: dict, scale: float, stats: dict, where: str, quantize_experts: bool) -> dict:
    out = {k: v for k, v in node.items() if not is_adapter(k)}
    for k in list(out):
        na, nb = adapter_names(k)
        if na not in node:
            continue
        w = jnp.asarray(out[k], jnp.float32)
        merged = lora_weight(w, node[na], node[nb], scale)
        merged = jnp.where(merged == w, w, merged)     # where nothing changed, W as it was (-0.0 + 0 would be +0.0)
        out[k] = merged
        if quantize_experts and where.endswith("experts"):
            q = lambda x: mx.qdq(x, axis=-2, fmt="e2m1", rule="even")  # noqa: E731  blocks along ``in`` of [E, in, out]
            d = merged - w
            qm, qw = q(merged), q(w)
            dd = float(jnp.sum(d * d))
            stats[f"{where}.{k}"] = {
                "delta_rel": float(jnp.linalg.norm(d) / jnp.maximum(jnp.linalg.norm(w), 1e-30)),
                "requant_rel": float(jnp.linalg.norm(qm - merged) / jnp.maximum(jnp.linalg.norm(merged), 1e-30)),
                "delta_kept": float(jnp.sum((qm - qw) * d) / dd) if dd > 0 else 1.0,
                "moved": float(jnp.mean(qm != qw))}
    for k, v in out.items():
        if isinstance(v, dict):
            out[k] = _merge_dict(v, scale, stats, f"{where}.{k}" if where else str(k), quantize_experts)
    return out


def merge_adapter(params, cfg: K3Config, lora: LoRAConfig, *, expert_format: str | None = None):
    """(the merged base tree in the state layout, {"tensors": per layer and leaf stats, "summary": ...}).
    ``params``: a float base (experts dequantized) with the adapter's leaves merged in
    (``layers.experts.merge_trees``)."""
    fmt = expert_format or cfg.expert_format
    view = unstack(jax.device_get(params), cfg)
    stats: dict = {}
    layers = [_merge_dict(lp, lora.scale, stats, f"layers.{l}", fmt == "mxfp4") for l, lp in enumerate(view["layers"])]
    top = _merge_dict({k: v for k, v in view.items() if k != "layers"}, lora.scale, stats, "", fmt == "mxfp4")
    merged = restack({**top, "layers": layers}, cfg)
    summary = {}
    if stats:
        kept = np.array([s["delta_kept"] for s in stats.values()])
        summary = {"expert_tensors": len(stats), "delta_kept_mean": float(kept.mean()),
                   "delta_kept_min": float(kept.min()),
                   "requant_rel_max": max(s["requant_rel"] for s in stats.values()),
                   "moved_mean": float(np.mean([s["moved"] for s in stats.values()]))}
    return merged, {"tensors": stats, "summary": summary}


__all__ = ["merge_adapter"]
