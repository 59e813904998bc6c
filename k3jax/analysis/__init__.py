"""Routing and expert-load statistics."""

from k3jax.analysis.routing import expert_load, layer_summary, routing_summary

__all__ = ["expert_load", "layer_summary", "routing_summary"]
