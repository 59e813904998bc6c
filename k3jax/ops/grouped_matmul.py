"""Dropless expert computation: a dense reference (every expert on every token, masked) and the sort-based
grouped path (``lax.ragged_dot``) that the model uses. Both take the same [E, in, out] expert stacks.

Sort-based dispatch, in rows M = tokens × A (notation.py):
    1. replicate each token A times (broadcast: its VJP is a sum, not a scatter)
    2. permute rows so they are grouped by expert id (stable argsort) — a permutation whose VJP is the inverse
       permutation (a gather), never a scatter-add (SPEC §7.2)
    3. grouped matmuls w1, w3 → GLU → w2 with group_sizes = bincount(ids, E)
    4. inverse permutation, weighted sum over the A copies in at-least-fp32
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.ops.norms import acc_dtype


@jax.custom_vjp
def permute_rows(x, order, inverse):
    """x[order] for a permutation ``order`` whose inverse is ``inverse``; VJP = gather by the inverse."""
    return x[order]


def _permute_fwd(x, order, inverse):
    return x[order], (order, inverse)


def _permute_bwd(res, g):
    order, inverse = res
    return g[inverse], None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def sort_by_expert(ids_ma, num_experts: int):
    """Flattened (token, slot) rows sorted by expert. Returns (order, inverse, group_sizes [E])."""
    flat = ids_ma.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, inverse, group_sizes


Act = Callable[[jax.Array, jax.Array], jax.Array]


def experts_sorted(z_mp, ids_ma, weights_ma, w1_epf, w3_epf, w2_efp, act: Act, *,
                   act_quant: Callable | None = None):
    """Sort-based dropless experts: Σ_a weights[m, a] · E_{ids[m, a]}(z[m]). Returns [M, P] in acc dtype.

    ``act_quant`` (optional) fake-quantizes each expert GEMM input (QAT, SPEC §10.7).
    """
    M, A = ids_ma.shape
    E = w1_epf.shape[0]
    acc = acc_dtype(z_mp.dtype)
    order, inverse, group_sizes = sort_by_expert(ids_ma, E)
    rows = jnp.broadcast_to(z_mp[:, None, :], (M, A, z_mp.shape[-1])).reshape(M * A, -1)
    xs = permute_rows(rows, order, inverse)
    if act_quant is not None:
        xs = act_quant(xs)
    cdt = z_mp.dtype
    g = lax.ragged_dot(xs, w1_epf.astype(cdt), group_sizes, preferred_element_type=acc)
    u = lax.ragged_dot(xs, w3_epf.astype(cdt), group_sizes, preferred_element_type=acc)
    h = act(g, u).astype(cdt)
    if act_quant is not None:
        h = act_quant(h)
    ys = lax.ragged_dot(h, w2_efp.astype(cdt), group_sizes, preferred_element_type=acc)
    y = permute_rows(ys, inverse, order).reshape(M, A, -1)
    return jnp.einsum("map,ma->mp", y, weights_ma.astype(acc))


def experts_dense(z_mp, ids_ma, weights_ma, w1_epf, w3_epf, w2_efp, act: Act, *,
                  act_quant: Callable | None = None):
    """Dense reference: every expert on every token, combined with a [M, E] weight matrix that is zero for the
    experts a token did not select. O(M·E·F) memory — for tests and tiny models."""
    E = w1_epf.shape[0]
    acc = acc_dtype(z_mp.dtype)
    cdt = z_mp.dtype
    x = act_quant(z_mp) if act_quant is not None else z_mp
    g = jnp.einsum("mp,epf->mef", x, w1_epf.astype(cdt), preferred_element_type=acc)
    u = jnp.einsum("mp,epf->mef", x, w3_epf.astype(cdt), preferred_element_type=acc)
    h = act(g, u).astype(cdt)
    if act_quant is not None:
        h = act_quant(h)
    y = jnp.einsum("mef,efp->mep", h, w2_efp.astype(cdt), preferred_element_type=acc)
    dense_w = jnp.sum(jax.nn.one_hot(ids_ma, E, dtype=acc) * weights_ma.astype(acc)[..., None], axis=1)
    return jnp.einsum("mep,me->mp", y, dense_w)


EXPERT_IMPLS = {"sorted": experts_sorted, "dense": experts_dense}
