"""The grouped GLU FFN of MXFP4 experts run in tile space: three grouped kernels around one padding of the rows.

    y = mxfp4_glu_ffn(x, (w1p, w1s), (w3p, w3s), (w2p, w2s), group_sizes, act)     rows of x sorted by expert

y [M, P] = (act(x W1ᵀ, x W3ᵀ) [→ act_quant]) W2ᵀ per group — what three ``mxfp4_gmm`` calls compute (values and the
gradient with respect to x equal theirs), without the row traffic between them. ``mxfp4_gmm`` pads the rows of
each call into whole per-group tiles and gathers the result back: for the FFN that is three pads, three even / odd
splits and three un-pads in the forward and five of each in the backward, each a full pass over [M, P] or [M, F]
rows (at K3's expert shapes this and the bf16 return exchange of ``ExpertParallel`` took 3.9 TB off the v5p-512
frozen-experts step's HBM traffic per chip; experiments/LOG.md, 2026-12-05 session 21). Here the rows are padded and
split once; a, b, h and the cotangents stay in the padded layout between the kernels (the GLU and the MXFP8
fake-quant of h are row-wise, so a padding row — a copy of a real one, ``api.pad_rows`` — never reaches a real row),
and one gather un-pads y (and dx in the backward).

The gather form (``rows=(order, inverse, copies)``): x is a table of tokens [N, P] and sorted row r is the copy
order[r] of token order[r] // copies (a MoE's A slots per token, sorted by expert: ``grouped_matmul.
sort_by_expert``); y comes back in the copies' order [N·copies, P]. The tile-padded even / odd halves are then
gathered from the table's halves (N rows, read once) and y_pad is gathered straight into the copies' order: no
[N·copies, P] sorted copy of the rows, padded copy, split or un-permute pass in between (kimi-k3 decode at B = 64 on
v5p-64: ~6 GB per chip and step of such passes at 1,024 copies per layer; experiments/LOG.md, 2026-12-07 session
33). The backward gathers dy by the same map and sums dx into the table's rows (a scatter-add over the padded rows;
padding and unused tiles' rows are dropped). Values: those of the sorted form on x[order // copies], forward and dx.

Dtypes follow the three-call form exactly: the kernels return the rows' dtype, act runs in ``acc`` on their outputs
and h is rounded to the rows' dtype (then ``act_quant``, straight-through); in the backward dh comes from the
transposed kernel in the rows' dtype, act's VJP runs in ``acc`` and da, db are rounded before their transposed
kernels, whose two dx are summed in the rows' dtype. Gradients: with respect to x only (frozen uint8 storage).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops.activations import glu_hidden
from k3jax.ops.grouped_matmul import match_varying, varying_zeros
from pallas_kernels.mxfp4_matmul import api
from pallas_kernels.mxfp4_matmul import kernel as _k
from pallas_kernels.mxfp4_matmul import kernel_t as _kt
from pallas_kernels.mxfp4_matmul.kernel import BlockSizes
from pallas_kernels.platform import target_platform


def _launch(platform: str, t: bool, groups: int):
    """The kernel for ``platform`` (transposed if ``t``); on TPU told the experts of one layer (``groups``), which
    its grid choice counts when the weights are a flattened stack of layers."""
    if platform != "tpu":
        return _kt.mxfp4_gmm_t_loop if t else _k.mxfp4_gmm_loop
    return functools.partial(_kt.mxfp4_gmm_t_tpu if t else _k.mxfp4_gmm_tpu, groups=groups)


def _hidden(tg, xe, xo, w1, w3, bs, platform, interpret, tiles, groups):
    """a = x W1ᵀ, b = x W3ᵀ [T·bm, F] in the rows' dtype, in tile space (unused tiles' rows unwritten)."""
    fwd = functools.partial(_launch(platform, False, groups), interpret=interpret, expected_tiles=tiles)
    return fwd(tg, xe, xo, *w1, bs), fwd(tg, xe, xo, *w3, bs)


def _in_place(tg, ws, layer):
    """(tile groups of w1 / w3, of w2; the weights) with a stacked layer's experts addressed where they lie
    (``api.layer_groups``; w1 and w3 share shapes, so one choice and one offset serve both; w2 may be sliced where
    they are read in place); unstacked (layer None): as given."""
    out = [api.layer_groups(tg, *w, layer) for w in ws]
    return out[0][0], out[2][0], [(p, s) for _, p, s, _ in out]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12, 13, 14, 15))
def _ffn(x, w1, w3, w2, group_sizes, layer, rows, act, act_quant, acc, bs13: BlockSizes, bs2: BlockSizes,
         platform: str, interpret, expected, copies):
    return _ffn_fwd(x, w1, w3, w2, group_sizes, layer, rows, act, act_quant, acc, bs13, bs2, platform, interpret,
                    expected, copies)[0]


def _row_maps(group_sizes, num_rows: int, bm: int, rows, copies: int):
    """(tile groups, what each padded row reads from x, what each output row reads from the padded rows, which
    output row each padded row holds — the backward's dy map —, and x's row of each padded row for the backward's
    scatter or None). The sorted form: ``group_tile_metadata``'s src_rows / dst_rows. The gather form (``rows`` =
    (order, inverse)): the table's token of each padded row (padding: a clipped real one), y's copies in their own
    order, and the tokens with padding and unused tiles' rows out of range (the scatter drops them)."""
    tg, src_rows, dst_rows, _ = api.group_tile_metadata(group_sizes, num_rows, bm)
    if rows is None:
        return tg, src_rows, dst_rows, src_rows, None
    order, inverse = rows
    copy = jnp.take(order, src_rows, mode="clip")
    token = copy // copies
    return (tg, token, jnp.take(dst_rows, inverse), copy,
            jnp.where(src_rows < num_rows, token, num_rows // copies))


def _ffn_fwd(x, w1, w3, w2, group_sizes, layer, rows, act, act_quant, acc, bs13, bs2, platform, interpret, expected,
             copies):
    G = group_sizes.shape[0]
    M = x.shape[0] * (1 if rows is None else copies)        # sorted rows
    tg, src, dst, held, token = _row_maps(group_sizes, M, bs13.block_m, rows, copies)
    tg, tg2, (w1, w3, w2) = _in_place(tg, (w1, w3, w2), layer)
    tiles = api.charged_tiles(expected, bs13.block_m)  # bs2 has the same block_m: one tile layout
    # sorted rows: padded, then split; a table of tokens: split (N rows), then each half gathered padded
    xe, xo = (api.split_even_odd(api.pad_rows(x, src)) if rows is None else
              tuple(api.pad_rows(half, src) for half in api.split_even_odd(x)))
    a, b = _hidden(tg, xe, xo, w1, w3, bs13, platform, interpret, tiles, G)
    # an unused tile's a, b (never written, any bits) give any h there: nothing reads it (the kernels skip unused
    # tiles, the rows are independent, and unpad_rows reads only used tiles' rows)
    h = glu_hidden(a, b, act, x.dtype, act_quant=act_quant, acc=acc)
    y_pad = _launch(platform, False, G)(tg2, *api.split_even_odd(h), *w2, bs2, interpret=interpret,
                                        expected_tiles=tiles)
    # rows past the groups: 0 (unpad_rows); the row maps go to the backward as they are; x[:, :0] (no bytes) carries
    # x's type (its varying mesh axes) and row count
    return api.unpad_rows(y_pad, dst), (xe, xo, w1, w3, w2, tg, tg2, (dst, held, token), x[:, :0], group_sizes)


def _ffn_bwd(act, act_quant, acc, bs13, bs2, platform, interpret, expected, copies, res, dy):
    xe, xo, w1, w3, w2, tg, tg2, (dst, held, token), x_type, group_sizes = res   # tg*, w*: as _in_place left them
    dt, G = x_type.dtype, group_sizes.shape[0]
    tiles = api.charged_tiles(expected, bs13.block_m)
    a, b = _hidden(tg, xe, xo, w1, w3, bs13, platform, interpret, tiles, G)
    bwd = functools.partial(_launch(platform, True, G), interpret=interpret, expected_tiles=tiles)
    dh = api.interleave_columns(*bwd(tg2, api.pad_rows(dy.astype(dt), held), *w2, bs2))
    _, act_vjp = jax.vjp(act, a.astype(acc), b.astype(acc))
    da, db = act_vjp(dh.astype(acc))  # the STE passes dh through act_quant
    e1, o1 = bwd(tg, da.astype(dt), *w1, bs13)
    e3, o3 = bwd(tg, db.astype(dt), *w3, bs13)
    if token is None:   # the sorted form
        dx = api.interleave_columns(api.unpad_rows(e1 + e3, dst), api.unpad_rows(o1 + o3, dst))  # past: 0
    else:   # each token's copies summed (in acc) into its row; padding and unused tiles' rows (token N) dropped
        dx = varying_zeros((x_type.shape[0], 2 * xe.shape[1]), acc, x_type, e1, dy).at[token].add(
            api.interleave_columns(e1 + e3, o1 + o3).astype(acc), mode="drop").astype(dt)
    # with W's F split over a mesh axis (tensor-parallel experts), each device's dx is a partial sum over its slice
    return match_varying(dx, x_type), None, None, None, None, None, None


_ffn.defvjp(_ffn_fwd, _ffn_bwd)


def mxfp4_glu_ffn(x, w1, w3, w2, group_sizes, act, *, act_quant=None, acc=jnp.float32, block_m: int | None = None,
                  block_n: int | None = None, block_k: int | None = None, platform: str | None = None,
                  interpret: bool = False, expected_rows: float | None = None, expected_groups: float | None = None,
                  rows=None, copies: int = 1):
    """Grouped GLU FFN over expert-sorted rows with MXFP4 expert stacks (module docstring).

    Args:
      x: [M, P] float32/bfloat16, rows sorted by expert (group_sizes [G], sum <= M; rows past the sum give zeros);
        or, with ``rows``, a table of N tokens [N, P].
      rows: None, or (order, inverse) int32 [N·copies] each (the gather form, module docstring): sorted row r is copy
        order[r] of token order[r] // copies, inverse the inverse permutation; y then comes back [N·copies, P] in
        the copies' order (a copy past the groups: zeros), and the gradient is the table's.
      w1, w3: (packed uint8 [G, F, P/2], scale uint8 [G, F, P/32]); w2: (packed [G, P, F/2], scale [G, P, F/32]);
        or each (packed, scale, layer): stacks of L layers, [L, G, ...], and the index (int32 scalar, the same for
        the three) of the layer to run, whose blocks the kernels read in place (``api.layer_groups``). A third item
        None: not stacked.
      act: the GLU activation act(a, b), elementwise (run in ``acc``).
      act_quant: None, or a function applied to h (the MXFP8 fake-quant of the GEMM input; straight-through).
      block_m, block_n, block_k, platform, interpret: as ``api.mxfp4_gmm`` (one block_m for the three kernels; n
        and k fit each weight).
      expected_rows, expected_groups: the cost estimates' routing expectation, as ``api.mxfp4_gmm`` (all six
        kernels charge the same expected tiles).
    Returns: y [M, P] in x.dtype. Gradient with respect to x only.
    """
    if rows is not None and any(jnp.shape(r) != (x.shape[0] * copies,) for r in rows):
        raise ValueError(f"rows (order, inverse) must be [N·copies] = [{x.shape[0] * copies}] each, got "
                         f"{[jnp.shape(r) for r in rows]}")
    ws = [(*w, None)[:3] for w in (w1, w3, w2)]
    layer = ws[0][2]
    if any((w[2] is None) != (layer is None) for w in ws) or (layer is not None and jnp.shape(layer) != ()):
        raise ValueError("w1, w3 and w2 must all be stacks with one scalar layer index, or none of them")
    one = [tuple(a if layer is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in w[:2]) for w in ws]
    if layer is not None and len({w[0].shape[0] for w in ws}) != 1:
        raise ValueError(f"stacks of different depths: {[w[0].shape for w in ws]}")
    G, F, _ = one[0][0].shape
    api.check_inputs(x, *one[0], grouped=True)
    api.check_inputs(x, *one[1], grouped=True)
    if one[1][0].shape != one[0][0].shape or one[2][0].shape[:2] != (G, x.shape[1]):
        raise ValueError(f"w1 {one[0][0].shape}, w3 {one[1][0].shape} and w2 {one[2][0].shape} are not one GLU FFN "
                         f"over x {x.shape}")
    api.check_inputs(jnp.zeros((0, F), x.dtype), *one[2], grouped=True)
    if group_sizes.shape != (G,):
        raise ValueError(f"group_sizes {group_sizes.shape} must be [G] = [{G}]")
    platform = target_platform(platform)
    expected = api.expected_load_of(expected_rows, expected_groups, G)
    per = api.rows_per_group(x.shape[0] * (1 if rows is None else copies), G, expected)  # block_m as in mxfp4_gmm
    bs13 = api.block_sizes(platform, per, F, x.shape[1], block_m, block_n, block_k)
    bs2 = api.block_sizes(platform, per, x.shape[1], F, block_m, block_n, block_k)
    w1, w3, w2 = (w[:2] for w in ws)
    rows = None if rows is None else tuple(jnp.asarray(r, jnp.int32) for r in rows)
    return _ffn(x, w1, w3, w2, group_sizes, layer, rows, act, act_quant, acc, bs13, bs2, platform,
                api.interpret_mode(interpret, x, *w1, *w3, *w2), expected, 1 if rows is None else copies)


__all__ = ["mxfp4_glu_ffn"]
