"""k3jax.model"""
