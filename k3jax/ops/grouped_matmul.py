"""Dropless expert computation: a dense reference (every expert on every token, masked) and the sort-based
grouped path (``lax.ragged_dot``) that the model uses. Both take the same [E, in, out] expert stacks.

Sort-based dispatch, in rows M = tokens × A (notation.py):
    1. replicate each token A times (broadcast: its VJP is a sum, not a scatter), after QAT's MXFP8 fake-quant of
       the token (row-wise: once per token, not per copy)
    2. permute rows so they are grouped by expert id (stable argsort) — a permutation whose VJP is the inverse
       permutation (a gather), never a scatter-add (docs/model.md §7.2)
    3. grouped matmuls w1, w3 → GLU → w2 with group_sizes = bincount(ids, E)
    4. inverse permutation, weighted sum over the A copies in at-least-fp32

Step 3 has two implementations with the same contract:
    "ragged"  lax.ragged_dot — the natural op on GPU/TPU; on XLA:CPU its cost grows linearly with the number of
              groups (each group is a full-height masked matmul, docs/numerics.md §14.2), so 256 experts cost ~16× 16
              experts.
    "tiled"   every expert's rows are padded to whole tiles of ``tile`` rows, so each tile belongs to one expert;
              a scan over tiles runs the GLU FFN of one tile with its expert's weights, indexed in place (a
              [V, P, F] weight gather costs more than the matmuls on CPU). Work follows the routed rows
              (≤ R + E·(tile − 1) padded rows), not the expert count. The default on CPU; custom VJP.
"sorted" (the model default) picks "tiled" on CPU and "ragged" elsewhere with ``lax.platform_dependent``.
Frozen experts held as MXFP4 checkpoint bytes run through k3jax/ops/packed_experts.py (same contract and steps 1, 2, 4).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.ops.activations import glu_hidden
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


def _ragged_ffn(xs, group_sizes, w1, w3, w2, act, act_quant, acc):
    """Grouped GLU FFN over expert-sorted rows ``xs`` [R, P] (already fake-quantized: ``experts_grouped``) with
    ``lax.ragged_dot``; ``act_quant`` fake-quantizes h."""
    cdt = xs.dtype
    g = lax.ragged_dot(xs, w1.astype(cdt), group_sizes, preferred_element_type=acc)
    u = lax.ragged_dot(xs, w3.astype(cdt), group_sizes, preferred_element_type=acc)
    h = glu_hidden(g, u, act, cdt, act_quant=act_quant, acc=acc)
    return lax.ragged_dot(h, w2.astype(cdt), group_sizes, preferred_element_type=acc)


def default_tile(rows: int, groups: int) -> int:
    """Tile height for the tiled grouped matmul: about a quarter of the mean group size, a power of two in
    [8, 128] — padding waste (≤ tile − 1 rows per group) stays small next to the rows themselves."""
    t = max(rows // max(4 * groups, 1), 1)
    return int(min(128, max(8, 1 << (t.bit_length() - 1))))


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _tile_scan_ffn(xt, g_tile, w1, w3, w2, act, act_quant, acc):
    """y[v] = E_{g_tile[v]}(xt[v]) for row tiles xt [V, t, P]: a scan over tiles that indexes each tile's expert
    weights in place (no [V, P, F] weight gather), with a scan backward that updates one expert's weight gradient
    per step (autodiff of the forward scan would add a full [E, P, F] cotangent per step)."""
    return _tile_scan_fwd(xt, g_tile, w1, w3, w2, act, act_quant, acc)[0]


def _tile_ffn_step(x, e, w1, w3, w2, act, act_quant, acc):
    cdt = x.dtype
    w1e, w3e, w2e = (lax.dynamic_index_in_dim(w, e, keepdims=False).astype(cdt) for w in (w1, w3, w2))
    a = jnp.dot(x, w1e, preferred_element_type=acc)
    b = jnp.dot(x, w3e, preferred_element_type=acc)
    h = glu_hidden(a, b, act, cdt, act_quant=act_quant, acc=acc)
    return a, b, h, w1e, w3e, w2e


def _tile_scan_fwd(xt, g_tile, w1, w3, w2, act, act_quant, acc):
    def step(_, inp):
        x, e = inp
        _, _, h, _, _, w2e = _tile_ffn_step(x, e, w1, w3, w2, act, act_quant, acc)
        return None, jnp.dot(h, w2e, preferred_element_type=acc)

    _, y = lax.scan(step, None, (xt, g_tile))
    return y, (xt, g_tile, w1, w3, w2)


def _tile_scan_bwd(act, act_quant, acc, res, dy):
    xt, g_tile, w1, w3, w2 = res

    def step(carry, inp):
        dw1, dw3, dw2 = carry
        x, e, dy_t = inp
        a, b, h, w1e, w3e, w2e = _tile_ffn_step(x, e, w1, w3, w2, act, act_quant, acc)
        dy_t = dy_t.astype(acc)
        dh = jnp.dot(dy_t, w2e.T.astype(acc))  # the STE passes dh through act_quant unchanged
        _, act_vjp = jax.vjp(act, a, b)
        da, db = act_vjp(dh.astype(a.dtype))
        dx = jnp.dot(da, w1e.T.astype(acc)) + jnp.dot(db, w3e.T.astype(acc))
        upd = lambda dw, g: lax.dynamic_update_index_in_dim(  # noqa: E731
            dw, lax.dynamic_index_in_dim(dw, e, keepdims=False) + g.astype(dw.dtype), e, 0)
        dw1 = upd(dw1, jnp.dot(x.T.astype(acc), da))
        dw3 = upd(dw3, jnp.dot(x.T.astype(acc), db))
        dw2 = upd(dw2, jnp.dot(h.T.astype(acc), dy_t))
        return (dw1, dw3, dw2), dx.astype(x.dtype)

    zeros = tuple(varying_zeros(w.shape, acc_dtype(w.dtype), xt, dy, w1, w3, w2) for w in (w1, w3, w2))
    (dw1, dw3, dw2), dxt = lax.scan(step, zeros, (xt, g_tile, dy))
    return (match_varying(dxt, xt), None, match_varying(dw1, w1).astype(w1.dtype),
            match_varying(dw3, w3).astype(w3.dtype), match_varying(dw2, w2).astype(w2.dtype))


def varying_zeros(shape, dtype, *inputs):
    """Zeros for a loop carry. Inside shard_map the carry must have the same varying-mesh-axes type as its updates;
    an exact zero derived from every input (a sum over an empty slice) gives it that type on every jax version."""
    zero = sum(jnp.sum(jnp.ravel(a)[:0]).astype(dtype) for a in jax.tree.leaves(inputs))
    return jnp.zeros(shape, dtype) + zero


def match_varying(ct, primal):
    """Inside shard_map: sum a cotangent over the mesh axes it varies along but its primal does not (what autodiff
    does for a replicated operand, e.g. expert weights × data-sharded tokens). A no-op outside shard_map."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    return lax.psum(ct, extra) if extra else ct


def varying_axes(x) -> frozenset:
    """Mesh axes along which ``x`` varies inside shard_map (jax 0.12: manual_axis_type.varying; earlier: vma)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", ()))


def varying_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """An out_shape for a custom call (``pallas_call``) computed from ``inputs``: inside shard_map (check_vma) it
    declares the union of their varying mesh axes, as an output computed from them varies; outside, a plain
    ShapeDtypeStruct. jax 0.12 spells the declaration ``manual_axis_type=ManualAxisType(varying=...)``, jax 0.11
    ``vma=...``."""
    axes = frozenset().union(*(varying_axes(a) for a in jax.tree.leaves(inputs)))
    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype)
    mat = getattr(jax.sharding, "ManualAxisType", None)
    if mat is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat(varying=axes))
    return jax.ShapeDtypeStruct(shape, dtype, vma=axes)


_tile_scan_ffn.defvjp(_tile_scan_fwd, _tile_scan_bwd)


def tile_rows(xs, group_sizes, tile: int):
    """Expert-sorted rows xs [R, P] (group_sizes [E]) → per-expert row tiles.

    Steps: 1. each group is padded to whole tiles of ``tile`` rows (padded offsets ``poff``); 2. slot s of the tiled
    layout holds row off[g] + i of group g = g(s) when i < size_g, else an all-zero row; 3. row r of xs sits at slot
    back[r]. The static tile count V = ceil((R + E·(tile − 1)) / tile) bounds the padded tiles; tiles past the last
    group are all padding (their expert id is clipped to E − 1). Rows past sum(group_sizes) have no slot of their own:
    back[r] then points at a padding slot.
    Returns (xt [V, tile, P], tile_expert int [V], back int [R]).
    """
    R, P = xs.shape
    E = group_sizes.shape[0]
    n_tiles = -(-(R + E * (tile - 1)) // tile)  # static bound on the padded tiles
    padded = -(-group_sizes // tile) * tile
    off = jnp.cumsum(group_sizes) - group_sizes
    poff = jnp.cumsum(padded) - padded
    slot = jnp.arange(n_tiles * tile)
    g_slot = jnp.clip(jnp.searchsorted(jnp.cumsum(padded), slot, side="right"), 0, E - 1)
    i = slot - poff[g_slot]
    src = jnp.where(i < group_sizes[g_slot], off[g_slot] + i, R)  # R → an all-zero padding row
    xt = jnp.concatenate([xs, jnp.zeros((1, P), xs.dtype)])[src].reshape(n_tiles, tile, P)
    row_e = jnp.clip(jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(R), side="right"), 0, E - 1)
    return xt, g_slot[::tile], poff[row_e] + jnp.arange(R) - off[row_e]


def _tiled_ffn(xs, group_sizes, w1, w3, w2, act, act_quant, acc, tile: int | None = None):
    """Grouped GLU FFN over expert-sorted rows ``xs`` [R, P] with per-expert tiles (module docstring); xs already
    fake-quantized (``experts_grouped``), ``act_quant`` on h."""
    R, P = xs.shape
    tile = tile or default_tile(R, w1.shape[0])
    xt, tile_expert, back = tile_rows(xs, group_sizes, tile)
    y = _tile_scan_ffn(xt, tile_expert, w1, w3, w2, act, act_quant, acc).reshape(-1, P)
    return y[back]


def experts_grouped(z_mp, ids_ma, weights_ma, w1_epf, w3_epf, w2_efp, act: Act, *, ffn, act_quant=None,
                    quantized_input: bool = False):
    """Steps 1, 2 and 4 of the module docstring around step 3, ``ffn(xs [R, P], group_sizes [E], w1, w3, w2, act,
    act_quant, acc) → [R, P]`` on the expert-sorted rows (``act_quant`` there: h's). An ``ffn`` marked
    ``gathers_rows`` (the packed experts' FFN kernel) takes the tokens z [M, P] and the sort instead
    (``rows=(order, inverse), copies=A``) and returns y [M·A, P] in the copies' order: it gathers its padded rows from
    z itself, so no sorted copy of the M·A rows is made (pallas_kernels/mxfp4_matmul/ffn.py).

    ``act_quant`` (the MXFP8 fake-quant of the GEMM inputs, straight-through) quantizes z here, once per token before
    its A copies: its blocks lie along P, so the copies' values are the ones quantizing each copy would give, for a
    1/A of the bytes (at K3 shapes under expert parallelism, the receive buffer is ~20x the tokens). With
    ``quantized_input`` the caller has done it (``ExpertParallel``, before its exchange)."""
    if act_quant is not None and not quantized_input:
        z_mp = act_quant(z_mp)
    M, A = ids_ma.shape
    # an array [E, P, F], a PackedWeight (its ``shape``: one layer's, also of a stack of layers), or a pytree of
    # per-expert stacks whose first leaf leads with E
    E = (w1_epf.shape if hasattr(w1_epf, "shape") else jax.tree.leaves(w1_epf)[0].shape)[0]
    acc = acc_dtype(z_mp.dtype)
    order, inverse, group_sizes = sort_by_expert(ids_ma, E)
    if getattr(ffn, "gathers_rows", False):  # it gathers each sorted row from the tokens, y in the copies' order
        y = ffn(z_mp, group_sizes, w1_epf, w3_epf, w2_efp, act, act_quant, acc, rows=(order, inverse), copies=A)
    else:
        rows = jnp.broadcast_to(z_mp[:, None, :], (M, A, z_mp.shape[-1])).reshape(M * A, -1)
        ys = ffn(permute_rows(rows, order, inverse), group_sizes, w1_epf, w3_epf, w2_efp, act, act_quant, acc)
        y = permute_rows(ys, inverse, order)
    return jnp.einsum("map,ma->mp", y.reshape(M, A, -1), weights_ma.astype(acc))


def experts_ragged(z_mp, ids_ma, weights_ma, w1_epf, w3_epf, w2_efp, act: Act, *, act_quant=None,
                   quantized_input: bool = False):
    """Sort-based dropless experts with ``lax.ragged_dot``: Σ_a weights[m, a] · E_{ids[m, a]}(z[m]) → [M, P]."""
    return experts_grouped(z_mp, ids_ma, weights_ma, w1_epf, w3_epf, w2_efp, act, ffn=_ragged_ffn,
                           act_quant=act_quant, quantized_input=quantized_input)


def experts_tiled(z_mp, ids_ma, weights_ma, w1_epf, w3_epf, w2_efp, act: Act, *, act_quant=None,
                  quantized_input: bool = False):
    """Sort-based dropless experts with per-expert row tiles (work follows the rows, not the expert count)."""
    return experts_grouped(z_mp, ids_ma, weights_ma, w1_epf, w3_epf, w2_efp, act, ffn=_tiled_ffn,
                           act_quant=act_quant, quantized_input=quantized_input)


def experts_sorted(z_mp, ids_ma, weights_ma, w1_epf, w3_epf, w2_efp, act: Act, *, act_quant=None,
                   quantized_input: bool = False):
    """The default dispatch: tiled on CPU, ragged_dot on GPU/TPU (same result to rounding)."""
    args = (z_mp, ids_ma, weights_ma, w1_epf, w3_epf, w2_efp)
    kw = {"act_quant": act_quant, "quantized_input": quantized_input}
    return lax.platform_dependent(
        *args,
        cpu=lambda *a: experts_tiled(*a, act, **kw),
        default=lambda *a: experts_ragged(*a, act, **kw))


def experts_dense(z_mp, ids_ma, weights_ma, w1_epf, w3_epf, w2_efp, act: Act, *,
                  act_quant: Callable | None = None, quantized_input: bool = False):
    """Dense reference: every expert on every token, combined with a [M, E] weight matrix that is zero for the
    experts a token did not select. O(M·E·F) memory — for tests and tiny models."""
    E = w1_epf.shape[0]
    acc = acc_dtype(z_mp.dtype)
    cdt = z_mp.dtype
    x = act_quant(z_mp) if act_quant is not None and not quantized_input else z_mp
    g = jnp.einsum("mp,epf->mef", x, w1_epf.astype(cdt), preferred_element_type=acc)
    u = jnp.einsum("mp,epf->mef", x, w3_epf.astype(cdt), preferred_element_type=acc)
    h = glu_hidden(g, u, act, cdt, act_quant=act_quant, acc=acc)
    y = jnp.einsum("mef,efp->mep", h, w2_efp.astype(cdt), preferred_element_type=acc)
    dense_w = jnp.sum(jax.nn.one_hot(ids_ma, E, dtype=acc) * weights_ma.astype(acc)[..., None], axis=1)
    return jnp.einsum("mep,me->mp", y, dense_w)


EXPERT_IMPLS = {"sorted": experts_sorted, "ragged": experts_ragged, "tiled": experts_tiled, "dense": experts_dense}
