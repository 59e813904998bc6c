"""What each MXFP4 matmul schedule computes and moves between HBM and on-chip memory: the ``pl.CostEstimate`` its
``pallas_call`` carries (XLA's cost model and ``k3jax.plan.hlo`` read it from the custom call; without it a Mosaic /
Triton call is opaque to both).

From the grid (kernel.py): a block is fetched when its block index differs from the previous grid step's, and an
output block is written back when its index changes. With T row tiles of bm rows, N = W's rows (out), K = its
columns (in), blocks (bn, bk), x / g and the outputs of ``itemsize`` bytes (fp32 accumulation on chip):

    forward (grid schedule: grid (T, N/bn, K/bk); tpu: the same grid, a row tile's whole K/2 as its row block;
             loop: grid (T, N/bn) with the K loop inside)
      rows      grid / loop: bm·K·itemsize per (t, j) -> T · (N/bn) · bm · K · itemsize (once per column tile, or
                once per tile on the grid schedule when K/bk = 1: the row block's index then stays (t, 0) across j);
                tpu: once per tile -> T · bm · K · itemsize
      weights   bn·bk/2 bytes per (t, j, k)      -> T · N · K/2                      (once per row tile)
      scales    bn·K/32 per (t, j)               -> T · N · K/32
      output    bm·bn per (t, j)                 -> T · bm · N · itemsize (the rows' dtype; the dense grid
                                                    schedule (CPU) writes fp32: · 4)
    transposed (dx = g W: tpu grid (T, N/bn, K/bk), dx resident per tile; loop grid (T, K/bk), the N loop inside)
      g rows    tpu: bm·bn per (t, n) -> T·bm·N·itemsize; loop: bm·N per (t, k) -> T·(K/bk)·bm·N·itemsize
      weights   T · N · K/2;   scales T · N · K/32
      output    dx halves, T · bm · K · itemsize
    FLOPs       2 · T·bm · N · K (both)

Weights and scales are fetched per step as above when their block index changes every step (N/bn > 1 or K/bk >
1: K3's shapes); with a single weight block per expert consecutive tiles of one expert would share it, and the
figure is an upper bound. Every tile is counted as used: the estimate is static and the used tiles depend on the
routing (``ceil(M/bm) + G`` tiles bound them; an unused tile fetches nothing and writes a zero block). For an
expert-parallel receive buffer at capacity factor c the padding rows are ~1 - 1/c of it, so the estimate's FLOPs
are the kernel's grid at its worst, not the model's useful FLOPs (``k3 plan`` reports both).
tests/pallas/test_mxfp4_cost.py recounts these bytes by walking the grid with the block index maps.
"""

from __future__ import annotations

from k3jax.ops.mx import BLOCK_SIZE

SCHEDULES = ("grid", "loop", "tpu")


def gmm_cost(schedule: str, tiles: int, bm: int, bn: int, bk: int, N: int, K: int, itemsize: int) -> dict:
    """{"flops", "bytes_accessed"} of the forward kernels y [T·bm, N] = x [T·bm, K] @ W_gᵀ (dense: one expert,
    T = M/bm)."""
    _check(schedule)
    column_reads = 1 if schedule == "tpu" or (schedule == "grid" and K == bk) else N // bn
    rows = tiles * column_reads * bm * K * itemsize
    weights = tiles * N * (K // 2 + K // BLOCK_SIZE)
    out = tiles * bm * N * (4 if schedule == "grid" else itemsize)
    return {"flops": 2 * tiles * bm * N * K, "bytes_accessed": rows + weights + out}


def gmm_t_cost(schedule: str, tiles: int, bm: int, bn: int, bk: int, N: int, K: int, itemsize: int) -> dict:
    """{"flops", "bytes_accessed"} of the transposed kernels dx [T·bm, K] = g [T·bm, N] @ W_g."""
    _check(schedule)
    reads_of_g = 1 if schedule == "tpu" else K // bk
    rows = tiles * reads_of_g * bm * N * itemsize
    weights = tiles * N * (K // 2 + K // BLOCK_SIZE)
    return {"flops": 2 * tiles * bm * N * K, "bytes_accessed": rows + weights + tiles * bm * K * itemsize}


def _check(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


__all__ = ["SCHEDULES", "gmm_cost", "gmm_t_cost"]
