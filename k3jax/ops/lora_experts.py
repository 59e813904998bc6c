"""Routed experts with per-expert LoRA adapters (QLoRA when the stacks are the checkpoint's MXFP4 bytes).

Each adapted stack is a ``k3jax.ops.lora.LoraWeight`` (base [E, in, out] — an array or a ``PackedWeight`` —,
A [E, in, r] or one [in, r] shared by every expert, B [E, r, out] with the scale folded in); an unadapted one is its
plain stack. On the expert-sorted rows
(``grouped_matmul.experts_grouped``: replicate, sort, FFN, un-sort, weighted sum) the FFN is

    a = x W1_e + (x A1_e) B1_e       b = x W3_e + (x A3_e) B3_e       h = act(a, b)       y = h W2_e + (h A2_e) B2_e

with every product grouped by expert: the base one by ``_base`` (GPU/TPU: ``lax.ragged_dot``, or the grouped MXFP4
kernel ``gmm`` from the packed bytes; CPU: a loop over per-expert row tiles, ``grouped_matmul.tile_rows``, that
decodes one expert's bytes for its tile and multiplies, under ``jax.checkpoint`` so nothing decoded is kept for the
backward — never a dequantized stack), the adapter's grouped the same way (``adapter_grouped``: two
``lax.ragged_dot`` over the sorted rows) or, on the tile loop's path and under dropout, by gathering each tile's
factors (r columns: small) into one batched product (``adapter_tiles``). Gradients reach the rows and A, B (and a
float base when it is differentiated); the packed bytes have none. The base products are the frozen weights' own,
so with B = 0 the outputs equal the unadapted experts' to the summation order of the FFN (the fused paths of
grouped_matmul / packed_experts add the same products in another order).

LoRA dropout (a stack's ``LoraWeight.dropout``, training only): the adapter's input rows are dropped before A, the
base product reads them undropped. The masks are drawn on the rows each expert receives — one keep bit per (row,
feature) of the tiles [V, t, in] (``adapter_tiles``), a row being one (token, slot) assignment, so a token sent to
two experts is dropped independently for each, as PEFT's per-expert ``nn.Linear`` modules each drop their input —
and each stack has its own key (w1 and w3 read the same rows with independent masks; w2 drops h). The masks follow
the tiling of the sorted rows: deterministic for a key and a routing, but not the same draws under another tile
size or under expert parallelism (k3jax/sharding/expert_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.ops.activations import glu_hidden
from k3jax.ops.grouped_matmul import Act, default_tile, experts_grouped, tile_rows
from k3jax.ops.lora import LoraDropout, LoraWeight
from k3jax.ops.packed_experts import PackedWeight, dequantize_stack

LORA_IMPLS = ("auto", "tiles", "grouped")


def _unwrap(w):
    return w.base if isinstance(w, LoraWeight) else w


def _dense_expert(w, e, dtype):
    """Expert e of a stack as [in, out] in ``dtype``: a slice of a float stack, or one expert's bytes decoded."""
    if isinstance(w, PackedWeight):
        w = w.one_layer()
        one = PackedWeight(*(lax.dynamic_index_in_dim(x, e, keepdims=True) for x in w[:2]))
        return dequantize_stack(one, dtype)[0]
    return lax.dynamic_index_in_dim(w, e, keepdims=False).astype(dtype)


def _base_tiles(xt, tile_expert, w, acc):
    """[V, t, in] tiles → [V, t, out]: tile v times its expert's base weight, one tile at a time."""
    @jax.checkpoint
    def one(x, e):
        return jnp.dot(x, _dense_expert(w, e, x.dtype), preferred_element_type=acc)

    return lax.map(lambda v: one(*v), (xt, tile_expert))


def _base(xs, group_sizes, tiled, w, acc, gmm, impl="auto"):
    """xs [R, in] sorted by expert → [R, out] (acc) = rows times their expert's base weight (module docstring);
    ``tiled``: ``tile_rows`` of xs; ``impl``: "tiles", "grouped" or "auto" (platform choice)."""
    def tiles(xs, group_sizes):
        xt, te, back = tiled
        return _base_tiles(xt, te, w, acc).reshape(-1, _out(w))[back]

    def grouped(xs, group_sizes):
        if isinstance(w, PackedWeight):
            return gmm(xs, w.packed, w.scale, group_sizes).astype(acc)
        return lax.ragged_dot(xs, w.astype(xs.dtype), group_sizes, preferred_element_type=acc)

    if impl == "tiles" or (isinstance(w, PackedWeight) and gmm is None):
        return tiles(xs, group_sizes)
    if impl == "grouped":
        return grouped(xs, group_sizes)
    return lax.platform_dependent(xs, group_sizes, cpu=tiles, default=grouped)


def _out(w) -> int:
    return w.packed.shape[1] if isinstance(w, PackedWeight) else w.shape[-1]


def adapter_tiles(tiled, a, b, acc, dropout: LoraDropout | None = None):
    """``tile_rows`` of xs [R, in] sorted by expert → [R, out] (acc) = (x A_e) B_e, each tile's factors gathered
    (r columns); an A [in, r] without the expert axis is shared by every expert (one product, no gather).
    ``dropout``: x dropped first, one mask over the tiles [V, t, in] (``dropout.keep_mask``; module docstring)."""
    xt, te, back = tiled
    cdt = xt.dtype
    if dropout is not None:
        xt = dropout(xt)
    if a.ndim == 2:  # shared A: x A is the same map for every expert
        xa = jnp.einsum("vti,ir->vtr", xt, a.astype(cdt), preferred_element_type=acc)
    else:
        xa = jnp.einsum("vti,vir->vtr", xt, a.astype(cdt)[te], preferred_element_type=acc)
    d = jnp.einsum("vtr,vro->vto", xa.astype(cdt), b.astype(cdt)[te], preferred_element_type=acc)
    return d.reshape(-1, d.shape[-1])[back]


def adapter_grouped(xs, group_sizes, a, b, acc):
    """xs [R, in] sorted by expert → [R, out] (acc) = (x A_e) B_e as two grouped products over the sorted rows
    (``lax.ragged_dot``; a shared A [in, r]: one plain product), the values of ``adapter_tiles`` without its
    tiling: the rows are never gathered into tiles and the [R, out] result never gathered back. Under the QLoRA
    step those gathers of float32 rows were the largest HBM traffic the adapters added (experiments/LOG.md,
    2026-12-07 session 36)."""
    cdt = xs.dtype
    if a.ndim == 2:
        xa = jnp.dot(xs, a.astype(cdt), preferred_element_type=acc)
    else:
        xa = lax.ragged_dot(xs, a.astype(cdt), group_sizes, preferred_element_type=acc)
    return lax.ragged_dot(xa.astype(cdt), b.astype(cdt), group_sizes, preferred_element_type=acc)


def _adapter(xs, group_sizes, tiled, w: LoraWeight, acc, impl):
    """(x A_e) B_e on the sorted rows: ``adapter_grouped`` where the base products are grouped, ``adapter_tiles``
    on the CPU tile loop's path and wherever the adapter drops its input (the masks are drawn over the tiles)."""
    def tiles(xs, group_sizes):
        return adapter_tiles(tiled, w.a, w.b, acc, w.dropout)

    def grouped(xs, group_sizes):
        return adapter_grouped(xs, group_sizes, w.a, w.b, acc)

    if impl == "tiles" or w.dropout is not None:
        return tiles(xs, group_sizes)
    if impl == "grouped":
        return grouped(xs, group_sizes)
    return lax.platform_dependent(xs, group_sizes, cpu=tiles, default=grouped)


def _product(xs, group_sizes, tiled, w, acc, gmm, impl):
    if not isinstance(w, LoraWeight):
        return _base(xs, group_sizes, tiled, w, acc, gmm, impl)
    return _base(xs, group_sizes, tiled, w.base, acc, gmm, impl) + _adapter(xs, group_sizes, tiled, w, acc, impl)


def _lora_ffn(xs, group_sizes, w1, w3, w2, act, act_quant, acc, *, gmm, tile, impl="auto"):
    tile = tile or default_tile(xs.shape[0], group_sizes.shape[0])  # xs fake-quantized by experts_grouped
    tiled = tile_rows(xs, group_sizes, tile)            # one tiling per input, shared by its products
    a = _product(xs, group_sizes, tiled, w1, acc, gmm, impl)
    b = _product(xs, group_sizes, tiled, w3, acc, gmm, impl)
    h = glu_hidden(a, b, act, xs.dtype, act_quant=act_quant, acc=acc)
    return _product(h, group_sizes, tile_rows(h, group_sizes, tile), w2, acc, gmm, impl)


def experts_lora(z_mp, ids_ma, weights_ma, w1, w3, w2, act: Act, *, act_quant: Callable | None = None,
                 gmm: Callable | None = None, tile: int | None = None, impl: str = "auto",
                 quantized_input: bool = False):
    """Dropless routed experts whose stacks may carry per-expert adapters: Σ_a weights[m, a] · E_{ids[m, a]}(z[m])
    → [M, P] (acc dtype), the MoE layer's experts_fn contract. ``gmm``: the grouped MXFP4 matmul for packed bases
    on GPU/TPU (``layers.backends.mxfp4_gmm``; None: the CPU tile loop everywhere). ``impl``: the base products'
    path — "auto" (the tile loop on CPU, the grouped one elsewhere), "tiles", or "grouped" (``lax.ragged_dot``, or
    ``gmm`` for a packed base, on any platform: ``ExpertParallel(packed_kernel="pallas")`` and the CPU tests)."""
    if impl not in LORA_IMPLS:
        raise ValueError(f"impl must be one of {LORA_IMPLS}, got {impl!r}")
    if impl == "grouped" and gmm is None and isinstance(_unwrap(w1), PackedWeight):
        raise ValueError("impl='grouped' over a packed base needs the grouped MXFP4 matmul gmm")
    ffn = partial(_lora_ffn, gmm=gmm, tile=tile, impl=impl)
    return experts_grouped(z_mp, ids_ma, weights_ma, w1, w3, w2, act, ffn=ffn, act_quant=act_quant,
                           quantized_input=quantized_input)


__all__ = ["LORA_IMPLS", "adapter_grouped", "adapter_tiles", "experts_lora"]
