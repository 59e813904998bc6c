"""compressed-tensors ``mxfp4-pack-quantized`` storage (docs/numerics.md §10.3, docs/checkpoint.md §11.4) and the
expert-stack conversions.

    weight_packed : uint8 [..., n/2]   byte[.., j] = code[.., 2j] | code[.., 2j+1] << 4   (LOW nibble = EVEN column)
    weight_scale  : uint8 [..., n/32]  E8M0 byte b, value 2^(b-127); 0xFF = NaN
    W[.., c]      = E2M1(code[.., c]) * 2^(scale[.., c // 32] - 127)

k3jax keeps routed experts as dense stacks [E, in, out] (w1, w3: [E, P, F]; w2: [E, F, P]); the checkpoint keeps
the torch orientation per expert, packed along ``in``: [E, out, in/2] + [E, out, in/32]. ``pack_experts`` and
``unpack_experts`` are the one conversion between the two (export, the QAT round trip, tests).

Export of QAT-trained experts is lossless because the MoE layer's weight fake-quant (``qat_weight_rule``, "even" by
default = compressed-tensors) blocks along ``in`` as the packing does: for a master stack w,
``unpack_experts(*pack_experts(w)) == fake_quant_mxfp4(w, axis=1)`` bit for bit, which is what the QAT model
computed with. The element codes and nibble packing themselves live in k3jax.ops.mx.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops import mx


def _check_float(name: str, w) -> None:
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{name} must be a float array, got dtype {w.dtype} (shape {w.shape})")
    if w.ndim < 1 or w.shape[-1] % mx.BLOCK_SIZE:
        raise ValueError(f"{name}: last axis must be a multiple of {mx.BLOCK_SIZE}, got shape {w.shape}")


def check_packed(packed, scale, *, name: str = "weight") -> None:
    """Raise ValueError unless (packed, scale) is a valid MXFP4 pair: uint8 [..., n/2] and uint8 [..., n/32]."""
    if packed.dtype != jnp.uint8:
        raise ValueError(f"{name}_packed must be uint8, got {packed.dtype} (shape {packed.shape})")
    if scale.dtype != jnp.uint8:
        raise ValueError(f"{name}_scale must be uint8 E8M0 bytes, got {scale.dtype} (shape {scale.shape})")
    if not mx.is_mxfp4_pair(packed.shape, scale.shape):
        raise ValueError(f"{name}: packed shape {packed.shape} and scale shape {scale.shape} do not match "
                         f"(expected packed [..., n/2] and scale [..., n/32] with n a multiple of {mx.BLOCK_SIZE})")


def mxfp4_pack(w: jax.Array, *, rule: str = "even") -> tuple[jax.Array, jax.Array]:
    """Quantize and pack ``w`` [..., n] (n % 32 == 0, blocks along the last axis).

    Returns (packed uint8 [..., n/2], scale uint8 [..., n/32]). ``rule="even"`` reproduces compressed-tensors bytes.
    """
    _check_float("w", w)
    codes, scale = mx.mxfp4_quantize(w, axis=-1, rule=rule)
    return mx.pack_codes(codes), scale


def mxfp4_unpack(packed: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Exact dequantization of (packed [..., n/2], scale [..., n/32]) to ``dtype`` [..., n]."""
    check_packed(packed, scale)
    return mx.mxfp4_dequantize(mx.unpack_codes(packed), scale, axis=-1, dtype=dtype)


def mxfp8_pack(x: jax.Array, *, rule: str = "ceil", fmt: str = "e4m3") -> tuple[jax.Array, jax.Array]:
    """MXFP8 along the last axis -> (element bytes uint8 [..., n], scale uint8 [..., n/32])."""
    _check_float("x", x)
    elems, scale = mx.mxfp8_quantize(x, axis=-1, rule=rule, fmt=fmt)
    return jax.lax.bitcast_convert_type(elems, jnp.uint8), scale


def mxfp8_unpack(data: jax.Array, scale: jax.Array, dtype=jnp.float32, *, fmt: str = "e4m3") -> jax.Array:
    """Inverse of ``mxfp8_pack``."""
    if data.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
        raise ValueError(f"MXFP8 data and scale must be uint8, got {data.dtype} {data.shape} and "
                         f"{scale.dtype} {scale.shape}")
    if data.shape[-1] % mx.BLOCK_SIZE or scale.shape != (*data.shape[:-1], data.shape[-1] // mx.BLOCK_SIZE):
        raise ValueError(f"MXFP8 data shape {data.shape} and scale shape {scale.shape} do not match")
    elems = jax.lax.bitcast_convert_type(data, mx.FORMATS[fmt].dtype)
    return mx.mxfp8_dequantize(elems, scale, axis=-1, dtype=dtype)


def pack_experts(w_eio: jax.Array, *, rule: str = "even", name: str = "experts") -> tuple[jax.Array, jax.Array]:
    """Dense expert stack [E, in, out] (jax or numpy) -> (packed uint8 [E, out, in/2], scale uint8 [E, out, in/32]),
    the checkpoint layout; ``rule="even"`` reproduces compressed-tensors bytes. ``name`` goes into error messages."""
    if w_eio.ndim != 3:
        raise ValueError(f"{name}: expected an expert stack [E, in, out], got shape {w_eio.shape}")
    if w_eio.shape[1] % mx.BLOCK_SIZE:
        raise ValueError(f"{name}: in = {w_eio.shape[1]} (shape {w_eio.shape}) is not a multiple of {mx.BLOCK_SIZE}")
    return mxfp4_pack(jnp.swapaxes(w_eio, 1, 2), rule=rule)


def unpack_experts(packed_eon: jax.Array, scale_eog: jax.Array, dtype=jnp.float32,
                   *, name: str = "experts") -> jax.Array:
    """Checkpoint layout [E, out, in/2] + [E, out, in/32] -> dense expert stack [E, in, out] in ``dtype`` (exact)."""
    check_packed(packed_eon, scale_eog, name=name)
    if packed_eon.ndim != 3:
        raise ValueError(f"{name}: expected packed [E, out, in/2], got shape {packed_eon.shape}")
    return jnp.swapaxes(mxfp4_unpack(packed_eon, scale_eog, dtype), 1, 2)


def pack_params(params, *, rule: str = "even"):
    """A params tree with every routed-expert dict {w1, w3, w2} (float stacks [..., E, in, out], the scanned groups'
    leading [G] included) replaced by its packed leaves ``w*_packed`` / ``w*_scale`` — the form
    ``load(..., keep_experts_packed=True)`` returns and the packed experts run from."""
    def convert(node):
        if not isinstance(node, dict):
            return node
        if set(node) == {"w1", "w3", "w2"}:
            out = {}
            for name, w in node.items():
                pack = lambda x, name=name: pack_experts(x, rule=rule, name=name)  # noqa: E731
                for _ in range(w.ndim - 3):  # a stacked group's leading [G] axis
                    pack = jax.vmap(pack)
                out[f"{name}_packed"], out[f"{name}_scale"] = jax.jit(pack)(w)
            return out
        return {k: convert(v) for k, v in node.items()}

    return convert(params)

