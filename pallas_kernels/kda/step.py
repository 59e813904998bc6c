"""KDA's one-token decode step as a TPU kernel: the layer's state read once and written once, in place in its stack.

    o, states = kda_step(q, k, v, g, beta, states, layer, scale=scale)     # states [L, B, N, K, V], updated in place

The step is ``k3jax.ops.kda.kda_step``'s (its jnp reference; docs/model.md §4.6), per (row b, head n):

    S <- Diag(exp g) S;   u = beta (v - S^T k);   S <- S + k u^T;   o = S^T (scale q)

XLA fuses that update into several passes over the state (fp32 [B, N, K, V], 6.3 MB per layer at 96 heads and one
row). On the TPU compiler a kimi-k3 decode step at B = 64 on v5p-64 (serve expert=64, one row per chip) read or
wrote each KDA layer's state ~4.5 times: the layer's slice copied out of the stacked cache into VMEM twice, one
reduction pass over it, the update written back by a dynamic-update-slice (experiments/LOG.md, 2026-12-07 session
35). The kernel reads each [heads, K, V] block of the layer once from the stack, in place (the layer index is
scalar-prefetched), and writes the new block over it (the stack is aliased to the output), so HBM sees the state
exactly once each way.

Grid (B, N / block_heads), both parallel: the blocks are independent. q, k, beta k, v, g enter as [B, N, K or V]
blocks [heads, K] (heads on sublanes, no padding in HBM); the kernel transposes each block once to take a head's
K-column, so the decay and k broadcast along V's lanes and the products over K are sublane sums. (As [B, N, K, 1]
columns they were padded 128-fold on the lanes: on v5p XLA laid out three such 25 MB temporaries for a 4-row
step.) The values are the reference's up to fp32 summation order. No backward: decode only (training runs the
chunked kernel).

TPU schedule only (the CPU interpreter runs it for the tests): a GPU decode keeps XLA's step
(``k3jax.layers.backends.kda_decode_step`` returns None there).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.ops.grouped_matmul import varying_struct
from k3jax.ops.kda.common import validate_inputs
from pallas_kernels.mxfp4_matmul.api import interpret_mode

BLOCK_HEADS = 8   # heads per block: [8, 128, 128] fp32 = 512 KiB of state a buffer (in and out double-buffered: 2 MiB)


def step_cost(B: int, N: int, K: int, V: int) -> dict:
    """{"flops", "transcendentals", "bytes_accessed"} of one call: the state [B, N, K, V] fp32 read and written once;
    q, k, beta k, g, v in and o out once (fp32); ~8 flops per state element (decay, two products, the write)."""
    return {"flops": 8 * B * N * K * V, "transcendentals": B * N * K,
            "bytes_accessed": 2 * B * N * K * V * 4 + B * N * (4 * K + 2 * V) * 4}


def _kernel(layer_ref, q_ref, k_ref, kb_ref, v_ref, g_ref, s_ref, o_ref, s_out_ref, *, scale: float):
    """One block of heads: q, k, kb = beta k, v, g [h, K or V] (heads on sublanes), the state [h, K, V] in place."""
    del layer_ref                                                   # read by the index maps
    qt, kt, kbt, gt = (jnp.transpose(r[...]) for r in (q_ref, k_ref, kb_ref, g_ref))      # [K, h]: columns
    v = v_ref[...]
    for i in range(s_ref.shape[0]):                                 # static: each head's [K, V] state
        qc, kc, kbc, gc = (x[:, i:i + 1] for x in (qt, kt, kbt, gt))  # [K, 1] columns
        S = s_ref[i] * jnp.exp(gc)                                  # Diag(exp g) S
        e = v[i:i + 1, :] - jnp.sum(S * kc, axis=0, keepdims=True)  # [1, V]: v - S^T k
        S = S + kbc * e                                             # + beta k e^T
        s_out_ref[i] = S
        o_ref[i:i + 1, :] = jnp.sum(S * (qc * scale), axis=0, keepdims=True)


def _check(q, k, v, g, beta, states, block_heads, interpret):
    """The jnp step's input checks (``k3jax.ops.kda.validate_inputs``), then the stack, its dtype and the tiling."""
    validate_inputs(q, k, v, g, beta, None, has_time=False)
    B, N, K = q.shape
    V = v.shape[-1]
    if states.ndim != 5 or tuple(states.shape[1:]) != (B, N, K, V):
        raise ValueError(f"states must be stacked [L, B, N, K, V] = [L, {B}, {N}, {K}, {V}], got {tuple(states.shape)}")
    if states.dtype != jnp.float32:
        raise ValueError(f"the KDA decode kernel keeps an fp32 state; got {states.dtype}")
    if N % block_heads or (not interpret and ((block_heads % 8 and block_heads != N) or K % 128 or V % 128)):
        raise ValueError(f"the KDA decode kernel tiles heads by {block_heads} (on TPU a multiple of 8 sublanes, or "
                         f"all heads) and K, V by 128 lanes; got {N} heads, K = {K}, V = {V}")


def _step(q, k, v, g, beta, states, layer, *, scale: float, block_heads: int, interpret):
    from jax.experimental.pallas import tpu as pltpu

    B, N, K = q.shape
    V = v.shape[-1]
    f32 = jnp.float32
    ins = (*(a.astype(f32) for a in (q, k, beta[..., None] * k, v, g)), states)

    def vec(b, n, lay):
        return b, n, 0

    def state(b, n, lay):
        return lay[0], b, n, 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, N // block_heads),
        in_specs=[*(pl.BlockSpec((None, block_heads, d), vec) for d in (K, K, K, V, K)),
                  pl.BlockSpec((None, None, block_heads, K, V), state)],
        out_specs=[pl.BlockSpec((None, block_heads, V), vec), pl.BlockSpec((None, None, block_heads, K, V), state)],
    )
    o, states = pl.pallas_call(
        functools.partial(_kernel, scale=scale),
        out_shape=[varying_struct((B, N, V), f32, *ins), varying_struct(states.shape, f32, *ins)],
        grid_spec=grid_spec,
        input_output_aliases={6: 1},     # operand 6 (after the prefetched layer): the stacked state
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=pl.CostEstimate(**step_cost(B, N, K, V)),
        interpret=interpret_mode(interpret, *ins),
        name="kda_decode_step",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), *ins)
    return o, states


def kda_step(q, k, v, g, beta, states, layer, *, scale: float, block_heads: int | None = None,
             interpret: bool = False):
    """One decode token of every row through the layer ``layer`` of a stacked KDA state, in place.

    Args: q, k, g [B, N, K]; v [B, N, V]; beta [B, N] (any float dtype, computed in fp32); states [L, B, N, K, V]
      fp32 (an unstacked state is the L = 1 reshape); layer an int32 scalar (traced: a scanned layer's index);
      block_heads: heads per block (default ``BLOCK_HEADS`` where it divides N, else N: the interpreter's small
      models).
    Returns: (o [B, N, V] fp32, states with layer ``layer`` advanced by the token). The states buffer is aliased to
      the output: under jit with the stack donated (a scanned decode's carry) the update happens in place.
    ValueError where the shapes or the state's dtype do not fit the kernel (``_check``)."""
    N = q.shape[1]
    block_heads = block_heads or (BLOCK_HEADS if N % BLOCK_HEADS == 0 else N)
    _check(q, k, v, g, beta, states, block_heads, interpret)
    return _step(q, k, v, g, beta, states, jnp.asarray(layer, jnp.int32), scale=float(scale),
                 block_heads=block_heads, interpret=interpret)


__all__ = ["BLOCK_HEADS", "kda_step", "step_cost"]
