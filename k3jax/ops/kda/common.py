"""Shared by every KDA rung: the input contract, the state layouts and the chunking checks.

Shapes (docstring letters, see k3jax/notation.py):
    q, k  [B, T, N, K]   l2-normalised queries/keys (any float dtype; q, k and v share one dtype)
    v     [B, T, N, V]
    g     [B, T, N, K]   log decay per head AND key channel, g <= 0 (fp32 or wider is used internally)
    beta  [B, T, N]      write strength in [0, 1] (post-sigmoid)
    state [B, N, K, V]   K-first, rows indexed by key channel, fp32 (or wider)

State layout. k3jax's canonical state is K-first ``S[b, n, k, v]`` (fla's layout). The K3 reference modelling,
FlashKDA and vLLM store it V-first ``S'[b, n, v, k] = S[b, n, k, v]``: the transpose of the last two axes.
Convert only at interop boundaries with ``state_k_first_to_v_first`` / ``state_v_first_to_k_first``.

Validation. Shapes, ranks and dtypes are always checked (ValueError naming the argument). Value checks (g <= 0,
beta in [0, 1], g >= gate_lower_bound) need concrete arrays and are skipped under tracing (inside jit/grad/vmap),
where a host round trip is not possible.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SUB_CHUNK = 16  # diagonal sub-block size of docs/model.md §4.5 (the bounded-gate factorisation needs <= 16 at lb = -5)


def state_k_first_to_v_first(state_bnkv):
    """[B, N, K, V] (k3jax / fla) -> [B, N, V, K] (K3 reference modelling, FlashKDA, vLLM)."""
    return jnp.swapaxes(state_bnkv, -1, -2)


def state_v_first_to_k_first(state_bnvk):
    """[B, N, V, K] -> [B, N, K, V]; inverse of ``state_k_first_to_v_first``."""
    return jnp.swapaxes(state_bnvk, -1, -2)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_float(name, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {x.dtype} (shape {tuple(x.shape)})")


def _check_values(g, beta, gate_lower_bound):
    """g <= 0 (and >= gate_lower_bound when given), beta in [0, 1]; only for concrete arrays."""
    if _is_concrete(g):
        g_np = np.asarray(g, dtype=np.float64)
        if g_np.size and np.nanmax(g_np) > 0:
            raise ValueError(f"g must be <= 0 (log decay); max is {np.nanmax(g_np):.3g} (shape {tuple(g.shape)})")
        if gate_lower_bound is not None and g_np.size and np.nanmin(g_np) < gate_lower_bound * (1 + 1e-6):
            raise ValueError(f"g must be >= gate_lower_bound {gate_lower_bound} on the bounded-gate path; min is "
                             f"{np.nanmin(g_np):.3g} (use gate_lower_bound=None for unbounded gates)")
    if _is_concrete(beta):
        b_np = np.asarray(beta, dtype=np.float64)
        if b_np.size and (np.nanmin(b_np) < 0 or np.nanmax(b_np) > 1):
            raise ValueError(f"beta must lie in [0, 1] (post-sigmoid); got range [{np.nanmin(b_np):.3g}, "
                             f"{np.nanmax(b_np):.3g}] (shape {tuple(beta.shape)})")


def validate_inputs(q, k, v, g, beta, initial_state=None, *, has_time: bool = True, gate_lower_bound=None):
    """Checks ranks, shapes, dtypes and (when concrete) value ranges; raises ValueError naming the argument.

    Shapes as in the module docstring; ``has_time=False`` drops the T axis (one decode token: q [B, N, K]).
    """
    rank = 4 if has_time else 3
    lead = "[B, T, N, " if has_time else "[B, N, "
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.ndim != rank:
            raise ValueError(f"{name} must have rank {rank} ({lead}K or V]), got shape {tuple(x.shape)}")
    if beta.ndim != rank - 1:
        raise ValueError(f"beta must have rank {rank - 1} ({lead[:-2]}]), got shape {tuple(beta.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_float(name, x)
    if k.shape != q.shape:
        raise ValueError(f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g shape {tuple(g.shape)} must equal q shape {tuple(q.shape)} (one decay per key channel)")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v shape {tuple(v.shape)} must match q shape {tuple(q.shape)} except the last axis")
    if beta.shape != q.shape[:-1]:
        raise ValueError(f"beta shape {tuple(beta.shape)} must be q shape without K, {tuple(q.shape[:-1])}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if initial_state is not None:
        B, N, K, V = q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1]
        if tuple(initial_state.shape) != (B, N, K, V):
            raise ValueError(f"initial_state shape {tuple(initial_state.shape)} must be K-first [B, N, K, V] = "
                             f"{(B, N, K, V)} (convert V-first states with state_v_first_to_k_first)")
        _check_float("initial_state", initial_state)
        if jnp.finfo(initial_state.dtype).bits < 32:
            raise ValueError(f"initial_state must be float32 or wider, got {initial_state.dtype}")
    _check_values(g, beta, gate_lower_bound)


def check_chunking(chunk_size: int, sub_chunk: int, gate_lower_bound: float | None) -> None:
    """Checks the tiling of a chunked rung; raises ValueError.

    chunk_size (C) must be a multiple of sub_chunk (c). With a bounded gate, lb must be negative and the factorised
    diagonal sub-block must fit fp32: its exponents span |lb| (c - 1) nats, which must stay below 126 in log2
    units (docs/model.md §4.5 item 2). Used by ``kda_chunked`` and by the Pallas ``kda_chunk``, which share the tiling.
    """
    if chunk_size % sub_chunk:
        raise ValueError(f"chunk_size {chunk_size} must be a multiple of sub_chunk {sub_chunk}")
    if gate_lower_bound is None:
        return
    if gate_lower_bound >= 0:
        raise ValueError(f"gate_lower_bound must be negative, got {gate_lower_bound}")
    span = abs(gate_lower_bound) * (sub_chunk - 1) / np.log(2.0)
    if span >= 126:
        raise ValueError(f"gate_lower_bound {gate_lower_bound} with sub-chunk {sub_chunk} spans {span:.0f} log2 units "
                         ">= 126: the factorised diagonal would overflow in fp32; use gate_lower_bound=None")
