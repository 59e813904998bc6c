"""Micro-benchmarks behind the checkpoint-load LOG entry: where bytes can move at what speed on this machine.

    python experiments/load_microbench.py FILE        # any large file (e.g. one shard), read from a warm page cache

Prints GB/s for: preadv into a reused buffer vs into newly allocated memory (numpy, anonymous mmap with
MADV_HUGEPAGE, MAP_POPULATE), and a [4096, 1024] BF16 transpose by numpy's tiled copies (``copy_T``) vs one XLA
program on the host CPU (``host_transpose``). Best of 5 after one warm-up.
"""

from __future__ import annotations

import mmap
import os
import sys
import time

import ml_dtypes
import numpy as np


def best(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(path: str) -> None:
    from k3jax.checkpoint.host import aligned_empty, copy_T, host_transpose

    n = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    warm = aligned_empty((n,), np.uint8)

    def anon(flags, advice=None):
        def run():
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
            if advice is not None:
                m.madvise(advice)
            b = np.frombuffer(m, np.uint8)
            os.preadv(fd, [memoryview(b)], 0)
            del b
            m.close()
        return run

    rows = {
        "preadv into a reused buffer": lambda: os.preadv(fd, [memoryview(warm)], 0),
        "preadv into new memory (numpy)": lambda: os.preadv(fd, [memoryview(aligned_empty((n,), np.uint8))], 0),
        "preadv into new memory (mmap, MADV_HUGEPAGE)": anon(0, getattr(mmap, "MADV_HUGEPAGE", None)),
        "preadv into new memory (mmap, MAP_POPULATE)": anon(getattr(mmap, "MAP_POPULATE", 0)),
    }
    print(f"{path}: {n / 1e6:.1f} MB")
    for name, fn in rows.items():
        print(f"  {name:46s} {n / best(fn) / 1e9:6.2f} GB/s")
    R, C = 4096, 1024
    src = np.random.default_rng(0).standard_normal((R, C)).astype(ml_dtypes.bfloat16)
    dst = aligned_empty((C, R), ml_dtypes.bfloat16)
    t = best(lambda: copy_T(dst, src))
    print(f"  {'BF16 [4096, 1024] transpose, numpy copy_T':46s} {src.nbytes / t / 1e9:6.2f} GB/s")
    print(f"  {'BF16 [4096, 1024] transpose, host_transpose':46s} "
          f"{src.nbytes / best(lambda: host_transpose(src, src.dtype)) / 1e9:6.2f} GB/s")
    with open("/proc/meminfo") as f:
        print("  " + next((line.strip() for line in f if line.startswith("AnonHugePages")), "AnonHugePages: n/a"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
