"""Chunked prefill in pieces vs one prefill, and each vs float64 with the same parameters (k3-tiny, 130 tokens,
64-token chunks, fp32 logits rel-RMS): the figures of experiments/LOG.md, 2026-12-02.

    python experiments/prefill_pieces.py
"""

import os
import sys

import jax
import numpy as np

from k3jax.config import default_run, get_preset
from k3jax.model.functional import init_params
from k3jax.testing import rel_rms

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "model"))
from test_cache import _pieces_vs_one_shot as pieces_vs_one_shot  # noqa: E402  (the test's own helper)

jax.config.update("jax_enable_x64", True)


cfg = get_preset("k3-tiny")
run = default_run(cfg, kda_chunk_size=64)
params = init_params(cfg, jax.random.key(0), run)
toks = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 130)).astype(np.int32)
run64 = default_run(cfg, kda_chunk_size=64, param_dtype="float64", compute_dtype="float64")
p64 = jax.tree.map(lambda a: a.astype(np.float64) if a.dtype == np.float32 else a, params)
_, exact = pieces_vs_one_shot(cfg, run64, p64, toks, (130,), 130)
for pieces in [(1, 17, 64, 1, 30, 3, 14), (18, 64, 48), (64, 64, 2)]:
    got, one = pieces_vs_one_shot(cfg, run, params, toks, pieces, 64)
    print(pieces, f"pieces vs one-shot {rel_rms(got, one):.2e}, pieces vs float64 {rel_rms(got, exact):.2e}, "
          f"one-shot vs float64 {rel_rms(one, exact):.2e}")
