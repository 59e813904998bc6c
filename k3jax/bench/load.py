"""`k3 bench load` — checkpoint load throughput vs a raw sequential read of the same files, peak RSS, bytes read.

For each checkpoint (k3-mini, and a larger synthetic K3-shaped one unless --quick) the benchmark writes random
params with ``save``, then in a fresh process with 8 simulated CPU devices:
  1. reads every shard file sequentially once to warm the page cache, then times a second raw read (16 MiB chunks);
  2. times ``load`` onto a 1-D "expert" mesh of the 8 devices (experts split, the rest replicated).
Both run in the same process with a warm page cache, so ``throughput_vs_raw_read`` = load B/s ÷ raw B/s isolates
our overhead (header parsing, validation, dequantization, device_put). ``peak_rss_over_largest_tensor`` = (peak RSS
− RSS before loading) ÷ bytes of the largest leaf: the streaming bound SPEC §14.5 asks for (≈2 expected on CPU).

    k3 bench load --json
    k3 bench load --quick --json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="k3-mini only, one repeat")
    p.add_argument("--repeats", type=int, default=2)


def _configs(quick: bool):
    from k3jax.config import get_preset

    mini = get_preset("k3-mini")
    if quick:
        return [("k3-mini", mini)]
    # ~4x the k3-mini payload: wider experts and more of them, same structure
    big = mini.replace(name="k3-mini-wide", num_experts=64, moe_intermediate_size=320, routed_expert_hidden_size=256)
    return [("k3-mini", mini), ("k3-mini-wide", big)]


def _write(cfg, d: str) -> None:
    import jax
    import numpy as np

    from k3jax.checkpoint.save import save
    from k3jax.model import abstract_params

    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype), abstract_params(cfg))
    save(params, cfg, d)


def _child(d: str, repeats: int) -> dict:
    """Runs in a fresh process (8 CPU devices): raw read vs load, same page-cache state."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from k3jax.checkpoint.load import current_rss_bytes, load, peak_rss_bytes

    files = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(f) for f in files)

    def raw_read() -> float:
        t = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.read(16 << 20):
                    pass
        return time.perf_counter() - t

    raw_read()  # warm the page cache
    raw_s = min(raw_read() for _ in range(repeats))
    mesh = Mesh(np.array(jax.devices()), ("expert",))
    rss0 = current_rss_bytes()
    times, stats = [], {}
    for _ in range(repeats):
        stats = {}
        t = time.perf_counter()
        _, params = load(d, mesh=mesh, progress=False, stats=stats)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t)
        del params
    load_s = min(times)
    return {"file_bytes": size, "payload_bytes": stats["checkpoint_bytes"], "raw_read_s": raw_s, "load_s": load_s,
            "raw_read_GBps": size / raw_s / 1e9, "load_GBps": size / load_s / 1e9,
            "bytes_read_per_process": stats["bytes_read"], "largest_leaf_bytes": stats["largest_leaf_bytes"],
            "peak_rss_bytes": peak_rss_bytes(), "rss_before_load_bytes": rss0, "devices": len(jax.devices())}


def run(args) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="k3bench-load-") as tmp:
        for name, cfg in _configs(args.quick):
            d = os.path.join(tmp, name)
            _write(cfg, d)
            env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
            out = subprocess.run([sys.executable, "-m", "k3jax.bench.load", "--child", d,
                                  str(1 if args.quick else args.repeats)],
                                 capture_output=True, text=True, env=env, timeout=900)
            if out.returncode:
                raise RuntimeError(f"load benchmark child failed for {name}:\n{out.stderr[-3000:]}")
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    key = list(results)[-1]  # the largest checkpoint sets the headline ratios
    r = results[key]
    return {
        "name": "load",
        "checkpoint": key,
        "results": results,
        "ratios": {
            "throughput_vs_raw_read": r["load_GBps"] / r["raw_read_GBps"],
            "peak_rss_over_largest_tensor": (r["peak_rss_bytes"] - r["rss_before_load_bytes"])
            / r["largest_leaf_bytes"],
        },
    }


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], int(sys.argv[3]))))
