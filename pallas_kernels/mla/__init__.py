"""Latent-attention kernels of gated MLA (Pallas), each beside its pure-jnp reference:

- ``mla_decode``: absorbed queries (up to 8 tokens per row) over the [c_kv | k_rope] cache, split-KV over the
  sequence with a combine step, ragged ``kv_len`` per row; each latent is read once per step for all heads.
- ``mla_flash``: flash attention for prefill and training (online softmax, causal block skipping, document segment
  ids, a query offset for context shards), keys and values up-projected per key block inside the kernel; custom VJP.
"""

from pallas_kernels.mla.decode import mla_decode
from pallas_kernels.mla.flash import mla_flash

__all__ = ["mla_decode", "mla_flash"]
