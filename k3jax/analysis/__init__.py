"""Routing analysis (issue #17): metric definitions (``metrics``), streaming collection from forward passes
(``collect``), static router analysis from checkpoint tensors (``static``), and the per-layer load summary
``k3 run`` prints (``routing``)."""

from k3jax.analysis.routing import expert_load, layer_summary, routing_summary

__all__ = ["expert_load", "layer_summary", "routing_summary"]
