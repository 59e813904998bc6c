"""Streaming, sharded load of an official-layout checkpoint into the k3jax params tree (SPEC §11.8).

    cfg, params = load("ckpt/")                                  # 1-D "expert" mesh over all devices
    cfg, params = load("ckpt/", mesh=mesh, keep_experts_packed=True)

1. ``open_checkpoint`` parses the index and every text shard header; ``validate`` checks every name, shape and dtype
   against the name map for the config — before any data byte is read. Vision shards are skipped.
2. Each leaf becomes one ``jax.make_array_from_callback``. The callback runs once per addressable device, replicas
   included, so results are memoized per device index; it reads only the byte ranges its index needs. Routed-expert
   stacks are separate per-expert tensors on disk, so a device holding experts [a, b) reads only those experts.
3. Leaves are built one after another and host copies dropped, so host memory stays near the largest leaf. Bytes
   are read with ``os.preadv`` straight into the output buffer (packed experts, same-dtype tensors) or into one
   reused scratch buffer that feeds a transpose (linear weights: torch [out, in] -> [in, out]), which runs as one XLA
   program on the host CPU (3.2 GB/s end to end on the CI CPU, into new memory; numpy's strided copies: 0.95 GB/s).
4. MXFP4 experts are dequantized on the host shard after reading (exact, numpy), or kept packed: with
   ``keep_experts_packed=True`` the experts dict of each MoE layer holds ``w{1,2,3}_packed`` uint8 [E, out, in/2]
   and ``w{1,2,3}_scale`` uint8 [E, out, in/32] (torch orientation, as on disk) instead of ``w{1,2,3}``.

Default shardings: routed-expert stacks split on the mesh axis "expert" (when it divides the expert count), every
other leaf replicated. ``shardings`` may be a callable ``(path, shape, dtype) -> Sharding`` or a tree shaped like the
result. ``verify=True`` checks every shard's sha256 against ``SHA256SUMS`` when that manifest is present.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.checkpoint import name_map as nm
from k3jax.checkpoint.errors import CheckpointError
from k3jax.checkpoint.reader import DTYPES, Checkpoint, Plan, open_checkpoint, validate
from k3jax.checkpoint.save import MANIFEST_NAME, architecture_diff, sha256_file

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
# byte → value of its low nibble (even column) / high nibble (odd column): one gather per output value, no shifts
_E2M1_LO = E2M1_VALUES[np.arange(256) & 0xF]
_E2M1_HI = E2M1_VALUES[np.arange(256) >> 4]
_E2M1_PAIR = np.stack([_E2M1_LO, _E2M1_HI], axis=-1)  # [256, 2]
with np.errstate(over="ignore"):  # E8M0 byte b → 2^(b-127), exact in float32 (2^-127 is a subnormal)
    _E8M0 = np.ldexp(np.float64(1), np.arange(256) - 127).astype(np.float32)
_E8M0[255] = np.nan  # rejected by the reader's scale check before any decode
ALIGN = 64  # XLA:CPU aliases (zero-copy) host buffers aligned to this; anything else is copied by device_put
_TILE = 128  # transpose tile: keeps both the strided reads and the writes in cache
_BF16 = np.dtype(ml_dtypes.bfloat16)


def mxfp4_dequantize_np(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Exact host dequantization: packed uint8 [..., n/2] + scale uint8 [..., n/32] → float32 [..., n].

    Low nibble = even column (compressed-tensors). Scale byte b means 2^(b-127); numpy keeps float32 subnormals, so
    this is exact for every byte but 0xFF (NaN, rejected by the reader before we get here).
    """
    packed, scale = np.asarray(packed), np.asarray(scale)
    G = scale.shape[-1]
    vals = _E2M1_PAIR[packed].reshape(*packed.shape[:-1], G, -1)
    vals *= _E8M0[scale][..., None]
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def mxfp4_dequantize_T_into(dst: np.ndarray, packed: np.ndarray, scale: np.ndarray) -> None:
    """``dst[...] = mxfp4_dequantize_np(packed, scale).T`` without the intermediate: dst [in, out] C-contiguous,
    packed [out, in/2], scale [out, in/32] (views of the mapped file are fine). Bit-identical to the reference."""
    n_in, n_out = dst.shape
    G = scale.shape[-1]
    k = n_in // G
    f32 = dst if dst.dtype == np.float32 else np.empty(dst.shape, np.float32)
    d4 = f32.reshape(G, k // 2, 2, n_out)
    pT = packed.T.reshape(G, k // 2, n_out)
    np.take(_E2M1_LO, pT, out=d4[:, :, 0, :], mode="clip")  # mode="clip": unbuffered; uint8 is always in range
    np.take(_E2M1_HI, pT, out=d4[:, :, 1, :], mode="clip")
    f32.reshape(G, k, n_out)[...] *= _E8M0[scale.T][:, None, :]
    if f32 is not dst:
        np.copyto(dst, f32, casting="unsafe")


def aligned_empty(shape, dtype, align: int = ALIGN) -> np.ndarray:
    """``np.empty`` whose data pointer is ``align``-byte aligned, so jax on CPU adopts it without a copy."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dtype).reshape(shape)


def copy_T(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src.T`` (2-D, dtype cast as ``astype``), in cache-sized tiles.

    BF16 → float32 is exact as a 16-bit shift, so that case runs as integer ops on the raw bits (bit-identical to
    the ml_dtypes cast, NaN payloads included) — several times faster than the strided ml_dtypes cast loop.
    """
    R, C = src.shape
    if src.dtype == _BF16 and dst.dtype == np.float32:
        s16, d32 = src.view(np.uint16), dst.view(np.uint32)
        for i in range(0, R, _TILE):
            for j in range(0, C, _TILE):
                np.left_shift(s16[i:i + _TILE, j:j + _TILE].T, 16, out=d32[j:j + _TILE, i:i + _TILE],
                              dtype=np.uint32)
        return
    if R <= _TILE or C <= _TILE:
        np.copyto(dst, src.T, casting="unsafe")
        return
    for i in range(0, R, _TILE):
        for j in range(0, C, _TILE):
            np.copyto(dst[j:j + _TILE, i:i + _TILE], src[i:i + _TILE, j:j + _TILE].T, casting="unsafe")


@functools.cache
def _host_cpu():
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # no CPU backend in this process (JAX_PLATFORMS without cpu)
        return None


@functools.cache
def _xla_swap_last(dtype: np.dtype):
    return jax.jit(lambda a: jnp.swapaxes(a, -1, -2).astype(dtype))


def host_transpose(src: np.ndarray, dtype) -> np.ndarray:
    """``swapaxes(src, -1, -2).astype(dtype)`` as a new C-contiguous, 64-byte-aligned host array.

    Runs as one XLA program on the host's CPU device: it reads ``src`` in place (an aligned buffer is adopted without
    a copy); end to end (dispatch and the new output's pages included) it moves 3.2 GB/s of an 8 MB BF16 matrix on
    the CI CPU, where numpy's strided copies (``copy_T``) move 0.95 GB/s (experiments/load_microbench.py). The result
    is a zero-copy view of XLA's buffer, which the CPU devices adopt in turn.
    Bit-identical to ``copy_T`` for widening and same-dtype casts (a transpose moves bits; bf16 -> f32 is exact).
    Falls back to ``copy_T`` where there is no CPU backend or for narrowing casts (rounding stays numpy's).
    """
    dtype = np.dtype(dtype)
    cpu = _host_cpu()
    if cpu is None or src.ndim < 2 or dtype.itemsize < src.dtype.itemsize:
        out = aligned_empty((*src.shape[:-2], src.shape[-1], src.shape[-2]), dtype)
        for i in np.ndindex(*src.shape[:-2]):
            copy_T(out[i], src[i])
        return out
    return np.asarray(_xla_swap_last(dtype)(jax.device_put(src, cpu)))


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


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux ``/proc/self/clear_refs`` 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm_rss_bytes() -> int:
    """RSS high-water mark since the last ``reset_peak_rss`` (``VmHWM``), or the process peak where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_rss_bytes()


# --------------------------------------------------------------------------------------------- leaf readers

def _norm_index(index, shape) -> tuple:
    return tuple((s.indices(n)[:2]) if isinstance(s, slice) else (s, s + 1) for s, n in zip(index, shape,
                                                                                            strict=False))


class Scratch:
    """One reusable, aligned host buffer for bytes that are read, transformed and dropped within one leaf.

    Pages of a fresh allocation are zero-filled by the kernel on first touch, which halves the speed of reading into
    them on the CI machine (preadv 6.2 GB/s into new memory vs 12 GB/s into warm memory); bytes that only feed a
    transpose therefore go through this buffer, which grows to the largest such tensor and is reused."""

    def __init__(self):
        self.buf: np.ndarray | None = None

    def take(self, shape, dtype) -> np.ndarray:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        if self.buf is None or self.buf.nbytes < n:
            self.buf = None
            self.buf = aligned_empty((n,), np.uint8)
        return self.buf[:n].view(dtype).reshape(shape)


class LeafSource:
    """Reads the host values of one output leaf, for any device index; memoized per index.

    Every result is a fresh ``ALIGN``-aligned C-contiguous array (for a full index), so on the CPU backend
    ``make_array_from_callback`` adopts it without copying, and replicas of one index share one host buffer.
    Packed experts and same-dtype tensors are read with positional reads straight into that buffer (one copy, as a
    plain ``read()``); linear weights and BF16 experts are read as stored and transposed (and cast) in one XLA pass
    on the host CPU (``host_transpose``); MXFP4 experts are dequantized out of the mapped file into the buffer.
    ``seconds`` sums the time spent here (read + decode).
    """

    def __init__(self, ck: Checkpoint, plan: Plan, path: tuple, shape: tuple, dtype, kind: str,
                 scratch: Scratch | None = None):
        self.ck, self.path, self.shape, self.dtype, self.kind = ck, path, tuple(shape), np.dtype(dtype), kind
        self.scratch = scratch if scratch is not None else Scratch()
        self.pairs = plan.leaves[path]  # [(spec, entry)]
        self.cache: dict[tuple, np.ndarray] = {}
        self.seconds = 0.0

    def __call__(self, index) -> np.ndarray:
        key = _norm_index(index, self.shape)
        if key not in self.cache:
            t = time.perf_counter()
            self.cache[key] = self._read(index)
            self.seconds += time.perf_counter() - t
        return self.cache[key]

    def _read(self, index) -> np.ndarray:
        if self.kind == "dense":
            if "full" not in self.cache:
                self.cache["full"] = self._dense()
            return self.cache["full"][tuple(index)]
        E = self.shape[0]
        ids = range(E)[index[0]] if isinstance(index[0], slice) else [index[0]]
        rest = tuple(index[1:])
        ck = self.ck
        if self.kind in ("packed", "scale"):  # kept packed: [E, out, in/2] or [E, out, in/32], on-disk bytes
            out = aligned_empty((len(ids), *self.shape[1:]), self.dtype)
            es = [e for s, e in self.pairs if s.part == self.kind]
            for j, i in enumerate(ids):
                ck.read_into(es[i], out[j])
        elif self.kind == "mxfp4":  # dense [E, in, out] from packed [out, in/2] + scale [out, in/32]
            out = aligned_empty((len(ids), *self.shape[1:]), self.dtype)
            pk = [e for s, e in self.pairs if s.part == "packed"]
            sc = [e for s, e in self.pairs if s.part == "scale"]
            for j, i in enumerate(ids):
                mxfp4_dequantize_T_into(out[j], ck.view_entry(pk[i]), ck.view_entry(sc[i]))
        else:  # kind == "expert": BF16 torch [out, in] per expert, read as stored, then one transpose for all
            ents = [e for _, e in self.pairs]
            dts = {ents[i].dtype for i in ids}
            common = DTYPES[next(iter(dts))] if len(dts) == 1 else np.dtype(np.float64 if "F64" in dts else np.float32)
            raw = self.scratch.take((len(ids), *ents[0].shape), common)
            for j, i in enumerate(ids):
                if len(dts) == 1:
                    ck.read_into(ents[i], raw[j])
                else:  # experts of one layer stored in different float dtypes: widen to a common one first
                    np.copyto(raw[j], ck.view_entry(ents[i]), casting="unsafe")
            out = host_transpose(raw, self.dtype)
            del raw
        return out[(slice(None), *rest)] if any(r != slice(None) for r in rest) else out

    def _dense(self) -> np.ndarray:
        (spec, entry), = self.pairs
        t = spec.transform
        src_dtype = DTYPES[entry.dtype]
        if t == "linear":  # leaf [*in, *out] ← torch [prod(out), prod(in)]: read as stored, one transpose pass
            raw = self.ck.read_into(entry, self.scratch.take(entry.shape, src_dtype))
            return host_transpose(raw, self.dtype).reshape(self.shape)
        out = aligned_empty(self.shape, self.dtype)
        if t in ("copy", "row", "conv", "flat", "a_log_4d") and math.prod(entry.shape) == out.size:
            if src_dtype == self.dtype:
                self.ck.read_into(entry, out)
            else:
                np.copyto(out.reshape(-1), self.ck.read_into(entry, aligned_empty(entry.shape, src_dtype)).reshape(-1),
                          casting="unsafe")
            return out
        # a_log_pad (checks the zero tail) and anything new: the name map's reference transform
        try:
            v = nm.from_hf(self.ck.view_entry(entry), spec, self.shape)
        except ValueError as err:
            raise CheckpointError(str(err).removeprefix(f"{spec.name}: "), file=entry.file, tensor=spec.name) from None
        np.copyto(out, v, casting="unsafe")
        return out


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


@functools.lru_cache(maxsize=8)
def _abstract_params(cfg):
    """``abstract_params(cfg)`` (an ``eval_shape`` trace of init, ~0.2 s for k3-mini) once per config."""
    from k3jax.model import abstract_params

    return abstract_params(cfg)


def load(path, *, cfg=None, mesh: Mesh | None = None, shardings=None, dtype=None, keep_experts_packed: bool = False,
         verify: bool = False, layout: str | None = None, progress: bool | None = None, stats: dict | None = None,
         track_rss: bool = False, strict_config: bool = False):
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
      stats: optional dict filled with bytes_read, seconds, a ``breakdown`` of seconds per phase, scale byte counts,
        peak RSS, largest leaf bytes.
      track_rss: with ``stats``, also record ``leaf_peak_rss_bytes``: the largest RSS rise while building one leaf
        (kernel high-water mark, reset per leaf, minus the RSS before that leaf) — host memory the load needs on top
        of what it has already loaded. Costs a few /proc reads per leaf, so off by default.
      strict_config: unknown keys in ``config.json`` are errors instead of one warning.
    Other writers' forms are accepted and converted (SPEC §2.1, §11): floating tensors in another float dtype are
    cast, ``A_log`` in any vector form with an exactly-zero tail; ``stats["tolerated"]`` says what was.
    Returns: (cfg, params).
    """
    from k3jax.config import from_hf

    t0 = time.perf_counter()
    bd: dict[str, float] = {}
    path = os.fspath(path)
    ck = open_checkpoint(path)
    t1 = time.perf_counter()
    bd["open_headers"] = t1 - t0
    cfg_file = os.path.join(path, "config.json")
    cfg_report: dict = {}
    if cfg is None:
        if not os.path.exists(cfg_file):
            raise CheckpointError("no config.json and no cfg given", file=path)
        cfg = from_hf(cfg_file, strict=strict_config, report=cfg_report)
    elif os.path.exists(cfg_file):
        diff = architecture_diff(from_hf(cfg_file, strict=strict_config, report=cfg_report), cfg)
        if diff:
            raise CheckpointError(f"config.json differs from the given cfg in {', '.join(diff)}", file=cfg_file)
    if dtype is not None:
        cfg = cfg.replace(param_dtype=np.dtype(dtype).name)
    t2 = time.perf_counter()
    bd["config"] = t2 - t1
    plan = validate(ck, cfg, layout)  # everything checked before any data is read
    t3 = time.perf_counter()
    bd["validate"] = t3 - t2
    if verify:
        verify_manifest(path)
    mesh = mesh if mesh is not None else Mesh(np.array(jax.devices()), ("expert",))
    try:
        abstract = _abstract_params(cfg)
    except TypeError:  # an unhashable cfg
        from k3jax.model import abstract_params

        abstract = abstract_params(cfg)
    t4 = time.perf_counter()
    bd["abstract_tree"] = t4 - t3
    leaves = output_leaves(plan, abstract, keep_experts_packed)
    # A_log leaves first (a few hundred bytes per layer): a non-zero padding tail then fails before any large tensor
    # is read. The order in which leaves are built does not change the result.
    leaves.sort(key=lambda leaf: leaf[0][-1] != "A_log")
    bd["plan_leaves"] = time.perf_counter() - t4

    total = sum(e.nbytes for e in ck.tensors.values())
    bar = None
    if progress if progress is not None else sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="load", file=sys.stderr)
    params: dict = {}
    largest = 0
    leaf_peak = None
    track = track_rss and stats is not None and reset_peak_rss()
    read0 = ck.bytes_read
    t_read = t_arrays = 0.0
    src_paths = [opath if kind in ("dense", "mxfp4", "expert") else (*opath[:-1], opath[-1].rsplit("_", 1)[0])
                 for opath, _, _, kind in leaves]
    last_use = {e.file: i for i, p in enumerate(src_paths) for _, e in plan.leaves[p]}
    done_after: dict[int, list[str]] = {}
    for f, i in last_use.items():
        done_after.setdefault(i, []).append(f)
    sizes = [math.prod(shape) * np.dtype(ldtype).itemsize for _, shape, ldtype, _ in leaves]
    scratch = Scratch()

    def sharding_of(li):
        opath, shape, ldtype, kind = leaves[li]
        if shardings is None:
            return default_sharding(mesh, kind, shape)
        if callable(shardings):
            return shardings(opath, shape, ldtype)
        return _tree_get(shardings, opath)

    def prepare(li):
        """Leaf li's sharding and a LeafSource whose cache holds every addressable index (read + decoded).

        Reading happens here, in the calling thread, one leaf at a time. A 1-2 thread pool that prepared leaves
        ahead was measured 1.4-1.9x SLOWER on the 2-core CI machine (GIL hand-offs between the many short Python
        steps of the reads and of array creation), so it is not used."""
        _, shape, ldtype, kind = leaves[li]
        sh = sharding_of(li)
        src = LeafSource(ck, plan, src_paths[li], shape, ldtype, kind, scratch)
        for index in sh.addressable_devices_indices_map(shape).values():
            src(index)
        return sh, src

    for li, (opath, shape, _, _) in enumerate(leaves):
        before = ck.bytes_read
        if track:
            rss_before = current_rss_bytes()
            reset_peak_rss()
        t = time.perf_counter()
        sh, src = prepare(li)
        t1 = time.perf_counter()
        arr = jax.make_array_from_callback(shape, sh, src)
        t_read += t1 - t
        t_arrays += time.perf_counter() - t1
        src.cache.clear()  # drop host copies before the next leaf (on CPU the array now owns its buffers)
        del src
        for f in done_after.get(li, ()):  # close files no later leaf reads (mapped pages count in RSS)
            ck.release(f)
        if track:
            leaf_peak = max(leaf_peak or 0, hwm_rss_bytes() - rss_before)
        _set(params, opath, arr)
        largest = max(largest, sizes[li])
        if bar is not None:
            bar.update(ck.bytes_read - before)
            bar.set_postfix(rss=f"{current_rss_bytes() / 2**20:.0f}MiB", refresh=False)
    if bar is not None:
        bar.close()
    ck.close()
    bd["read_decode"] = t_read
    bd["make_arrays"] = t_arrays
    if stats is not None:
        seconds = time.perf_counter() - t0
        bd["other"] = seconds - sum(bd.values())
        stats.update(bytes_read=ck.bytes_read - read0, seconds=seconds, breakdown=bd,
                     tolerated=plan.tolerated(cfg_report),
                     scale_bytes=dict(ck.scale_bytes), peak_rss=peak_rss_bytes(), largest_leaf_bytes=largest,
                     checkpoint_bytes=total, packed_modules=len(ck.packed_modules()), leaves=len(leaves))
        if leaf_peak is not None:
            stats["leaf_peak_rss_bytes"] = leaf_peak
    return cfg, params


def _tree_get(tree, path):
    x = tree
    for k in path:
        x = x[k]
    return x


__all__ = ["ALIGN", "LeafSource", "aligned_empty", "copy_T", "current_rss_bytes", "default_sharding", "hwm_rss_bytes",
           "load", "mxfp4_dequantize_T_into", "mxfp4_dequantize_np", "output_leaves", "peak_rss_bytes",
           "reset_peak_rss", "verify_manifest"]
