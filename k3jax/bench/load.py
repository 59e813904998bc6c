"""`k3 bench load` — checkpoint load throughput vs a raw sequential read of the same files, peak RSS, bytes read.

For each checkpoint (k3-mini or --preset, and unless --quick a larger synthetic one closer to K3's I/O profile) the
benchmark writes random params with ``save``, then in a fresh process with 8 simulated CPU devices:
  1. reads every shard file sequentially once to warm the page cache, then times a second raw read (16 MiB chunks);
  2. loads once per mode untimed (``first_load_s``: jax runtime init, the abstract-tree trace and the transpose
     programs, all cached per process), then times ``load`` onto ``make_mesh({"expert": 8})`` (experts split, the
     rest replicated; best of ``--repeats``) in two modes:
       as_stored  ``load(dtype="bfloat16", keep_experts_packed=True)``: every tensor in its on-disk representation
                  (BF16 dense tensors transposed to k3jax's [in, out], MXFP4 experts packed) — the load itself;
       float32    ``load()`` with the preset's defaults: float32 params and MXFP4 experts dequantized on the host,
                  which writes ~2x (BF16) to ~7.5x (MXFP4) the file bytes;
  3. measures memory in fresh processes (malloc set to return large blocks to the OS, so RSS follows live memory),
     one per mode: a warm-up load, a baseline RSS, then one load with per-leaf high-water tracking.
Raw read and loads run in the same process with a warm page cache, so ``throughput_vs_raw_read`` (as_stored) and
``throughput_vs_raw_read_float32`` = raw read time ÷ load time isolate our overhead (headers, validation,
transposes, dequantization, array creation); ``*_breakdown`` gives the seconds per phase of each best timed load.
The raw read reuses one 16 MiB buffer (glibc hands the freed chunk back), so it never touches new memory; a load's
outputs must live in new memory, whose pages the kernel zero-fills on first touch. ``fresh_buffer_read`` times the
same reads into a new buffer per file, and ``throughput_vs_fresh_buffer_read`` compares the as_stored load with it.

``peak_rss_over_largest_tensor`` = ``leaf_peak_rss_bytes`` ÷ bytes of the largest leaf (the larger of the two
modes), where ``leaf_peak_rss_bytes``
is the largest rise of the kernel's RSS high-water mark while building one leaf, over the RSS just before that leaf
(high-water mark reset per leaf via /proc/self/clear_refs). On the CPU backend the loaded arrays live in host
memory, so the whole-load rise (``load_peak_rss_increase_bytes``) necessarily contains the result itself
(``result_rss_bytes``, RSS after minus before with the params alive); the per-leaf figure is the host memory the
load needs on top of what it has already loaded — the streaming bound of docs/numerics.md §14.5 (the leaf's own output
counts as 1×, so ≤ 2 means temporaries of at most one leaf). Where clear_refs is unavailable the whole-load rise is
used.

    k3 bench load --json
    k3 bench load --quick --json
    k3 bench load --quick --preset k3-tiny --json     # the test's size

``ratios``: ``throughput_vs_raw_read``, ``throughput_vs_raw_read_float32``, ``throughput_vs_fresh_buffer_read``,
``peak_rss_over_largest_tensor`` (of the largest checkpoint). ``float32_result_unique_bytes`` is 4 bytes per
parameter (``k3jax.model.count_params``) and ``bytes_read_per_process`` is the payload read once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from k3jax.checkpoint.host import aligned_empty, current_rss_bytes, hwm_rss_bytes, reset_peak_rss
from k3jax.checkpoint.load import load
from k3jax.checkpoint.save import save
from k3jax.config import get_preset
from k3jax.model import abstract_params
from k3jax.sharding.mesh import make_mesh

# The on-disk representation: BF16 dense tensors (transposed to k3jax's [in, out]) and packed MXFP4 experts.
AS_STORED = {"dtype": "bfloat16", "keep_experts_packed": True}


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="the small checkpoint only, one repeat")
    p.add_argument("--preset", default="k3-mini", help="the small checkpoint's preset (default k3-mini)")
    p.add_argument("--repeats", type=int, default=2)


def _configs(quick: bool, preset: str = "k3-mini"):
    small = get_preset(preset)
    if quick:
        return [(preset, small)]
    mini = get_preset("k3-mini")
    # Closer to K3's I/O profile than k3-mini (0.9 GB vs 37 MB): routed experts 64% of the file bytes (K3: 93%,
    # k3-mini: 34%) and each expert matrix a 1.4 MB MXFP4 tensor (K3: 5.5 MB, k3-mini: 15 KB) — per-tensor costs
    # (syscalls, Python, array creation) weigh on k3-mini's tiny tensors far more than on the release's.
    big = mini.replace(name="k3-io-synthetic", hidden_size=1024, kda_num_heads=8, kda_head_dim=128, mla_num_heads=8,
                       q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                       intermediate_size=2048, num_experts=16, num_experts_per_token=4, moe_intermediate_size=1536,
                       routed_expert_hidden_size=1792)
    return [(preset, small), ("k3-io-synthetic", big)]


def _write(cfg, d: str) -> None:
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype), abstract_params(cfg))
    save(params, cfg, d)


def _child(d: str, repeats: int) -> dict:
    """Runs in a fresh process (8 CPU devices): raw read vs load, same page-cache state."""
    import gc

    import jax
    import numpy as np

    files = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(f) for f in files)

    def raw_read() -> float:
        t = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.read(16 << 20):
                    pass
        return time.perf_counter() - t

    def fresh_read() -> float:
        """The same reads into newly allocated buffers (one per file), as any loader's outputs must be: the kernel
        zero-fills each new page on first touch, a write pass the reused-buffer raw read does not pay."""
        t = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                buf = memoryview(aligned_empty((os.path.getsize(f),), np.uint8))
                pos = 0
                while n := fh.readinto(buf[pos:pos + (16 << 20)]):
                    pos += n
                del buf
        return time.perf_counter() - t

    raw_read()  # warm the page cache
    raw_s = min(raw_read() for _ in range(repeats))
    fresh_s = min(fresh_read() for _ in range(repeats))
    mesh = make_mesh({"expert": jax.device_count()})

    def timed(**kw) -> tuple[float, dict]:
        stats = {}
        t = time.perf_counter()
        _, params = load(d, mesh=mesh, progress=False, stats=stats, **kw)
        jax.block_until_ready(params)
        dt = time.perf_counter() - t
        del params
        gc.collect()
        return dt, stats

    first_s, _ = timed(**AS_STORED)  # cold: jax runtime init, abstract tree trace, transpose programs (cached)
    timed()
    runs = [timed(**AS_STORED) for _ in range(repeats)]
    stored_s, stats = min(runs, key=lambda r: r[0])
    f32_runs = [timed() for _ in range(repeats)]
    f32_s, f32_stats = min(f32_runs, key=lambda r: r[0])

    return {"file_bytes": size, "payload_bytes": stats["checkpoint_bytes"], "raw_read_s": raw_s,
            "raw_read_GBps": size / raw_s / 1e9, "fresh_buffer_read_s": fresh_s,
            "fresh_buffer_read_GBps": size / fresh_s / 1e9, "first_load_s": first_s,
            "as_stored_load_s": stored_s, "as_stored_GBps": size / stored_s / 1e9,
            "as_stored_breakdown": {k: round(v, 4) for k, v in stats["breakdown"].items()},
            "float32_load_s": f32_s, "float32_GBps": size / f32_s / 1e9,
            "float32_breakdown": {k: round(v, 4) for k, v in f32_stats["breakdown"].items()},
            "leaves_as_stored": stats["leaves"], "leaves_float32": f32_stats["leaves"],
            "bytes_read_per_process": stats["bytes_read"], "largest_leaf_bytes": stats["largest_leaf_bytes"],
            "devices": len(jax.devices())}


def _child_mem(d: str, mode: str) -> dict:
    """Runs in a fresh process whose malloc returns large blocks to the OS on free (``MALLOC_MMAP_THRESHOLD_``), so
    RSS follows live memory: one warm-up load, baseline, then one load with per-leaf high-water tracking."""
    import gc

    import jax

    mesh = make_mesh({"expert": jax.device_count()})
    kw = AS_STORED if mode == "as_stored" else {}
    _, params = load(d, mesh=mesh, progress=False, **kw)  # warm-up: jax runtime, abstract tree
    jax.block_until_ready(params)
    del params
    gc.collect()
    rss0 = current_rss_bytes()
    hwm_ok = reset_peak_rss()
    stats = {}
    _, params = load(d, mesh=mesh, progress=False, stats=stats, track_rss=True, **kw)
    jax.block_until_ready(params)
    hwm = hwm_rss_bytes()
    rss1 = current_rss_bytes()
    host = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    unique = sum(x.nbytes for x in jax.tree.leaves(params))  # replicas share one aliased host buffer
    del params
    return {f"{mode}_{k}": v for k, v in {
        "rss_before_load_bytes": rss0, "load_peak_rss_increase_bytes": (hwm - rss0) if hwm_ok else None,
        "result_rss_bytes": rss1 - rss0, "result_unique_bytes": unique, "result_all_shards_bytes": host,
        "leaf_peak_rss_bytes": stats.get("leaf_peak_rss_bytes"), "largest_leaf_bytes": stats["largest_leaf_bytes"],
    }.items()}


def run(args) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="k3bench-load-") as tmp:
        for name, cfg in _configs(args.quick, getattr(args, "preset", "k3-mini")):
            d = os.path.join(tmp, name)
            _write(cfg, d)
            env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
            res = {}
            mem_env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
            for mode, extra, xenv in (("--child", [str(1 if args.quick else args.repeats)], {}),
                                      ("--child-mem", ["as_stored"], mem_env), ("--child-mem", ["float32"], mem_env)):
                out = subprocess.run([sys.executable, "-m", "k3jax.bench.load", mode, d, *extra],
                                     capture_output=True, text=True, env=dict(env, **xenv), timeout=900)
                if out.returncode:
                    raise RuntimeError(f"load benchmark child {mode} failed for {name}:\n{out.stderr[-3000:]}")
                res.update(json.loads(out.stdout.strip().splitlines()[-1]))
            results[name] = res
    key = list(results)[-1]  # the largest checkpoint sets the headline ratios
    r = results[key]

    def rss_ratio(mode):
        peak = r[f"{mode}_leaf_peak_rss_bytes"]
        peak = peak if peak is not None else (r[f"{mode}_load_peak_rss_increase_bytes"] or 0)
        return peak / r[f"{mode}_largest_leaf_bytes"]

    return {
        "name": "load",
        "checkpoint": key,
        "modes": {"as_stored": "load(dtype='bfloat16', keep_experts_packed=True): tensors as on disk (BF16 dense "
                               "transposed to [in, out], MXFP4 experts packed)",
                  "float32": "load() defaults for the preset: float32 params, MXFP4 experts dequantized"},
        "results": results,
        "ratios": {
            "throughput_vs_raw_read": r["raw_read_s"] / r["as_stored_load_s"],
            "throughput_vs_raw_read_float32": r["raw_read_s"] / r["float32_load_s"],
            "throughput_vs_fresh_buffer_read": r["fresh_buffer_read_s"] / r["as_stored_load_s"],
            "peak_rss_over_largest_tensor": max(rss_ratio("as_stored"), rss_ratio("float32")),
        },
    }


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], int(sys.argv[3]))))
    elif len(sys.argv) == 4 and sys.argv[1] == "--child-mem":
        print(json.dumps(_child_mem(sys.argv[2], sys.argv[3])))
