"""The K3 network: parameter tree (params.py) and forward pass (transformer.py)."""

from k3jax.model.params import abstract_params, count_params, init_params
from k3jax.model.transformer import forward, hidden_states, lm_loss

__all__ = ["init_params", "abstract_params", "count_params", "forward", "hidden_states", "lm_loss"]
