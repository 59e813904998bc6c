"""Public MX API: MXFP4 / MXFP8 pack and unpack (compressed-tensors layout), expert-stack conversions, host decoder.

The element codes, nibble packing and array math live in k3jax.ops.mx (the MoE layer calls its fake-quant directly,
driven by the config's ``qat`` fields, docs/numerics.md §10.7); this package re-exports them and owns the storage layout
(docs/numerics.md §10.3) and its numpy decoder for the checkpoint loader.

    packed, scale = mxfp4_pack(w)            # w [..., n] -> uint8 [..., n/2], uint8 [..., n/32]
    w_q = mxfp4_unpack(packed, scale)        # exact
    packed, scale = pack_experts(w_eio)      # [E, in, out] -> [E, out, in/2], [E, out, in/32] (checkpoint)
    packed_params = pack_params(params)      # every routed-expert stack of a model's params, packed
    w_eio = unpack_experts(packed, scale)    # exact inverse on quantized values
"""

from k3jax.ops.mx import (
    BLOCK_SIZE,
    SCALE_RULES,
    count_scale_bytes,
    e8m0_to_float,
    fake_quant_mxfp4,
    fake_quant_mxfp8,
    mxfp4_dequantize,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
    pack_codes,
    qdq,
    unpack_codes,
)
from k3jax.quant.host import mxfp4_dequantize_np, mxfp4_dequantize_T_into
from k3jax.quant.packing import (
    check_packed,
    mxfp4_pack,
    mxfp4_unpack,
    mxfp8_pack,
    mxfp8_unpack,
    pack_experts,
    pack_params,
    unpack_experts,
)

__all__ = [
    "BLOCK_SIZE", "SCALE_RULES", "check_packed", "count_scale_bytes", "e8m0_to_float", "fake_quant_mxfp4",
    "fake_quant_mxfp8", "mxfp4_dequantize", "mxfp4_dequantize_T_into", "mxfp4_dequantize_np", "mxfp4_pack",
    "mxfp4_quantize", "mxfp4_unpack", "mxfp8_dequantize", "mxfp8_pack", "mxfp8_quantize", "mxfp8_unpack",
    "pack_codes", "pack_experts", "pack_params", "qdq", "unpack_codes", "unpack_experts",
]
