"""Byte access to an opened checkpoint: memory-mapped views, positional reads, byte accounting, scale-byte checks.

``open_checkpoint`` reads the index and every text shard header (``k3jax.checkpoint.container``) and returns a
``Checkpoint``; no data byte is read before its ``read*`` / ``view*`` methods are called. Each file is mapped with
``np.memmap`` and byte ranges are viewed with ``ml_dtypes`` dtypes, or a tensor's bytes are copied straight into a
caller's buffer with positional reads (``read_into``). Reads count the bytes they copy (``bytes_read`` and the
process-wide ``BYTES_READ``) and check E8M0 scale bytes (0xFF = NaN is an error naming the tensor).

    ck = open_checkpoint("ckpt/")
    a = ck.read("language_model.model.norm.weight")
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import numpy as np

from k3jax.checkpoint.container import (
    EXPERT_TENSOR_RE,
    SAFETENSORS_DTYPES,
    ShardHeader,
    TensorEntry,
    read_headers,
    read_index,
    shard_files,
)
from k3jax.checkpoint.errors import CheckpointError


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


def _is_scale(e: TensorEntry) -> bool:
    return e.name.endswith(".weight_scale") and e.dtype == "U8"


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

    def _fd(self, file: str) -> int:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                fd = self._fds[file] = os.open(os.path.join(self.path, file), os.O_RDONLY)
            return fd

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n
        BYTES_READ.add(n)

    def _typed(self, e: TensorEntry, raw: np.ndarray) -> np.ndarray:
        """``raw`` bytes as ``e``'s dtype and shape; scale bytes checked."""
        a = raw.view(SAFETENSORS_DTYPES[e.dtype]).reshape(e.shape)
        if _is_scale(e):
            self.check_scale(e, a)
        return a

    def view_bytes(self, file: str, start: int, end: int) -> np.ndarray:
        """A read-only view of file bytes [start, end) in the page cache, no copy; counted in ``bytes_read``.

        The caller consumes the bytes (decodes or copies them into its own buffer) and must not keep the view.
        """
        m = self._map(file)
        if end > m.shape[0]:
            raise CheckpointError(f"byte range [{start}, {end}) past the end of the file ({m.shape[0]} bytes): "
                                  "the file shrank after its header was read", file=file)
        self._count(end - start)
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
            self._count(nbytes)
        return self._typed(e, buf)

    def view_entry(self, e: TensorEntry) -> np.ndarray:
        """``read_entry`` without the copy: a read-only typed view of the mapped bytes (scale bytes checked)."""
        return self._typed(e, self.view_bytes(e.file, e.start, e.end))

    def read_entry(self, e: TensorEntry) -> np.ndarray:
        return self._typed(e, self.read_bytes(e.file, e.start, e.end))

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
        """Module prefixes stored MXFP4 — decided by the presence of ``<prefix>.weight_packed``
        (docs/numerics.md §10.5)."""
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
                m = EXPERT_TENSOR_RE.match(n)
                if m:
                    k = int(m.group(2))
                    f, s, t = out.get(k, (e.file, e.start, e.end))
                    if f != e.file:
                        raise CheckpointError(f"expert {k} is split across files {f} and {e.file}", tensor=n)
                    out[k] = (f, min(s, e.start), max(t, e.end))
        return out


def open_checkpoint(path: str, *, skip_vision: bool = True) -> Checkpoint:
    """Read the index (if any) and every text shard header; check the containers and the index. No data is read."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError("not a checkpoint directory", file=path)
    weight_map, total_size = read_index(path) or (None, None)
    files = shard_files(path, weight_map, skip_vision=skip_vision)
    headers, tensors, skipped = read_headers(path, files, weight_map, skip_vision=skip_vision)
    return Checkpoint(path, headers, tensors, skipped, weight_map, total_size)


__all__ = ["BYTES_READ", "ByteCounter", "Checkpoint", "open_checkpoint"]
