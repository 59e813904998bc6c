"""KDA as a recurrence over tokens (docs/model.md §4.3) and its one-token decode step (docs/model.md §4.6).

The rung just above the float64 oracle ``k3jax.reference.kda.kda_recurrent``: the same update, vectorised over
(B, N) and scanned over T. Shapes and the state layout: see ``k3jax.ops.kda.common``.

For a speculative verify piece, ``kda_recurrent_recorded`` also returns each token's update vector (and optionally
each state), and ``kda_replay`` rebuilds the state after any prefix of the piece from them (``k3jax.model.rollback``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.kda.common import validate_inputs
from k3jax.ops.norms import acc_dtype
from k3jax.ops.segments import runs


def _step(S, q, k, v, g, beta, scale):
    """One token for all (B, N). S [B,N,K,V]; q,k,g [B,N,K]; v [B,N,V]; beta [B,N]. All in the compute dtype."""
    S = S * jnp.exp(g)[..., :, None]                        # S <- Diag(exp g) S
    e = v - jnp.einsum("bnkv,bnk->bnv", S, k)                # error on the decayed state
    S = S + (beta[..., None] * k)[..., :, None] * e[..., None, :]
    o = jnp.einsum("bnkv,bnk->bnv", S, q * scale)            # read after the write
    return S, o


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None):
    """Token-by-token KDA (docs/model.md §4.3) as one ``lax.scan`` over T; each step updates every (B, N) at once.

    Args: q, k, g [B, T, N, K]; v [B, T, N, V]; beta [B, T, N]; initial_state [B, N, K, V] K-first, fp32 or wider
      (zeros if None). ``scale`` defaults to K^-0.5. ``segment_ids`` [B, T] (packed rows, docs/model.md §4.7): the state
      is zeroed before the first token of every document after the row's first (``k3jax.ops.segments``).
    Returns: o [B, T, N, V] in q.dtype, final state [B, N, K, V] in ``acc_dtype(q.dtype)``.
    Memory under autodiff is one state per token (the scan saves them); use ``kda_chunked`` for training.
    """
    validate_inputs(q, k, v, g, beta, initial_state)
    B, T, N, K = q.shape
    V = v.shape[-1]
    ct = acc_dtype(q.dtype)
    scale = K ** -0.5 if scale is None else scale
    S0 = jnp.zeros((B, N, K, V), ct) if initial_state is None else initial_state.astype(ct)
    xs = tuple(jnp.moveaxis(a.astype(ct), 1, 0) for a in (q, k, v, g, beta))
    if segment_ids is None:
        def body(S, x):
            return _step(S, *x, scale)
    else:
        run = runs(segment_ids)
        start = jnp.concatenate([jnp.zeros_like(run[:, :1], bool), run[:, 1:] != run[:, :-1]], axis=1)
        xs = (*xs, start.T)

        def body(S, x):
            *x, new_doc = x
            return _step(jnp.where(new_doc[:, None, None, None], jnp.zeros((), S.dtype), S), *x, scale)

    S, o = jax.lax.scan(body, S0, xs)
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), S


def kda_step(q, k, v, g, beta, state, *, scale=None):
    """One decode token (docs/model.md §4.6): natural-exp decay, delta write, read.

    Shapes: q, k, g [B, N, K]; v [B, N, V]; beta [B, N]; state [B, N, K, V] (K-first). A time axis of length 1
    ([B, 1, N, K], beta [B, 1, N]) is also accepted; the output then keeps it.
    Returns: o ([B, N, V] or [B, 1, N, V]) in q.dtype, new state in ``acc_dtype(q.dtype)``.
    """
    has_time = q.ndim == 4
    if has_time:
        if q.shape[1] != 1:
            raise ValueError(f"kda_step takes one token; q has T = {q.shape[1]} (shape {tuple(q.shape)})")
        validate_inputs(q, k, v, g, beta, state, has_time=True)
        q, k, v, g, beta = (a[:, 0] for a in (q, k, v, g, beta))
    else:
        validate_inputs(q, k, v, g, beta, None, has_time=False)
        B, N, K = q.shape
        if tuple(state.shape) != (B, N, K, v.shape[-1]):
            raise ValueError(f"state shape {tuple(state.shape)} must be K-first [B, N, K, V] = "
                             f"{(B, N, K, v.shape[-1])}")
    ct = acc_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    S, o = _step(state.astype(ct), *(a.astype(ct) for a in (q, k, v, g, beta)), scale)
    o = o.astype(q.dtype)
    return (o[:, None] if has_time else o), S


def step_recorded(S, q, k, v, g, beta, scale):
    """``_step`` that also returns the delta rule's update vector u = beta (v - (Diag(exp g) S)^T k), so that the
    new state is Diag(exp g) S + k u^T. Shapes as ``_step``'s; u [B, N, V]. Returns (S, o, u)."""
    S = S * jnp.exp(g)[..., :, None]
    u = beta[..., None] * (v - jnp.einsum("bnkv,bnk->bnv", S, k))
    S = S + k[..., :, None] * u[..., None, :]
    o = jnp.einsum("bnkv,bnk->bnv", S, q * scale)
    return S, o, u


def kda_recurrent_recorded(q, k, v, g, beta, *, initial_state, scale=None, keep_states: bool = False):
    """``kda_recurrent`` over a short piece (a speculative verify, T <= ~16) that also returns what undoing the piece's
    tail needs (``kda_replay``, ``k3jax.model.rollback``).

    Args: as ``kda_recurrent`` (no documents); initial_state [B, N, K, V] K-first.
    Returns: o [B, T, N, V] in q.dtype; the final state [B, N, K, V]; u [B, T, N, V], the update vector of every
      token (``step_recorded``); states [B, T, N, K, V], the state after every token (None unless ``keep_states``:
      T states are T times the state's memory). All but o in ``acc_dtype(q.dtype)``.
    """
    validate_inputs(q, k, v, g, beta, initial_state)
    K = q.shape[-1]
    ct = acc_dtype(q.dtype)
    scale = K ** -0.5 if scale is None else scale
    xs = tuple(jnp.moveaxis(a.astype(ct), 1, 0) for a in (q, k, v, g, beta))

    def body(S, x):
        S, o, u = step_recorded(S, *x, scale)
        return S, (o, u, S) if keep_states else (o, u)

    S, ys = jax.lax.scan(body, initial_state.astype(ct), xs)
    o, u = (jnp.moveaxis(a, 0, 1) for a in ys[:2])
    states = jnp.moveaxis(ys[2], 0, 1) if keep_states else None
    return o.astype(q.dtype), S, u, states


def kda_replay(state, k, u, G, n):
    """The state after the first n[b] tokens of a piece, rebuilt from the state before it and the piece's keys, update
    vectors and cumulative log-decays, in one sum instead of n steps (the recurrence unrolled):

        S_n = Diag(exp G_n) S_0 + sum_{j <= n} Diag(exp(G_n - G_j)) k_j u_j^T,   G_j = g_1 + ... + g_j, G_0 = 0.

    Args: state [B, N, K, V] (S_0, K-first); k, G [B, T, N, K]; u [B, T, N, V] (``kda_recurrent_recorded``);
      n [B] int in [0, T]. Returns S_n [B, N, K, V] in ``acc_dtype(state.dtype)``.
    The weights of tokens j > n are masked before the exp: G_n - G_j >= 0 there and its exp may overflow.
    Float64 twin: ``k3jax.reference.kda.kda_replay``."""
    ct = acc_dtype(state.dtype)
    k, u, G = (a.astype(ct) for a in (k, u, G))
    B, T = k.shape[:2]
    n = jnp.asarray(n, jnp.int32)
    G0 = jnp.concatenate([jnp.zeros_like(G[:, :1]), G], axis=1)                    # [B, T + 1, N, K]: G_0 = 0
    Gn = jnp.take_along_axis(G0, n[:, None, None, None], axis=1)[:, 0]            # [B, N, K]
    live = (jnp.arange(T)[None, :] < n[:, None])[:, :, None, None]                # token j (0-based) is kept
    w = jnp.exp(jnp.where(live, Gn[:, None] - G, -jnp.inf))                        # [B, T, N, K]
    return jnp.exp(Gn)[..., None] * state.astype(ct) + jnp.einsum("btnk,btnv->bnkv", w * k, u)
