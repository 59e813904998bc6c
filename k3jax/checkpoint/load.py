"""Streaming, sharded load of an official-layout checkpoint into the k3jax params tree (docs/checkpoint.md §11.8).

    cfg, params = load("ckpt/")                                  # experts on the "expert" axis over all devices
    cfg, params = load("ckpt/", mesh=mesh, keep_experts_packed=True)
    cfg, params = load(shipped_checkpoint())                     # the trained k3-mini shipped with the package

1. ``open_checkpoint`` (io.py, container.py) parses the index and every text shard header; ``plan_load`` (plan.py)
   checks every name, shape and dtype against the name map for the config — before any data byte is read. Vision
   shards are skipped.
2. Each leaf becomes one ``jax.make_array_from_callback``. The callback (``LeafSource``, leaves.py) runs once per
   addressable device, replicas included, so results are memoized per device index; it reads only the byte ranges
   its index needs. Routed-expert stacks are separate per-expert tensors on disk, so a device holding experts
   [a, b) reads only those experts.
3. Leaves are built one after another and host copies dropped, so host memory stays near the largest leaf. Bytes
   are read with ``os.preadv`` straight into the output buffer (packed experts, same-dtype tensors) or into one
   reused scratch buffer that feeds a transpose (linear weights: torch [out, in] -> [in, out]), which runs as one XLA
   program on the host CPU (3.2 GB/s end to end on the CI CPU, into new memory; numpy's strided copies: 0.95 GB/s;
   host.py).
4. MXFP4 experts are dequantized on the host shard after reading (exact, numpy: ``k3jax.quant.host``), or kept
   packed: with ``keep_experts_packed=True`` the experts dict of each MoE layer holds ``w{1,2,3}_packed`` uint8
   [E, out, in/2] and ``w{1,2,3}_scale`` uint8 [E, out, in/32] (torch orientation, as on disk) instead of
   ``w{1,2,3}``.

Default shardings: routed-expert stacks split on the mesh axis "expert" (when it divides the expert count), every
other leaf replicated. ``shardings`` may be a callable ``(path, shape, dtype) -> Sharding`` or a tree shaped like the
result. ``verify=True`` checks every shard's sha256 against ``SHA256SUMS`` when that manifest is present.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from k3jax.checkpoint.container import verify_manifest
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.host import Scratch, current_rss_bytes, hwm_rss_bytes, peak_rss_bytes, reset_peak_rss
from k3jax.checkpoint.io import Checkpoint, open_checkpoint
from k3jax.checkpoint.leaves import (
    LeafSource,
    StackedSource,
    default_mesh,
    default_sharding,
    output_leaves,
    source_path,
)
from k3jax.checkpoint.plan import Plan, plan_load
from k3jax.config import RunConfig, architecture_diff, from_hf
from k3jax.model import abstract_params
from k3jax.pytree import get_path, set_path


def _resolve_config(path: str, cfg, strict: bool):
    """(cfg, report): ``config.json``'s config, or ``cfg`` checked against it."""
    cfg_file = os.path.join(path, "config.json")
    report: dict = {}
    if cfg is None:
        if not os.path.exists(cfg_file):
            raise CheckpointError("no config.json and no cfg given", file=path)
        cfg = from_hf(cfg_file, strict=strict, report=report)
    elif os.path.exists(cfg_file):
        diff = architecture_diff(from_hf(cfg_file, strict=strict, report=report), cfg)
        if diff:
            raise CheckpointError(f"config.json differs from the given cfg in {', '.join(diff)}", file=cfg_file)
    return cfg, report


def _sharding_fn(shardings, mesh: Mesh):
    """``(path, shape, dtype, kind, stacked) -> Sharding`` from the ``shardings`` argument (None, callable or tree)."""
    def sharding_of(opath, shape, ldtype, kind, stacked):
        if shardings is None:
            return default_sharding(mesh, kind, shape, stacked)
        if callable(shardings):
            return shardings(opath, shape, ldtype)
        return get_path(shardings, opath)
    return sharding_of


def _release_schedule(plan: Plan, src_rows: list[list[tuple]]) -> dict[int, list[str]]:
    """``{leaf number: files no later leaf reads}``: each file is closed right after its last leaf (mapped pages
    count in RSS)."""
    last_use = {e.file: i for i, rows in enumerate(src_rows) for p in rows for _, e in plan.leaves[p]}
    done_after: dict[int, list[str]] = {}
    for f, i in last_use.items():
        done_after.setdefault(i, []).append(f)
    return done_after


def _progress_bar(progress: bool | None, total: int):
    if not (progress if progress is not None else sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="load", file=sys.stderr)


@dataclass
class _Built:
    """What building the leaves measured: seconds reading + decoding and making arrays, the largest leaf's bytes,
    the largest per-leaf RSS rise (None unless tracked)."""

    read_decode: float = 0.0
    make_arrays: float = 0.0
    largest: int = 0
    leaf_peak: int | None = None


def _build_leaves(ck: Checkpoint, plan: Plan, leaves: list, sharding_of, bar, track: bool) -> tuple[dict, _Built]:
    """Every leaf as a jax array, one after another, in the params tree; host copies dropped after each leaf.

    Reading happens here, in the calling thread, one leaf at a time. A 1-2 thread pool that prepared leaves ahead
    was measured 1.4-1.9x SLOWER on the 2-core CI machine (GIL hand-offs between the many short Python steps of
    the reads and of array creation), so it is not used."""
    params: dict = {}
    built = _Built()
    src_rows = [[source_path(r, leaf.kind) for r in leaf.rows] for leaf in leaves]
    done_after = _release_schedule(plan, src_rows)
    scratch = Scratch()
    for li, (opath, shape, ldtype, kind, _, stacked) in enumerate(leaves):
        before = ck.bytes_read
        if track:
            rss_before = current_rss_bytes()
            reset_peak_rss()
        t = time.perf_counter()
        sh = sharding_of(opath, shape, ldtype, kind, stacked)
        if stacked:
            src = StackedSource([LeafSource(ck, plan, r, shape[1:], ldtype, kind, scratch) for r in src_rows[li]])
        else:
            src = LeafSource(ck, plan, src_rows[li][0], shape, ldtype, kind, scratch)
        for index in sh.addressable_devices_indices_map(shape).values():
            src(index)  # read + decode every addressable index into the cache
        t1 = time.perf_counter()
        arr = jax.make_array_from_callback(shape, sh, src)
        built.read_decode += t1 - t
        built.make_arrays += time.perf_counter() - t1
        src.cache.clear()  # drop host copies before the next leaf (on CPU the array now owns its buffers)
        del src
        for f in done_after.get(li, ()):  # close files no later leaf reads (mapped pages count in RSS)
            ck.release(f)
        if track:
            built.leaf_peak = max(built.leaf_peak or 0, hwm_rss_bytes() - rss_before)
        params = set_path(params, opath, arr)  # nested dicts, int keys for layer lists
        built.largest = max(built.largest, math.prod(shape) * np.dtype(ldtype).itemsize)
        if bar is not None:
            bar.update(ck.bytes_read - before)
            bar.set_postfix(rss=f"{current_rss_bytes() / 2**20:.0f}MiB", refresh=False)
    return params, built


def load(path, *, cfg=None, mesh: Mesh | None = None, shardings=None, dtype=None, keep_experts_packed: bool = False,
         verify: bool = False, layout: str | None = None, progress: bool | None = None, stats: dict | None = None,
         track_rss: bool = False, strict_config: bool = False):
    """Load a checkpoint directory into sharded jax arrays.

    Args:
      path: checkpoint directory (index + shards + config.json).
      cfg: config to load for; defaults to ``config.json``. If both exist their architectures must agree.
      mesh: device mesh; default ``make_mesh({"expert": jax.device_count()})`` (all devices on "expert").
      shardings: callable ``(path, shape, dtype) -> Sharding`` or a tree like the result; default: experts on
        "expert", the rest replicated.
      dtype: parameter dtype (float32 by default); leaves the release stores F32 stay at least float32.
      keep_experts_packed: return MXFP4 experts as ``w*_packed`` / ``w*_scale`` uint8 leaves (see module doc).
      verify: check shard sha256 against ``SHA256SUMS`` when present.
      progress: tqdm bar with bytes/s and RSS (default: when stderr is a terminal).
      stats: optional dict filled with bytes_read, seconds, a ``breakdown`` of seconds per phase, scale byte counts,
        peak RSS, largest leaf bytes.
      track_rss: with ``stats``, also record ``leaf_peak_rss_bytes``: the largest RSS rise while building one leaf
        (kernel high-water mark, reset per leaf, minus the RSS before that leaf) — host memory the load needs on top
        of what it has already loaded. Costs a few /proc reads per leaf, so off by default.
      strict_config: unknown keys in ``config.json`` are errors instead of one warning.
    Other writers' forms are accepted and converted (docs/model.md §2.1, docs/checkpoint.md §11): floating tensors in
    another float dtype are cast, ``A_log`` in any vector form with an exactly-zero tail, a dense MLP under transformers
    5's ``block_sparse_moe.{gate,up,down}_proj`` names; ``stats["tolerated"]`` says what was.
    Returns: (cfg, params).
    """
    t0 = time.perf_counter()
    bd: dict[str, float] = {}
    path = os.fspath(path)
    ck = open_checkpoint(path)
    t1 = time.perf_counter()
    bd["open_headers"] = t1 - t0
    cfg, cfg_report = _resolve_config(path, cfg, strict_config)
    t2 = time.perf_counter()
    bd["config"] = t2 - t1
    plan = plan_load(ck, cfg, layout)  # everything checked before any data is read
    t3 = time.perf_counter()
    bd["validate"] = t3 - t2
    if verify:
        verify_manifest(path)
    mesh = mesh if mesh is not None else default_mesh()

    abstract = abstract_params(cfg, RunConfig(param_dtype=np.dtype(dtype or "float32").name))  # cached per config
    t4 = time.perf_counter()
    bd["abstract_tree"] = t4 - t3
    leaves = output_leaves(plan, abstract, keep_experts_packed, cfg)
    # A_log leaves first (a few hundred bytes per layer): a non-zero padding tail then fails before any large tensor
    # is read. The order in which leaves are built does not change the result.
    leaves.sort(key=lambda leaf: leaf.path[-1] != "A_log")
    bd["plan_leaves"] = time.perf_counter() - t4

    total = sum(e.nbytes for e in ck.tensors.values())
    bar = _progress_bar(progress, total)
    track = track_rss and stats is not None and reset_peak_rss()
    read0 = ck.bytes_read
    params, built = _build_leaves(ck, plan, leaves, _sharding_fn(shardings, mesh), bar, track)
    if bar is not None:
        bar.close()
    ck.close()
    bd["read_decode"] = built.read_decode
    bd["make_arrays"] = built.make_arrays
    if stats is not None:
        seconds = time.perf_counter() - t0
        bd["other"] = seconds - sum(bd.values())
        stats.update(bytes_read=ck.bytes_read - read0, seconds=seconds, breakdown=bd,
                     tolerated=plan.tolerated(cfg_report),
                     scale_bytes=dict(ck.scale_bytes), peak_rss=peak_rss_bytes(), largest_leaf_bytes=built.largest,
                     checkpoint_bytes=total, packed_modules=len(ck.packed_modules()), leaves=len(leaves))
        if built.leaf_peak is not None:
            stats["leaf_peak_rss_bytes"] = built.leaf_peak
    return cfg, params


def shipped_checkpoint() -> str | None:
    """The directory of the trained k3-mini shipped with the package (``k3jax/assets/k3-mini-stdlib``: byte-level,
    the model `k3 run` evaluates), or None in an install without it."""
    p = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "k3-mini-stdlib")
    return p if os.path.exists(os.path.join(p, "config.json")) else None


__all__ = ["load", "shipped_checkpoint"]
