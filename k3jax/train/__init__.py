"""k3jax.train"""
