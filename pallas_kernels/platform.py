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
