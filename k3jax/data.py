"""Byte-level token data from a corpus that exists on every machine: the Python standard library's own sources.

    tokens = stdlib_bytes(max_bytes=1 << 20)   # uint8 array, deterministic file order
    docs = stdlib_documents(max_bytes=1 << 20)  # the same bytes, one document per file
    text_identity(tokens)   # {"sha256", "bytes", "python"}: which text a figure was measured on

The corpus is the running interpreter's own standard library, so it differs between Python versions (and builds):
a figure measured on it names its text with ``text_identity``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig

import numpy as np


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests"))
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    if not out:
        raise FileNotFoundError(f"no .py files under the standard library at {root}")
    return out


def stdlib_documents(max_bytes: int = 1 << 20) -> list[bytes]:
    """The stdlib sources (sorted paths), one document per file, up to ``max_bytes`` in all (the last one cut)."""
    chunks, n = [], 0
    for path in stdlib_files():
        with open(path, "rb") as f:
            b = f.read()
        chunks.append(b[:max_bytes - n])
        n += len(chunks[-1])
        if n >= max_bytes:
            break
    return chunks


def stdlib_bytes(max_bytes: int = 1 << 20) -> np.ndarray:
    """The first ``max_bytes`` bytes of the concatenated stdlib sources (sorted paths) as uint8 tokens."""
    return np.frombuffer(b"".join(stdlib_documents(max_bytes)), dtype=np.uint8).copy()


def text_identity(tokens) -> dict:
    """Which bytes a figure was measured on, so that two machines' figures can be compared: the sha256 of
    ``tokens`` (uint8 byte tokens) and their count, and the Python version whose standard library is the corpus
    (``stdlib_files``: the running interpreter's)."""
    b = np.ascontiguousarray(tokens, dtype=np.uint8).tobytes()
    return {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b), "python": platform.python_version()}
