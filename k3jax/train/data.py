"""Training data: byte-level tokens, a held-out split and a batch order that is a pure function of (seed, step).

    train, heldout = split(load_corpus(None, max_bytes=4 << 20), heldout_frac=0.05)
    x = batch_at(train, seed=0, step=17, batch=16, seq_len=128)   # [16, 129] int32; inputs x[:, :-1]

Because ``batch_at`` depends only on (seed, step), a resumed run sees exactly the batches an uninterrupted run
would (the data position IS the step). Vocabularies smaller than 256 (k3-tiny: 97) see ``byte % vocab``. Windows
of the held-out split, and their loss, are ``k3jax.train.evaluate``'s.
"""

from __future__ import annotations

import json
import os

import numpy as np

from k3jax.data import stdlib_bytes
from k3jax.errors import InputError


def _read_user_file(path: str) -> bytes:
    if not os.path.isfile(path):
        raise InputError(f"--data: no such file {path!r}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise InputError(f"--data: cannot read {path!r}: {e}") from e
    if not path.endswith(".jsonl"):
        return raw
    out = []
    for n, line in enumerate(raw.decode("utf-8", errors="strict").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"--data: {path}:{n}: not JSON ({e.msg})") from e
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise InputError(f"--data: {path}:{n}: each JSONL line needs a string field \"text\"")
        out.append(rec["text"].encode("utf-8"))
    return b"\n".join(out)


def load_corpus(paths=None, *, max_bytes: int = 4 << 20) -> np.ndarray:
    """uint8 tokens: the stdlib corpus (``paths`` None) or the concatenation of user text / JSONL files."""
    if not paths:
        toks = stdlib_bytes(max_bytes)
    else:
        toks = np.frombuffer(b"\n".join(_read_user_file(os.fspath(p)) for p in paths)[:max_bytes], np.uint8).copy()
    if toks.size == 0:
        raise InputError("--data: the corpus is empty")
    return toks


def split(tokens: np.ndarray, heldout_frac: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout): the held-out part is the corpus tail, so no training window overlaps it."""
    n_held = int(len(tokens) * heldout_frac)
    return tokens[: len(tokens) - n_held], tokens[len(tokens) - n_held:]


def check_size(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if len(tokens) < seq_len + 2:
        raise InputError(f"--data: the {what} split has {len(tokens)} bytes, fewer than seq_len + 2 = {seq_len + 2}")


def batch_at(tokens: np.ndarray, *, seed: int, step: int, batch: int, seq_len: int, vocab: int = 256) -> np.ndarray:
    """[batch, seq_len + 1] int32 windows at positions drawn from numpy's PCG64 seeded by (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    x = tokens[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)
    return x % vocab if vocab < 256 else x


def unigram_entropy(tokens: np.ndarray, vocab: int = 256) -> float:
    """Unigram (byte-frequency) entropy in nats: the loss of the best context-free predictor."""
    t = tokens.astype(np.int64) % vocab if vocab < 256 else tokens.astype(np.int64)
    p = np.bincount(t, minlength=vocab).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


__all__ = ["batch_at", "check_size", "load_corpus", "split", "unigram_entropy"]
