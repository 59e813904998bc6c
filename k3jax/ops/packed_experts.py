"""Routed experts run from their MXFP4 checkpoint bytes (docs/numerics.md §10.3): frozen weights, and never a
high-precision copy of a whole expert stack.

Weights, torch orientation as on disk and as ``checkpoint.load(..., keep_experts_packed=True)`` returns them
(y = x @ W_eᵀ with W_e [out, in], blocks of 32 along ``in``):

    w1, w3   packed uint8 [E, F, P/2]   scale uint8 [E, F, P/32]        (out F, in P)
    w2       packed uint8 [E, P, F/2]   scale uint8 [E, P, F/32]        (out P, in F)

``experts_sorted_packed`` has the contract of ``grouped_matmul.experts_sorted`` (sort rows by expert, grouped GLU FFN,
un-sort, weighted sum over the A slots in at-least-fp32) with the FFN step replaced by ``_packed_ffn``:

  "tiles" (CPU, XLA): rows padded to per-expert tiles (``grouped_matmul.tile_rows``); a loop over experts e, inside it
      over chunks c of fc columns of F (fc ≤ 512, whole scale blocks), decodes W1[e, c], W3[e, c] [fc, P] and
      W2[e, :, c] [P, fc] — 3·fc·P values, the only decoded weights alive at any time — and runs e's row tiles through
      that slice of the FFN: a = x W1[c]ᵀ, b = x W3[c]ᵀ, y += act(a, b) W2[:, c]ᵀ. act is elementwise and MXFP8 blocks
      of h (act_quant) are 32 wide, so the F split changes only the summation order of y. Each weight byte is decoded
      once per pass; experts without rows are skipped.
  "gmm" (GPU/TPU): the grouped GLU FFN of three grouped MXFP4 matmuls, ``gmm(x, w1, w3, w2, group_sizes, act,
      act_quant=, acc=) → [R, P]`` — the Pallas kernels run in tile space (pallas_kernels/mxfp4_matmul/ffn.py: the
      rows padded into per-expert tiles once, not once per matmul), which ops cannot import: ``layers/backends.py``
      passes it in (``mxfp4_glu_ffn``). The kernels' outputs are in the rows' dtype, so in bf16 runs a and b are
      rounded to bf16 before act (the XLA loop keeps them in fp32).
  "auto": ``lax.platform_dependent(cpu="tiles", default="gmm")`` ("tiles" everywhere when no ``gmm`` is given).

Gradients (custom_vjp): w.r.t. the rows only — the uint8 storage has no cotangent. The backward follows the forward's
implementation: "tiles" per (e, c) and tile recomputes a, b, then dh = dy W2[:, c], (da, db) = act_vjp(dh),
dx += da W1[c] + db W3[c]; "gmm" differentiates the FFN kernel (its VJP recomputes a, b and runs the Pallas kernel's
transposed form, dx = g W contracting over ``out``, from the packed bytes).
``act_quant`` on the GEMM inputs is a straight-through estimator, as in grouped_matmul: applied to the tokens
outside the custom_vjp (``experts_grouped``: once per token, before its copies), and passed through unchanged for h.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.ops import mx
from k3jax.ops.activations import glu_hidden
from k3jax.ops.grouped_matmul import (
    Act,
    default_tile,
    experts_dense,
    experts_grouped,
    match_varying,
    tile_rows,
    varying_zeros,
)

PACKED_IMPLS = ("auto", "tiles", "gmm", "dense")
FFN_CHUNK = 512  # columns of F decoded per (expert, chunk) step of the "tiles" loop (at most; whole scale blocks)


class PackedWeight(NamedTuple):
    """One MXFP4 expert stack in the checkpoint's form: packed uint8 [E, N, K/2] + E8M0 scale uint8 [E, N, K/32] for
    W_e [N = out, K = in]. A pytree: it passes through jit, shard_map and the experts_fn weight slots of the MoE
    layer.

    ``layer`` (an int32 scalar, or None): the stacks hold every layer of a scanned group, packed [L, E, N, K/2] and
    scale [L, E, N, K/32], and this weight is layer ``layer`` of them. The grouped kernels read that layer's packed
    bytes from the stack in place (``pallas_kernels/mxfp4_matmul``, ``api.layer_groups``: its scales, and a stack
    whose minor dim is off TPU's 128 lanes, are sliced); a slice of the packed stack fed to them would be a
    copy of the layer's experts per call (XLA materialises a custom call's operands: 40.8 of the 53.4 GB per chip of
    full K3's decode step on v5p-64; experiments/LOG.md, session 30). The other paths take ``one_layer`` (the
    slice)."""

    packed: jax.Array
    scale: jax.Array
    layer: jax.Array | None = None

    @property
    def stacked(self) -> bool:
        return self.layer is not None

    @property
    def shape(self) -> tuple:
        """[E, N, K/2]: one layer's packed shape."""
        return tuple(self.packed.shape[-3:])

    def one_layer(self) -> PackedWeight:
        """The weight of one layer: itself, or its layer's slice of the stacks (a copy where XLA materialises it)."""
        if self.layer is None:
            return self
        return PackedWeight(*(lax.dynamic_index_in_dim(x, self.layer, keepdims=False) for x in self[:2]))


def num_experts(w) -> int:
    """E of an expert stack: an array [E, in, out] or a ``PackedWeight`` (stacked or not)."""
    if isinstance(w, PackedWeight):
        return w.shape[0]
    return jax.tree.leaves(w)[0].shape[0]


def dequantize_stack(w: PackedWeight, dtype=jnp.float32) -> jax.Array:
    """PackedWeight → the dense stack [E, in, out] in ``dtype`` (exact). Materializes the whole stack: references and
    the dequantize-then-matmul comparison only."""
    return jnp.swapaxes(mx.mxfp4_dequantize(mx.unpack_codes(w.packed), w.scale, axis=-1, dtype=dtype), -1, -2)


def ffn_chunk(hidden: int, target: int | None = None) -> int:
    """Columns of F per chunk: the largest multiple of 32 that divides F and is ≤ ``target`` (default FFN_CHUNK; F
    itself if F ≤ target)."""
    target = FFN_CHUNK if target is None else target
    if hidden % mx.BLOCK_SIZE:
        raise ValueError(f"expert hidden F = {hidden} is not a multiple of {mx.BLOCK_SIZE} (w2's MXFP4 blocks)")
    if hidden <= target:
        return hidden
    return max(c for c in range(mx.BLOCK_SIZE, target + 1, mx.BLOCK_SIZE) if hidden % c == 0)


def _decode(packed, scale, dtype):
    """Bytes [N, k/2] + scale bytes [N, k/32] → W [N, k] in ``dtype`` (exact: fp4 × 2^e)."""
    return mx.mxfp4_dequantize(mx.unpack_codes(packed), scale, axis=-1, dtype=dtype)


def _chunk(w1: PackedWeight, w3: PackedWeight, w2: PackedWeight, e, c, fc: int, dtype):
    """The decoded weights of expert e, F-chunk c: W1[e, c], W3[e, c] [fc, P] and W2[e, :, c] [P, fc]."""
    _, _, half = w1.packed.shape
    P = w2.packed.shape[1]

    def rows(w):  # rows c·fc … of [E, F, P/2] / [E, F, P/32]
        return _decode(lax.dynamic_slice(w.packed, (e, c * fc, 0), (1, fc, half))[0],
                       lax.dynamic_slice(w.scale, (e, c * fc, 0), (1, fc, w.scale.shape[2]))[0], dtype)

    b2 = lax.dynamic_slice(w2.packed, (e, 0, c * (fc // 2)), (1, P, fc // 2))[0]
    s2 = lax.dynamic_slice(w2.scale, (e, 0, c * (fc // mx.BLOCK_SIZE)), (1, P, fc // mx.BLOCK_SIZE))[0]
    return rows(w1), rows(w3), _decode(b2, s2, dtype)


def _dot_nt(x, w, acc):
    """x [t, K] @ w [N, K]ᵀ → [t, N] in ``acc``."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=acc)


def _expert_chunk_loop(group_sizes, tile: int, weights, fc: int, dtype, body, carry):
    """carry ← body(v, (W1c, W3c, W2c), carry) for every (expert e, F-chunk c) and every row tile v of e, decoding
    each (e, c) once. Tiles of e: [tile_start[e], tile_start[e] + ceil(size_e / tile)) — the layout of ``tile_rows``."""
    E = group_sizes.shape[0]
    F = weights[0].packed.shape[1]
    n_tiles = -(-group_sizes // tile)
    tile_start = jnp.cumsum(n_tiles) - n_tiles

    def expert(e, carry):
        def chunk(c, carry):
            w = _chunk(*weights, e, c, fc, dtype)
            return lax.fori_loop(tile_start[e], tile_start[e] + n_tiles[e], lambda v, cy: body(v, w, cy), carry)

        return lax.cond(n_tiles[e] > 0, lambda cy: lax.fori_loop(0, F // fc, chunk, cy), lambda cy: cy, carry)

    return lax.fori_loop(0, E, expert, carry)


def _add_tile(y, v, update):
    return lax.dynamic_update_index_in_dim(y, lax.dynamic_index_in_dim(y, v, keepdims=False) + update, v, 0)


def _tiles_forward(xs, group_sizes, w1, w3, w2, act, act_quant, acc, tile: int, fc: int):
    """y [R, P] (acc) = the GLU FFN of each row's expert, by the (expert, F-chunk) loop over row tiles."""
    R, P = xs.shape
    cdt = xs.dtype
    xt, _, back = tile_rows(xs, group_sizes, tile)

    def body(v, w, y):
        w1c, w3c, w2c = w
        x = lax.dynamic_index_in_dim(xt, v, keepdims=False)
        h = glu_hidden(_dot_nt(x, w1c, acc), _dot_nt(x, w3c, acc), act, cdt, act_quant=act_quant, acc=acc)
        return _add_tile(y, v, _dot_nt(h, w2c, acc))

    y0 = varying_zeros(xt.shape, acc, xt, group_sizes, w1, w3, w2)
    yt = _expert_chunk_loop(group_sizes, tile, (w1, w3, w2), fc, cdt, body, y0)
    return yt.reshape(-1, P)[back]


def _tiles_backward(xs, group_sizes, w1, w3, w2, dy, *, act, acc, tile: int, fc: int):
    """dx [R, P] for the rows of ``_tiles_forward`` (weights frozen); act_quant on h is straight-through."""
    R, P = xs.shape
    xt, _, back = tile_rows(xs, group_sizes, tile)
    dyt, _, _ = tile_rows(dy.astype(acc), group_sizes, tile)

    def body(v, w, dx):
        w1c, w3c, w2c = w
        x = lax.dynamic_index_in_dim(xt, v, keepdims=False)
        a, b = _dot_nt(x, w1c.astype(x.dtype), acc), _dot_nt(x, w3c.astype(x.dtype), acc)
        dh = jnp.dot(lax.dynamic_index_in_dim(dyt, v, keepdims=False), w2c)  # [t, P] @ [P, fc]
        _, act_vjp = jax.vjp(act, a, b)
        da, db = act_vjp(dh.astype(a.dtype))
        return _add_tile(dx, v, jnp.dot(da.astype(acc), w1c) + jnp.dot(db.astype(acc), w3c))

    dx0 = varying_zeros(xt.shape, acc, xt, dyt, group_sizes, w1, w3, w2)
    dxt = _expert_chunk_loop(group_sizes, tile, (w1, w3, w2), fc, acc, body, dx0)
    return dxt.reshape(-1, P)[back].astype(xs.dtype)


def _gmm_forward(xs, group_sizes, w1, w3, w2, rows, act, act_quant, acc, gmm, copies):
    """y [R, P] (acc) by the grouped GLU FFN kernel ``gmm`` (the Pallas kernels on GPU/TPU; output in xs.dtype);
    with ``rows`` its gather form (xs a table of tokens, y in the copies' order)."""
    form = {} if rows is None else {"rows": rows, "copies": copies}
    return gmm(xs, w1, w3, w2, group_sizes, act, act_quant=act_quant, acc=acc, **form).astype(acc)


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _packed_ffn(xs, group_sizes, w1, w3, w2, rows, act, act_quant, acc, gmm, impl, copies):
    """Grouped GLU FFN of expert-sorted rows xs [R, P] with PackedWeight stacks → [R, P] acc (module docstring); with
    ``rows`` = (order, inverse) xs is a table of tokens and sorted row r is copy order[r] of token order[r] //
    ``copies``: y [N·copies, P] in the copies' order (``experts_grouped``'s gather form)."""
    return _packed_ffn_fwd(xs, group_sizes, w1, w3, w2, rows, act, act_quant, acc, gmm, impl, copies)[0]


def _tiling(xs, group_sizes, w2, rows=None):
    R = xs.shape[0] if rows is None else rows[0].shape[0]       # the sorted rows
    return default_tile(R, group_sizes.shape[0]), ffn_chunk(w2.shape[2] * 2)


def _one_layer(f):
    """``f(xs, group_sizes, w1, w3, w2, ...)`` on one layer's weights (the XLA loop does not read a stack)."""
    return lambda xs, gs, *ws, **kw: f(xs, gs, *(w.one_layer() for w in ws[:3]), *ws[3:], **kw)


def _sorted(xs, rows, copies):
    """The expert-sorted rows of ``xs``: itself, or in the gather form the table's tokens of ``rows``' order."""
    return xs if rows is None else jnp.take(xs, rows[0] // copies, axis=0)


def _packed_ffn_fwd(xs, group_sizes, w1, w3, w2, rows, act, act_quant, acc, gmm, impl, copies):
    tile, fc = _tiling(xs, group_sizes, w2, rows)
    loop = _one_layer(partial(_tiles_forward, act=act, act_quant=act_quant, acc=acc, tile=tile, fc=fc))

    def tiles(xs, group_sizes, w1, w3, w2, rows):   # the XLA loop takes the sorted rows; y back in the copies' order
        y = loop(_sorted(xs, rows, copies), group_sizes, w1, w3, w2)
        return y if rows is None else y[rows[1]]

    args = (xs, group_sizes, w1, w3, w2, rows)
    if impl == "gmm" or (impl == "auto" and gmm is not None):
        on_gmm = partial(_gmm_forward, act=act, act_quant=act_quant, acc=acc, gmm=gmm, copies=copies)
        y = on_gmm(*args) if impl == "gmm" else lax.platform_dependent(*args, cpu=tiles, default=on_gmm)
    else:
        y = tiles(*args)
    return y, args


def _gmm_backward(xs, group_sizes, w1, w3, w2, rows, dy, *, act, act_quant, acc, gmm, copies):
    """dx of ``_gmm_forward``: the FFN kernel's own VJP (a and b recomputed by the kernel; dh = dy W2, da W1 + db W3
    by the transposed kernel over the packed bytes); act_quant on h is straight-through there too."""
    fwd = partial(_gmm_forward, group_sizes=group_sizes, w1=w1, w3=w3, w2=w2, rows=rows, act=act,
                  act_quant=act_quant, acc=acc, gmm=gmm, copies=copies)
    _, vjp = jax.vjp(fwd, xs)
    return vjp(dy.astype(acc))[0]


def _packed_ffn_bwd(act, act_quant, acc, gmm, impl, copies, res, dy):
    xs, group_sizes, w1, w3, w2, rows = res
    tile, fc = _tiling(xs, group_sizes, w2, rows)
    loop = _one_layer(partial(_tiles_backward, act=act, acc=acc, tile=tile, fc=fc))

    def tiles(xs, group_sizes, w1, w3, w2, rows, dy):   # the gather form: dy sorted, each token's copies summed
        if rows is None:
            return loop(xs, group_sizes, w1, w3, w2, dy)
        dxs = loop(_sorted(xs, rows, copies), group_sizes, w1, w3, w2, dy[rows[0]]).astype(acc)
        return varying_zeros(xs.shape, acc, xs, dxs).at[rows[0] // copies].add(dxs).astype(xs.dtype)

    args = (xs, group_sizes, w1, w3, w2, rows, dy)
    if impl == "gmm" or (impl == "auto" and gmm is not None):
        on_gmm = partial(_gmm_backward, act=act, act_quant=act_quant, acc=acc, gmm=gmm, copies=copies)
        dx = on_gmm(*args) if impl == "gmm" else lax.platform_dependent(*args, cpu=tiles, default=on_gmm)
    else:
        dx = tiles(*args)
    # with F sharded (tensor), each device's dx is a partial sum over its F slice: psum to the rows' varying axes
    return match_varying(dx, xs), None, None, None, None, None  # frozen uint8 storage, int maps: no cotangent


_packed_ffn.defvjp(_packed_ffn_fwd, _packed_ffn_bwd)


def _check(w: PackedWeight, name: str, n: int, k: int, num: int) -> None:
    want_p, want_s = mx.mxfp4_packed_shapes((num, n, k))
    lead = w.packed.shape[:1] if w.stacked else ()
    want_p, want_s = (*lead, *want_p), (*lead, *want_s)
    if w.packed.dtype != jnp.uint8 or w.scale.dtype != jnp.uint8 or w.packed.shape != want_p \
            or w.scale.shape != want_s or k % mx.BLOCK_SIZE or (w.stacked and jnp.shape(w.layer) != ()):
        raise ValueError(f"{name}: expected packed uint8 {want_p} and scale uint8 {want_s} (in = {k} a multiple of "
                         f"{mx.BLOCK_SIZE}), got {w.packed.dtype} {w.packed.shape} and {w.scale.dtype} {w.scale.shape}"
                         + (f", layer of shape {jnp.shape(w.layer)}" if w.stacked else ""))


def experts_packed(z_mp, ids_ma, weights_ma, w1: PackedWeight, w3: PackedWeight, w2: PackedWeight, act: Act, *,
                   act_quant: Callable | None = None, gmm: Callable | None = None, impl: str = "auto",
                   quantized_input: bool = False):
    """``experts_sorted_packed`` with each stack as one ``PackedWeight`` (the MoE layer's experts_fn form)."""
    if impl not in PACKED_IMPLS:
        raise ValueError(f"impl must be one of {PACKED_IMPLS}, got {impl!r}")
    if impl == "gmm" and gmm is None:
        raise ValueError("impl='gmm' needs the grouped MXFP4 GLU FFN kernel (layers/backends.py: mxfp4_glu_ffn)")
    E, F, half = w1.shape
    P = 2 * half
    _check(w1, "w1", F, P, E)
    _check(w3, "w3", F, P, E)
    _check(w2, "w2", P, F, E)
    if z_mp.shape[-1] != P:
        raise ValueError(f"z [M, P] has P = {z_mp.shape[-1]}, the packed experts have in = {P}")
    # only the kernels read a stack in place; "tiles" / "dense" (and "auto" with no kernel) take the layer's slice,
    # "auto" with a kernel slices in its CPU branch (``_one_layer``)
    if impl in ("tiles", "dense") or gmm is None:
        w1, w3, w2 = (w.one_layer() for w in (w1, w3, w2))
    if impl == "dense":
        dt = z_mp.dtype
        return experts_dense(z_mp, ids_ma, weights_ma, *(dequantize_stack(w, dt) for w in (w1, w3, w2)), act,
                             act_quant=act_quant, quantized_input=quantized_input)

    def ffn(xs, group_sizes, w1, w3, w2, act, act_quant, acc, rows=None, copies=1):  # xs fake-quantized (STE there)
        return _packed_ffn(xs, group_sizes, w1, w3, w2, rows, act, act_quant, acc, gmm, impl, copies)

    ffn.gathers_rows = True     # experts_grouped hands it the tokens and the sort (its gather form)
    return experts_grouped(z_mp, ids_ma, weights_ma, w1, w3, w2, act, ffn=ffn, act_quant=act_quant,
                           quantized_input=quantized_input)


def experts_sorted_packed(z_mp, ids_ma, weights_ma, w1p, w1s, w3p, w3s, w2p, w2s, act: Act, *,
                          act_quant: Callable | None = None, gmm: Callable | None = None, impl: str = "auto"):
    """Dropless routed experts from MXFP4 bytes: Σ_a weights[m, a] · E_{ids[m, a]}(z[m]) → [M, P] (acc dtype).

    Args:
      z_mp: [M, P] float rows (the latent, or the model width for a standard MoE).
      ids_ma, weights_ma: [M, A] expert ids (int) and gate weights.
      w1p, w3p: uint8 [E, F, P/2]; w1s, w3s: uint8 [E, F, P/32]; w2p: uint8 [E, P, F/2]; w2s: uint8 [E, P, F/32].
      act: the GLU activation act(a, b) (elementwise).
      act_quant: None, or MXFP8 fake-quant of the GEMM inputs (straight-through), as in experts_sorted.
      gmm: the grouped MXFP4 GLU FFN for GPU/TPU (``layers.backends.mxfp4_glu_ffn``); None: the XLA loop everywhere.
      impl: "auto" | "tiles" (XLA loop) | "gmm" | "dense" (dequantize, then the dense reference).
    Gradients: w.r.t. z_mp and weights_ma; none for the uint8 stacks.
    """
    return experts_packed(z_mp, ids_ma, weights_ma, PackedWeight(w1p, w1s), PackedWeight(w3p, w3s),
                          PackedWeight(w2p, w2s), act, act_quant=act_quant, gmm=gmm, impl=impl)


__all__ = ["FFN_CHUNK", "PACKED_IMPLS", "PackedWeight", "dequantize_stack", "experts_packed", "experts_sorted_packed",
           "ffn_chunk", "num_experts"]
