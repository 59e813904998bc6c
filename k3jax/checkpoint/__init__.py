"""k3jax.checkpoint"""
