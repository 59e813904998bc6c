"""Public entry ``kda_chunk``: input checks, padding, the in-chunk sums of g, and the custom_vjp wiring.

Forward: the Pallas kernel (``kernel.py``). Backward: the VJP of the jnp chunked path
(``k3jax.ops.kda.kda_chunked``), recomputed from the saved inputs; the kernel has no backward of its own yet.
``interpret`` reaches ``pallas_call``; it defaults to True when the target platform
(``pallas_kernels.platform.target_platform``: ``platform=``, else the current mesh's device, else the default
backend) is the CPU, and True becomes the TPU interpreter inside ``jax.shard_map`` (``interpret_mode``: the generic
one loses the varying mesh axes there); the kernel's outputs declare the inputs' varying axes (README.md). The
platform picks the schedule (kernel.py: TPU = sequential chunk grid) and the default block_v. Input and tiling
checks are the jnp rung's (``k3jax.ops.kda.validate_inputs``, ``check_chunking``), so both reject the same
arguments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops import kda as kda_ops
from k3jax.ops.kda.chunked import doc_masks
from k3jax.ops.norms import acc_dtype
from pallas_kernels.kda.kernel import BlockSizes, kda_fwd_pallas
from pallas_kernels.mxfp4_matmul.api import interpret_mode
from pallas_kernels.platform import target_platform

# Value columns per program: 64 for Triton (registers); the whole lane width (128 = K3's V) for Mosaic.
DEFAULT_BLOCK_V = {"cpu": 64, "gpu": 64, "tpu": 128}


def in_chunk_sums(g, *, chunk: int, sub_chunk: int):
    """The decay sums the kernel needs, each a direct sum of the g it spans (no cancellation).

    g: [B, Tp, N, K] (Tp a multiple of chunk). Returns
      lr  [B, Tp, N, K]: sum_{r0 < t <= i} g_t within the 16-row sub-chunk (r0 its first row),
      rex [B, Tp, N, K]: sum_{j < t < r0 + c} g_t within the sub-chunk,
      gcs [B, Tp, N, K]: sum_{chunk start <= t <= i} g_t,
      tot [B, Tp / c, N, K]: per-sub-chunk totals.
    """
    B, Tp, N, K = g.shape
    c = sub_chunk
    gs = g.reshape(B, Tp // c, c, N, K)
    first = (jnp.arange(c) == 0)[None, None, :, None, None]
    lr = jnp.cumsum(jnp.where(first, 0.0, gs), axis=2).reshape(B, Tp, N, K)
    rev = jax.lax.cumsum(gs, axis=2, reverse=True)
    rex = jnp.concatenate([rev[:, :, 1:], jnp.zeros_like(rev[:, :, :1])], axis=2).reshape(B, Tp, N, K)
    gcs = jnp.cumsum(g.reshape(B, Tp // chunk, chunk, N, K), axis=2).reshape(B, Tp, N, K)
    tot = jnp.sum(gs, axis=2)
    return lr, rex, gcs, tot


@functools.cache
def _make(scale: float, chunk: int, sub_chunk: int, block_v: int, gate_lower_bound, platform: str, interpret,
          segments: bool):
    """The custom_vjp function f(q, k, v, g, beta, h0[, segment_ids]) for one static configuration; ``segments``
    adds the segment_ids argument (an integer input, no cotangent) and the kernel's document masks."""
    bs = BlockSizes(chunk=chunk, sub_chunk=sub_chunk, block_v=block_v)

    def forward(q, k, v, g, beta, h0, segment_ids=None):
        T = q.shape[1]
        Tp = -(-T // chunk) * chunk
        pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        ct = acc_dtype(q.dtype)
        # Padding with g = 0, beta = 0, q = k = v = 0 is a no-op for the state; padded outputs are dropped.
        qp, kp, vp = pad(q), pad(k), pad(v)
        gp, bp = pad(g.astype(jnp.float32)), pad(beta.astype(jnp.float32))
        lr, rex, gcs, tot = in_chunk_sums(gp, chunk=chunk, sub_chunk=sub_chunk)
        # Document masks [B, Tp] (padding continues the last document), as fp32 0/1 and exact run indices.
        docs = None if segment_ids is None else [d.astype(jnp.float32) for d in doc_masks(segment_ids, Tp, chunk)]
        o, ht = kda_fwd_pallas(qp, kp, vp, gp, bp, lr, rex, gcs, tot, h0.astype(jnp.float32), scale=scale,
                               gate_lower_bound=gate_lower_bound, bs=bs, platform=platform, interpret=interpret,
                               docs=docs)
        return o[:, :T], ht.astype(ct)

    def reference(q, k, v, g, beta, h0, segment_ids=None):
        return kda_ops.kda_chunked(q, k, v, g, beta, scale=scale, initial_state=h0, chunk_size=chunk,
                                   gate_lower_bound=gate_lower_bound, sub_chunk=sub_chunk, segment_ids=segment_ids)

    if segments:
        @jax.custom_vjp
        def f(q, k, v, g, beta, h0, segment_ids):
            return forward(q, k, v, g, beta, h0, segment_ids)

        def f_fwd(q, k, v, g, beta, h0, segment_ids):
            return forward(q, k, v, g, beta, h0, segment_ids), (q, k, v, g, beta, h0, segment_ids)

        def f_bwd(res, cts):
            *diff, segment_ids = res
            _, vjp = jax.vjp(lambda *a: reference(*a, segment_ids=segment_ids), *diff)
            return (*vjp(cts), None)                               # segment_ids: integer, no cotangent
    else:
        @jax.custom_vjp
        def f(q, k, v, g, beta, h0):
            return forward(q, k, v, g, beta, h0)

        def f_fwd(q, k, v, g, beta, h0):
            return forward(q, k, v, g, beta, h0), (q, k, v, g, beta, h0)

        def f_bwd(res, cts):
            # Backward = VJP of the jnp chunked path (same math, recomputed; per-chunk states under checkpoint).
            _, vjp = jax.vjp(reference, *res)
            return vjp(cts)

    f.defvjp(f_fwd, f_bwd)
    return f


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size: int = 64,
              gate_lower_bound: float | None = None, sub_chunk: int = kda_ops.SUB_CHUNK, block_v: int | None = None,
              platform: str | None = None, interpret=None, segment_ids=None):
    """Chunked KDA with a Pallas forward kernel; same contract as ``k3jax.ops.kda.kda_chunked``.

    q, k: [B, T, N, K]; v: [B, T, N, V]; g: [B, T, N, K] log decay <= 0; beta: [B, T, N] in [0, 1];
    initial_state: [B, N, K, V] K-first fp32 (zeros if None). Returns o [B, T, N, V] (q.dtype) and the final
    state [B, N, K, V] in ``acc_dtype(q.dtype)`` (float64 inputs are computed in fp32 inside the kernel).
    Unbounded gates (gate_lower_bound None) use in-sub-chunk differences of sums for the exact diagonal decays;
    see README.md "Known limits". ``platform``: "cpu", "gpu" ("cuda", "rocm") or "tpu" (None: ``target_platform()``)
    picks the schedule and the default ``block_v`` (``DEFAULT_BLOCK_V``); ``interpret`` None = platform is "cpu", True
    = a Pallas interpreter (inside ``shard_map`` the TPU one), or an interpreter config (``pltpu.InterpretParams``).
    ``segment_ids``: None, or [B, T] integer document ids of packed rows (docs/model.md §4.7): every document runs from
    a zero state (the initial state continues the first), the final state is the last document's; the kernel applies
    the masks of ``kda_chunked(..., segment_ids=)`` (README.md "Packed documents"). Not differentiated.
    """
    kda_ops.validate_inputs(q, k, v, g, beta, initial_state, gate_lower_bound=gate_lower_bound)
    kda_ops.check_chunking(chunk_size, sub_chunk, gate_lower_bound)
    B, T, N, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    platform = target_platform(platform)
    if interpret is None or isinstance(interpret, bool | int):
        interpret = platform == "cpu" if interpret is None else bool(interpret)
    block_v = DEFAULT_BLOCK_V[platform] if block_v is None else block_v
    h0 = jnp.zeros((B, N, K, V), jnp.float32) if initial_state is None else initial_state
    interpret = interpret_mode(interpret, q, k, v, g, beta, h0)    # inside shard_map: the TPU interpreter
    if segment_ids is not None and tuple(segment_ids.shape) != (B, T):
        raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} must be [B, T] = {(B, T)}")
    f = _make(scale, chunk_size, sub_chunk, block_v, None if gate_lower_bound is None else float(gate_lower_bound),
              platform, interpret, segment_ids is not None)
    if segment_ids is None:
        return f(q, k, v, g, beta, h0)
    return f(q, k, v, g, beta, h0, jnp.asarray(segment_ids))
