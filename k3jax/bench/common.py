"""Shared benchmark helpers: warm median timing and an XLA matmul peak measured in the same process.

Both live in ``k3jax.train.flops`` (the train loop measures its MFU peak with them, and train never imports bench);
benchmarks import them from here.
"""

from __future__ import annotations

from k3jax.train.flops import matmul_peak_flops, time_median

__all__ = ["matmul_peak_flops", "time_median"]
