"""Model FLOPs per token (for MFU; the peak comes from ``k3jax.bench.common.matmul_peak_flops``).

MFU = flops_per_token · tokens/s / peak, with flops_per_token = 6 · (active matmul parameters) + attention terms
(fwd + bwd = 3 × forward). Routed experts count k/E of their parameters; the embedding lookup counts nothing.
MLA: causal QKᵀ and PV, on average T/2 keys per query. KDA: ~4·K·V per head per token for the state update and read.
"""

from __future__ import annotations

import jax
import numpy as np

from k3jax.config import K3Config


def flops_per_token(cfg: K3Config, params, seq_len: int) -> float:
    dense = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        if leaf.ndim < 2 or names[0] == "embed":
            continue
        n = float(np.prod(leaf.shape))
        if "experts" in names:
            n *= cfg.num_experts_per_token / cfg.num_experts
        dense += n
    attn = 0.0
    for l in range(cfg.num_layers):
        if cfg.is_mla(l):
            attn += 2 * cfg.mla_num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len / 2
        else:
            attn += 4 * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim
    return 6.0 * dense + 3.0 * attn


__all__ = ["flops_per_token"]
