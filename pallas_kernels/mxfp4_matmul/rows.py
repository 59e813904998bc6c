"""The routed experts of a small batch in one kernel: the token table on chip, each selected expert over its rows.

    y = mxfp4_glu_ffn_rows(x, ids, weights, w1, w3, w2, act)     x [N, P] tokens; ids, weights [N, A]

y [N, P] (fp32) = Σ_a weights[n, a] · FFN_{ids[n, a]}(x[n]) over the G experts of the stacks (an id ≥ G: none),
with FFN_e(x) = (act(x W1_eᵀ, x W3_eᵀ) [→ MXFP8]) W2_eᵀ — what ``experts_grouped`` over the gather-form FFN
(``ffn.mxfp4_glu_ffn``) computes, for a batch whose token table fits on chip (decode and verify: the small-batch
rule runs every token on every device, each device over its own experts; N ≤ ``MAX_ROWS``).

Why a kernel of its own. The grouped FFN sorts the N·A copies by expert and pads every group to whole row tiles,
sized for the dropless worst case: at kimi-k3's B = 64 decode on v5p-64 each device pads 1,024 copies (~64 of them
its own) into 1,264-1,936 rows, and a, b, h, their even / odd splits, the padded gathers and y's un-pad are full
passes over those buffers in XLA, ~7 GB per chip and step above the expert weights (experiments/LOG.md,
2026-12-07 session 34). Here the table of N tokens stays in VMEM and the grid runs over the selected experts only,
(slot s, F block j); expert e's rows are taken from the table in chunks of ``CHUNK`` (one bf16 tile), c = 0 ..
ceil(n_e / CHUNK) - 1:

    x_c = onehot_cᵀ x                [CHUNK, P]  (the chunk's rows: an exact 0/1 matmul, from ``selection``'s rank)
    a = x_c W1_e[j]ᵀ, b = x_c W3_e[j]ᵀ            (rounded to the rows' dtype, as the grouped kernels return them)
    h = act(a, b) → rows' dtype → MXFP8 (blocks of 32 along F: whole blocks in a bf-wide tile)
    y_e,c += h W2_e[:, j]ᵀ           [CHUNK, P]  (fp32 over j; then rounded to the rows' dtype: the w2 kernel's output)
    out += (onehot_c · gate_e) y_e,c [N, P]      at the last j (gate_e: each row's summed weights for e)

so each selected expert's weights are read (and decoded) once per F block whatever its chunks, nothing else leaves
the chip but x (once) and out (once), and no tile padding exists in HBM. The MXU work is the grouped kernels' at
16-row tiles, plus the chunks' gathers and combines (2·N·P per row each: small beside 6·F·P). The contraction over
F's packed nibbles takes h's even and odd columns, split in VMEM by two exact 0/1 matmuls (a strided lane slice does
not lower), and the scales come in the TPU kernels' transposed layout. An earlier form ran every row of the table
through every selected expert (no gathers): 64 / 1.7 times this MXU work at B = 64, whose compiled FLOPs (9.9 ms)
nearly met the step's HBM time.

Values: the grouped path's, up to fp32 summation order (the F blocks of W2 and the experts are summed in another
order); ``reference.glu_ffn_rows_reference`` is the jnp rung. Gradient (custom VJP): with respect to x and the
weights, by the VJP of the grouped gather form (recomputed; decode differentiates nothing, a small-batch training
step gets exact gradients). TPU only (scalar prefetch): other targets run the grouped path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops import mx
from k3jax.ops.grouped_matmul import match_varying, sort_by_expert, varying_struct
from pallas_kernels.glu_quant.kernel import glu_mxfp8_tile
from pallas_kernels.mxfp4_matmul import api, cost
from pallas_kernels.mxfp4_matmul import kernel as _k
from pallas_kernels.mxfp4_matmul.ffn import mxfp4_glu_ffn
from pallas_kernels.platform import tpu_vmem_bytes

ROW_ALIGN = 16          # rows are padded to a multiple of the bf16 sublane tile (zero rows, zero gates)
CHUNK = 16              # rows of an expert multiplied together: gathered from the table in chunks of one bf16 tile
MAX_ROWS = 512          # the largest token table taken (Mosaic compiles K3's shapes at 512 rows: test_targets.py)
BLOCK_F = (512, 256)    # F block: the largest dividing F whose packed half (bf/2) is whole 128-lane tiles; else F


def f_block(F: int, want: int | None = None) -> int:
    """The F block: ``want``, or the largest of ``BLOCK_F`` dividing F (bf/2 a multiple of 128 lanes and bf/32 of
    8 sublanes: W2's packed and scale blocks), else F whole."""
    if want is not None:
        if F % want or (want != F and (want // 2) % 128):
            raise ValueError(f"block_f {want} must divide F = {F} with block_f/2 a multiple of 128 (or be F)")
        return want
    return next((b for b in BLOCK_F if F % b == 0), F)


def selection(ids, weights, groups: int):
    """(selected experts first then -1 [G], their count [1], rows per expert [G], rank [G, N, 1] int32, gates
    [G, N, 1] fp32): rank[e, n] = row n's place among the rows routed to e (ascending n), -1 where n is not;
    gate[e, n] = Σ_a weights[n, a] over row n's slots routed to e (ids ≥ G: no expert)."""
    onehot = ids[:, :, None] == jnp.arange(groups, dtype=ids.dtype)        # [N, A, G]
    gates = jnp.einsum("nag,na->gn", onehot.astype(jnp.float32), weights.astype(jnp.float32))
    routed = jnp.any(onehot, axis=1).T                                     # [G, N]
    rank = jnp.where(routed, jnp.cumsum(routed, axis=1) - 1, -1).astype(jnp.int32)
    rows = jnp.sum(routed, axis=1).astype(jnp.int32)
    chosen = rows > 0
    order = jnp.argsort(~chosen, stable=True).astype(jnp.int32)           # selected first, ascending
    count = jnp.sum(chosen.astype(jnp.int32))
    sel = jnp.where(jnp.arange(groups) < count, order, -1).astype(jnp.int32)
    return sel, count[None], rows, rank[:, :, None], gates[:, :, None]


def estimate(rows: int, P: int, F: int, itemsize: int, f_blocks: int, experts: float, tiles: float) -> pl.CostEstimate:
    c = cost.rows_ffn_cost(rows, P, F, itemsize, experts, tiles, CHUNK, f_blocks)
    return pl.CostEstimate(flops=c["flops"], transcendentals=0, bytes_accessed=c["bytes_accessed"])


def _split_columns(h):
    """(h[:, 0::2], h[:, 1::2]) of a VMEM tile by two 0/1 matmuls (exact: one product per output, fp32 sums)."""
    n = h.shape[1]
    rows = lax.broadcasted_iota(jnp.int32, (n, n // 2), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n // 2), 1)
    precision = lax.Precision.HIGHEST if h.dtype == jnp.float32 else None

    def pick(parity):
        sel = jnp.where(rows == 2 * cols + parity, 1.0, 0.0).astype(h.dtype)
        return lax.dot_general(h, sel, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32).astype(h.dtype)

    return pick(0), pick(1)


def _chunk_map(rank, c):
    """[Np, CHUNK] 0/1: table row n is row i of chunk c of the expert's rows (``selection``'s rank)."""
    cols = lax.broadcasted_iota(jnp.int32, (rank.shape[0], CHUNK), 1) + c * CHUNK
    return rank == cols


def _gather(onehot, x):
    """The chunk's rows of the table x [Np, k]: onehotᵀ x → [CHUNK, k], exact (one product of 1 per output)."""
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return lax.dot_general(onehot.astype(x.dtype), x, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel(sel_ref, meta_ref, n_ref, xe_ref, xo_ref, r_ref, g_ref, p1_ref, s1_ref, p3_ref, s3_ref, p2_ref,
            s2_ref, o_ref, y_ref, s2f_ref, *, act, rule, acc, nf: int, bf: int):
    s, j = pl.program_id(0), pl.program_id(1)
    used = s < meta_ref[0]
    chunks = (n_ref[jnp.maximum(sel_ref[s], 0)] + CHUNK - 1) // CHUNK   # the expert's rows, in chunks
    dt = xe_ref.dtype

    @pl.when((s == 0) & (j == 0))
    def _init():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(used & (j == 0))
    def _start():  # an expert's first F block: its W2 scales decoded once
        s2f_ref[...] = mx.e8m0_to_float(s2_ref[...])

    @pl.when(used)
    def _compute():
        w1 = _k.decode_tile(p1_ref[...], _k.expand_scale_t_by_dot(s1_ref[...]), dt)
        w3 = _k.decode_tile(p3_ref[...], _k.expand_scale_t_by_dot(s3_ref[...]), dt)
        rows = slice(None) if nf == 1 else pl.ds(pl.multiple_of(j * (bf // mx.BLOCK_SIZE), 8), bf // mx.BLOCK_SIZE)
        w2 = _k.decode_tile(p2_ref[...], _k.expand_scale_t_by_dot(s2f_ref[rows, :]), dt)

        def chunk(c, carry):
            pick = _chunk_map(r_ref[...], c)
            xe, xo = _gather(pick, xe_ref[...]), _gather(pick, xo_ref[...])
            a = _k.tile_dot(xe, xo, *w1).astype(dt)
            b = _k.tile_dot(xe, xo, *w3).astype(dt)
            he, ho = _split_columns(glu_mxfp8_tile(a, b, act, rule, dt, acc))
            at = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
            part = _k.tile_dot(he, ho, *w2)
            y_ref[at, :] = jnp.where(j == 0, part, y_ref[at, :] + part)
            return carry

        lax.fori_loop(0, chunks, chunk, 0)

    @pl.when(used & (j == nf - 1))
    def _combine():  # y_e in the rows' dtype (the grouped w2 kernel's output), weighted back into the table's rows
        def chunk(c, carry):
            spread = jnp.where(_chunk_map(r_ref[...], c), g_ref[...], 0.0)          # [Np, CHUNK]: gate or 0
            y = y_ref[pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK), :].astype(dt).astype(jnp.float32)
            o_ref[...] += lax.dot_general(spread, y, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                                          preferred_element_type=jnp.float32)
            return carry

        lax.fori_loop(0, chunks, chunk, 0)


def _in_place(packed, scale, layer):
    """(packed, transposed scales, packed offset, scale offset) of one weight: the packed bytes as
    ``api.layer_groups`` addresses them (a stack flattened [L·G, ...] at offset layer·G, or sliced off the 128 lanes;
    unstacked as given), and the scales as it slices them, except that a stack's scales larger than the chip's VMEM
    are read in place too (flattened, at offset layer·G): this kernel reads only the selected experts' scale blocks,
    where a slice reads and writes all G of them (1.7 GB per chip and step of kimi-k3's B = 64 decode on v5p-64).
    Smaller stacks stay sliced: XLA's memory-space assignment copies an operand that fits into VMEM whole before
    every call (v6e-256's decode: 14 GB per chip and step; experiments/LOG.md, 2026-12-07 session 34)."""
    offset, packed_l, one_scale, G = api.layer_groups(jnp.zeros((1,), jnp.int32), packed, scale, layer)
    if layer is None or scale.size <= tpu_vmem_bytes():
        return packed_l, _k.transposed_scales(one_scale), offset[0], jnp.int32(0)
    scale_t = jnp.swapaxes(scale, -1, -2)           # the TPU compiler's storage of [.., N, K/32] read as it lies
    return packed_l, scale_t.reshape(-1, *scale_t.shape[2:]), offset[0], jnp.asarray(layer, jnp.int32) * G


def _call(x, ids, weights, w1, w3, w2, layer, act, rule, acc, bf, interpret, charged):
    N, P = x.shape
    G, F = w1[0].shape[-3], w1[0].shape[-2]
    Np = -(-N // ROW_ALIGN) * ROW_ALIGN
    sel, count, n_rows, rank, gates = selection(ids, weights, G)
    pad = Np - N
    xe, xo = api.split_even_odd(jnp.pad(x, ((0, pad), (0, 0))))
    rank = jnp.pad(rank, ((0, 0), (0, pad), (0, 0)), constant_values=-1)
    gates = jnp.pad(gates, ((0, 0), (0, pad), (0, 0)))
    (p1, s1, *o13), (p3, s3, *_), (p2, s2, *o2) = (_in_place(*w, layer) for w in (w1, w3, w2))
    meta = jnp.stack([count[0], *o13, *o2]).astype(jnp.int32)   # count, the expert offsets of w1 / w3, w2
    nf = F // bf
    if _k.interpreter_needs_static_grid(meta, interpret):
        extent = G                              # unused slots fetch nothing new and compute nothing
    else:
        extent = jnp.maximum(count[0], 1)       # the dynamic grid: the selected experts only

    def slot(s, j, sel, meta, n):
        """(expert, F block) of step (s, j); past the selected ones the last step's blocks (no new fetch)."""
        on = s < meta[0]
        e = jnp.maximum(sel[jnp.minimum(s, jnp.maximum(meta[0] - 1, 0))], 0)
        return e, jnp.where(on, j, nf - 1), (meta[1], meta[2]), (meta[3], meta[4])

    def blocks(f):
        return lambda s, j, sel, meta, n: f(*slot(s, j, sel, meta, n))

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(extent, nf),
        in_specs=[
            pl.BlockSpec((Np, P // 2), lambda s, j, sel, meta, n: (0, 0)),
            pl.BlockSpec((Np, P // 2), lambda s, j, sel, meta, n: (0, 0)),
            pl.BlockSpec((None, Np, 1), blocks(lambda e, f, o13, o2: (e, 0, 0))),
            pl.BlockSpec((None, Np, 1), blocks(lambda e, f, o13, o2: (e, 0, 0))),
            pl.BlockSpec((None, bf, P // 2), blocks(lambda e, f, o13, o2: (e + o13[0], f, 0))),
            pl.BlockSpec((None, P // mx.BLOCK_SIZE, bf), blocks(lambda e, f, o13, o2: (e + o13[1], 0, f))),
            pl.BlockSpec((None, bf, P // 2), blocks(lambda e, f, o13, o2: (e + o13[0], f, 0))),
            pl.BlockSpec((None, P // mx.BLOCK_SIZE, bf), blocks(lambda e, f, o13, o2: (e + o13[1], 0, f))),
            pl.BlockSpec((None, P, bf // 2), blocks(lambda e, f, o13, o2: (e + o2[0], 0, f))),
            pl.BlockSpec((None, F // mx.BLOCK_SIZE, P), blocks(lambda e, f, o13, o2: (e + o2[1], 0, 0))),  # per e
        ],
        out_specs=pl.BlockSpec((Np, P), lambda s, j, sel, meta, n: (0, 0)),
        scratch_shapes=[pltpu.VMEM((Np, P), jnp.float32), pltpu.VMEM((F // mx.BLOCK_SIZE, P), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, act=act, rule=rule, acc=acc, nf=nf, bf=bf),
        out_shape=varying_struct((Np, P), jnp.float32, sel, xe, gates, p1, s1, p2),
        grid_spec=grid_spec,
        compiler_params=_k.tpu_params(("arbitrary", "arbitrary"), True),
        cost_estimate=estimate(Np, P, F, x.dtype.itemsize, nf, *charged),
        interpret=interpret,
        name="mxfp4_glu_ffn_rows",
    )(sel, meta, n_rows, xe, xo, rank, gates, p1, s1, p3, s3, p2, s2)
    return out[:N].astype(acc)


def _grouped(x, ids, weights, w1, w3, w2, layer, act, rule, acc, interpret):
    """The same sum by the grouped gather-form FFN (the VJP's forward)."""
    G = w1[0].shape[-3]
    N, A = ids.shape
    order, inverse, group_sizes = sort_by_expert(ids, G)
    quant = None if rule is None else functools.partial(mx.fake_quant_mxfp8, axis=-1, rule=rule)
    stack = (lambda w: w) if layer is None else (lambda w: (*w, layer))
    y = mxfp4_glu_ffn(x, stack(w1), stack(w3), stack(w2), group_sizes, act, act_quant=quant, acc=acc,
                      platform="tpu", interpret=interpret, rows=(order, inverse), copies=A)
    return jnp.einsum("nap,na->np", y.astype(acc).reshape(N, A, -1), weights.astype(acc))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _rows_ffn(x, ids, weights, w1, w3, w2, layer, act, rule, acc, bf, interpret, charged):
    return _call(x, ids, weights, w1, w3, w2, layer, act, rule, acc, bf, interpret, charged)


def _rows_ffn_fwd(x, ids, weights, w1, w3, w2, layer, act, rule, acc, bf, interpret, charged):
    return (_call(x, ids, weights, w1, w3, w2, layer, act, rule, acc, bf, interpret, charged),
            (x, ids, weights, w1, w3, w2, layer))


def _rows_ffn_bwd(act, rule, acc, bf, interpret, charged, res, dy):
    x, ids, weights, w1, w3, w2, layer = res
    _, vjp = jax.vjp(lambda x, w: _grouped(x, ids, w, w1, w3, w2, layer, act, rule, acc, interpret), x, weights)
    dx, dw = vjp(dy.astype(acc))
    return match_varying(dx, x), None, match_varying(dw, weights), None, None, None, None


_rows_ffn.defvjp(_rows_ffn_fwd, _rows_ffn_bwd)


def mxfp4_glu_ffn_rows(x, ids, weights, w1, w3, w2, act, *, act_quant_rule: str | None = None, acc=jnp.float32,
                       block_f: int | None = None, interpret: bool = False, expected_rows: float | None = None,
                       expected_groups: float | None = None, idle: float = 0.0):
    """Σ_a weights[n, a] · FFN_{ids[n, a]}(x[n]) over MXFP4 expert stacks, in one TPU kernel (module docstring).

    Args:
      x: [N, P] float32/bfloat16 token rows (MXFP8-quantized already where the model quantizes expert inputs).
      ids: int [N, A] expert ids in [0, G), or ≥ G for a slot routed elsewhere (zero); weights: [N, A] gates.
      w1, w3: (packed uint8 [G, F, P/2], scale uint8 [G, F, P/32]); w2: (packed [G, P, F/2], scale [G, P, F/32]);
        or each (packed, scale, layer) over stacks [L, G, ...] read in place (``api.layer_groups``).
      act: the GLU activation, called ``act(a, b, remat=False)`` in ``acc`` (``ops.activations.glu_activation``).
      act_quant_rule: the MXFP8 scale rule of h's fake-quant (straight-through), or None for none.
      block_f: F columns per step (default ``f_block``). interpret: the Pallas (or, in shard_map, TPU) interpreter.
      expected_rows, expected_groups, idle: the cost estimate's expected routed rows, selected experts and
        P(none selected) per call (``cost.expected_load``; the grid visits max(count, 1) experts, each expert's rows
        in chunks of ``CHUNK``: ``cost.expected_tiles``); None: the worst case (all G, every slot's row).
    Returns: [N, P] in ``acc``. Gradients with respect to x and weights.
    """
    ws = [(*w, None)[:3] for w in (w1, w3, w2)]
    layer = ws[0][2]
    if any((w[2] is None) != (layer is None) for w in ws):
        raise ValueError("w1, w3 and w2 must all be stacks with one layer index, or none of them")
    one = [tuple(jax.ShapeDtypeStruct(a.shape[-3:], a.dtype) for a in w[:2]) for w in ws]
    G, F, _ = one[0][0].shape
    for w in one[:2]:
        api.check_inputs(x, *w, grouped=True)
    api.check_inputs(jnp.zeros((0, F), x.dtype), *one[2], grouped=True)
    if one[1][0].shape != one[0][0].shape or one[2][0].shape[:2] != (G, x.shape[1]):
        raise ValueError(f"w1 {one[0][0].shape}, w3 {one[1][0].shape} and w2 {one[2][0].shape} are not one GLU FFN "
                         f"over x {x.shape}")
    if ids.shape != weights.shape or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids {ids.shape} and weights {weights.shape} must both be [N, A] with N = {x.shape[0]}")
    N, A = ids.shape
    if N > MAX_ROWS:
        raise ValueError(f"{N} token rows: the kernel takes at most {MAX_ROWS} (the grouped FFN takes more)")
    if expected_groups is None:   # every slot on a distinct expert of its own chunk, at most
        charged = (float(G), float(min(G * -(-N // CHUNK), -(-N * min(A, G) // CHUNK) + G)))
    else:
        rows = N * min(A, G) if expected_rows is None else expected_rows
        charged = (min(expected_groups + idle, G), cost.expected_tiles(rows, expected_groups, CHUNK))
    return _rows_ffn(x, ids.astype(jnp.int32), weights, tuple(ws[0][:2]), tuple(ws[1][:2]), tuple(ws[2][:2]), layer,
                     act, act_quant_rule, jnp.dtype(acc), f_block(F, block_f), api.interpret_mode(interpret, x, ids),
                     charged)


__all__ = ["f_block", "mxfp4_glu_ffn_rows", "selection"]
