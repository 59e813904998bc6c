"""Where `kda_chunked`'s forward time goes on XLA:CPU: a `jax.profiler` trace, summed per thunk and per category.

    python experiments/kda_profile.py [--seq 4096] [--chunks-per-group 4] [--top 25]

Runs the `k3 bench kda` inputs (H = 4, K = V = 128, safe gate lb = -5), traces three warm calls and prints the
slowest XLA thunks (fusion names as XLA emits them; `ynn_fusion` / `dot` are matmuls) and totals by kind.
Thunks may overlap on the two cores, so totals can exceed the wall time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import tempfile

import jax


def main() -> None:
    from k3jax.bench.kda import _inputs
    from k3jax.ops import kda

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--chunks-per-group", type=int, default=4)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    x = _inputs(jax.random.PRNGKey(0), 1, args.seq, 4, 128, 128)
    fn = jax.jit(lambda *a: kda.kda_chunked(*a, chunk_size=64, gate_lower_bound=-5.0,
                                            chunks_per_group=args.chunks_per_group))
    jax.block_until_ready(fn(*x))
    reps = 3
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(reps):
            jax.block_until_ready(fn(*x))
        jax.profiler.stop_trace()
        events = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[-1]))["traceEvents"]
    per, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(("ThunkExecutor", "$", "Slinky")):
            per[e["name"]] += e["dur"] / reps / 1e3
            count[e["name"]] += 1
    kinds = collections.Counter()
    for name, ms in per.items():
        kind = ("while loop (contains others)" if name.startswith("while") else
                "matmul" if name.startswith(("ynn", "dot")) else
                "exp fusion" if "exponential" in name else
                "concatenate" if "concatenate" in name else
                "copy / transpose" if "transpose" in name or "copy" in name else
                "dynamic slice / update" if "dynamic" in name else "other elementwise")
        kinds[kind] += ms
    print(f"T = {args.seq}, chunks_per_group = {args.chunks_per_group}: ms per call")
    for name, ms in per.most_common(args.top):
        print(f"  {ms:7.2f}  x{count[name] // reps:<4d} {name}")
    for kind, ms in kinds.most_common():
        print(f"  {ms:7.2f}  {kind}")


if __name__ == "__main__":
    main()
