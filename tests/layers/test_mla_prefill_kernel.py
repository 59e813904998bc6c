"""Cached prefill pieces through the MLA flash kernel (``MLA.extend`` with impl="pallas" and more than
``MAX_DECODE_QUERIES`` tokens: per-row offsets q_offset = start) against the XLA latent attention (impl="xla", the
materialized form): ragged starts and lengths over a cache holding stale finite rows, flat and stacked (``layer``)
caches, under a 2-device context mesh, and through ``model.cache.prefill`` pieces on k3-tiny (slow)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import default_run, get_preset
from k3jax.layers.mla import MAX_DECODE_QUERIES, MLA
from k3jax.model import cache as C  # noqa: N812
from k3jax.model.functional import init_params
from k3jax.sharding.context_parallel import ContextParallel
from k3jax.sharding.mesh import make_mesh
from k3jax.testing import TOL, assert_close

B, S, T, BLOCK = 3, 40, 12, 8
START = np.array([0, 5, 17], np.int32)
LENGTHS = np.array([12, 9, 0], np.int32)   # row 2: an idle row (all padding)


@pytest.fixture(autouse=True)
def _ieee_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _setup(stacked: bool):
    cfg = get_preset("k3-tiny")
    mla = MLA(d=cfg.hidden_size, num_heads=cfg.mla_num_heads, q_lora_rank=cfg.q_lora_rank,
              kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
              qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, output_gate=cfg.mla_output_gate,
              rngs=nnx.Rngs(0))
    k = jax.random.split(jax.random.key(1), 3)
    lead = (2, B) if stacked else (B,)          # stale, finite rows everywhere (a reused cache)
    cache = {"c_kv": jax.random.normal(k[0], (*lead, S, cfg.kv_lora_rank)),
             "k_rope": jax.random.normal(k[1], (*lead, S, cfg.qk_rope_head_dim))}
    x = jax.random.normal(k[2], (B, T, cfg.hidden_size))
    return cfg, mla, cache, x


def _extend(cfg, mla, cache, x, *, impl, absorbed, layer=None, context=None):
    gdef, state = nnx.split(mla)

    @jax.jit
    def run(state, cache, x):
        return nnx.merge(gdef, state).extend(x, cache, start=jnp.asarray(START), lengths=jnp.asarray(LENGTHS),
                                             norm_eps=cfg.mla_norm_eps, block_size=BLOCK, absorbed=absorbed,
                                             layer=layer, context=context, impl=impl)
    return run(state, cache, x)


def _check(got, want):
    (y, cache), (y_ref, cache_ref) = got, want
    assert np.isfinite(np.asarray(y)).all()                           # padding queries included
    real = np.arange(T)[None, :] < LENGTHS[:, None]
    assert_close(np.asarray(y)[real], np.asarray(y_ref)[real], TOL["fp32_vs_fp64"], name="y (real tokens)")
    for name in cache:
        np.testing.assert_array_equal(np.asarray(cache[name]), np.asarray(cache_ref[name]), err_msg=name)


@pytest.mark.parametrize("stacked", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_extend_flash_equals_xla(stacked):
    assert T > MAX_DECODE_QUERIES                     # the flash kernel's branch, not the decode kernel's
    cfg, mla, cache, x = _setup(stacked)
    layer = 1 if stacked else None
    want = _extend(cfg, mla, cache, x, impl="xla", absorbed=False, layer=layer)
    _check(_extend(cfg, mla, cache, x, impl="pallas", absorbed=True, layer=layer), want)


@pytest.mark.slow   # 10.6 s on the shared 2-core machine: past the default pass's budget
def test_extend_flash_under_a_context_mesh():
    """The piece split over 2 devices (mirror-balanced: each shard's two halves at their own per-row offsets)."""
    cfg, mla, cache, x = _setup(False)
    cp = ContextParallel(make_mesh({"context": 2}), "fsdp", batch=B)
    want = _extend(cfg, mla, cache, x, impl="xla", absorbed=False)
    _check(_extend(cfg, mla, cache, x, impl="pallas", absorbed=False, context=cp), want)


@pytest.mark.slow
def test_prefill_pieces_pallas_equals_xla_scanned_cache():
    """k3-tiny through ``model.cache.prefill`` in two ragged pieces of width 16 (rows of 16 + 11 and 5 + 14 tokens:
    the second piece starts at 16 and 5), stacked (scanned) caches: logits and caches of mla_impl="pallas" match
    "xla"."""
    cfg = get_preset("k3-tiny")
    out = {}
    for impl in ("xla", "pallas"):
        run = default_run(cfg, kda_chunk_size=64, mla_impl=impl)
        params = init_params(cfg, jax.random.key(0), run)
        toks = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 32)).astype(np.int32)
        cache = C.init_cache(cfg, 2, 40, run, stacked=True)
        logits = []
        at = np.zeros(2, np.int32)
        for lengths in (np.array([16, 5]), np.array([11, 14])):
            piece = np.zeros((2, 16), np.int32)
            for r in range(2):
                piece[r, :lengths[r]] = toks[r, at[r]: at[r] + lengths[r]]
            lg, cache = C.prefill(params, piece, lengths, cache, cfg, run)
            logits.append(np.concatenate([np.asarray(lg[r, :lengths[r]]) for r in range(2)]))
            at += lengths
        out[impl] = (np.concatenate(logits), cache)
    assert_close(out["pallas"][0], out["xla"][0], TOL["fp32_vs_fp64"], name="logits")
    for a, b in zip(jax.tree.leaves(out["pallas"][1]), jax.tree.leaves(out["xla"][1]), strict=True):
        assert_close(a, b, TOL["fp32_vs_fp64"], atol_floor=1e-30, name="cache")
