"""A checkpoint transformers 5's ``save_pretrained`` wrote for a Kimi-Linear it built itself: the release's tensor
names, transformers' config form (``layer_types``, ``mlp_layer_types``, ``linear_num_heads``, ... and no
``linear_attn_config`` / ``first_k_dense_replace``). ``k3 logits`` reads it and matches transformers' logits; export
writes the release's form.

Torch never enters this environment: ``tests/golden/kimi_linear_transformers_form/make_golden.py`` ran transformers
once in a separate venv (see the README there) and committed ``ckpt/`` as ``save_pretrained`` wrote it and
``golden.npz`` (``tokens`` int32 [2, 70], transformers' float32 ``logits`` [2, 70, 256] of one uncached forward).
"""

import json
import os

import numpy as np
import pytest

from k3jax.checkpoint.load import load
from k3jax.checkpoint.save import save
from k3jax.cli.main import main
from k3jax.config import from_hf
from k3jax.config.hf_keys import DERIVED_NAMES
from k3jax.testing import TOL, assert_close

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "kimi_linear_transformers_form")
CKPT = os.path.join(GOLDEN, "ckpt")
MAX_ABS = 1e-4  # float32 logits of std ~1 from two implementations (as the kimi_linear oracle test)


@pytest.fixture(scope="module")
def golden():
    with np.load(os.path.join(GOLDEN, "golden.npz"), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def test_the_golden_config_is_transformers_form():
    with open(os.path.join(CKPT, "config.json")) as f:
        raw = json.load(f)
    assert "linear_attn_config" not in raw and "first_k_dense_replace" not in raw and "mla_use_nope" not in raw
    derived = {"layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"}
    assert derived <= set(raw)


def test_k3_logits_reads_a_transformers_saved_checkpoint_and_matches_transformers(golden, tmp_path):
    tokens, out = tmp_path / "tokens.npy", tmp_path / "logits.npy"
    np.save(tokens, golden["tokens"])
    assert main(["logits", CKPT, "--tokens", str(tokens), "--out", str(out), "--strict-config"]) == 0
    got, want = np.load(out), golden["logits"]
    assert got.shape == want.shape == (2, 70, 256)
    assert_close(got, want, TOL["fp32_vs_fp64"], name="k3jax vs transformers logits")
    assert np.abs(got - want).max() <= MAX_ABS


def test_export_of_a_transformers_form_checkpoint_writes_the_release_form(tmp_path):
    stats = {}
    cfg, params = load(CKPT, progress=False, strict_config=True, stats=stats)
    t = stats["tolerated"]
    assert t["dense_mlp_names"] == {"block_sparse_moe": [0, 1]} and t["unknown_keys"] == []
    assert (cfg.full_attn_layers, cfg.first_k_dense_replace, cfg.kda_conv_size) == ((2, 5), 2, 3)
    d = tmp_path / "export"
    save(params, cfg, str(d))
    with open(d / "config.json") as f:
        written = json.load(f)
    assert written["linear_attn_config"]["full_attn_layers"] == [2, 5] and written["first_k_dense_replace"] == 2
    assert not DERIVED_NAMES & set(written)
    report = {}
    assert from_hf(str(d), strict=True, report=report) == cfg and report["transformers_form"] == {}
