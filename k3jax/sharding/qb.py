"""Quantile Balancing on a mesh (docs/model.md §8.2): the bias update with tokens sharded over the rules' "batch"
axes and the [E, bins] histogram all-reduced once per MoE layer (one int32 psum, so the sum is exact). The math —
the histogram, the estimate from it and the exact reference — is k3jax/optim/qb.py's; this module only places it.

    f = qb_update_sharded(mesh, "ep", top_k=4);  b_new = f(scores [N, E], cutoff [N], bias [E])
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from k3jax.optim.qb import QB_BINS, qb_update
from k3jax.sharding.rules import mesh_axes_of


def qb_update_sharded(mesh, rules="ep", *, top_k: int, bins: int = QB_BINS):
    """``f(scores [N, E], cutoff [N], bias [E]) -> b_new [E]`` with tokens sharded over the rules' "batch" axes and
    the [E, bins] histogram all-reduced once (int32 psum); the bias in and out is replicated."""
    axes = mesh_axes_of("batch", rules, mesh)
    tok = P(axes or None)

    def local(s, a, b):
        return qb_update(s, a, b, top_k=top_k, bins=bins, axis_names=axes)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(axes or None, None), tok, P()), out_specs=P())
