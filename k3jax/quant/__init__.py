"""k3jax.quant"""
