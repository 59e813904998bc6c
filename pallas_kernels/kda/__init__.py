"""Chunked KDA forward kernel (Pallas) with a jnp-VJP backward."""

from pallas_kernels.kda.api import kda_chunk

__all__ = ["kda_chunk"]
