"""Verify records and rollback (k3jax/model/rollback.py): a recorded verify piece rolled back to keep[b] tokens per row
equals extending only those tokens (states, conv tails, lengths, MLA latents, zeros at the dropped positions), in both
modes and both cache layouts, and decoding goes on identically; the recorded extend's logits (and the taps it passes
through) equal the plain extend's; the replay formula equals the recurrence in float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import default_run, get_preset
from k3jax.errors import InputError
from k3jax.model import cache as C  # noqa: N812
from k3jax.model import rollback as R  # noqa: N812
from k3jax.model.functional import init_params
from k3jax.model.layout import layout
from k3jax.ops.kda.recurrent import kda_recurrent_recorded, kda_replay
from k3jax.pytree import key_names
from k3jax.reference import kda as ref_kda
from k3jax.testing import TOL, assert_close

T = 5                                     # the verify piece's width; every piece here has it (one compile)
PROMPT = np.array([4, 2, 5])              # ragged prefilled rows
MAX_LEN = 20
TAPS = (1, 3)                             # every extend here returns the stream after these layers (a draft's taps)


@functools.cache
def _setup(name):
    cfg = get_preset(name)
    run = default_run(cfg)
    params = init_params(cfg, jax.random.key(0), run)
    return cfg, run, params


def _prefilled(name, stacked, rng):
    """A cache holding ragged prompts, filled by an extend of the verify piece's width (no separate compile)."""
    cfg, run, params = _setup(name)
    prompt = rng.integers(0, cfg.vocab_size, (len(PROMPT), T)).astype(np.int32)
    cache = C.init_cache(cfg, len(PROMPT), MAX_LEN, run, stacked=stacked)
    return C.extend(params, prompt, PROMPT, cache, cfg, run, taps=TAPS)[1]


def _leaves(cache):
    return {key_names(p): x for p, x in jax.tree_util.tree_leaves_with_path(cache)}


def _assert_caches_match(got, ref, name):
    """Same leaves; lengths equal; every float leaf close; latents exactly zero past each row's length."""
    g, r = _leaves(got), _leaves(ref)
    assert g.keys() == r.keys(), f"{name}: leaves {sorted(set(g) ^ set(r))} differ"
    np.testing.assert_array_equal(np.asarray(got["lengths"]), np.asarray(ref["lengths"]))
    lengths = np.asarray(ref["lengths"])
    for path, x in g.items():
        if path == ("lengths",):
            continue
        assert_close(x, r[path], TOL["fp32_shallow"], atol_floor=1e-30, name=f"{name} {path}")
        if path[-1] in ("c_kv", "k_rope"):                     # [B, S, X] or stacked [G, B, S, X]
            x = np.asarray(x)
            past = np.arange(x.shape[-2])[None, :] >= lengths[:, None]
            assert not np.any(x[..., past, :]), f"{name} {path}: nonzero latents past the row's length"


# kimi-linear-tiny (no AttnRes, one scanned group): 31 s on this 2-core CPU, over the default budget.
@pytest.mark.parametrize("name, stacked", [("k3-tiny", False),
                                           pytest.param("kimi-linear-tiny", True, marks=pytest.mark.slow)],
                         ids=["k3-tiny-flat", "kimi-linear-tiny-stacked"])
def test_rollback_equals_extending_the_kept_prefix(name, stacked):
    """Two verify rounds on a prefilled ragged batch; the next step is a one-token piece of the same width."""
    cfg, run, params = _setup(name)
    assert layout(cfg).groups >= 1 if stacked else True
    rng = np.random.default_rng(0)
    B = len(PROMPT)
    cache = _prefilled(name, stacked, rng)
    for step, keep in enumerate((np.array([0, 2, T]), np.array([2, T, 0]))):   # row 2: all of it, then nothing
        piece = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
        plain_logits, plain, plain_taps = C.extend(params, piece, None, cache, cfg, run, taps=TAPS)
        logits, verified, taps = C.extend(params, piece, None, R.with_records(cache, cfg, T, "both"), cfg, run,
                                          taps=TAPS)
        assert_close(logits, plain_logits, TOL["fp32_shallow"], name="recorded vs plain logits")
        assert taps.shape == (B, T, len(TAPS), cfg.hidden_size)
        assert_close(taps, plain_taps, TOL["fp32_shallow"], name="recorded vs plain taps")
        _, ref, _ = C.extend(params, piece, keep, cache, cfg, run, taps=TAPS)   # only the kept tokens
        nxt = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
        one = np.ones((B,), np.int32)
        ref_next = C.extend(params, nxt, one, ref, cfg, run, taps=TAPS)[0][:, 0]
        got = {}
        for mode in ("copy", "replay"):
            got[mode] = R.rollback(verified, cfg, keep, mode=mode)
            _assert_caches_match(got[mode], ref, f"{name} step {step} {mode}")
            logits_next = C.extend(params, nxt, one, got[mode], cfg, run, taps=TAPS)[0][:, 0]
            assert_close(logits_next, ref_next, TOL["fp32_shallow"], name=f"{mode}: the next decode step")
        _assert_caches_match(got["replay"], got["copy"], "replay vs copy")
        full = R.rollback(verified, cfg, np.full((B,), T), mode="replay")  # keeping all = the plain extend
        _assert_caches_match(full, plain, "keep everything")
        cache = got["copy"]
        if step == 1:                                                      # row 2 kept nothing: untouched
            for a, b in zip(jax.tree.leaves(C.unstack_cache(cache, cfg)["layers"]),
                            jax.tree.leaves(C.unstack_cache(ref, cfg)["layers"]), strict=True):
                np.testing.assert_array_equal(np.asarray(a)[2], np.asarray(b)[2])


def test_replay_formula_equals_the_recurrence_float64(x64):
    """S_n = Diag(exp G_n) S_0 + sum_j Diag(exp(G_n - G_j)) k_j u_j^T equals the token-by-token state after n tokens
    (NumPy float64 loops), including the strongest gates; the jnp recording scan and replay match them."""
    for gate in ("safe", "softplus", "extreme"):
        x = ref_kda.random_inputs(3, B=2, T=6, N=2, K=4, V=3, gate=gate)
        states, u = ref_kda.kda_recurrent_records(x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"])
        o_ref, _ = ref_kda.kda_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"])
        G = np.cumsum(x["g"], axis=1)
        o, last, u_j, states_j = kda_recurrent_recorded(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")),
                                                        initial_state=jnp.asarray(x["h0"]), keep_states=True)
        assert_close(o, o_ref, TOL["fp64_vs_fp64"], name=f"{gate}: recorded outputs")
        assert_close(u_j, u, TOL["fp64_vs_fp64"], name=f"{gate}: update vectors")
        assert_close(states_j, states, TOL["fp64_vs_fp64"], name=f"{gate}: states")
        assert_close(last, states[:, -1], TOL["fp64_vs_fp64"], name=f"{gate}: final state")
        for n in range(7):
            want = x["h0"] if n == 0 else states[:, n - 1]
            rows = np.array([n, 6 - n])
            assert_close(ref_kda.kda_replay(x["h0"], x["k"], u, G, np.array([n, n])), want, TOL["fp64_vs_fp64"],
                         name=f"{gate}: NumPy replay of {n} tokens")
            both = np.stack([want[0], (x["h0"] if n == 6 else states[:, 5 - n])[1]])
            assert_close(kda_replay(jnp.asarray(x["h0"]), jnp.asarray(x["k"]), jnp.asarray(u), jnp.asarray(G),
                                    jnp.asarray(rows)), both, TOL["fp64_vs_fp64"], name=f"{gate}: jnp replay {rows}")


def test_record_leaves_have_axes_and_bytes():
    """Every record leaf has its logical axes (both layouts); record_bytes counts what with_records adds, and the
    full-size figure is the formula's."""
    cfg = get_preset("kimi-linear-tiny")
    for stacked in (False, True):
        shapes = jax.eval_shape(lambda c: R.with_records(c, cfg, T, "both"), C.cache_shapes(cfg, 2, 16,
                                                                                             stacked=stacked))
        for path, x in jax.tree_util.tree_leaves_with_path(shapes):
            assert len(C.cache_leaf_axes(key_names(path), x.ndim)) == x.ndim, path
    k3 = get_preset("kimi-k3")
    N, K, L = k3.kda_num_heads, k3.kda_head_dim, k3.num_kda_layers
    assert R.record_bytes(k3, 1, 8, "copy") == L * (8 * N * K * K + 8 * 3 * N * K) * 4 + 8 * 4
    assert R.record_bytes(k3, 1, 8, "replay") == L * (8 * 3 * N * K + 8 * 3 * N * K) * 4 + 8 * 4
    cache = C.init_cache(cfg, 2, 16)
    assert R.record_bytes(cfg, 2, T, "replay") == C.cache_bytes(R.with_records(cache, cfg, T, "replay")) - \
        C.cache_bytes(cache)


def test_bad_requests_name_the_value():
    cfg, run, params = _setup("k3-tiny")
    cache = _prefilled("k3-tiny", False, np.random.default_rng(1))
    rec = R.with_records(cache, cfg, T, "both")                # the main test's programs: no new compile
    piece = np.ones((len(PROMPT), T), np.int32)
    with pytest.raises(C.CacheError, match="no verify piece has run"):
        R.rollback(rec, cfg, np.array([1, 1, 1]), mode="copy")
    with pytest.raises(C.CacheError, match=f"made for a piece of {T} tokens"):
        C.extend(params, piece[:, :2], None, rec, cfg, run)
    with pytest.raises(C.CacheError, match=r"taps \[5\] are outside"):
        C.extend(params, piece, None, rec, cfg, run, taps=(0, 5))
    _, done, _ = C.extend(params, piece, np.array([T, 3, 0]), rec, cfg, run, taps=TAPS)
    with pytest.raises(C.CacheError, match="already holds a recorded verify piece"):
        C.extend(params, piece, None, done, cfg, run)
    with pytest.raises(C.CacheError, match="already carries verify records"):
        R.with_records(done, cfg, T, "copy")
    with pytest.raises(C.CacheError, match=rf"keep must lie in \[0, {T}\]"):
        R.rollback(done, cfg, np.array([T + 1, 0, 0]))
    with pytest.raises(InputError, match="holds both copy and replay records"):
        R.rollback(done, cfg, np.array([1, 0, 0]))
    with pytest.raises(InputError, match="not the records of a copy rollback"):
        R.rollback(R.with_records(cache, cfg, T, "replay"), cfg, np.array([1, 0, 0]), mode="copy")
    with pytest.raises(InputError, match="mode must be one of"):
        R.with_records(cache, cfg, T, "undo")
    with pytest.raises(C.CacheError, match="no verify records"):
        R.rollback(cache, cfg, np.array([1, 0, 0]))
    kept = np.array([2, T, T])                                   # clipped to each row's real tokens
    plain = R.rollback(done, cfg, kept, mode="replay")
    back = R.rollback(done, cfg, kept, mode="replay", donate=True)  # donates all but the records
    assert jax.tree.structure(back) == jax.tree.structure(plain)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(back["lengths"]).tolist() == (PROMPT + [2, 3, 0]).tolist() and "rec_pos" not in back
