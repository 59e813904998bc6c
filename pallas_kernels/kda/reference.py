"""The jnp rungs below the ``kda_chunk`` kernel (docs/design.md §3.2): chunked (same tiling) and recurrent, from
k3jax.ops.

The whole ladder, with the test of each rung: k3jax/ops/kda/README.md.
"""

from k3jax.ops.kda import kda_chunked as kda_chunk_reference  # noqa: F401
from k3jax.ops.kda import kda_recurrent as kda_recurrent_reference  # noqa: F401
