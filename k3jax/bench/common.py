"""Shared benchmark helpers: warm median timing and an XLA matmul peak measured in the same process."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def time_median(fn, *args, reps: int) -> float:
    """Median wall time of ``fn(*args)`` over ``reps`` runs after one compile + warm-up run."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak_flops(n: int = 1024, dtype=jnp.float32, reps: int = 5) -> float:
    """Achieved FLOP/s of a jitted [n, n] @ [n, n] matmul — the 'peak' that efficiency ratios divide by."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(jnp.matmul)
    return 2.0 * n**3 / time_median(f, a, b, reps=reps)
