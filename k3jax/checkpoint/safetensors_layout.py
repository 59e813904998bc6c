"""safetensors container layout of the official K3 shards (docs/checkpoint.md §11.5–11.6), computed without any weights.

    file   = u64_le(N) ‖ header (N bytes) ‖ data
    header = '{' + ','.join('"name":{"dtype":"D","shape":[a,b],"data_offsets":[s,e]}') + '}'   compact JSON,
             keys in that order, no "__metadata__", right-padded with spaces to a multiple of 8 (N counts them)
    order  = dtype rank (F32, BF16, U8), then the name's bytes; data contiguous in header order

    >>> lay = shard_layout([("b", "BF16", (2,)), ("c", "F32", ())])
    >>> lay.header.decode()
    '{"c":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}}     '
    >>> lay.header_len, lay.payload_bytes, lay.file_bytes
    (112, 8, 128)
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# dtype -> (rank in the official header order, item size in bytes). K3 uses exactly these three
# (docs/checkpoint.md §11.6).
K3_HEADER_DTYPES = {"F32": (0, 4), "BF16": (1, 2), "U8": (2, 1)}


def itemsize(dtype: str) -> int:
    if dtype not in K3_HEADER_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not used by the K3 checkpoint format; "
                         f"known: {', '.join(K3_HEADER_DTYPES)}")
    return K3_HEADER_DTYPES[dtype][1]


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * itemsize(dtype)


def order_key(name: str, dtype: str) -> tuple[int, bytes]:
    """Official header / data order: dtype rank first, then byte-lexicographic name."""
    itemsize(dtype)
    return K3_HEADER_DTYPES[dtype][0], name.encode("utf-8")


def shard_file_name(k: int, total: int) -> str:
    """``model-{k:05d}-of-{total:06d}.safetensors`` — the total has SIX digits (``-of-000096``)."""
    if not 1 <= k <= total:
        raise ValueError(f"shard number {k} outside 1..{total}")
    return f"model-{k:05d}-of-{total:06d}.safetensors"


@dataclass(frozen=True)
class ShardLayout:
    """One safetensors file: padded header bytes, per-tensor data offsets (relative to 8 + N) and sizes."""

    header: bytes  # the N padded header bytes
    names: tuple[str, ...]  # header order
    offsets: tuple[tuple[int, int], ...]  # data_offsets, same order
    payload_bytes: int

    @property
    def header_len(self) -> int:
        return len(self.header)

    @property
    def data_start(self) -> int:
        return 8 + len(self.header)

    @property
    def file_bytes(self) -> int:
        return 8 + len(self.header) + self.payload_bytes

    @property
    def header_sha256(self) -> str:
        return hashlib.sha256(self.header).hexdigest()

    def prefix(self) -> bytes:
        """The first ``data_start`` bytes of the file: the u64 length and the header."""
        return struct.pack("<Q", len(self.header)) + self.header


def shard_layout(entries: Iterable[tuple[str, str, Sequence[int]]]) -> ShardLayout:
    """Header and offsets for ``(name, dtype, shape)`` entries given in any order (sorted here)."""
    ents = sorted(((n, d, tuple(int(s) for s in sh)) for n, d, sh in entries), key=lambda e: order_key(e[0], e[1]))
    parts, names, offsets = [], [], []
    pos = 0
    seen = set()
    for name, dtype, shape in ents:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one shard")
        if name == "__metadata__":
            raise ValueError("'__metadata__' is not a tensor name (the K3 format has no metadata entry)")
        seen.add(name)
        end = pos + nbytes(dtype, shape)
        dims = ",".join(map(str, shape))
        parts.append(f'{json.dumps(name, ensure_ascii=False)}:{{"dtype":"{dtype}","shape":[{dims}],'
                     f'"data_offsets":[{pos},{end}]}}')
        names.append(name)
        offsets.append((pos, end))
        pos = end
    raw = ("{" + ",".join(parts) + "}").encode("utf-8")
    header = raw + b" " * (-len(raw) % 8)
    return ShardLayout(header=header, names=tuple(names), offsets=tuple(offsets), payload_bytes=pos)


__all__ = ["K3_HEADER_DTYPES", "itemsize", "nbytes", "order_key", "shard_file_name", "ShardLayout", "shard_layout"]
