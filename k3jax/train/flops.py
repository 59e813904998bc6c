"""Model FLOPs per token and the matmul peak they are divided by (MFU).

MFU = flops_per_token · tokens/s / peak, with flops_per_token = 6 · (active matmul parameters) + attention terms
(fwd + bwd = 3 × forward). Routed experts count k/E of their parameters; the embedding lookup counts nothing.
MLA: causal QKᵀ and PV, on average T/2 keys per query. KDA: ~4·K·V per head per token for the state update and read.
A matmul weight is a leaf with two or more axes besides the stacked-layers axis of the repeated groups.

The peak is measured, not looked up: ``matmul_peak_flops`` times a jitted n×n matmul in this process (the train
loop calls it at start-up; ``k3 bench`` re-exports it from ``k3jax.bench.common``, so train never imports bench).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import K3Config
from k3jax.model.counts import active_leaf
from k3jax.pytree import key_names


def flops_per_token(cfg: K3Config, params, seq_len: int) -> float:
    """Training FLOPs per token of ``params`` (a state dict, or any tree of arrays / ShapeDtypeStructs)."""
    dense = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = key_names(path)
        # leaves under "groups" carry a leading stacked-layers axis (k3jax/model/layout.py): a [G, D] norm is a vector
        ndim = leaf.ndim - (names[:1] == ("groups",))
        if ndim < 2 or names[0] == "embed":
            continue
        dense += active_leaf(cfg, names, int(np.prod(leaf.shape)))
    attn = 0.0
    for l in range(cfg.num_layers):
        if cfg.is_mla(l):
            attn += 2 * cfg.mla_num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len / 2
        else:
            attn += 4 * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim
    return 6.0 * dense + 3.0 * attn


def time_median(fn, *args, reps: int) -> float:
    """Median wall time of ``fn(*args)`` over ``reps`` runs after one compile + warm-up run."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak_flops(n: int = 1024, dtype=jnp.float32, reps: int = 5) -> float:
    """Achieved FLOP/s of a jitted [n, n] @ [n, n] matmul — the 'peak' that efficiency ratios divide by."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(jnp.matmul)
    return 2.0 * n**3 / time_median(f, a, b, reps=reps)


__all__ = ["flops_per_token", "matmul_peak_flops", "time_median"]
