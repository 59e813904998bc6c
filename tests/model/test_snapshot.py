"""Prefix snapshots (k3jax/model/snapshot.py): snapshot at any position p → restore into another slot → continue
equals one-shot prefill and token-by-token decode; provenance keys refuse a snapshot used with another model,
parameter set or prompt.

The f32 property test runs the chunked KDA prefill (16-token chunks on k3-tiny), whose state at p is what a
snapshot stores, at the issue's 1e-6 (seen <= 7e-7; the prefill keeps the whole prompt's chunk grid and exact
pairwise decays, layers/kda.py ``_aligned``); in float64 the three must agree to 1e-10, at random p and at p = 1
and p = a chunk multiple."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3jax.config import default_run, get_preset
from k3jax.model import cache as C  # noqa: N812
from k3jax.model import snapshot as S  # noqa: N812
from k3jax.model.functional import init_params
from k3jax.testing import assert_close, rel_rms

T = 40  # one padded width: every prefill compiles once


class _Model(tuple):
    def __repr__(self):  # hypothesis prints the fixture of a failing example: keep it to a line
        return f"<{self[0].name} {self[1]}>"


def _model(**run_overrides):
    cfg = get_preset("k3-tiny")
    run = default_run(cfg, **run_overrides)
    params = init_params(cfg, jax.random.key(0), run)
    return _Model((cfg, run, params, S.params_fingerprint(params)))


def _fill_row(cache, row, value):
    """Every float entry of ``row`` set to ``value`` (a recycled slot's stale contents)."""
    return jax.tree.map(lambda x: x.at[row].set(value) if jnp.issubdtype(x.dtype, jnp.floating) else x, cache)


def _three_ways(m, toks, p, other, slot_value):
    """(snapshot → restore → continue, one-shot prefill, token by token, marked prefill) logits for ``toks`` [T]."""
    cfg, run, params, fp = m
    both = np.stack([toks, other])
    marked, cache = C.prefill(params, both, None, C.init_cache(cfg, 2, T, run), cfg, run, marks=np.array([p, -1]))
    snap = S.snapshot(cache, 0, p, cfg=cfg, key=S.provenance(cfg, fp, toks[:p], run))
    # Restore into row 1 of a cache whose row 0 holds the other prompt and whose row 1 is stale.
    target = C.prefill(params, both[::-1], None, C.init_cache(cfg, 2, T, run), cfg, run)[1]
    target = _fill_row(target, 1, slot_value)
    target = S.restore(target, 1, snap, cfg=cfg, key=S.provenance(cfg, fp, toks[:p], run))
    rest = np.zeros((2, T), np.int32)
    rest[1, : T - p] = toks[p:]
    cont, after = C.prefill(params, rest, np.array([0, T - p]), target, cfg, run)
    assert np.asarray(after["lengths"]).tolist() == [T, T]
    one, _ = C.prefill(params, both, None, C.init_cache(cfg, 2, T, run), cfg, run)   # same shapes as the others
    cache = C.init_cache(cfg, 1, T, run)
    tbt = []
    for t in range(T):
        lg, cache = C.decode_step(params, toks[t: t + 1], cache, cfg, run)
        tbt.append(np.asarray(lg[0]))
    return np.asarray(cont[1, : T - p]), np.asarray(one[0]), np.stack(tbt), np.asarray(marked[0])


@pytest.fixture(scope="module")
def recurrent_f32():
    return _model(kda_impl="recurrent")


@pytest.fixture(scope="module")
def chunked_f32():
    return _model()                                                      # k3-tiny: 16-token chunks


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 31 - 1), p=st.integers(1, T - 1))
def test_snapshot_restore_continue_f32(chunked_f32, seed, p):
    rng = np.random.default_rng(seed)
    toks, other = rng.integers(0, 97, (2, T)).astype(np.int32)
    cont, one, tbt, marked = _three_ways(chunked_f32, toks, p, other, np.nan)
    print(f"p={p}: continue {rel_rms(cont, one[p:]):.2e}, marked {rel_rms(marked, one):.2e}, "
          f"token by token {rel_rms(tbt, one):.2e}")
    # Not bitwise: the batch's other row differs between the runs, which changes how the MoE groups tokens.
    assert_close(cont, one[p:], 1e-6, name="restore + continue vs one-shot")
    assert_close(marked, one, 1e-6, name="prefill with a mark vs one-shot")
    assert_close(tbt, one, 1e-6, name="token by token vs one-shot")


@pytest.fixture(scope="module")
def chunked_f64():
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield _model(param_dtype="float64", compute_dtype="float64")    # k3-tiny: 16-token chunks
    finally:
        jax.config.update("jax_enable_x64", prev)


def _check_f64(m, seed, p, slot_value=np.nan):
    rng = np.random.default_rng(seed)
    toks, other = rng.integers(0, 97, (2, T)).astype(np.int32)
    cont, one, tbt, marked = _three_ways(m, toks, p, other, slot_value)
    errs = {"continue": rel_rms(cont, one[p:]), "token-by-token": rel_rms(tbt, one), "marked": rel_rms(marked, one)}
    assert max(errs.values()) <= 1e-10, errs


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 31 - 1), p=st.integers(1, T - 1))
def test_snapshot_inside_a_chunk_float64(chunked_f64, seed, p):
    _check_f64(chunked_f64, seed, p)


@pytest.mark.parametrize("p", [1, 16, pytest.param(32, marks=pytest.mark.slow), pytest.param(T - 1,
                                                                                       marks=pytest.mark.slow)])
def test_snapshot_at_edges_float64(chunked_f64, p):
    _check_f64(chunked_f64, 7, p, slot_value=np.nan if p % 2 else 1e30)


def test_snapshot_at_the_row_end_needs_no_mark(recurrent_f32):
    cfg, run, params, fp = recurrent_f32
    toks = np.stack([np.arange(T, dtype=np.int32) % 97] * 2)
    _, cache = C.prefill(params, toks, None, C.init_cache(cfg, 2, T, run), cfg, run)
    snap = S.snapshot(cache, 0, T, cfg=cfg, key=S.provenance(cfg, fp, toks[0], run))
    assert snap.position == T
    with pytest.raises(C.CacheError, match="no KDA state was recorded at position 5"):
        S.snapshot(cache, 0, 5, cfg=cfg, key=S.provenance(cfg, fp, toks[0, :5], run))


def test_restore_refuses_another_model_params_or_prompt(recurrent_f32):
    cfg, run, params, fp = recurrent_f32
    toks = np.stack([np.arange(T, dtype=np.int32) * 7 % 97] * 2)
    _, cache = C.prefill(params, toks, None, C.init_cache(cfg, 2, T, run), cfg, run, marks=np.array([9, -1]))
    snap = S.snapshot(cache, 0, 9, cfg=cfg, key=S.provenance(cfg, fp, toks[0, :9], run))
    fresh = C.init_cache(cfg, 2, T, run)
    other_prompt = toks[0, :9].copy()
    other_prompt[3] += 1
    other_cfg = cfg.replace(rms_norm_eps=1e-6)
    other_params = jax.tree.map(lambda x: x * 1.0001, params)
    cases = {"prompt's token prefix": S.provenance(cfg, fp, other_prompt, run),
             "parameters": S.provenance(cfg, S.params_fingerprint(other_params), toks[0, :9], run),
             "model config": S.provenance(other_cfg, fp, toks[0, :9], run),
             "dtypes": S.provenance(cfg, fp, toks[0, :9], run.replace(compute_dtype="bfloat16")),
             "prefix length": S.provenance(cfg, fp, toks[0, :10], run)}
    for what, key in cases.items():
        with pytest.raises(S.SnapshotMismatchError, match=what):
            S.restore(fresh, 0, snap, cfg=cfg, key=key)
    S.restore(fresh, 0, snap, cfg=cfg, key=S.provenance(cfg, fp, toks[0, :9], run))  # the matching key works
