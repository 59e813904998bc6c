"""The one place layers reach Pallas kernels (STYLE.md §2: ops → pallas_kernels → layers/backends.py only).

Kernels are imported lazily, so the XLA paths never import Pallas. Off-GPU the kernels run in interpret mode.
"""

from __future__ import annotations


def kda_chunk_pallas(q, k, v, g, beta, *, scale, initial_state, chunk_size, gate_lower_bound):
    """Chunked KDA forward as a Pallas kernel (custom VJP through the jnp chunked path); see pallas_kernels/kda."""
    from pallas_kernels.kda import kda_chunk

    return kda_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                     gate_lower_bound=gate_lower_bound)
