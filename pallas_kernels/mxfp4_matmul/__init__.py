"""MXFP4-weight matmul and its grouped (per-expert) variant (docs/numerics.md §10.8); see README.md."""

from pallas_kernels.mxfp4_matmul.api import mxfp4_gmm, mxfp4_matmul
from pallas_kernels.mxfp4_matmul.ffn import mxfp4_glu_ffn

__all__ = ["mxfp4_glu_ffn", "mxfp4_gmm", "mxfp4_matmul"]
