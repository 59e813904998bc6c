"""k3jax.layers"""
