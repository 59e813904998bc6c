"""Counting parameters: all of them (``count_params``) and the ones one token multiplies by (``active_params``).

The one definition of active parameters (``k3 plan``'s ``active_params``, the AOT plans' 6·N_active·tokens, the
ablation report's ``active_params``, MFU's FLOPs per token): every weight a token's forward touches, counted once —
a routed-expert stack at top-k / E of itself (A of E experts run per token), the router's balancing bias at nothing
(it picks experts, it multiplies nothing) and the input embedding at nothing unless it is tied to the output head
(a row lookup, not a matmul); everything else in full, the output head included.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from k3jax.config import K3Config
from k3jax.model.functional import abstract_params
from k3jax.pytree import key_names


def count_params(tree) -> int:
    """Elements over every leaf of ``tree`` (arrays or ShapeDtypeStructs)."""
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(tree)))


def is_routed_expert(names: tuple) -> bool:
    return "experts" in names


def active_leaf(cfg: K3Config, names: tuple, size: int) -> int:
    """How many of the ``size`` elements of the parameter at key path ``names`` (any view: stacked, per layer, or
    an ``experts`` dict's packed leaves) one token multiplies by."""
    if is_routed_expert(names):
        return size // cfg.num_experts * cfg.num_experts_per_token  # a stack holds E equal experts
    if names[-2:] == ("moe", "bias") or (names[0] == "embed" and not cfg.tie_word_embeddings):
        return 0
    return size


def active_params(cfg: K3Config) -> tuple[int, int]:
    """(active parameters of ``cfg``, the routed experts' part of them), from its parameter shapes (allocates
    nothing; works at full size)."""
    total = experts = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]:
        names = key_names(path)
        n = active_leaf(cfg, names, math.prod(leaf.shape))
        total += n
        experts += n if is_routed_expert(names) else 0
    return total, experts


__all__ = ["active_leaf", "active_params", "count_params", "is_routed_expert"]
