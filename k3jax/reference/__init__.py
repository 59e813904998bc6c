"""k3jax.reference"""
