"""float32 bit patterns: the exact arithmetic under the MX formats (k3jax/ops/mx.py) and the kernels that quantize
in place (pallas_kernels/glu_quant). Powers of two and values are assembled from bits, never from log2 / exp2
(inexact on XLA:CPU), and every helper is element-wise integer / float32 arithmetic, so it also runs inside a Pallas
kernel. XLA:CPU and TPU arithmetic flush float32 subnormals to zero: the helpers say where that matters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def f32_bits(x: jax.Array) -> jax.Array:
    """The float32 bit pattern of ``x`` as int32 (x is cast to float32 first)."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def from_bits(bits_i32: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits_i32.astype(jnp.int32), jnp.float32)


def pow2_f32(e: jax.Array) -> jax.Array:
    """2^e as float32 for integer e in [-126, 127], built from the bit pattern (exact; never exp2)."""
    return from_bits((e.astype(jnp.int32) + 127) << 23)


def flush_subnormals(x: jax.Array) -> jax.Array:
    """float32 ``x`` with subnormals replaced by signed zero (what XLA:CPU arithmetic does implicitly)."""
    bits = f32_bits(x)
    return jnp.where((bits & 0x7F800000) == 0, from_bits(bits & jnp.int32(-0x80000000)), x.astype(jnp.float32))


def scale_by_pow2(x: jax.Array, e: jax.Array) -> jax.Array:
    """x * 2^e for float32 x and integer e in [-254, 254] as two normal factors (no subnormal operand to flush)."""
    e1 = e // 2
    return x * pow2_f32(e1) * pow2_f32(e - e1)


def f32_bits_to(bits: jax.Array, dtype) -> jax.Array:
    """float32 bit pattern -> ``dtype``; bfloat16 is rounded from the bits (RNE) so subnormals survive XLA:CPU."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return from_bits(bits)
    if dtype == jnp.bfloat16:
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        hi = jnp.where(is_nan, 0x7FC0, rounded & 0xFFFF)
        return lax.bitcast_convert_type(hi.astype(jnp.uint16), jnp.bfloat16)
    return from_bits(bits).astype(dtype)


def assemble_f32(sign: jax.Array, sig: jax.Array, e: jax.Array) -> jax.Array:
    """Bits of the float32 (-1)^sign * sig * 2^e for int sig in [0, 16) and e >= -149: exact, subnormal or not.

    Results above the float32 range become +-Inf.
    """
    msb = jnp.where(sig >= 8, 3, jnp.where(sig >= 4, 2, jnp.where(sig >= 2, 1, 0)))
    top = msb + e  # unbiased exponent of the value
    normal = ((top + 127) << 23) | ((sig << (23 - msb)) & 0x7FFFFF)
    subnormal = sig << jnp.clip(e + 149, 0, 31)
    mag = jnp.where(top >= -126, normal, subnormal)
    mag = jnp.where(top > 127, 0x7F800000, mag)
    mag = jnp.where(sig == 0, 0, mag)
    return mag | (sign.astype(jnp.int32) << 31)


def is_negative(x: jax.Array) -> jax.Array:
    """``x < 0`` from the float32 bits: true for negative numbers (subnormals included, which XLA:CPU's
    comparisons would flush), false for -0.0 and +0.0."""
    bits = f32_bits(x)
    return (bits < 0) & ((bits & 0x7FFFFFFF) != 0)


__all__ = ["assemble_f32", "f32_bits", "f32_bits_to", "flush_subnormals", "from_bits", "is_negative", "pow2_f32",
           "scale_by_pow2"]
