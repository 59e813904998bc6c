"""Microscaling (MX) formats: MXFP4 (E2M1) and MXFP8 (E4M3, E5M2) quantize / dequantize, STE fake-quant
(docs/numerics.md §10).

A block is 32 consecutive elements along one axis (the contraction axis); each block shares one E8M0 scale byte b,
meaning 2^(b-127) (0xFF = NaN). Three scale rules are named explicitly (docs/numerics.md §10.2), with a = max|x| over
the block as float32 and e_max the largest element exponent (2 for E2M1, 8 for E4M3, 15 for E5M2):

    floor (OCP)                 b = E(a) - e_max + 127                           a/scale in [4, 8): may clip
    ceil  (round-up)            b = ((bits(fp32(a / max_elem)) + 0x7FFFFF) >> 23) & 0xFF   never clips
    even  (compressed-tensors)  b = (((bits(a) + 0x200000) >> 23) & 0xFF) - e_max  reproduces the K3 checkpoint bytes

All three clamp b to [0, 254]; an all-zero block gets b = 0 (scale 2^-127), as compressed-tensors writes it.

Exponents come from the float32 bits and scales are built from bit patterns, never from log2 / exp2
(docs/numerics.md §10.6: both are inexact on XLA:CPU). XLA:CPU also flushes float32 subnormals to zero in arithmetic,
so:
  * dequantization assembles the float32 result's bits directly, which is exact even where the result is subnormal
    (scale bytes 0..2); bfloat16 results are rounded from those bits (RNE);
  * quantization reads inputs as float32 and treats float32 subnormal inputs (|x| < 2^-126) as signed zero on every
    platform (a defined choice, mirrored by the float64 oracle in k3jax/reference/mx.py). float64 inputs are
    quantized as fp32(x).

Other defined behaviour:
  * E2M1 sign bit = (x < 0) on the float32 input (docs/numerics.md §10.2), byte-identical to compressed-tensors: a
    negative value that rounds to zero (a negative subnormal included) is code 0x8 (-0), an input of exactly -0.0 is
    code 0x0 (+0). The element rounding is shared by all three scale rules, so floor and ceil treat signed zeros the
    same way. MXFP8 elements keep the float8 cast's sign instead (-0.0 and negative underflows become -0, 0x80):
    they are never stored, and -0 and +0 dequantize to equal values;
  * a block holding a NaN or +-Inf gets scale byte 0xFF and all-zero element codes, so it dequantizes to NaN in all
    32 positions (NaN propagates through fake-quant instead of being hidden);
  * dequantized values beyond the float32 range (only at scale bytes >= 253) become +-Inf.

The STE fake-quant functions (``fake_quant_mxfp4``, ``fake_quant_mxfp8``) return qdq(x) exactly in the forward pass
and pass the cotangent through unchanged (identity, saturation included) via ``jax.custom_jvp``; this is
``x + stop_gradient(qdq(x) - x)`` without its rounding (that sum is not exactly qdq(x) in bf16, and turns -0 into +0).
They accept a last block shorter than 32 along ``axis`` (padded with zeros, which never change a block max); the
packed storage in k3jax.quant requires whole blocks.

This module is the one home of the element codes: E2M1 rounding and decoding, nibble packing (``pack_codes`` /
``unpack_codes``: low nibble = even column), the stored shapes that follow (``mxfp4_packed_shapes``: [..., n/2]
and [..., n/32]), the block size (``BLOCK_SIZE``) and the host lookup tables the numpy decoders use
(``E2M1_VALUES``, ``E2M1_BYTE_LO`` / ``_HI`` / ``_PAIR``, ``E8M0_VALUES``). Kernels, the expert layers and the
checkpoint code import them; storage layouts live in k3jax.quant.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from k3jax.config import SCALE_RULES  # the rule names are run settings (RunConfig.qat_*_rule); defined there
from k3jax.ops.fp32_bits import (
    assemble_f32,
    f32_bits,
    f32_bits_to,
    flush_subnormals,
    is_negative,
    pow2_f32,
    scale_by_pow2,
)

BLOCK_SIZE = 32
SCALE_NAN = 0xFF

# Host (numpy) tables, read-only. E2M1 code -> value; bit 3 = sign, bits 2-1 = exponent (bias 1), bit 0 = mantissa.
# Code 8 is -0.
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
# packed byte -> value of its low nibble (even column) / high nibble (odd column) / both [256, 2]: one gather per value
E2M1_BYTE_LO = E2M1_VALUES[np.arange(256) & 0xF]
E2M1_BYTE_HI = E2M1_VALUES[np.arange(256) >> 4]
E2M1_BYTE_PAIR = np.stack([E2M1_BYTE_LO, E2M1_BYTE_HI], axis=-1)
with np.errstate(over="ignore"):  # E8M0 byte b -> 2^(b-127), exact in float32 (2^-127 is a subnormal); 0xFF = NaN
    E8M0_VALUES = np.ldexp(np.float64(1), np.arange(256) - 127).astype(np.float32)
E8M0_VALUES[SCALE_NAN] = np.nan
for _table in (E2M1_VALUES, E2M1_BYTE_LO, E2M1_BYTE_HI, E2M1_BYTE_PAIR, E8M0_VALUES):
    _table.flags.writeable = False
del _table


@dataclass(frozen=True)
class ElementFormat:
    name: str
    emax: int  # largest unbiased element exponent
    max_value: float  # largest finite magnitude
    dtype: object  # ml_dtypes element dtype


FORMATS = {
    "e2m1": ElementFormat("e2m1", 2, 6.0, jnp.float4_e2m1fn),
    "e4m3": ElementFormat("e4m3", 8, 448.0, jnp.float8_e4m3fn),
    "e5m2": ElementFormat("e5m2", 15, 57344.0, jnp.float8_e5m2),
}


# ---------------------------------------------------------------------------------------------------------------
# scale bytes (the float32 bit helpers are k3jax/ops/fp32_bits.py's)


def scale_bytes(amax: jax.Array, *, fmt: str = "e2m1", rule: str = "even") -> jax.Array:
    """E8M0 scale byte per block from its float32 max-abs ``amax`` (>= 0) (docs/numerics.md §10.2).

    Returns uint8 of amax's shape: 0 for an all-zero block, 0xFF where amax is NaN or Inf, else in [0, 254].
    """
    if rule not in SCALE_RULES:
        raise ValueError(f"unknown scale rule {rule!r}; expected one of {SCALE_RULES}")
    f = FORMATS[fmt]
    amax = flush_subnormals(amax.astype(jnp.float32))
    bits = f32_bits(amax)
    if rule == "floor":
        b = ((bits >> 23) & 0xFF) - f.emax
    elif rule == "even":
        b = (((bits + 0x00200000) >> 23) & 0xFF) - f.emax
    else:  # ceil: the power of two at or above fp32(a / max_elem)
        # Divide by a float32 constant so the quotient is rounded exactly as the rule says (float32 division).
        q_bits = f32_bits(amax / jnp.float32(f.max_value))
        b = ((q_bits + 0x7FFFFF) >> 23) & 0xFF
        # A subnormal quotient rounds up to 2^-126 (b = 1); computed without it, since XLA:CPU flushes it to zero.
        b = jnp.where(amax < jnp.float32(f.max_value * 2.0**-126), 1, b)
    b = jnp.where(amax == 0, 0, jnp.clip(b, 0, 254))
    b = jnp.where(jnp.isfinite(amax), b, SCALE_NAN)
    return b.astype(jnp.uint8)


def e8m0_to_float(scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Scale byte(s) -> 2^(b-127) exactly (b = 0 gives the subnormal 2^-127, 0xFF gives NaN)."""
    b = scale.astype(jnp.int32)
    bits = jnp.where(b == 0, 0x00400000, b << 23)
    bits = jnp.where(b == SCALE_NAN, 0x7FC00000, bits)
    return f32_bits_to(bits, dtype)


def count_scale_bytes(scale) -> dict:
    """Counts of the special E8M0 bytes: ``{"zero": #0x00 (2^-127), "nan": #0xFF, "total": size}`` (host ints)."""
    s = np.asarray(scale)
    if s.dtype != np.uint8:
        raise ValueError(f"scale must be uint8 E8M0 bytes, got {s.dtype}")
    return {"zero": int(np.sum(s == 0)), "nan": int(np.sum(s == SCALE_NAN)), "total": int(s.size)}


# ---------------------------------------------------------------------------------------------------------------
# E2M1 element codes


def e2m1_round_codes(v: jax.Array, negative: jax.Array | None = None) -> jax.Array:
    """Round float32 ``v`` (already divided by the block scale) to E2M1 codes: RNE, saturating at +-6.

    Bit 3 (the sign) is ``negative`` (default ``v < 0``, see ``is_negative``): a negative value that rounds to
    zero is code 0x8, an exact -0.0 is code 0x0 (compressed-tensors' bytes, docs/numerics.md §10.2). Returns uint8.
    """
    v = v.astype(jnp.float32)
    m = jnp.minimum(jnp.abs(v), 6.0)
    # Grid spacing is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; round half to even within each binade.
    q_lo = jnp.round(m * 2.0)  # 0..4, in halves
    q_mid = jnp.round(m)  # 2..4
    q_hi = jnp.round(m * 0.5)  # 2..3, in twos
    idx = jnp.where(m < 2.0, q_lo, jnp.where(m < 4.0, q_mid + 2.0, q_hi + 4.0))
    # A value in [1.75, 2) rounds to 2 through q_lo = 4 -> idx 4 (= value 2); [3.5, 4) -> q_mid 4 -> idx 6 (= 4).
    code = idx.astype(jnp.int32)
    sign = (is_negative(v) if negative is None else negative).astype(jnp.int32)
    return (code | (sign << 3)).astype(jnp.uint8)


def e2m1_decode(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
    """E2M1 codes (uint8, low 4 bits used) -> values, by arithmetic (no table, so it also runs inside kernels)."""
    c = codes.astype(jnp.int32)
    e = (c >> 1) & 3
    m = (c & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * jnp.where(e == 3, 4.0, jnp.where(e == 2, 2.0, 1.0)))
    return jnp.where((c & 8) != 0, -mag, mag).astype(dtype)


def pack_codes(codes: jax.Array) -> jax.Array:
    """uint8 E2M1 codes [..., n] (n even) -> bytes [..., n/2]: byte j = code 2j | code 2j+1 << 4 (low nibble = even
    column, docs/numerics.md §10.3)."""
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def mxfp4_packed_shapes(shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The stored shapes of an MXFP4 tensor of logical ``shape`` [..., n] blocked along its last axis: (packed uint8
    [..., n/2] (``pack_codes``), scale uint8 [..., n/32] (one E8M0 byte per block)). The one statement of the rule;
    n must be a multiple of ``BLOCK_SIZE`` (callers check it with their own wording)."""
    *lead, n = shape
    return (*lead, n // 2), (*lead, n // BLOCK_SIZE)


def is_mxfp4_pair(packed_shape, scale_shape) -> bool:
    """Whether ``packed_shape`` / ``scale_shape`` are ``mxfp4_packed_shapes`` of one logical [..., n] (n = twice the
    packed last axis, a multiple of ``BLOCK_SIZE``)."""
    if len(packed_shape) < 1:
        return False
    logical = (*packed_shape[:-1], packed_shape[-1] * 2)
    return logical[-1] % BLOCK_SIZE == 0 and (tuple(packed_shape), tuple(scale_shape)) == mxfp4_packed_shapes(logical)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """bytes [..., m] -> uint8 E2M1 codes [..., 2m] (low nibble first); inverse of ``pack_codes``."""
    return jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---------------------------------------------------------------------------------------------------------------
# blocking along an axis


def _to_blocks(x: jax.Array, axis: int, *, pad: bool, name: str = "x") -> tuple[jax.Array, int]:
    """Move ``axis`` last and split it into [..., G, 32]. Returns the blocks and the original length."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    if n % BLOCK_SIZE:
        if not pad:
            raise ValueError(f"{name}: axis length {n} (shape {x.shape}) is not a multiple of {BLOCK_SIZE}")
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -n % BLOCK_SIZE)])
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE), n


def _from_blocks(xb: jax.Array, axis: int, n: int) -> jax.Array:
    x = xb.reshape(*xb.shape[:-2], -1)[..., :n]
    return jnp.moveaxis(x, -1, axis)


def _quantize_blocks(xb: jax.Array, fmt: str, rule: str):
    """[..., G, 32] float -> (elements [..., G, 32], scale bytes [..., G]); E2M1 elements are uint8 codes."""
    f = FORMATS[fmt]
    x32 = xb.astype(jnp.float32)
    x = flush_subnormals(x32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    b = scale_bytes(amax, fmt=fmt, rule=rule)
    finite = (b != SCALE_NAN)[..., None]
    x = jnp.where(finite, x, 0.0)
    v = scale_by_pow2(x, 127 - jnp.where(finite, b[..., None].astype(jnp.int32), 127))
    if fmt == "e2m1":  # the sign from the input itself: flushing keeps a subnormal's sign, but makes it -0.0
        return e2m1_round_codes(v, is_negative(x32) & finite), b
    # Clip first: the float8 casts are not saturating (480 -> NaN for E4M3, docs/numerics.md §10.6). The cast keeps the
    # sign, so a negative value that underflows is -0.
    v = jnp.clip(v, -f.max_value, f.max_value)
    return v.astype(f.dtype), b


def _dequantize_blocks(elems: jax.Array, b: jax.Array, fmt: str, dtype) -> jax.Array:
    """Exact dequantization of [..., G, 32] elements with [..., G] scale bytes (bits assembled directly)."""
    dtype = jnp.dtype(dtype)
    bi = b.astype(jnp.int32)[..., None]
    if fmt == "e2m1":
        c = elems.astype(jnp.int32)
        sign, e, m = (c >> 3) & 1, (c >> 1) & 3, c & 1
        # value = (2 + m) * 2^(e - 2) for e > 0, m * 2^-1 for e == 0
        sig = jnp.where(e == 0, m, 2 + m)
        ex = jnp.where(e == 0, -1, e - 2)
    else:
        f = FORMATS[fmt]
        mant_bits = 3 if fmt == "e4m3" else 2
        bias = 7 if fmt == "e4m3" else 15
        raw = lax.bitcast_convert_type(elems.astype(f.dtype), jnp.uint8).astype(jnp.int32)
        sign = (raw >> 7) & 1
        e = (raw >> mant_bits) & ((1 << (7 - mant_bits)) - 1)
        m = raw & ((1 << mant_bits) - 1)
        sig = jnp.where(e == 0, m, m + (1 << mant_bits))
        ex = jnp.where(e == 0, 1, e) - bias - mant_bits
    if dtype == jnp.float64:
        # float64 holds every value as a normal number: sig * 2^e with the power of two built from its bits.
        p2 = lax.bitcast_convert_type((ex + bi - 127 + 1023).astype(jnp.int64) << 52, jnp.float64)
        out = jnp.where(sign == 1, -1.0, 1.0) * sig.astype(jnp.float64) * p2
        out = jnp.where(bi == SCALE_NAN, jnp.nan, out)
    else:
        bits = assemble_f32(sign, sig, ex + bi - 127)
        bits = jnp.where(bi == SCALE_NAN, 0x7FC00000, bits)
        out = f32_bits_to(bits, dtype)
    if fmt != "e2m1":
        out = jnp.where(jnp.isnan(elems.astype(jnp.float32)), jnp.nan, out).astype(dtype)
    return out


# ---------------------------------------------------------------------------------------------------------------
# public quantize / dequantize


def _check_rule(rule: str) -> None:
    if rule not in SCALE_RULES:
        raise ValueError(f"unknown scale rule {rule!r}; expected one of {SCALE_RULES}")


def mxfp4_quantize(x: jax.Array, *, axis: int = -1, rule: str = "even") -> tuple[jax.Array, jax.Array]:
    """MXFP4-quantize ``x`` in blocks of 32 along ``axis`` (length must be a multiple of 32).

    Returns (codes, scale): codes uint8 E2M1 codes (0..15), same shape as x; scale uint8 E8M0 bytes, x's shape with
    ``axis`` divided by 32.
    """
    _check_rule(rule)
    xb, n = _to_blocks(x, axis, pad=False)
    codes, b = _quantize_blocks(xb, "e2m1", rule)
    return _from_blocks(codes, axis, n), jnp.moveaxis(b, -1, axis)


def mxfp4_dequantize(codes: jax.Array, scale: jax.Array, *, axis: int = -1, dtype=jnp.float32) -> jax.Array:
    """Inverse of ``mxfp4_quantize`` (exact in float32/float64; bfloat16 exact unless below 2^-126)."""
    cb, n = _to_blocks(codes, axis, pad=False, name="codes")
    out = _dequantize_blocks(cb, jnp.moveaxis(scale, axis, -1), "e2m1", dtype)
    return _from_blocks(out, axis, n)


def mxfp8_quantize(x: jax.Array, *, axis: int = -1, rule: str = "ceil", fmt: str = "e4m3"):
    """MXFP8-quantize ``x`` (E4M3 by default, or E5M2) in blocks of 32 along ``axis``.

    Returns (elements, scale): elements in the ml_dtypes float8 dtype, same shape as x; scale uint8 E8M0 bytes.
    Scaled values are clipped to +-max before the (non-saturating) float8 cast.
    """
    _check_rule(rule)
    if fmt not in ("e4m3", "e5m2"):
        raise ValueError(f"MXFP8 element format must be 'e4m3' or 'e5m2', got {fmt!r}")
    xb, n = _to_blocks(x, axis, pad=False)
    elems, b = _quantize_blocks(xb, fmt, rule)
    return _from_blocks(elems, axis, n), jnp.moveaxis(b, -1, axis)


def mxfp8_dequantize(elems: jax.Array, scale: jax.Array, *, axis: int = -1, dtype=jnp.float32) -> jax.Array:
    """Inverse of ``mxfp8_quantize``; the element format is read from ``elems.dtype``."""
    fmt = {jnp.dtype(jnp.float8_e4m3fn): "e4m3", jnp.dtype(jnp.float8_e5m2): "e5m2"}.get(jnp.dtype(elems.dtype))
    if fmt is None:
        raise ValueError(f"elems must be float8_e4m3fn or float8_e5m2, got {elems.dtype}")
    eb, n = _to_blocks(elems, axis, pad=False, name="elems")
    out = _dequantize_blocks(eb, jnp.moveaxis(scale, axis, -1), fmt, dtype)
    return _from_blocks(out, axis, n)


def qdq(x: jax.Array, *, axis: int, fmt: str, rule: str) -> jax.Array:
    """Quantize-dequantize in blocks of 32 along ``axis`` (a short last block is allowed). Same shape and dtype."""
    _check_rule(rule)
    if fmt not in FORMATS:
        raise ValueError(f"unknown element format {fmt!r}; expected one of {tuple(FORMATS)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"qdq needs a floating input, got {x.dtype}")
    axis = axis % x.ndim
    xb, n = _to_blocks(x, axis, pad=True)
    elems, b = _quantize_blocks(xb, fmt, rule)
    return _from_blocks(_dequantize_blocks(elems, b, fmt, x.dtype), axis, n)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _fake_quant(x, axis, fmt, rule):
    return qdq(x, axis=axis, fmt=fmt, rule=rule)


@_fake_quant.defjvp
def _fake_quant_jvp(axis, fmt, rule, primals, tangents):
    (x,), (t,) = primals, tangents
    # Straight-through: the forward is qdq(x), the derivative is taken as the identity (saturation included).
    return _fake_quant(x, axis, fmt, rule), t


def fake_quant_mxfp4(w: jax.Array, *, axis: int, rule: str = "even") -> jax.Array:
    """MXFP4 (E2M1) STE fake-quant: forward qdq(w) in blocks of 32 along ``axis``, gradient identity.

    Args:
      w: any float array (float32, bfloat16, float64); for the expert stacks [E, in, out] use axis=1 (``in``).
      axis: the block (contraction) axis; a last block shorter than 32 is allowed.
      rule: scale rule, "even" (compressed-tensors, default for weights), "floor" or "ceil".
    Returns: same shape and dtype as w.
    """
    return _fake_quant(w, axis % w.ndim, "e2m1", rule)


def fake_quant_mxfp8(x: jax.Array, *, axis: int = -1, rule: str = "ceil") -> jax.Array:
    """MXFP8 (E4M3) STE fake-quant of activations: forward qdq(x) (clipped to +-448 before the cast), gradient identity.

    Args:
      x: any float array; blocks of 32 along ``axis`` (the contraction axis of the GEMM it feeds).
      rule: scale rule, "ceil" by default (never clips).
    Returns: same shape and dtype as x.
    """
    return _fake_quant(x, axis % x.ndim, "e4m3", rule)


def mxfp8_qdq_elementwise(x: jax.Array, amax: jax.Array, *, rule: str = "ceil", dtype=None) -> jax.Array:
    """MXFP8 (E4M3) quantize-dequantize of each element of ``x`` given its block's max |x| ``amax`` (float32,
    broadcast to x's shape): ``qdq(x, fmt="e4m3")`` bit for bit wherever ``amax`` is the max that ``qdq`` takes over
    the block (of the flushed float32 values; a block holding NaN or +-Inf: NaN). Element-wise integer and float32
    arithmetic only — no float8 dtype and no [..., G, 32] view, whose 32-wide minor dimension a TPU pads to 128
    lanes — so it runs inside a kernel that finds the block max its own way (pallas_kernels/glu_quant).

    The E4M3 rounding is done on the significand: v = x / scale (clipped to +-448) has the quantum 2^(E-3) of its
    binade E (2^-9 below 2^-6: the subnormals), and round-half-even of v / quantum is an integer s <= 16; the value
    s · quantum · scale is assembled from bits (exact where it is a float32 subnormal). NaN elements give NaN.
    Returns ``dtype`` (default x.dtype)."""
    _check_rule(rule)
    dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    x = flush_subnormals(x.astype(jnp.float32))
    b = scale_bytes(amax, fmt="e4m3", rule=rule).astype(jnp.int32)
    finite = b != SCALE_NAN
    v = scale_by_pow2(jnp.where(finite, x, 0.0), 127 - jnp.where(finite, b, 127))
    v = jnp.clip(v, -FORMATS["e4m3"].max_value, FORMATS["e4m3"].max_value)
    bits = f32_bits(v)
    e = jnp.maximum(((bits >> 23) & 0xFF) - 127, -6)  # the binade (subnormals share -6's quantum 2^-9)
    # round half to even of |v| / 2^(e-3) < 2^5 by the float32 adder: adding 1.5 · 2^23 leaves no fraction bits
    magic = jnp.float32(1.5 * 2**23)
    s = (jnp.abs(v) * pow2_f32(3 - e) + magic - magic).astype(jnp.int32)
    carry = s == 16  # rounded up into the next binade
    out = assemble_f32(bits < 0, jnp.where(carry, 8, s), e - 3 + carry.astype(jnp.int32) + b - 127)
    out = jnp.where(~finite | jnp.isnan(v), 0x7FC00000, out)
    return f32_bits_to(out, dtype)


@dataclass(frozen=True)
class ActQuant:
    """The MXFP8 (E4M3) STE fake-quant of a GEMM input along its last axis (``fake_quant_mxfp8``), as the MoE layers
    pass it: called on an array it quantizes it. ``glu``, when set, is a fused implementation of the GLU hidden
    that this quant follows — ``glu(a, b, act, dtype, rule, acc=)`` = this quant of act(a, b) rounded to ``dtype``, with
    act's gradient (a kernel: k3jax/layers/backends.py), or None where it has no kernel for the target — which
    ``ops.activations.glu_hidden`` runs in its place."""
    rule: str = "ceil"
    glu: object = None

    def __call__(self, x: jax.Array) -> jax.Array:
        return fake_quant_mxfp8(x, axis=-1, rule=self.rule)
