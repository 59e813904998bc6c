"""Host (numpy) MXFP4 decoding of the compressed-tensors layout, for the checkpoint loader (docs/numerics.md §10.3,
docs/checkpoint.md §11.8).

The fast twin of ``k3jax.quant.mxfp4_unpack`` (jnp, exact) for bytes that never leave the host: one table gather
per output value (``k3jax.ops.mx`` byte tables, no shifts) and one multiply by the E8M0 scale, straight out of the
mapped file. Bit-identical to ``mxfp4_unpack`` for every scale byte but 0xFF (NaN), which the reader rejects first.

    w = mxfp4_dequantize_np(packed, scale)          # packed uint8 [..., n/2] + scale [..., n/32] -> float32 [..., n]
    mxfp4_dequantize_T_into(dst, packed, scale)     # dst [in, out] = that, transposed, for packed [out, in/2]
"""

from __future__ import annotations

import numpy as np

from k3jax.ops.mx import E2M1_BYTE_HI, E2M1_BYTE_LO, E2M1_BYTE_PAIR, E8M0_VALUES


def mxfp4_dequantize_np(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Exact host dequantization: packed uint8 [..., n/2] + scale uint8 [..., n/32] → float32 [..., n].

    Low nibble = even column (compressed-tensors). Scale byte b means 2^(b-127); numpy keeps float32 subnormals, so
    this is exact for every byte but 0xFF (NaN, rejected by the reader before we get here).
    """
    packed, scale = np.asarray(packed), np.asarray(scale)
    G = scale.shape[-1]
    vals = E2M1_BYTE_PAIR[packed].reshape(*packed.shape[:-1], G, -1)
    vals *= E8M0_VALUES[scale][..., None]
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def mxfp4_dequantize_T_into(dst: np.ndarray, packed: np.ndarray, scale: np.ndarray) -> None:
    """``dst[...] = mxfp4_dequantize_np(packed, scale).T`` without the intermediate: dst [in, out] C-contiguous,
    packed [out, in/2], scale [out, in/32] (views of the mapped file are fine). Bit-identical to the reference."""
    n_in, n_out = dst.shape
    G = scale.shape[-1]
    k = n_in // G
    f32 = dst if dst.dtype == np.float32 else np.empty(dst.shape, np.float32)
    d4 = f32.reshape(G, k // 2, 2, n_out)
    pT = packed.T.reshape(G, k // 2, n_out)
    np.take(E2M1_BYTE_LO, pT, out=d4[:, :, 0, :], mode="clip")  # mode="clip": unbuffered; uint8 is always in range
    np.take(E2M1_BYTE_HI, pT, out=d4[:, :, 1, :], mode="clip")
    f32.reshape(G, k, n_out)[...] *= E8M0_VALUES[scale.T][:, None, :]
    if f32 is not dst:
        np.copyto(dst, f32, casting="unsafe")


__all__ = ["mxfp4_dequantize_T_into", "mxfp4_dequantize_np"]
