"""Public MX API: MXFP4 / MXFP8 pack and unpack (compressed-tensors layout), expert-stack conversions, QAT policy.

The array math lives in k3jax.ops.mx (the model calls its fake-quant directly); this package re-exports it and owns
the storage layout (SPEC §10.3) and the QAT policy (SPEC §10.7).

    packed, scale = mxfp4_pack(w)            # w [..., n] -> uint8 [..., n/2], uint8 [..., n/32]
    w_q = mxfp4_unpack(packed, scale)        # exact
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
    qdq,
)
from k3jax.quant.packing import (
    check_packed,
    experts_to_packed,
    mxfp4_pack,
    mxfp4_unpack,
    mxfp8_pack,
    mxfp8_unpack,
    pack_codes,
    packed_to_experts,
    unpack_codes,
)
from k3jax.quant.qat import QATPolicy, export_experts_mxfp4, import_experts_mxfp4

__all__ = [
    "BLOCK_SIZE", "SCALE_RULES", "QATPolicy", "check_packed", "count_scale_bytes", "e8m0_to_float",
    "experts_to_packed", "export_experts_mxfp4", "fake_quant_mxfp4", "fake_quant_mxfp8", "import_experts_mxfp4",
    "mxfp4_dequantize", "mxfp4_pack", "mxfp4_quantize", "mxfp4_unpack", "mxfp8_dequantize", "mxfp8_pack",
    "mxfp8_quantize", "mxfp8_unpack", "pack_codes", "packed_to_experts", "qdq", "unpack_codes",
]
