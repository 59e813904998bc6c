"""Pallas kernels, each beside its pure-jnp reference. Depend only on k3jax.ops / k3jax.notation."""
