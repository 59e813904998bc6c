"""Held-out evaluation (k3jax.train.evaluate): window layouts, and the loss against a per-token float64 reference."""

import jax
import numpy as np
import pytest

from k3jax.config import get_preset
from k3jax.model import forward, init_params
from k3jax.train.evaluate import heldout_loss, make_scorer, spaced_windows, tiled_windows, windowed_loss


@pytest.mark.parametrize("n", [2, 17, 33, 64, 65])
def test_tiled_windows_predict_every_token_but_the_first_once(n):
    t = np.arange(n) % 97
    w = tiled_windows(t, seq_len=16)
    assert w.tokens.shape == (-(-(n - 1) // 16), 17) and w.mask.shape == (w.tokens.shape[0], 16)
    np.testing.assert_array_equal(w.tokens[:, 1:][w.mask > 0], t[1:])  # targets, in stream order
    np.testing.assert_array_equal(w.tokens[:, :-1][w.mask > 0], t[:-1])  # the tokens that predict them
    k = w.mask.sum(1).astype(int)
    assert (w.mask == (np.arange(16)[None] < k[:, None])).all()  # each mask is a prefix


def test_spaced_windows_are_fixed_full_windows_and_mod_vocab():
    t = np.arange(1000, dtype=np.uint8)
    w = spaced_windows(t, num=5, seq_len=8, vocab=97)
    assert w.tokens.shape == (5, 9) and w.mask is None
    np.testing.assert_array_equal(w.tokens[0], np.arange(9) % 97)
    np.testing.assert_array_equal(w.tokens[-1], t[-9:].astype(np.int32) % 97)
    np.testing.assert_array_equal(w.tokens, spaced_windows(t, num=5, seq_len=8, vocab=97).tokens)


@pytest.mark.slow
def test_heldout_loss_matches_a_per_token_reference_masked_or_not():
    cfg = get_preset("k3-tiny")
    params = init_params(cfg, jax.random.key(0))
    t = (np.arange(150) * 7 + 3) % cfg.vocab_size
    T = 16
    starts = np.arange(0, t.size - 1, T)
    logits = [np.asarray(forward(params, t[None, a:a + T + 1][:, :-1], cfg), np.float64)[0] for a in starts]
    nll = []
    for a, lg in zip(starts, logits):
        y = t[a + 1:a + T + 1]
        lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
        nll.extend((lse[:y.size] - lg[np.arange(y.size), y]).tolist())
    ref = float(np.mean(nll))
    nats, n = windowed_loss(params, cfg, t, seq_len=T, batch=4)  # 10 windows: a padded last batch, a partial window
    assert n == t.size - 1
    np.testing.assert_allclose(nats, ref, rtol=2e-6)
    full = tiled_windows(t[:129], seq_len=T)._replace(mask=None)  # 8 full windows, unmasked, batches of 3
    nats2, n2 = heldout_loss(params, full, batch=3, score=make_scorer(cfg))
    assert n2 == 128
    np.testing.assert_allclose(nats2, np.mean(nll[:128]), rtol=2e-6)
