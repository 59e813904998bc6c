"""Routing analysis: metric definitions (``metrics``), streaming collection from forward passes
(``collect``), static router analysis from checkpoint tensors (``static``), figures (``plots``)."""

from k3jax.analysis.metrics import expert_load, load_stats

__all__ = ["expert_load", "load_stats"]
