"""Held-out loss of a model over a byte stream, in non-overlapping windows (what `k3 run` reports).

    nats, n = windowed_loss(params, cfg, heldout_tokens, seq_len=256, batch=8)

Each window of ``seq_len + 1`` tokens is an independent sequence that predicts its last ``seq_len`` tokens, so
every held-out token but the first of each window is predicted exactly once; ``n`` counts the predicted tokens.
The last partial window is scored on the tokens it has.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def windowed_loss(params, cfg, tokens, *, seq_len: int = 256, batch: int = 8) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats per token, float64 accumulation) and the number of tokens scored."""
    from k3jax.model import forward

    t = np.asarray(tokens).reshape(-1).astype(np.int32)
    if t.size < 2:
        raise ValueError(f"need at least 2 tokens to score, got {t.size}")
    starts = np.arange(0, t.size - 1, seq_len)

    @jax.jit
    def ce(p, x, y, m):
        logits = forward(p, x, cfg)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y) * m)

    total, count = 0.0, 0
    for i in range(0, starts.size, batch):
        s = starts[i:i + batch]
        x = np.zeros((batch, seq_len), np.int32)
        y = np.zeros((batch, seq_len), np.int32)
        m = np.zeros((batch, seq_len), np.float32)
        for j, a in enumerate(s):
            w = t[a:a + seq_len + 1]
            x[j, :w.size - 1], y[j, :w.size - 1], m[j, :w.size - 1] = w[:-1], w[1:], 1.0
        total += float(ce(params, x, y, m))
        count += int(m.sum())
    return total / count, count


__all__ = ["windowed_loss"]
