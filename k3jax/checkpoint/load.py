"""Streaming, sharded load of an official-layout checkpoint into the k3jax params tree (SPEC §11.8).

    cfg, params = load("ckpt/")                                  # 1-D "expert" mesh over all devices
    cfg, params = load("ckpt/", mesh=mesh, keep_experts_packed=True)

1. ``open_checkpoint`` parses the index and every text shard header; ``validate`` checks every name, shape and dtype
   against the name map for the config — before any data byte is read. Vision shards are skipped.
2. Each leaf becomes one ``jax.make_array_from_callback``. The callback runs once per addressable device, replicas
   included, so results are memoized per device index; it reads only the byte ranges its index needs. Routed-expert
   stacks are separate per-expert tensors on disk, so a device holding experts [a, b) reads only those experts.
3. Leaves are built one after another and host copies dropped, so host memory stays near the largest leaf.
4. MXFP4 experts are dequantized on the host shard after reading (exact, numpy), or kept packed: with
   ``keep_experts_packed=True`` the experts dict of each MoE layer holds ``w{1,2,3}_packed`` uint8 [E, out, in/2]
   and ``w{1,2,3}_scale`` uint8 [E, out, in/32] (torch orientation, as on disk) instead of ``w{1,2,3}``.

Default shardings: routed-expert stacks split on the mesh axis "expert" (when it divides the expert count), every
other leaf replicated. ``shardings`` may be a callable ``(path, shape, dtype) -> Sharding`` or a tree shaped like the
result. ``verify=True`` checks every shard's sha256 against ``SHA256SUMS`` when that manifest is present.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.reader import Checkpoint, Plan, open_checkpoint, validate
from k3jax.checkpoint.save import MANIFEST_NAME, architecture, sha256_file

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def mxfp4_dequantize_np(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Exact host dequantization: packed uint8 [..., n/2] + scale uint8 [..., n/32] → float32 [..., n].

    Low nibble = even column (compressed-tensors). Scale byte b means 2^(b-127); numpy keeps float32 subnormals, so
    this is exact for every byte but 0xFF (NaN, rejected by the reader before we get here).
    """
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    vals = E2M1_VALUES[codes]
    s = np.ldexp(np.float32(1), scale.astype(np.int32) - 127).astype(np.float32)
    G = scale.shape[-1]
    return (vals.reshape(*vals.shape[:-1], G, -1) * s[..., None]).reshape(vals.shape)


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


# --------------------------------------------------------------------------------------------- leaf readers

def _norm_index(index, shape) -> tuple:
    return tuple((s.indices(n)[:2]) if isinstance(s, slice) else (s, s + 1) for s, n in zip(index, shape,
                                                                                            strict=False))


class LeafSource:
    """Reads the host values of one output leaf, for any device index; memoized per index."""

    def __init__(self, ck: Checkpoint, plan: Plan, path: tuple, shape: tuple, dtype, kind: str):
        self.ck, self.path, self.shape, self.dtype, self.kind = ck, path, tuple(shape), np.dtype(dtype), kind
        self.pairs = plan.leaves[path]  # [(spec, entry)]
        self.cache: dict[tuple, np.ndarray] = {}

    def __call__(self, index) -> np.ndarray:
        key = _norm_index(index, self.shape)
        if key not in self.cache:
            self.cache[key] = self._read(index)
        return self.cache[key]

    def _read(self, index) -> np.ndarray:
        if self.kind == "dense":
            if "full" not in self.cache:
                self.cache["full"] = self._dense()
            return self.cache["full"][tuple(index)]
        E = self.shape[0]
        ids = range(E)[index[0]] if isinstance(index[0], slice) else [index[0]]
        rest = tuple(index[1:])
        if self.kind in ("packed", "scale"):  # kept packed: [E, out, in/2] or [E, out, in/32], on-disk bytes
            es = [e for s, e in self.pairs if s.part == self.kind]
            return np.stack([self.ck.read_entry(es[i]) for i in ids])[(slice(None), *rest)]
        if self.kind == "mxfp4":  # dense [E, in, out] from packed [out, in/2] + scale [out, in/32]
            pk = [e for s, e in self.pairs if s.part == "packed"]
            sc = [e for s, e in self.pairs if s.part == "scale"]
            out = np.empty((len(ids), *self.shape[1:]), self.dtype)
            for j, i in enumerate(ids):
                w_oi = mxfp4_dequantize_np(self.ck.read_entry(pk[i]), self.ck.read_entry(sc[i]))
                out[j] = w_oi.T.astype(self.dtype)
            return out[(slice(None), *rest)]
        # kind == "expert": BF16 torch [out, in] per expert
        ents = [e for _, e in self.pairs]
        out = np.empty((len(ids), *self.shape[1:]), self.dtype)
        for j, i in enumerate(ids):
            out[j] = self.ck.read_entry(ents[i]).T.astype(self.dtype)
        return out[(slice(None), *rest)]

    def _dense(self) -> np.ndarray:
        (spec, entry), = self.pairs
        a = self.ck.read_entry(entry)
        try:
            v = nm.from_hf(a, spec, self.shape)
        except ValueError as err:
            raise CheckpointError(str(err).removeprefix(f"{spec.name}: "), file=entry.file,
                                  tensor=spec.name) from None
        return np.asarray(v).astype(self.dtype, copy=False)


def output_leaves(plan: Plan, abstract, keep_experts_packed: bool) -> list[tuple[tuple, tuple, object, str]]:
    """``[(output path, shape, dtype, kind)]`` in tree order; kind ∈ dense | expert | mxfp4 | packed | scale."""
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for kp, sds in flat:
        path = nm.key_path(kp)
        if path not in plan.leaves:
            raise CheckpointError(f"params leaf {'/'.join(map(str, path))} has no tensor in the checkpoint")
        if path in plan.packed:
            if plan.packed[path] and keep_experts_packed:
                s_pk = next(s for s, _ in plan.leaves[path] if s.part == "packed")
                s_sc = next(s for s, _ in plan.leaves[path] if s.part == "scale")
                E = sds.shape[0]
                out.append(((*path[:-1], f"{path[-1]}_packed"), (E, *s_pk.shape), np.uint8, "packed"))
                out.append(((*path[:-1], f"{path[-1]}_scale"), (E, *s_sc.shape), np.uint8, "scale"))
            else:
                out.append((path, tuple(sds.shape), sds.dtype, "mxfp4" if plan.packed[path] else "expert"))
        else:
            out.append((path, tuple(sds.shape), sds.dtype, "dense"))
    return out


def default_sharding(mesh: Mesh, kind: str, shape) -> NamedSharding:
    """Routed-expert stacks on the "expert" axis when it divides E; everything else replicated."""
    if kind != "dense" and "expert" in mesh.axis_names and shape[0] % mesh.shape["expert"] == 0:
        return NamedSharding(mesh, PartitionSpec("expert"))
    return NamedSharding(mesh, PartitionSpec())


def _set(tree: dict, path: tuple, value) -> None:
    x = tree
    for k, nxt in zip(path[:-1], path[1:], strict=False):
        if isinstance(x, list):
            while len(x) <= k:
                x.append(None)
            if x[k] is None:
                x[k] = [] if isinstance(nxt, int) else {}
            x = x[k]
        else:
            x = x.setdefault(k, [] if isinstance(nxt, int) else {})
    if isinstance(x, list):
        while len(x) <= path[-1]:
            x.append(None)
    x[path[-1]] = value


def verify_manifest(path: str) -> int:
    """Check every file listed in ``SHA256SUMS`` (if present); returns the number checked."""
    mf = os.path.join(path, MANIFEST_NAME)
    if not os.path.exists(mf):
        return 0
    n = 0
    with open(mf, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            digest, fname = line.strip().split(maxsplit=1)
            fname = fname.lstrip("*")
            if os.path.basename(fname) != fname:
                raise CheckpointError(f"manifest names {fname!r}, outside the directory", file=MANIFEST_NAME)
            got = sha256_file(os.path.join(path, fname))
            if got != digest:
                raise CheckpointError(f"sha256 {got} does not match the manifest's {digest}", file=fname)
            n += 1
    return n


def load(path, *, cfg=None, mesh: Mesh | None = None, shardings=None, dtype=None, keep_experts_packed: bool = False,
         verify: bool = False, layout: str | None = None, progress: bool | None = None, stats: dict | None = None):
    """Load a checkpoint directory into sharded jax arrays.

    Args:
      path: checkpoint directory (index + shards + config.json).
      cfg: config to load for; defaults to ``config.json``. If both exist their architectures must agree.
      mesh: device mesh; default a 1-D mesh ("expert",) over all devices.
      shardings: callable ``(path, shape, dtype) -> Sharding`` or a tree like the result; default: experts on
        "expert", the rest replicated.
      dtype: parameter dtype (``cfg.param_dtype`` by default); leaves the release stores F32 stay at least float32.
      keep_experts_packed: return MXFP4 experts as ``w*_packed`` / ``w*_scale`` uint8 leaves (see module doc).
      verify: check shard sha256 against ``SHA256SUMS`` when present.
      progress: tqdm bar with bytes/s and RSS (default: when stderr is a terminal).
      stats: optional dict filled with bytes_read, seconds, scale byte counts, peak RSS, largest leaf bytes.
    Returns: (cfg, params).
    """
    from k3jax.config import from_hf
    from k3jax.model import abstract_params

    t0 = time.perf_counter()
    path = os.fspath(path)
    ck = open_checkpoint(path)
    cfg_file = os.path.join(path, "config.json")
    if cfg is None:
        if not os.path.exists(cfg_file):
            raise CheckpointError("no config.json and no cfg given", file=path)
        cfg = from_hf(cfg_file)
    elif os.path.exists(cfg_file):
        fcfg = from_hf(cfg_file)
        a, b = architecture(fcfg), architecture(cfg)
        a.pop("expert_format"), b.pop("expert_format")  # storage is decided by the tensors present
        if a != b:
            diff = sorted(k for k in a if a[k] != b.get(k))
            raise CheckpointError(f"config.json differs from the given cfg in {', '.join(diff)}", file=cfg_file)
    if dtype is not None:
        cfg = cfg.replace(param_dtype=np.dtype(dtype).name)
    plan = validate(ck, cfg, layout)  # everything checked before any data is read
    if verify:
        verify_manifest(path)
    mesh = mesh if mesh is not None else Mesh(np.array(jax.devices()), ("expert",))
    leaves = output_leaves(plan, abstract_params(cfg), keep_experts_packed)

    total = sum(e.nbytes for e in ck.tensors.values())
    bar = None
    if progress if progress is not None else sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="load", file=sys.stderr)
    params: dict = {}
    largest = 0
    read0 = ck.bytes_read
    for opath, shape, ldtype, kind in leaves:
        if shardings is None:
            sh = default_sharding(mesh, kind, shape)
        elif callable(shardings):
            sh = shardings(opath, shape, ldtype)
        else:
            sh = _tree_get(shardings, opath)
        src = LeafSource(ck, plan, opath if kind in ("dense", "mxfp4", "expert") else (*opath[:-1],
                         opath[-1].rsplit("_", 1)[0]), shape, ldtype, kind)
        before = ck.bytes_read
        arr = jax.make_array_from_callback(shape, sh, src)
        src.cache.clear()  # drop host copies before the next leaf
        _set(params, opath, arr)
        largest = max(largest, int(np.prod(shape)) * np.dtype(ldtype).itemsize)
        if bar is not None:
            bar.update(ck.bytes_read - before)
            bar.set_postfix(rss=f"{current_rss_bytes() / 2**20:.0f}MiB", refresh=False)
    if bar is not None:
        bar.close()
    ck.close()
    if stats is not None:
        stats.update(bytes_read=ck.bytes_read - read0, seconds=time.perf_counter() - t0,
                     scale_bytes=dict(ck.scale_bytes), peak_rss=peak_rss_bytes(), largest_leaf_bytes=largest,
                     checkpoint_bytes=total, packed_modules=len(ck.packed_modules()))
    return cfg, params


def _tree_get(tree, path):
    x = tree
    for k in path:
        x = x[k]
    return x


__all__ = ["LeafSource", "default_sharding", "load", "mxfp4_dequantize_np", "output_leaves", "verify_manifest",
           "peak_rss_bytes", "current_rss_bytes"]
