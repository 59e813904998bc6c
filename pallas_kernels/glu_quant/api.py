"""The GLU hidden of the expert FFNs with its MXFP8 fake-quant fused: one pass over a and b writes h quantized.

    h = glu_mxfp8(a, b, act, dtype, rule)     a, b [..., F] (F a multiple of 32); h [..., F] in ``dtype``

Values: ``reference.glu_mxfp8_reference`` bit for bit (act in ``acc``, h rounded to ``dtype``, then E4M3 qdq in
blocks of 32 along F with the scale rule ``rule``). Gradient: straight-through the quant, act's VJP in ``acc`` (XLA,
element-wise), da / db in a's / b's dtypes — the unfused path's. Unfused, XLA:TPU materialises the quant's
per-block terms: at K3's per-chip expert rows ([81,920, 3,072], f32 a and b) one forward of the QAT experts' FFN
moved 29.4 GB against 10.1 GB without the quant (experiments/tpu_layout_bytes.py; experiments/LOG.md, 2026-12-07
session 29); this kernel reads a and b once and writes h once, and the FFN moves the no-quant figure.

TPU kernel (``pltpu.roll`` finds the block max); with ``interpret=True`` the Pallas interpreter runs it on any host
(inside ``shard_map`` the TPU interpreter). Other targets get the reference (the kernel has no GPU schedule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from k3jax.ops.grouped_matmul import varying_struct
from pallas_kernels.glu_quant import kernel as _k
from pallas_kernels.glu_quant.reference import glu_mxfp8_reference
from pallas_kernels.mxfp4_matmul.api import interpret_mode
from pallas_kernels.platform import target_platform

BLOCK_ROWS = 256       # rows per tile (a multiple of 8)
BLOCK_COLS = 1024      # columns per tile at most: a multiple of 128 dividing F, else F whole


def block_sizes(rows: int, cols: int) -> tuple[int, int]:
    bm = BLOCK_ROWS if rows >= BLOCK_ROWS else rows
    bf = next((c for c in (BLOCK_COLS, 512, 256, 128) if cols % c == 0), cols)
    return bm, bf


def _call(a, b, act, dtype, rule, acc, interpret):
    lead, F = a.shape[:-1], a.shape[-1]
    a2, b2 = a.reshape(-1, F), b.reshape(-1, F)
    R = a2.shape[0]
    bm, bf = block_sizes(R, F)
    spec = pl.BlockSpec((bm, bf), lambda i, j: (i, j))
    h = pl.pallas_call(
        functools.partial(_k.glu_mxfp8_kernel, act=act, rule=rule, acc=acc),
        grid=(pl.cdiv(R, bm), F // bf), in_specs=[spec, spec], out_specs=spec,
        out_shape=varying_struct((R, F), dtype, a2, b2),
        cost_estimate=_k.estimate(R, F, a2.dtype.itemsize, jnp.dtype(dtype).itemsize),
        interpret=interpret_mode(interpret, a2, b2))(a2, b2)
    return h.reshape(*lead, F)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _glu(a, b, act, dtype, rule, acc, interpret):
    return _call(a, b, act, dtype, rule, acc, interpret)


def _glu_fwd(a, b, act, dtype, rule, acc, interpret):
    return _call(a, b, act, dtype, rule, acc, interpret), (a, b)


def _glu_bwd(act, dtype, rule, acc, interpret, res, dh):
    a, b = res
    _, act_vjp = jax.vjp(act, a.astype(acc), b.astype(acc))
    da, db = act_vjp(dh.astype(acc))  # the STE passes dh through the quant; the rounding to dtype transposes to a cast
    return da.astype(a.dtype), db.astype(b.dtype)


_glu.defvjp(_glu_fwd, _glu_bwd)


def glu_mxfp8(a, b, act, dtype, rule: str = "ceil", *, acc=jnp.float32, platform: str | None = None,
              interpret: bool = False):
    """MXFP8-quantized GLU hidden (module docstring).

    Args:
      a, b: gate / up pre-activations [..., F], one shape, float32 or bfloat16; F a multiple of 32.
      act: the element-wise GLU activation act(a, b) (``ops.activations.glu_activation``), run in ``acc``; the
        kernel calls it with ``remat=False`` (a checkpoint does not lower in a kernel body).
      dtype: h's dtype (the rows' dtype). rule: the MXFP8 scale rule ("ceil", "floor" or "even").
      platform: the target (None: the one being compiled for); interpret: run the kernel in the Pallas interpreter.
    Returns: h [..., F] in ``dtype``.
    """
    if a.shape != b.shape or a.shape[-1] % 32:
        raise ValueError(f"a {a.shape} and b {b.shape} must share one shape whose last axis is a multiple of 32")
    if not interpret and target_platform(platform) != "tpu":
        return glu_mxfp8_reference(a, b, act, dtype, rule, acc)
    return _glu(a, b, act, jnp.dtype(dtype), rule, jnp.dtype(acc), interpret)


__all__ = ["block_sizes", "glu_mxfp8"]
