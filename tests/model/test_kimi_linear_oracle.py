"""k3jax against HF transformers' own Kimi-Linear (``KimiLinearForCausalLM``, torch 2.13 CPU, float32).

Torch never enters this environment: ``tests/golden/kimi_linear/make_golden.py`` ran transformers once in a
separate venv (see the README there) and committed what it made:

- ``ckpt/``: ``config.json``, ``generation_config.json`` and ``model.safetensors`` (fp32) exactly as transformers'
  ``save_pretrained`` wrote them for a seeded random init of the ``kimi-linear-tiny`` preset (the config it read is
  ``hf_config.json``, k3jax's ``to_hf_dict`` of the preset).
- ``golden.npz``, for prompts i = 0, 1, 2 (lengths 1, 7, 70; batch 1):
  ``prompt_{i}`` int32 [P], ``generated_{i}`` int32 [24] (``model.generate``: greedy, ``use_cache=True``),
  ``step_logits_{i}`` float32 [24, V] (the logits each cached step chose from: step j is position P - 1 + j),
  ``forward_logits_{i}`` float32 [P + 24, V] (one uncached forward over prompt + generated tokens),
  ``forward_logits_f64_2`` float64 [94, V] (the same forward of prompt 2 in true float64: transformers' modelling
  source with its internal float32 casts made float64), and ``versions`` (str: torch, transformers, python, numpy).

Here: k3jax's float32 full forward on prompt + generated tokens (as ``k3 logits`` runs it) equals transformers'
float32 forward logits within max abs ≤ 1e-4 and rel-RMS ≤ 1e-5 (both asserted; docs/numerics.md §15.2's tiny
Kimi-Linear row; measured ≤ 4.2e-5 / 5.1e-6, which is float32 rounding: transformers' float32 is 5.2e-6 rel-RMS from the
float64 forward, k3jax's 2e-6); the checkpoint's config is the preset's architecture. Slow: the preset's run settings
(small KDA chunks and key blocks), and k3jax in float64 against the float64 forward (≤ 1e-10; measured 7e-14).

The checkpoint is loaded as transformers wrote it, with ``strict_config``: layer 0's dense MLP under
``block_sparse_moe.{gate,up,down}_proj`` (docs/model.md §13: "accept both") and the keys ``KimiLinearConfig`` derives
(``layer_types``, ``mlp_layer_types``, ...; checked to agree with the ones k3jax reads).
"""

import os
import warnings

import jax
import numpy as np
import pytest

from k3jax.checkpoint.load import load
from k3jax.config import RunConfig, UnknownConfigKeysWarning, architecture_diff, default_run, from_hf, get_preset
from k3jax.model import forward

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "kimi_linear")
CKPT = os.path.join(GOLDEN, "ckpt")
PROMPTS = 3
MAX_ABS, REL_RMS = 1e-4, 1e-5


@pytest.fixture(scope="module")
def golden():
    with np.load(os.path.join(GOLDEN, "golden.npz"), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _load(path, dtype=None):
    return load(path, dtype=dtype, progress=False, strict_config=True)


@pytest.fixture(scope="module")
def loaded():
    return _load(CKPT)


def _sequences(golden):
    """[3, T] right-padded prompt + generated tokens (causal: padding never reaches earlier positions), lengths."""
    seqs = [np.concatenate([golden[f"prompt_{i}"], golden[f"generated_{i}"]]) for i in range(PROMPTS)]
    tokens = np.zeros((PROMPTS, max(len(s) for s in seqs)), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    return tokens, [len(s) for s in seqs]


def _check_forward(cfg, params, run, golden):
    tokens, lengths = _sequences(golden)
    logits = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg, run))(params, tokens), np.float32)
    for i, n in enumerate(lengths):
        got, want = logits[i, :n], golden[f"forward_logits_{i}"]
        assert got.shape == want.shape
        err = np.abs(got - want).max()
        rel = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
        assert err <= MAX_ABS and rel <= REL_RMS, f"prompt {i} (T={n}): max abs {err:.2e}, rel-RMS {rel:.2e}"
        assert (got[len(golden[f"prompt_{i}"]) - 1:-1].argmax(-1) == golden[f"generated_{i}"]).all()


def test_checkpoint_config_is_the_kimi_linear_tiny_preset(loaded):
    cfg, _ = loaded
    preset = get_preset("kimi-linear-tiny")
    assert architecture_diff(cfg, preset, storage=True) == []
    report = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownConfigKeysWarning)
        assert architecture_diff(from_hf(os.path.join(GOLDEN, "hf_config.json"), report=report), preset) == []
    assert report["unknown_keys"] == []


def test_full_forward_matches_transformers(loaded, golden):
    """As ``k3 logits`` runs it: a config read from a file gets ``RunConfig()`` (64-token KDA chunks, as
    transformers' chunked path; the 94-token sequence crosses one)."""
    cfg, params = loaded
    _check_forward(cfg, params, RunConfig(), golden)


@pytest.mark.slow  # a second compile of the 8-layer forward (~10 s on a free core)
def test_full_forward_matches_transformers_preset_run(loaded, golden):
    """The preset's run settings: 16-token KDA chunks and 16-key MLA blocks (many-chunk and blockwise paths)."""
    cfg, params = loaded
    _check_forward(cfg, params, default_run(get_preset("kimi-linear-tiny")), golden)


@pytest.mark.slow  # float64 load + compile
def test_float64_forward_matches_transformers_float64(golden, x64):
    """Every formula and eps: k3jax in float64 vs transformers' forward in true float64 (prompt 2, 94 tokens)."""
    cfg, params = _load(CKPT, dtype="float64")
    i = PROMPTS - 1
    tokens = np.concatenate([golden[f"prompt_{i}"], golden[f"generated_{i}"]])[None].astype(np.int32)
    run = RunConfig(param_dtype="float64", compute_dtype="float64")
    got = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg, run))(params, tokens))[0]
    want = golden[f"forward_logits_f64_{i}"]
    assert got.dtype == want.dtype == np.float64
    assert np.abs(got - want).max() <= 1e-10

