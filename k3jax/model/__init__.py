"""The K3 network: parameter tree (params.py) and forward pass (transformer.py)."""

from k3jax.model.params import abstract_params, count_params, init_params

__all__ = ["init_params", "abstract_params", "count_params"]
