"""Host memory for the loader: aligned buffers, a reusable scratch buffer, fast transposes, RSS probes.

* ``aligned_empty``: XLA:CPU adopts (zero-copy) host buffers aligned to ``ALIGN`` bytes; anything else is copied by
  ``device_put``, so every buffer handed to ``jax.make_array_from_callback`` comes from here.
* ``Scratch``: bytes that only feed a transpose go through one reused buffer (fresh pages are zero-filled by the
  kernel on first touch, which halves the read speed into them).
* ``host_transpose`` (one XLA program on the host CPU) and its numpy twin ``copy_T`` (cache-sized tiles): torch
  [out, in] -> [in, out], bit-identical for widening and same-dtype casts.
* ``peak_rss_bytes`` / ``current_rss_bytes`` / ``reset_peak_rss`` / ``hwm_rss_bytes``: what the load costs in RSS.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

ALIGN = 64  # XLA:CPU aliases (zero-copy) host buffers aligned to this; anything else is copied by device_put
_TILE = 128  # transpose tile: keeps both the strided reads and the writes in cache
_BF16 = np.dtype(ml_dtypes.bfloat16)


def aligned_empty(shape, dtype, align: int = ALIGN) -> np.ndarray:
    """``np.empty`` whose data pointer is ``align``-byte aligned, so jax on CPU adopts it without a copy."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dtype).reshape(shape)


class Scratch:
    """One reusable, aligned host buffer for bytes that are read, transformed and dropped within one leaf.

    Pages of a fresh allocation are zero-filled by the kernel on first touch, which halves the speed of reading into
    them on the CI machine (preadv 6.2 GB/s into new memory vs 12 GB/s into warm memory); bytes that only feed a
    transpose therefore go through this buffer, which grows to the largest such tensor and is reused."""

    def __init__(self):
        self.buf: np.ndarray | None = None

    def take(self, shape, dtype) -> np.ndarray:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        if self.buf is None or self.buf.nbytes < n:
            self.buf = None
            self.buf = aligned_empty((n,), np.uint8)
        return self.buf[:n].view(dtype).reshape(shape)


def copy_T(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src.T`` (2-D, dtype cast as ``astype``), in cache-sized tiles.

    BF16 → float32 is exact as a 16-bit shift, so that case runs as integer ops on the raw bits (bit-identical to
    the ml_dtypes cast, NaN payloads included) — several times faster than the strided ml_dtypes cast loop.
    """
    R, C = src.shape
    if src.dtype == _BF16 and dst.dtype == np.float32:
        s16, d32 = src.view(np.uint16), dst.view(np.uint32)
        for i in range(0, R, _TILE):
            for j in range(0, C, _TILE):
                np.left_shift(s16[i:i + _TILE, j:j + _TILE].T, 16, out=d32[j:j + _TILE, i:i + _TILE],
                              dtype=np.uint32)
        return
    if R <= _TILE or C <= _TILE:
        np.copyto(dst, src.T, casting="unsafe")
        return
    for i in range(0, R, _TILE):
        for j in range(0, C, _TILE):
            np.copyto(dst[j:j + _TILE, i:i + _TILE], src[i:i + _TILE, j:j + _TILE].T, casting="unsafe")


@functools.cache
def _host_cpu():
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # no CPU backend in this process (JAX_PLATFORMS without cpu)
        return None


@functools.cache
def _xla_swap_last(dtype: np.dtype):
    return jax.jit(lambda a: jnp.swapaxes(a, -1, -2).astype(dtype))


def host_transpose(src: np.ndarray, dtype) -> np.ndarray:
    """``swapaxes(src, -1, -2).astype(dtype)`` as a new C-contiguous, 64-byte-aligned host array.

    Runs as one XLA program on the host's CPU device: it reads ``src`` in place (an aligned buffer is adopted without
    a copy); end to end (dispatch and the new output's pages included) it moves 3.2 GB/s of an 8 MB BF16 matrix on
    the CI CPU, where numpy's strided copies (``copy_T``) move 0.95 GB/s (experiments/load_microbench.py). The result
    is a zero-copy view of XLA's buffer, which the CPU devices adopt in turn.
    Bit-identical to ``copy_T`` for widening and same-dtype casts (a transpose moves bits; bf16 -> f32 is exact).
    Falls back to ``copy_T`` where there is no CPU backend or for narrowing casts (rounding stays numpy's).
    """
    dtype = np.dtype(dtype)
    cpu = _host_cpu()
    if cpu is None or src.ndim < 2 or dtype.itemsize < src.dtype.itemsize:
        out = aligned_empty((*src.shape[:-2], src.shape[-1], src.shape[-2]), dtype)
        for i in np.ndindex(*src.shape[:-2]):
            copy_T(out[i], src[i])
        return out
    return np.asarray(_xla_swap_last(dtype)(jax.device_put(src, cpu)))


# ------------------------------------------------------------------------------------------------- RSS probes

def peak_rss_bytes() -> int:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux ``/proc/self/clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm_rss_bytes() -> int:
    """RSS high-water mark since the last ``reset_peak_rss`` (``VmHWM``), or the process peak where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_rss_bytes()


__all__ = ["ALIGN", "Scratch", "aligned_empty", "copy_T", "current_rss_bytes", "host_transpose", "hwm_rss_bytes",
           "peak_rss_bytes", "reset_peak_rss"]
