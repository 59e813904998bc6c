"""k3jax.analysis"""
