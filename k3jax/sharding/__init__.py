"""k3jax.sharding"""
