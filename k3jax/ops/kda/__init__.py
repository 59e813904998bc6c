"""Kimi Delta Attention core (docs/model.md §4), in pure jnp; the math ladder is in README.md beside this file.

    common.py     input contract, K-first / V-first state layouts, chunking checks
    gates.py      featurisation before the core: safe / softplus gates, causal conv + SiLU, L2 norm
    recurrent.py  kda_recurrent (scan over tokens) and kda_step (one decode token)
    chunked.py    kda_chunked (UT/WY over 64-token chunks) and its per-chunk chunk_intra

Precision. "fp32" means "at least fp32": everything runs in ``k3jax.ops.norms.acc_dtype(q.dtype)``, so bf16
inputs run in fp32 and float64 inputs (jax_enable_x64) stay float64 end to end. Outputs are cast back to q.dtype;
states are returned in that accumulation dtype.
"""

from k3jax.ops.kda.chunked import chunk_intra, kda_chunked
from k3jax.ops.kda.common import (
    SUB_CHUNK,
    check_chunking,
    state_k_first_to_v_first,
    state_v_first_to_k_first,
    validate_inputs,
)
from k3jax.ops.kda.gates import causal_conv_silu, gate_safe, gate_softplus, l2norm
from k3jax.ops.kda.recurrent import kda_recurrent, kda_step

__all__ = [
    "SUB_CHUNK",
    "causal_conv_silu",
    "check_chunking",
    "chunk_intra",
    "gate_safe",
    "gate_softplus",
    "kda_chunked",
    "kda_recurrent",
    "kda_step",
    "l2norm",
    "state_k_first_to_v_first",
    "state_v_first_to_k_first",
    "validate_inputs",
]
