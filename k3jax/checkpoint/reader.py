"""Our own safetensors reader: index + shard headers, validation against the name map, memory-mapped byte ranges.

Why not the ``safetensors`` library: safetensors 0.8.0 cannot return F8_E4M3, F8_E8M0 or F4 tensors through
``framework="numpy"`` or ``"flax"``, and ``framework="flax"`` puts whole tensors on device 0 (SPEC §11.8, §14.5).
The container is simple (u64 LE length, JSON header, data), so we parse it ourselves, map each file with
``np.memmap`` and view byte ranges with ``ml_dtypes`` dtypes, or copy a tensor's bytes straight into a caller's
buffer with positional reads (``read_into``). Nothing is ever unpickled: pickle-based files
(``.bin``, ``.pt``, ``.pth``, ``.pkl``, ``.ckpt``) are refused outright.

Order of work (SPEC §11.8): ``open_checkpoint`` reads the index and every text shard header and checks the
containers; ``validate`` checks names, shapes and dtypes against ``name_map.hf_tensors`` for the config — all before
a single data byte is read. Data reads go through ``Checkpoint.read*`` / ``view*``, which count the bytes they
read (``bytes_read``) and check E8M0 scale bytes (0xFF = NaN is an error naming the tensor).

    ck = open_checkpoint("ckpt/")
    plan = validate(ck, cfg)                    # raises CheckpointError naming file and tensor
    a = ck.read("language_model.model.norm.weight")
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from k3jax.checkpoint.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 256 << 20  # the K3 shards have <1 MiB headers; anything past this is corrupt
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # K3 release shards 95/96: skipped by the text loader

# safetensors dtype -> numpy dtype (ml_dtypes for the ones numpy lacks). F4 (two codes per byte) is not listed:
# K3 stores its MXFP4 experts as U8 bytes, and a shape-in-elements F4 entry would need its own byte rule.
DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

# Floating dtypes a tensor may be stored in instead of the layout's own: cast on load (never reinterpreted).
# Integer, bool and float8 storage must match exactly (float8 without scales is a quantization, not a dtype).
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
A_LOG_TRANSFORMS = ("a_log_pad", "a_log_4d")

_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(w\d)\.(weight_packed|weight_scale|weight)$")


# ------------------------------------------------------------------------------------------- byte accounting

class ByteCounter:
    """Bytes copied out of the file maps (i.e. actually read from disk or page cache), thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n

    def reset(self) -> int:
        with self._lock:
            v, self.value = self.value, 0
        return v


BYTES_READ = ByteCounter()  # process-wide total over all open checkpoints


# ---------------------------------------------------------------------------------------------- containers

@dataclass(frozen=True)
class TensorEntry:
    """One tensor of one shard; ``start``/``end`` are absolute file offsets."""

    name: str
    file: str  # file name relative to the checkpoint directory
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class ShardHeader:
    file: str
    size: int  # file bytes
    header_len: int  # N (padding included)
    entries: dict[str, TensorEntry]  # header order
    metadata: dict | None = None

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def _no_duplicate_keys(what: str, file: str):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise CheckpointError(f"{what} has the key {k!r} twice", file=file)
            out[k] = v
        return out
    return hook


def read_header(path: str, file: str | None = None) -> ShardHeader:
    """Parse and check one safetensors container header (no data is read).

    Checks: 8-byte length present; header inside the file; JSON object; every entry has a known dtype, a shape of
    non-negative ints and ``data_offsets`` whose length equals prod(shape) × itemsize; ranges inside the payload and
    not overlapping.
    """
    file = file or os.path.basename(path)
    size = os.path.getsize(path)
    if size < 8:
        raise CheckpointError(f"truncated shard: {size} bytes, fewer than the 8-byte header length", file=file)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise CheckpointError(f"header length {n} runs past the end of the file ({size} bytes): "
                                  "truncated or not a safetensors file", file=file)
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit", file=file)
        raw = f.read(n)
    try:
        hdr = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys("header", file))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"header is not valid UTF-8 JSON ({e})", file=file) from None
    if not isinstance(hdr, dict):
        raise CheckpointError(f"header must be a JSON object, got {type(hdr).__name__}", file=file)
    meta = hdr.pop("__metadata__", None)
    if meta is not None and not isinstance(meta, dict):
        raise CheckpointError("'__metadata__' must be an object", file=file)
    data_start, payload = 8 + n, size - 8 - n
    entries: dict[str, TensorEntry] = {}
    for name, e in hdr.items():
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
            raise CheckpointError("header entry must be an object with dtype, shape and data_offsets",
                                  file=file, tensor=name)
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in DTYPES:
            raise CheckpointError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})", file=file, tensor=name)
        if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
            raise CheckpointError(f"shape {shape!r} must be a list of non-negative ints", file=file, tensor=name)
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise CheckpointError(f"data_offsets {offs!r} must be [start, end] with 0 <= start <= end",
                                  file=file, tensor=name)
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if offs[1] - offs[0] != want:
            raise CheckpointError(f"dtype {dtype} and shape {shape} need {want} bytes but data_offsets {offs} "
                                  f"span {offs[1] - offs[0]}", file=file, tensor=name)
        if offs[1] > payload:
            raise CheckpointError(f"data_offsets {offs} run past the end of the data ({payload} bytes after the "
                                  "header): truncated shard or bad offsets", file=file, tensor=name)
        entries[name] = TensorEntry(name, file, dtype, tuple(shape), data_start + offs[0], data_start + offs[1])
    ranges = sorted((e.start, e.end, e.name) for e in entries.values() if e.end > e.start)
    for (s0, e0, n0), (s1, _, n1) in zip(ranges, ranges[1:], strict=False):
        if s1 < e0:
            raise CheckpointError(f"data of {n1!r} [{s1 - data_start}, ...) overlaps {n0!r} "
                                  f"[{s0 - data_start}, {e0 - data_start})", file=file, tensor=n1)
    return ShardHeader(file, size, n, entries, meta)


# --------------------------------------------------------------------------------------------- checkpoints

@dataclass
class Checkpoint:
    """An opened checkpoint directory: every text tensor → (file, dtype, shape, absolute byte range)."""

    path: str
    headers: dict[str, ShardHeader]
    tensors: dict[str, TensorEntry]  # text tensors, on-disk order per file
    skipped: list[str] = field(default_factory=list)  # vision tensors (not read)
    index: dict[str, str] | None = None  # weight_map
    total_size: int | None = None  # index metadata.total_size
    bytes_read: int = 0
    scale_bytes: dict[str, int] = field(default_factory=lambda: {"0x00": 0, "0xFF": 0, "total": 0})
    _maps: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    _fds: dict[str, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- reads
    def _map(self, file: str) -> np.ndarray:
        with self._lock:
            m = self._maps.get(file)
            if m is None:  # a plain ndarray view of the map: slicing an np.memmap subclass costs more per call
                m = np.memmap(os.path.join(self.path, file), dtype=np.uint8, mode="r").view(np.ndarray)
                self._maps[file] = m
            return m

    def view_bytes(self, file: str, start: int, end: int) -> np.ndarray:
        """A read-only view of file bytes [start, end) in the page cache, no copy; counted in ``bytes_read``.

        The caller consumes the bytes (decodes or copies them into its own buffer) and must not keep the view.
        """
        m = self._map(file)
        if end > m.shape[0]:
            raise CheckpointError(f"byte range [{start}, {end}) past the end of the file ({m.shape[0]} bytes): "
                                  "the file shrank after its header was read", file=file)
        with self._lock:
            self.bytes_read += end - start
        BYTES_READ.add(end - start)
        return m[start:end]

    def read_bytes(self, file: str, start: int, end: int) -> np.ndarray:
        """A private uint8 copy of file bytes [start, end); counted in ``bytes_read``."""
        return np.array(self.view_bytes(file, start, end))

    def read_into(self, e: TensorEntry, dst: np.ndarray) -> np.ndarray:
        """Copy entry ``e``'s bytes into ``dst`` (C-contiguous, exactly ``e``'s byte count) with positional reads
        (``os.preadv``): page cache -> ``dst``, the single copy a plain ``read()`` makes, without faulting a mapping
        in page by page. Returns ``dst``'s bytes viewed as the entry's dtype and shape; counted in ``bytes_read``;
        scale bytes checked."""
        nbytes = e.end - e.start
        buf = dst.reshape(-1).view(np.uint8)
        if buf.nbytes != nbytes:
            raise ValueError(f"read_into: destination holds {buf.nbytes} bytes, {e.name} has {nbytes}")
        if not hasattr(os, "preadv"):  # not on every platform: copy out of the mapping instead
            np.copyto(buf, self.view_bytes(e.file, e.start, e.end))
        else:
            fd = self._fd(e.file)
            mv, got = memoryview(buf), 0
            while got < nbytes:
                n = os.preadv(fd, [mv[got:]], e.start + got)
                if n == 0:
                    raise CheckpointError(f"byte range [{e.start}, {e.end}) past the end of the file: the file shrank "
                                          "after its header was read", file=e.file, tensor=e.name)
                got += n
            with self._lock:
                self.bytes_read += nbytes
            BYTES_READ.add(nbytes)
        a = buf.view(DTYPES[e.dtype]).reshape(e.shape)
        if e.name.endswith(".weight_scale") and e.dtype == "U8":
            self.check_scale(e, a)
        return a

    def _fd(self, file: str) -> int:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                fd = self._fds[file] = os.open(os.path.join(self.path, file), os.O_RDONLY)
            return fd

    def view_entry(self, e: TensorEntry) -> np.ndarray:
        """``read_entry`` without the copy: a read-only typed view of the mapped bytes (scale bytes checked)."""
        a = self.view_bytes(e.file, e.start, e.end).view(DTYPES[e.dtype]).reshape(e.shape)
        if e.name.endswith(".weight_scale") and e.dtype == "U8":
            self.check_scale(e, a)
        return a

    def read_entry(self, e: TensorEntry) -> np.ndarray:
        a = self.read_bytes(e.file, e.start, e.end).view(DTYPES[e.dtype]).reshape(e.shape)
        if e.name.endswith(".weight_scale") and e.dtype == "U8":
            self.check_scale(e, a)
        return a

    def read(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise CheckpointError("no such tensor in the checkpoint", file=self.path, tensor=name)
        return self.read_entry(self.tensors[name])

    def check_scale(self, e: TensorEntry, scale: np.ndarray) -> None:
        """Count E8M0 bytes 0x00 (2^-127) and 0xFF (NaN); a NaN scale is an error naming the tensor."""
        nan = int(np.count_nonzero(scale == 0xFF))
        with self._lock:
            self.scale_bytes["0x00"] += int(np.count_nonzero(scale == 0))
            self.scale_bytes["0xFF"] += nan
            self.scale_bytes["total"] += int(scale.size)
        if nan:
            raise CheckpointError(f"{nan} E8M0 scale byte(s) are 0xFF (NaN)", file=e.file, tensor=e.name)

    def release(self, file: str) -> None:
        """Unmap one file (its pages stop counting in RSS); a later read maps it again."""
        with self._lock:
            self._maps.pop(file, None)
            fd = self._fds.pop(file, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._maps.clear()  # np.memmap closes its mapping when the last view goes away
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    # -- structure
    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.tensors.values():
            out[e.dtype] = out.get(e.dtype, 0) + e.nbytes
        return out

    def packed_modules(self) -> list[str]:
        """Module prefixes stored MXFP4 — decided by the presence of ``<prefix>.weight_packed`` (SPEC §10.5)."""
        return [n[: -len(".weight_packed")] for n in self.tensors if n.endswith(".weight_packed")]

    def expert_pages(self, moe_prefix: str) -> dict[int, tuple[str, int, int]]:
        """``{expert id: (file, start, end)}`` of each expert's bytes under ``<moe_prefix>.experts``, from the header.

        The release stores experts in string order of the id (0, 1, 10, 100, ...), each as one contiguous page; the
        range here is [min start, max end) over the expert's tensors, so it is right whatever the order.
        """
        out: dict[int, tuple[str, int, int]] = {}
        pre = moe_prefix + ".experts."
        for n, e in self.tensors.items():
            if n.startswith(pre):
                m = _EXPERT_RE.match(n)
                if m:
                    k = int(m.group(2))
                    f, s, t = out.get(k, (e.file, e.start, e.end))
                    if f != e.file:
                        raise CheckpointError(f"expert {k} is split across files {f} and {e.file}", tensor=n)
                    out[k] = (f, min(s, e.start), max(t, e.end))
        return out


def _check_file_name(fname, tensor: str, root: str) -> str:
    if not isinstance(fname, str) or not fname:
        raise CheckpointError(f"index maps it to {fname!r}, not a file name", file=INDEX_NAME, tensor=tensor)
    if os.path.isabs(fname) or fname.startswith(("/", "\\")) or ".." in re.split(r"[\\/]", fname) \
            or "/" in fname or "\\" in fname:
        raise CheckpointError(f"index maps it to {fname!r}, which is outside the checkpoint directory "
                              "(only plain file names in the same directory are allowed)", file=INDEX_NAME,
                              tensor=tensor)
    if fname.lower().endswith(PICKLE_SUFFIXES):
        raise CheckpointError(f"index maps it to the pickle-based file {fname!r}; k3jax never unpickles "
                              "(convert it to safetensors first)", file=INDEX_NAME, tensor=tensor)
    if not fname.endswith(".safetensors"):
        raise CheckpointError(f"index maps it to {fname!r}, not a .safetensors file", file=INDEX_NAME, tensor=tensor)
    p = os.path.join(root, fname)
    if not os.path.isfile(p):
        raise CheckpointError(f"index maps it to {fname!r}, which does not exist in {root}", file=INDEX_NAME,
                              tensor=tensor)
    real_root = os.path.realpath(root)
    if os.path.commonpath([os.path.realpath(p), real_root]) != real_root:
        raise CheckpointError(f"index maps it to {fname!r}, a link leading outside the checkpoint directory",
                              file=INDEX_NAME, tensor=tensor)
    return fname


check_file_name = _check_file_name  # public: index entries are checked the same way by every reader


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def open_checkpoint(path: str, *, skip_vision: bool = True) -> Checkpoint:
    """Read the index (if any) and every text shard header; check the containers and the index. No data is read."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError("not a checkpoint directory", file=path)
    listing = sorted(os.listdir(path))
    index_path = os.path.join(path, INDEX_NAME)
    weight_map = total_size = None
    if os.path.exists(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                idx = json.load(f, object_pairs_hook=_no_duplicate_keys("index", INDEX_NAME))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"not valid JSON ({e})", file=INDEX_NAME) from None
        if not isinstance(idx, dict) or not isinstance(idx.get("weight_map"), dict):
            raise CheckpointError("must be a JSON object with a 'weight_map' object", file=INDEX_NAME)
        weight_map = idx["weight_map"]
        total_size = (idx.get("metadata") or {}).get("total_size")
        checked: dict[str, str] = {}
        for name, fname in weight_map.items():
            if fname not in checked:
                checked[fname] = _check_file_name(fname, name, path)
        files = sorted(set(weight_map.values()))
        if skip_vision:  # shards holding only vision tensors are not even opened
            text_files = {f for n, f in weight_map.items() if not is_vision(n)}
            files = [f for f in files if f in text_files]
    else:
        files = [f for f in listing if f.endswith(".safetensors")]
        if not files:
            pickles = [f for f in listing if f.lower().endswith(PICKLE_SUFFIXES)]
            if pickles:
                raise CheckpointError(f"only pickle-based weight files ({', '.join(pickles[:3])}); k3jax never "
                                      "unpickles — convert them to safetensors first", file=path)
            raise CheckpointError(f"no {INDEX_NAME} and no .safetensors files", file=path)

    headers: dict[str, ShardHeader] = {}
    tensors: dict[str, TensorEntry] = {}
    skipped: list[str] = []
    for fname in files:
        h = read_header(os.path.join(path, fname), fname)
        headers[fname] = h
        for name, e in h.entries.items():
            if skip_vision and is_vision(name):
                skipped.append(name)
                continue
            if name in tensors:
                raise CheckpointError(f"appears in two shards: {tensors[name].file} and {fname}", file=fname,
                                      tensor=name)
            if weight_map is not None and weight_map.get(name) != fname:
                where = f"maps it to {weight_map[name]}" if name in weight_map else "does not list it"
                raise CheckpointError(f"is in this shard's header but the index {where}", file=fname, tensor=name)
            tensors[name] = e
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in tensors and not (skip_vision and is_vision(name)):
                raise CheckpointError(f"the index maps it to {fname}, whose header does not contain it",
                                      file=fname, tensor=name)
    return Checkpoint(path, headers, tensors, skipped, weight_map, total_size)


# ---------------------------------------------------------------------------------------------- validation

@dataclass
class Plan:
    """The validated mapping: k3jax leaf path → its checkpoint tensors (TensorSpec, TensorEntry) pairs.

    ``casts`` counts tensors stored in another float dtype than the layout's (``{"F32->BF16": 190}``: stored F32
    where the release has BF16); they are cast on load, never reinterpreted. ``a_log_forms`` counts the stored
    shapes of ``A_log`` that differ from the layout's own (``{"[H]": 3}``).
    """

    cfg: object
    layout: str
    leaves: dict[tuple, list[tuple[object, TensorEntry]]]  # path -> [(spec, entry)], experts in numeric order
    packed: dict[tuple, bool]  # expert leaf path -> stored MXFP4?
    casts: dict[str, int] = field(default_factory=dict)
    a_log_forms: dict[str, int] = field(default_factory=dict)

    def entries(self, path) -> list[TensorEntry]:
        return [e for _, e in self.leaves[path]]

    def tolerated(self, config_report: dict | None = None) -> dict:
        """What was accepted that the release itself does not contain: ``unknown_keys`` and ``ignored_keys`` of
        the config (from ``from_hf(..., report=)``), ``casts`` and ``a_log_form`` (one name, or a sorted list if
        the layers differ; absent when A_log is stored as the layout stores it)."""
        r = config_report or {}
        out = {"unknown_keys": list(r.get("unknown_keys", ())), "ignored_keys": list(r.get("ignored_keys", ())),
               "casts": dict(sorted(self.casts.items()))}
        if self.a_log_forms:
            forms = sorted(self.a_log_forms)
            out["a_log_form"] = forms[0] if len(forms) == 1 else forms
        return out


def _expected_specs(ck: Checkpoint, cfg, layout) -> list:
    """Name-map specs with the expert storage decided per module by the presence of ``weight_packed``."""
    from k3jax.checkpoint import name_map as nm

    packed_mods = {n[: -len(".weight_packed")] for n in ck.tensors if n.endswith(".weight_packed")}
    has_dense_expert = any(n.endswith(".weight") and ".experts." in n and _EXPERT_RE.match(n) for n in ck.tensors)
    lists = []
    if packed_mods or not has_dense_expert:
        try:
            lists.append(("mxfp4", nm.hf_tensors(cfg, layout, "mxfp4")))
        except ValueError as e:  # expert width not a multiple of 32: it cannot be MXFP4
            if packed_mods:
                raise CheckpointError(f"packed experts present but {e}", file=ck.path) from None
    if has_dense_expert or not lists:
        lists.append(("bf16", nm.hf_tensors(cfg, layout, "bf16")))
    if len(lists) == 1:
        return lists[0][1]
    out = [s for s in lists[0][1] if s.transform != "mxfp4"]
    out += [s for s in lists[0][1] if s.transform == "mxfp4" and s.name.rsplit(".", 1)[0] in packed_mods]
    out += [s for s in lists[1][1] if s.transform == "expert" and s.name.rsplit(".", 1)[0] not in packed_mods]
    return out


def _examples(names: Iterable[str], where, k: int = 3) -> str:
    names = list(names)
    shown = ", ".join(f"{n!r}{where(n)}" for n in names[:k])
    return shown + (f" and {len(names) - k} more" if len(names) > k else "")


def validate(ck: Checkpoint, cfg, layout: str | None = None) -> Plan:
    """Check names, shapes and dtypes against the name map for ``cfg`` before any data is read.

    Raises CheckpointError listing missing / extra tensors (with their files) or the first shape / dtype mismatch.
    """
    from k3jax.checkpoint import name_map as nm

    layout = layout or nm.default_layout(cfg)
    specs = _expected_specs(ck, cfg, layout)
    expected = {s.name: s for s in specs}
    missing = [n for n in expected if n not in ck.tensors]
    extra = [n for n in ck.tensors if n not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) missing: " + _examples(
                missing, lambda n: f" (expected in {nm.shard_file_of(n, cfg, layout)})"))
        if extra:
            stray_packed = [n for n in extra if n.endswith(".weight_packed") and not _EXPERT_RE.match(n)]
            note = "; only routed experts may be stored MXFP4" if stray_packed else ""
            parts.append(f"{len(extra)} unexpected tensor(s): " + _examples(
                extra, lambda n: f" in {ck.tensors[n].file}") + note)
        raise CheckpointError(f"does not match config {getattr(cfg, 'name', '?')!r} ({layout} layout): "
                              + "; ".join(parts), file=ck.path)
    leaves: dict[tuple, list] = {}
    packed: dict[tuple, bool] = {}
    casts: dict[str, int] = {}
    a_log_forms: dict[str, int] = {}
    for s in specs:
        e = ck.tensors[s.name]
        if e.dtype != s.dtype:
            if not (s.dtype in FLOAT_DTYPES and e.dtype in FLOAT_DTYPES):
                want = f"a float dtype ({s.dtype} in the {layout} layout)" if s.dtype in FLOAT_DTYPES else s.dtype
                raise CheckpointError(f"dtype {e.dtype}, expected {want} for config {cfg.name!r}", file=e.file,
                                      tensor=s.name)
            casts[f"{e.dtype}->{s.dtype}"] = casts.get(f"{e.dtype}->{s.dtype}", 0) + 1
        if s.transform in A_LOG_TRANSFORMS and e.shape != tuple(s.shape):
            form = a_log_form(e.shape, cfg)
            if form is None:
                raise CheckpointError(f"shape {list(e.shape)}, expected {list(s.shape)} for config {cfg.name!r} "
                                      f"(A_log may also be stored [H], [1, 1, H, 1] or zero-padded [N >= H], "
                                      f"H = {cfg.kda_num_heads})", file=e.file, tensor=s.name)
            a_log_forms[form] = a_log_forms.get(form, 0) + 1
            s = s._replace(shape=tuple(e.shape), transform="a_log_pad")  # flattened, tail checked on read
        elif e.shape != tuple(s.shape):
            raise CheckpointError(f"shape {list(e.shape)}, expected {list(s.shape)} for config {cfg.name!r}",
                                  file=e.file, tensor=s.name)
        leaves.setdefault(s.path, []).append((s, e))
        if s.transform in ("mxfp4", "expert"):
            packed[s.path] = s.transform == "mxfp4"
    for path, lst in leaves.items():
        if path in packed:  # numeric expert order (disk order is string order), packed before scale
            lst.sort(key=lambda se: (se[0].expert, se[0].part != "packed"))
            kinds = {se[0].transform for se in lst}
            if len(kinds) > 1:
                raise CheckpointError(f"experts of {'/'.join(map(str, path))} are partly MXFP4 and partly BF16; "
                                      "one leaf must use one storage", file=ck.path)
    return Plan(cfg, layout, leaves, packed, casts, a_log_forms)


def a_log_form(stored: tuple, cfg) -> str | None:
    """Name of an accepted other storage of ``A_log`` (SPEC §2.1), or None if ``stored`` is not one: a vector
    of N >= H values (one non-unit axis, e.g. [H], [1, 1, H, 1], [128]) whose tail past H must be exactly 0."""
    H = cfg.kda_num_heads
    big = [n for n in stored if n != 1]
    N = math.prod(stored)
    if len(big) > 1 or N < H:
        return None
    if stored == (H,):
        return "[H]"
    if stored == (1, 1, H, 1):
        return "[1, 1, H, 1]"
    return f"{list(stored)} zero-padded" if N > H else f"{list(stored)}"


__all__ = ["BYTES_READ", "ByteCounter", "Checkpoint", "DTYPES", "FLOAT_DTYPES", "INDEX_NAME", "Plan", "ShardHeader",
           "TensorEntry", "a_log_form", "check_file_name", "is_vision", "open_checkpoint", "read_header", "validate"]
