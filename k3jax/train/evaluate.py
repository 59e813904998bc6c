"""Held-out evaluation, the one home: mean next-token cross-entropy over windows of the held-out split.

    nats, n = windowed_loss(params, cfg, heldout_tokens, seq_len=64, batch=32)       # `k3 run`, the ship script
    w = spaced_windows(heldout_tokens, num=32, seq_len=128, vocab=97)                 # the train loop's fixed eval set
    nats, n = heldout_loss(params, w, batch=16, score=make_scorer(cfg, params_sharding=..., batch_sharding=...))

A window of ``seq_len + 1`` tokens is an independent sequence that predicts its last ``seq_len`` tokens; ``mask``
marks the predictions that are scored (None: all of them) and ``n`` counts them. ``tiled_windows`` covers a whole
token stream with non-overlapping windows (every token but the first of each window is predicted exactly once; the
last, partial window is zero-padded and scored on the tokens it has); ``spaced_windows`` picks ``num`` evenly spaced
full windows, the same ones at every eval of a run. Windows are scored ``batch`` at a time; with a mask, a short last
batch is padded with masked-out rows (one compiled shape), without one it is scored as it is. Sums are float32 per
batch and float64 across batches.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from k3jax.errors import InputError
from k3jax.model import forward


class Windows(NamedTuple):
    tokens: np.ndarray  # [N, T + 1] int32: position t predicts t + 1
    mask: np.ndarray | None  # [N, T] float32: 1 where the prediction of token t + 1 is scored; None: everywhere
    segments: np.ndarray | None = None  # [N, T + 1] int32 document ids of packed windows (None: one sequence each)


def packed_windows(batch: dict) -> Windows:
    """A packed batch ({"tokens", "segments", "weights"}: ``k3jax.train.data``) as held-out windows: documents
    mixed on their own, predictions scored by their weights."""
    return Windows(batch["tokens"], batch["weights"], batch["segments"])


def tiled_windows(tokens, *, seq_len: int) -> Windows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over the whole stream (consecutive windows share one)."""
    t = np.asarray(tokens).reshape(-1).astype(np.int32)
    if t.size < 2:
        raise InputError(f"need at least 2 tokens to score, got {t.size}")
    starts = np.arange(0, t.size - 1, seq_len)
    w = np.zeros((starts.size, seq_len + 1), np.int32)
    m = np.zeros((starts.size, seq_len), np.float32)
    for j, a in enumerate(starts):
        s = t[a:a + seq_len + 1]
        w[j, :s.size], m[j, :s.size - 1] = s, 1.0
    return Windows(w, m)


def spaced_windows(tokens: np.ndarray, *, num: int, seq_len: int, vocab: int = 256, between: bool = False) -> Windows:
    """``num`` evenly spaced full windows; tokens are taken ``% vocab`` when ``vocab < 256`` (byte-level data).
    ``between``: instead, the ``num - 1`` windows midway between neighbouring ones (a scaling study's tuning windows),
    which share no token with them — a ValueError when the spacing is under two windows."""
    starts = np.linspace(0, len(tokens) - seq_len - 1, num).astype(np.int64)
    if between:
        if num < 2 or np.min(np.diff(starts)) < 2 * (seq_len + 1):
            raise ValueError(f"{num} windows of {seq_len + 1} tokens over {len(tokens)} held-out tokens leave no room "
                             f"for disjoint windows between them (need a spacing of >= {2 * (seq_len + 1)} tokens)")
        starts = (starts[:-1] + starts[1:]) // 2
    w = tokens[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)
    return Windows(w % vocab if vocab < 256 else w, None)


def make_scorer(cfg, run=None, *, params_sharding=None, batch_sharding=None, dispatch=None):
    """(params, tokens [b, T + 1], mask [b, T] or None, segments [b, T + 1] or None) -> summed (masked)
    cross-entropy (f32), jitted. With shardings (the train loop's data-parallel eval), tokens, mask and segments
    are placed with ``batch_sharding`` first."""
    def score(params, tokens, mask, segments=None):
        seg = None if segments is None else segments[:, :-1]
        logits = forward(params, tokens[:, :-1], cfg, run, dispatch=dispatch, segment_ids=seg)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        # no multiply without a mask: an all-ones one changes XLA's summation order (the last bits of the loss)
        return jnp.sum(ce) if mask is None else jnp.sum(ce * mask)

    if batch_sharding is None:
        return jax.jit(score)
    jitted = jax.jit(score, in_shardings=(params_sharding, batch_sharding, batch_sharding, batch_sharding))
    return lambda params, tokens, mask, segments=None: jitted(
        params, *jax.device_put((tokens, mask, segments), batch_sharding))


def heldout_loss(params, windows: Windows, *, batch: int, score) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats per scored token) over ``windows``, and the number of tokens scored;
    ``score`` is a ``make_scorer`` function."""
    total, count = 0.0, 0
    for i in range(0, len(windows.tokens), batch):
        t = windows.tokens[i:i + batch]
        m = None if windows.mask is None else windows.mask[i:i + batch]
        s = None if windows.segments is None else windows.segments[i:i + batch]
        if m is not None and len(t) < batch:
            t, m = (np.concatenate([a, np.zeros((batch - len(a), a.shape[1]), a.dtype)]) for a in (t, m))
            if s is not None:
                s = np.concatenate([s, np.zeros((batch - len(s), s.shape[1]), s.dtype)])
        total += float(score(params, t, m) if s is None else score(params, t, m, s))
        count += t[:, 1:].size if m is None else int(m.sum())
    return total / count, count


def windowed_loss(params, cfg, tokens, *, seq_len: int = 256, batch: int = 8, run=None) -> tuple[float, int]:
    """Held-out loss of ``tokens`` covered by ``tiled_windows`` (what `k3 run` and the ship script report)."""
    return heldout_loss(params, tiled_windows(tokens, seq_len=seq_len), batch=batch, score=make_scorer(cfg, run))


__all__ = ["Windows", "heldout_loss", "make_scorer", "packed_windows", "spaced_windows", "tiled_windows",
           "windowed_loss"]
