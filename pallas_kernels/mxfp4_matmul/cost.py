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
figure is an upper bound.

Which tiles are charged (``charged_cost``). The used tiles depend on the routing, the estimate is one static
number, and an unused tile costs (almost) nothing: the dynamic TPU grid never visits it (its tile extent is the used
count), the static (megacore) TPU grid visits it to fetch nothing new and write its zero output block, and a
loop-schedule program of an unused tile loads and writes nothing. By default every one of the T static tiles is
charged (the grid at its worst: ``ceil(M/bm) + G`` bound the used ones). A caller that knows its routing passes the
expected used tiles instead (``expected_tiles(rows, groups, bm)`` from ``expected_load``): at decode a chip's rows
reach ~1 of its experts, and charging the static grid overstates the weights read by ~G x. For an expert-parallel
receive buffer at capacity factor c the padding rows are ~1 - 1/c of it, so the default's FLOPs are the kernel's
grid at its worst, not the model's useful FLOPs (``k3 plan`` reports both).
tests/pallas/test_mxfp4_cost.py recounts these bytes by walking the grid with the block index maps.
"""

from __future__ import annotations

import math

from k3jax.ops.mx import BLOCK_SIZE

SCHEDULES = ("grid", "loop", "tpu")


def gmm_cost(schedule: str, tiles: int, bm: int, bn: int, bk: int, N: int, K: int, itemsize: int,
             weight_fetches: float | None = None) -> dict:
    """{"flops", "bytes_accessed"} of the forward kernels y [T·bm, N] = x [T·bm, K] @ W_gᵀ (dense: one expert,
    T = M/bm). ``weight_fetches``: how many times an expert's whole weights are read when they stay resident
    (``kernel.resident_weights``); None: once per row tile."""
    _check(schedule)
    column_reads = 1 if schedule == "tpu" or (schedule == "grid" and K == bk) else N // bn
    rows = tiles * column_reads * bm * K * itemsize
    weights = (tiles if weight_fetches is None else weight_fetches) * N * (K // 2 + K // BLOCK_SIZE)
    out = tiles * bm * N * (4 if schedule == "grid" else itemsize)
    return {"flops": 2 * tiles * bm * N * K, "bytes_accessed": rows + weights + out}


def gmm_t_cost(schedule: str, tiles: int, bm: int, bn: int, bk: int, N: int, K: int, itemsize: int,
               weight_fetches: float | None = None) -> dict:
    """{"flops", "bytes_accessed"} of the transposed kernels dx [T·bm, K] = g [T·bm, N] @ W_g; ``weight_fetches`` as
    ``gmm_cost``'s."""
    _check(schedule)
    reads_of_g = 1 if schedule == "tpu" else K // bk
    rows = tiles * reads_of_g * bm * N * itemsize
    weights = (tiles if weight_fetches is None else weight_fetches) * N * (K // 2 + K // BLOCK_SIZE)
    return {"flops": 2 * tiles * bm * N * K, "bytes_accessed": rows + weights + tiles * bm * K * itemsize}


def expected_load(tokens: float, top_k: int, num_experts: int, local_experts: int) -> dict:
    """{"rows", "groups", "idle"}: the expected assignments and distinct experts reached on a device holding
    ``local_experts`` of ``num_experts`` when ``tokens`` tokens each pick ``top_k`` distinct experts.

    A token picks a given expert with probability p_e (sum over e = top_k); for independent tokens the expected
    distinct experts reached is sum_e 1 - (1 - p_e)^tokens, concave in p_e, so at most its value at p_e = k/E
    (Jensen): ``local_experts·(1 - (1 - k/E)^tokens)`` is an upper bound for a device's share, exact under uniform
    routing, for any router on the average device (a hot device may exceed it). It is >= the with-replacement form
    E_l·(1 - (1 - 1/E)^(tokens·k)), since (1 - 1/E)^k >= 1 - k/E. Rows: tokens·k·E_l/E on the average device;
    idle: ``idle_probability``."""
    if tokens < 0 or not 0 < top_k <= num_experts or not 0 < local_experts <= num_experts:
        raise ValueError(f"expected_load needs tokens >= 0 and 0 < top_k, local_experts <= num_experts; got "
                         f"{tokens}, {top_k}, {local_experts}, {num_experts}")
    return {"rows": tokens * top_k * local_experts / num_experts,
            "groups": local_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens),
            "idle": idle_probability(tokens, top_k, num_experts, local_experts)}


def idle_probability(tokens: float, top_k: int, num_experts: int, local_experts: int) -> float:
    """P(no token picks any of a device's ``local_experts``) when ``tokens`` tokens each pick ``top_k`` distinct
    experts uniformly: (C(E - El, k) / C(E, k))^tokens (what a grid that visits max(selected, 1) experts pays for)."""
    if num_experts - local_experts < top_k:
        return 0.0
    one = math.prod((num_experts - local_experts - i) / (num_experts - i) for i in range(top_k))
    return one ** tokens


def rows_ffn_cost(rows: int, P: int, F: int, itemsize: int, experts: float, tiles: float, chunk: int,
                  f_blocks: int) -> dict:
    """{"flops", "bytes_accessed"} of the small-batch routed FFN (rows.py) over ``experts`` visited experts and
    ``tiles`` chunks of ``chunk`` rows: each visited expert's w1, w3, w2 (packed and scales: 3·F·P·17/32 bytes), rank
    and gate columns read once, the table of ``rows`` rows read once, the fp32 output written once; each chunk's three
    matmuls, its gathers from the table (once per F block, ``f_blocks``) and its combine into the output."""
    per_expert = 3 * F * (P // 2 + P // BLOCK_SIZE) + rows * 8
    flops = tiles * chunk * (6 * F * P + 2 * rows * P * (f_blocks + 1))
    return {"flops": int(math.ceil(flops)),
            "bytes_accessed": int(math.ceil(experts * per_expert + rows * P * (itemsize + 4)))}


def expected_tiles(rows: float, groups: float, bm: int) -> float:
    """An upper bound on the expected used row tiles for ``rows`` expected rows over ``groups`` expected non-empty
    groups: a group of n >= 1 rows takes ceil(n/bm) <= 1 + (n - 1)/bm tiles, so sum_g ceil(n_g/bm) <= D·(1 - 1/bm) +
    rows/bm for D non-empty groups; linear in D and rows, so it holds for their expectations (and an upper bound
    on E[D] keeps it one)."""
    return groups * (1.0 - 1.0 / bm) + rows / bm


def charged_cost(fn, schedule: str, tiles: int, expected: float | None, bm: int, bn: int, bk: int, N: int, K: int,
                 itemsize: int, *, static_grid: bool = False, resident_groups: int | None = None) -> dict:
    """The integer {"flops", "bytes_accessed"} a kernel's estimate carries: ``fn`` (``gmm_cost`` / ``gmm_t_cost``)
    over all ``tiles`` static tiles when ``expected`` is None, else over u = min(expected, tiles - 1) used tiles (the
    last static tile is never used), plus on the TPU schedule what unused tiles cost. The dynamic grid
    (``kernel.visited_tiles``) visits one tile only when none is used (one block of each input, its output written):
    E[bytes] = E[used]·per tile + P(none used)·that visit <= this. The static grid (``static_grid``, the megacore
    one, ``kernel.static_tpu_grid``) visits every unused tile: they fetch one block of each input between them
    (per core: <= this plus one block per extra core) and each writes its output block, (tiles - u) of them.
    ``resident_groups``: the call's G experts when each stays resident (TPU, ``kernel.resident_weights``): the used
    tiles come grouped by expert, so an expert's weights are read once per run of its tiles, at most min(G, used
    tiles) runs, plus one read for the unused tiles' block and (static grid) one where the megacore's second core
    starts inside a run."""
    fetch = None
    if resident_groups is not None:
        n = tiles if expected is None else min(max(expected, 0.0), tiles - 1)
        fetch = min(resident_groups, n) + (2 if static_grid else 1)
    if expected is None:
        c = fn(schedule, tiles, bm, bn, bk, N, K, itemsize, weight_fetches=fetch)
    else:
        used = min(max(expected, 0.0), tiles - 1)
        c = fn(schedule, used, bm, bn, bk, N, K, itemsize, weight_fetches=fetch)
        if schedule == "tpu":
            weight_block = 0 if fetch is not None else bn * bk // 2 + bn * K // BLOCK_SIZE
            rows_in, rows_out = (bm * bn, bm * K) if fn is gmm_t_cost else (bm * K, bm * N)
            writes = tiles - used if static_grid else 1
            extra = weight_block + (rows_in + writes * rows_out) * itemsize
            c = {**c, "bytes_accessed": c["bytes_accessed"] + extra}
    return {k: int(math.ceil(v)) for k, v in c.items()}


def _check(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


__all__ = ["SCHEDULES", "charged_cost", "expected_load", "expected_tiles", "gmm_cost", "gmm_t_cost", "idle_probability",
           "rows_ffn_cost"]
