"""k3jax.ops"""
