"""Fixtures shared by the CLI tests."""

import numpy as np
import pytest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(a k3-tiny checkpoint with packed MXFP4 experts and weights large enough to route unevenly, a token file of
    3 ragged rows: 30, 21 and 7 real ids)."""
    from k3jax.checkpoint.save import save
    from k3jax.config import get_preset
    from k3jax.testing import random_params

    d = tmp_path_factory.mktemp("tiny")
    cfg = get_preset("k3-tiny")
    save(random_params(cfg, seed=5, std=0.2), cfg, d / "ckpt")
    rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 30)).astype(np.int32)
    rows[1, 21:] = -1
    rows[2, 7:] = -1
    np.save(d / "tokens.npy", rows)
    return str(d / "ckpt"), str(d / "tokens.npy")
