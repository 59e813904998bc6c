"""Which backend a kernel is being built for: picks block sizes, layouts and compiler params per platform.

Triton (GPU) and Mosaic (TPU) reject each other's compiler params and want different tiles, and a jit'd function is
traced before it is lowered, so the kernels ask here at trace time. The answer comes from, in order: an explicit
``platform=`` argument; the device of the current mesh (``jax.sharding.use_abstract_mesh`` with an abstract CUDA
device, or the ``mesh.abstract_mesh`` of deviceless TPU topology devices: lowering for a backend that is not the
default one requires such a mesh anyway); the default backend.
"""

from __future__ import annotations

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def target_platform(platform: str | None = None) -> str:
    """'cpu', 'gpu' or 'tpu' (``cuda`` and ``rocm`` are 'gpu': both lower through Triton)."""
    if platform is None:
        device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
        platform = device.platform if device is not None else jax.default_backend()
    platform = _ALIASES.get(platform, platform)
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS} (or cuda / rocm), got {platform!r}")
    return platform


# VMEM per TensorCore by TPU device kind (the figures of jax/_src/tpu_info.py); an unknown kind reads as the largest
TPU_VMEM_BYTES = {"TPU v5": 64 << 20, "TPU v5 lite": 128 << 20, "TPU v6 lite": 128 << 20}


def tpu_vmem_bytes() -> int:
    """The VMEM of one TensorCore of the TPU being compiled for (the current abstract mesh's device, else the first
    device); the largest known where the kind is unknown or the target is not a TPU."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    kind = device.device_kind if device is not None else jax.devices()[0].device_kind
    return TPU_VMEM_BYTES.get(kind, max(TPU_VMEM_BYTES.values()))
