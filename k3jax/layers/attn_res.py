"""The Attention-Residuals pseudo-query block (docs/model.md §3.3): the learned parameters of one AttnRes mix.

Parameters: gain [D] (RMS key-norm gain, ones) and query [D] (pseudo-query, zeros: the first mix is uniform).
HF: ``{slot}_norm.weight`` and ``{slot}_proj.weight`` [1, D], where the slot is ``self_attention_res`` /
``mlp_res`` inside a layer and ``model.output_attn_res`` for the output mix.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import HFLeaf, param, vec
from k3jax.ops.attn_res import attn_res, attn_res_masked


class AttnResQuery(nnx.Module):
    HF = {"gain": vec("_norm.weight"), "query": HFLeaf("_proj.weight", "row")}

    def __init__(self, d: int, dtype=jnp.float32):
        self.gain = param(jnp.ones((d,), dtype), ("norm",))
        self.query = param(jnp.zeros((d,), dtype), ("norm",))

    def __call__(self, sources, eps: float, with_ms: bool = False):
        """AttnRes mix of ``sources`` (a list of [..., D] arrays) → [..., D] in at-least-fp32 (``with_ms``: and its
        mean square [..., 1], ``ops.attn_res``)."""
        return attn_res(sources, self.query[...], self.gain[...], eps, with_ms=with_ms)

    def masked(self, blocks, count, part, eps: float, with_ms: bool = False):
        """The mix of ``blocks[:count] + [part]`` for a block buffer [NB, ..., D] and a traced ``count`` (the
        scanned stack, ``ops.attn_res.attn_res_masked``)."""
        return attn_res_masked(blocks, count, part, self.query[...], self.gain[...], eps, with_ms=with_ms)


__all__ = ["AttnResQuery"]
