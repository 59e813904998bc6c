"""The one place layers reach Pallas kernels (docs/design.md §2: ops → pallas_kernels → layers/backends.py only).

Kernels are imported lazily, so the XLA paths never import Pallas. Off-GPU the KDA kernel runs in interpret mode; so
does the MXFP4 grouped matmul on CPU (off GPU/TPU the packed experts run the XLA loop of k3jax/ops/packed_experts.py
unless the "ragged" dispatch asks for the kernel).
"""

from __future__ import annotations

from pallas_kernels.platform import target_platform


def kda_chunk_pallas(q, k, v, g, beta, *, scale, initial_state, chunk_size, gate_lower_bound, segment_ids=None):
    """Chunked KDA forward as a Pallas kernel (custom VJP through the jnp chunked path); see pallas_kernels/kda.
    ``segment_ids`` [B, T]: packed documents, each from a zero state (``k3jax.ops.segments``)."""
    from pallas_kernels.kda import kda_chunk  # Pallas: imported lazily, so the XLA paths never import Pallas

    docs = {} if segment_ids is None else {"segment_ids": segment_ids}
    return kda_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                     gate_lower_bound=gate_lower_bound, **docs)


def kernel_target() -> str:
    """The platform being compiled for ('cpu', 'gpu' or 'tpu'): the current (abstract) mesh's device, else the
    default backend (``pallas_kernels.platform.target_platform``)."""
    return target_platform()


def mxfp4_gmm(x, packed, scale, group_sizes, *, platform: str | None = None):
    """Grouped MXFP4 matmul y [M, N] = x [M, K] @ W_gᵀ per expert group (packed uint8 [G, N, K/2], scale uint8
    [G, N, K/32]; rows sorted by group; output in x.dtype), with pallas_kernels/mxfp4_matmul's block sizes; its VJP
    with respect to x is the kernel's transposed form. ``platform``: whose schedule and tiles (None: the platform
    being compiled for). Compiled for a GPU/TPU target; for a CPU target a Pallas interpreter runs it (inside
    ``shard_map`` the TPU one), so ``platform="tpu"`` runs the TPU schedule on CPU, inside ``shard_map`` too
    (``ExpertParallel(packed_kernel="pallas")``). The packed experts' "sorted" dispatch never runs it on CPU: it
    takes the XLA loop of k3jax/ops/packed_experts.py."""
    from pallas_kernels.mxfp4_matmul import mxfp4_gmm as gmm  # Pallas, lazily (the module docstring)

    target = kernel_target()
    return gmm(x, packed, scale, group_sizes, platform=platform or target, interpret=target == "cpu")


def mxfp4_glu_ffn(x, w1, w3, w2, group_sizes, act, *, act_quant=None, acc=None, platform: str | None = None):
    """The grouped GLU FFN of MXFP4 expert stacks (``PackedWeight`` pairs w1, w3 [G, F, P/2 | P/32], w2 [G, P, F/2 |
    F/32]) over expert-sorted rows x [R, P]: the three grouped kernels of ``mxfp4_gmm`` run in tile space, the rows
    padded into per-expert tiles once (pallas_kernels/mxfp4_matmul/ffn.py); output in x.dtype, VJP with respect to
    x by the transposed kernel. ``platform``, the interpreter on CPU: as ``mxfp4_gmm``."""
    import jax.numpy as jnp

    from pallas_kernels.mxfp4_matmul import mxfp4_glu_ffn as ffn  # Pallas, lazily (the module docstring)

    target = kernel_target()
    return ffn(x, tuple(w1), tuple(w3), tuple(w2), group_sizes, act, act_quant=act_quant,
               acc=jnp.float32 if acc is None else acc, platform=platform or target, interpret=target == "cpu")
