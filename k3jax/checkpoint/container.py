"""The checkpoint directory as a container: safetensors shard headers, the index, the manifest, file-name safety.

Why not the ``safetensors`` library: safetensors 0.8.0 cannot return F8_E4M3, F8_E8M0 or F4 tensors through
``framework="numpy"`` or ``"flax"``, and ``framework="flax"`` puts whole tensors on device 0 (docs/checkpoint.md §11.8,
docs/numerics.md §14.5). The container is simple (u64 LE length, JSON header, data), so we parse it ourselves. Nothing
is ever unpickled: pickle-based files (``.bin``, ``.pt``, ``.pth``, ``.pkl``, ``.ckpt``) are refused outright.

Everything here reads headers and JSON only, never tensor data (``k3jax.checkpoint.io`` reads the bytes):

    h = read_header("ckpt/model-00001-of-000010.safetensors")      # ShardHeader: checked entries, byte ranges
    weight_map, total_size = read_index("ckpt/")                    # None if there is no index
    headers, tensors, skipped = read_headers("ckpt/", shard_files("ckpt/", weight_map), weight_map)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from k3jax.checkpoint.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "SHA256SUMS"  # `sha256sum -c` format: "<hex>  <file>"
MAX_HEADER_BYTES = 256 << 20  # the K3 shards have <1 MiB headers; anything past this is corrupt
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # K3 release shards 95/96: skipped by the text loader

# safetensors dtype -> numpy dtype (ml_dtypes for the ones numpy lacks). F4 (two codes per byte) is not listed:
# K3 stores its MXFP4 experts as U8 bytes, and a shape-in-elements F4 entry would need its own byte rule.
SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

# one routed expert's tensor: (moe prefix + ".experts", expert id, w1/w2/w3, part)
EXPERT_TENSOR_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(w\d)\.(weight_packed|weight_scale|weight)$")


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


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def _no_duplicate_keys(what: str, file: str):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise CheckpointError(f"{what} has the key {k!r} twice", file=file)
            out[k] = v
        return out
    return hook


# ------------------------------------------------------------------------------------------------ shard headers

def _header_json(path: str, file: str, size: int) -> tuple[int, dict]:
    """The header length N and the parsed header object of one shard (``__metadata__`` still in it)."""
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
    return n, hdr


def _entry(name: str, e, file: str, data_start: int, payload: int) -> TensorEntry:
    """One checked header entry: known dtype, shape of non-negative ints, offsets spanning exactly its bytes."""
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
        raise CheckpointError("header entry must be an object with dtype, shape and data_offsets",
                              file=file, tensor=name)
    dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r} (known: {', '.join(SAFETENSORS_DTYPES)})", file=file,
                              tensor=name)
    if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
        raise CheckpointError(f"shape {shape!r} must be a list of non-negative ints", file=file, tensor=name)
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
            and 0 <= offs[0] <= offs[1]):
        raise CheckpointError(f"data_offsets {offs!r} must be [start, end] with 0 <= start <= end",
                              file=file, tensor=name)
    want = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
    if offs[1] - offs[0] != want:
        raise CheckpointError(f"dtype {dtype} and shape {shape} need {want} bytes but data_offsets {offs} "
                              f"span {offs[1] - offs[0]}", file=file, tensor=name)
    if offs[1] > payload:
        raise CheckpointError(f"data_offsets {offs} run past the end of the data ({payload} bytes after the "
                              "header): truncated shard or bad offsets", file=file, tensor=name)
    return TensorEntry(name, file, dtype, tuple(shape), data_start + offs[0], data_start + offs[1])


def read_header(path: str, file: str | None = None) -> ShardHeader:
    """Parse and check one safetensors container header (no data is read).

    Checks: 8-byte length present; header inside the file; JSON object; every entry has a known dtype, a shape of
    non-negative ints and ``data_offsets`` whose length equals prod(shape) × itemsize; ranges inside the payload and
    not overlapping.
    """
    file = file or os.path.basename(path)
    size = os.path.getsize(path)
    n, hdr = _header_json(path, file, size)
    meta = hdr.pop("__metadata__", None)
    if meta is not None and not isinstance(meta, dict):
        raise CheckpointError("'__metadata__' must be an object", file=file)
    data_start, payload = 8 + n, size - 8 - n
    entries = {name: _entry(name, e, file, data_start, payload) for name, e in hdr.items()}
    ranges = sorted((e.start, e.end, e.name) for e in entries.values() if e.end > e.start)
    for (s0, e0, n0), (s1, _, n1) in zip(ranges, ranges[1:], strict=False):
        if s1 < e0:
            raise CheckpointError(f"data of {n1!r} [{s1 - data_start}, ...) overlaps {n0!r} "
                                  f"[{s0 - data_start}, {e0 - data_start})", file=file, tensor=n1)
    return ShardHeader(file, size, n, entries, meta)


# ------------------------------------------------------------------------------------------- index and names

def check_file_name(fname, tensor: str, root: str) -> str:
    """``fname`` if the index may map ``tensor`` to it: a plain ``.safetensors`` file inside ``root`` (no paths,
    no links out, no pickle-based files); else CheckpointError naming the index and the tensor."""
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


def read_index(path: str) -> tuple[dict[str, str], int | None] | None:
    """``(weight_map, metadata.total_size)`` of ``path``'s index, every file name checked; None without an index."""
    index_path = os.path.join(path, INDEX_NAME)
    if not os.path.exists(index_path):
        return None
    try:
        with open(index_path, encoding="utf-8") as f:
            idx = json.load(f, object_pairs_hook=_no_duplicate_keys("index", INDEX_NAME))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"not valid JSON ({e})", file=INDEX_NAME) from None
    if not isinstance(idx, dict) or not isinstance(idx.get("weight_map"), dict):
        raise CheckpointError("must be a JSON object with a 'weight_map' object", file=INDEX_NAME)
    weight_map = idx["weight_map"]
    checked: dict[str, str] = {}
    for name, fname in weight_map.items():
        if fname not in checked:
            checked[fname] = check_file_name(fname, name, path)
    return weight_map, (idx.get("metadata") or {}).get("total_size")


def shard_files(path: str, weight_map: dict[str, str] | None, *, skip_vision: bool = True) -> list[str]:
    """The shard files to open: the index's (shards holding only vision tensors left out with ``skip_vision``),
    or without an index every ``.safetensors`` file of the directory (sorted)."""
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
        if skip_vision:  # shards holding only vision tensors are not even opened
            text_files = {f for n, f in weight_map.items() if not is_vision(n)}
            files = [f for f in files if f in text_files]
        return files
    listing = sorted(os.listdir(path))
    files = [f for f in listing if f.endswith(".safetensors")]
    if not files:
        pickles = [f for f in listing if f.lower().endswith(PICKLE_SUFFIXES)]
        if pickles:
            raise CheckpointError(f"only pickle-based weight files ({', '.join(pickles[:3])}); k3jax never "
                                  "unpickles — convert them to safetensors first", file=path)
        raise CheckpointError(f"no {INDEX_NAME} and no .safetensors files", file=path)
    return files


def read_headers(path: str, files: list[str], weight_map: dict[str, str] | None, *, skip_vision: bool = True):
    """Every shard header of ``files``, cross-checked with the index: each text tensor in exactly one shard, the
    one the index names. Returns ``(headers {file: ShardHeader}, tensors {name: TensorEntry}, skipped names)``."""
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
    return headers, tensors, skipped


# ---------------------------------------------------------------------------------------------------- manifest

def sha256_file(path: str, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


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


__all__ = ["EXPERT_TENSOR_RE", "INDEX_NAME", "MANIFEST_NAME", "MAX_HEADER_BYTES", "PICKLE_SUFFIXES",
           "SAFETENSORS_DTYPES", "VISION_PREFIXES", "ShardHeader", "TensorEntry", "check_file_name", "is_vision",
           "read_header", "read_headers", "read_index", "sha256_file", "shard_files", "verify_manifest"]
