"""Document boundaries of packed rows (docs/model.md §4.7): one rule for every token mixer.

    run = runs(segment_ids)          # [B, T] int32: 0 for the row's first document, +1 at every boundary

A packed row carries ``segment_ids`` [B, T] beside its tokens; token t starts a new document when its id differs
from token t - 1's (documents are contiguous runs, so any labelling works: 1, 1, 2, 2, 3 or 7, 7, 0, 0, 5). Each
mixer works on the run index, which is non-decreasing along the row: KDA resets its state and its conv window at a
boundary, MLA attends within its run only. An initial state or conv tail (a cache) continues the row's first run.
"""

from __future__ import annotations

import jax.numpy as jnp


def runs(segment_ids):
    """[B, T] ids → [B, T] int32 run index: the number of document boundaries at or before each token."""
    s = jnp.asarray(segment_ids)
    if s.ndim != 2:
        raise ValueError(f"segment_ids must be [B, T], got shape {tuple(s.shape)}")
    change = (s[:, 1:] != s[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros_like(change[:, :1]), jnp.cumsum(change, axis=1)], axis=1)


__all__ = ["runs"]
