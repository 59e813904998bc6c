"""The GLU hidden with its MXFP8 fake-quant fused into one pass (TPU kernel); see api.py."""

from pallas_kernels.glu_quant.api import glu_mxfp8

__all__ = ["glu_mxfp8"]
