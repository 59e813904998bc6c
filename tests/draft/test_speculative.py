"""Speculative decoding is exact (k3jax/draft/speculative.py).

* The acceptance rules against their definitions: greedy against a loop; rejection sampling's first emitted token
  has the target sampler's distribution whatever the draft's (chi-square over 200,000 pure draws).
* Greedy with a draft emits the tokens of greedy without one — wherever the plain run's top-2 logit margin exceeds
  1e-3 (a piece of K + 1 tokens rounds ~1e-6 apart from one token at a time) — with the target's logits behind each
  token within 1e-5: ragged rows, a drafter that alternates whole-block acceptance with none (the state and conv
  tails after a rejected block must be the accepted ones), the target drafting for itself (every block accepted),
  both rollback modes.
* Sampling keeps the target's distribution through the real verify pass: 20,000 draws of the first token after a
  fixed context, and of the second given the first's most likely value, over the 15 most likely tokens plus one
  pooled cell, pass a chi-square test against the target's own probabilities, with a good and a bad drafter.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from k3jax.config import default_run, get_preset
from k3jax.draft.speculative import TargetDrafter, accept_greedy, accept_sampled, generate_speculative, speculative_step
from k3jax.model.cache import extend, init_cache
from k3jax.model.functional import init_params
from k3jax.model.generate import Sampling, filtered_logits, generate
from k3jax.testing import assert_same_greedy

P_MIN = 0.01          # the chi-square tests' threshold


def _chi2_p(draws, probs, cells: int = 15) -> float:
    """p-value of draws [N] against probs [W] over the ``cells`` most likely tokens plus one pooled cell (cells
    without probability are dropped; a draw in one fails the test outright)."""
    probs = np.asarray(probs, np.float64) / np.sum(probs)
    top = np.argsort(-probs)[:cells]
    observed = np.append([(draws == t).sum() for t in top], len(draws) - np.isin(draws, top).sum()).astype(np.float64)
    expected = np.append(probs[top], max(1.0 - probs[top].sum(), 0.0)) * len(draws)
    empty = expected < 1e-9 * len(draws)                 # no probability: a draw there fails outright
    if observed[empty].sum() > 0:
        return 0.0
    observed, expected = observed[~empty], expected[~empty]
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


def test_accept_greedy_is_the_longest_matching_prefix():
    rng = np.random.default_rng(0)
    B, K, W = 64, 5, 7
    logits = rng.normal(size=(B, K + 1, W)).astype(np.float32)
    best = logits.argmax(-1)
    draft = np.where(rng.random((B, K)) < 0.7, best[:, :K], rng.integers(0, W, (B, K)))
    n, bonus = map(np.asarray, accept_greedy(jnp.asarray(logits), jnp.asarray(draft, jnp.int32)))
    for b in range(B):
        m = 0
        while m < K and draft[b, m] == best[b, m]:
            m += 1
        assert n[b] == m and bonus[b] == best[b, m]


@pytest.mark.parametrize("s", [Sampling(greedy=False, temperature=0.9),
                               Sampling(greedy=False, temperature=1.3, top_k=5, top_p=0.9)], ids=["t", "t_topk_topp"])
def test_rejection_sampling_keeps_the_target_distribution(s):
    """Pure draws (no model): target logits fixed per position, a draft distribution q far from p; the first emitted
    token (d_1 if accepted, else the residual draw) must follow p_0, and given d_1 accepted with d_1 = x, the second
    must follow p_1 — the rule is checked for any q."""
    rng = np.random.default_rng(1)
    N, K, W = 200_000, 3, 12
    z = jnp.asarray(np.broadcast_to(rng.normal(size=(1, K + 1, W)) * 1.5, (N, K + 1, W)), jnp.float32)
    p = np.asarray(jax.nn.softmax(filtered_logits(z[:1], s), axis=-1))[0]
    q1 = rng.dirichlet(np.full(W, 0.5), size=K)                           # a bad draft, the same for every row
    key_d, key_a = jax.random.split(jax.random.key(2))
    draft = jax.random.categorical(key_d, jnp.log(jnp.asarray(q1))[None].repeat(N, 0), axis=-1).astype(jnp.int32)
    q = jnp.asarray(q1, jnp.float32)[None].repeat(N, 0)
    n, nxt = map(np.asarray, accept_sampled(z, draft, q, key_a, s))
    draft = np.asarray(draft)
    first = np.where(n >= 1, draft[:, 0], nxt)
    assert _chi2_p(first, p[0], cells=11) > P_MIN
    assert 0 < (n == 0).mean() < 1 and (n == K).any()


# ---------------------------------------------------------------------------------------------------------------
# Through the model (k3-tiny, random weights)


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("k3-tiny")
    run = default_run(cfg)
    return cfg, run, init_params(cfg, jax.random.key(0), run)


class _Alternating(TargetDrafter):
    """The target's own greedy tokens on even steps (a whole block accepted), then a block whose first token is
    wrong (nothing accepted) — the rollback right after a full acceptance must leave the accepted state."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.step = 0

    def propose(self, state, anchor, key, s, target_cache=None):
        ids, q = super().propose(state, anchor, key, s, target_cache)
        self.step += 1
        if self.step % 2 == 0:
            ids = ids.at[:, 0].set((ids[:, 0] + 1) % self.cfg.vocab_size)
        return ids, q


def _check_greedy(tiny_model, drafter, prompts, N, rollback):
    cfg, run, params = tiny_model
    plain = generate(params, prompts, cfg, run, max_new_tokens=N)
    spec = generate_speculative(params, prompts, cfg, run, drafter=drafter, max_new_tokens=N,
                                rollback_mode=rollback)
    assert_same_greedy(spec.tokens, spec.logits, plain.tokens, plain.logits)
    return spec


def _prompts(cfg, lengths, seed=3):
    rng = np.random.default_rng(seed)
    out = np.full((len(lengths), max(lengths)), -1, np.int32)
    for b, n in enumerate(lengths):
        out[b, :n] = rng.integers(0, cfg.vocab_size, n)
    return out


def test_greedy_equals_plain_greedy_with_full_and_empty_acceptances(tiny):
    cfg, run, params = tiny
    K = 3
    spec = _check_greedy(tiny, _Alternating(params, cfg, run, K=K), _prompts(cfg, [5, 9, 2]), 14, "copy")
    hist = spec.timing["accepted_histogram"]
    assert hist[0] > 0 and hist[K] > 0, hist                      # both kinds of step happened


@pytest.mark.slow
@pytest.mark.parametrize("rollback", ["copy", "replay"])
@pytest.mark.parametrize("K", [1, 4, 7])
def test_target_as_its_own_draft_accepts_every_block(tiny, K, rollback):
    cfg, run, params = tiny
    spec = _check_greedy(tiny, TargetDrafter(params, cfg, run, K=K), _prompts(cfg, [6, 3, 11]), 16, rollback)
    hist = np.asarray(spec.timing["accepted_histogram"])
    assert hist[K] >= 0.9 * hist.sum(), hist


def test_replay_rollback_greedy_equals_plain(tiny):
    cfg, run, params = tiny
    _check_greedy(tiny, _Alternating(params, cfg, run, K=2), _prompts(cfg, [4, 7]), 10, "replay")


class _Tempered(TargetDrafter):
    """A deliberately bad drafter: the target's tokens drawn at 3x the temperature (q far from p)."""

    def propose(self, state, anchor, key, s, target_cache=None):
        hot = Sampling(greedy=False, temperature=s.temperature * 3.0, top_k=0, top_p=1.0)
        return super().propose(state, anchor, key, hot, target_cache)


@pytest.mark.slow
@pytest.mark.parametrize("bad", [False, True], ids=["good_draft", "bad_draft"])
def test_sampling_through_the_verify_pass_keeps_the_target_distribution(tiny, bad):
    cfg, run, params = tiny
    s = Sampling(greedy=False, temperature=1.0, top_k=40)
    N, K = 20_000, 3
    prompt = _prompts(cfg, [6], seed=5)
    anchor = int(prompt[0, -1])
    ctx = prompt[:, :-1]
    cache = init_cache(cfg, 1, 16, run)
    _, cache = extend(params, ctx, None, cache, cfg, run)
    big = jax.tree.map(lambda x: jnp.repeat(x, N, axis=0), cache)
    drafter = (_Tempered if bad else TargetDrafter)(params, cfg, run, K=K)
    rows = [[] for _ in range(N)]
    anchors = np.full((N,), anchor, np.int32)
    live = np.ones((N,), bool)
    for step in range(2):
        acc, nxt, piece, _, big, _ = speculative_step(params, big, None, anchors, live, drafter,
                                                      jax.random.key(10 + step), s, cfg, run)
        for b in range(N):
            rows[b] += [*piece[b, 1:1 + acc[b]].tolist(), int(nxt[b])]
        anchors = nxt
    first = np.array([r[0] for r in rows])
    second = np.array([r[1] for r in rows])

    def target_probs(tokens):
        logits, _ = extend(params, tokens, None, init_cache(cfg, 1, 16, run), cfg, run, last_only=True)
        return np.asarray(jax.nn.softmax(filtered_logits(logits, s), axis=-1))[0].astype(np.float64)

    p1 = target_probs(prompt)
    assert _chi2_p(first, p1) > P_MIN
    mode = int(np.argmax(p1))
    p2 = target_probs(np.concatenate([prompt, [[mode]]], axis=1))
    sel = first == mode
    assert sel.sum() > 500
    assert _chi2_p(second[sel], p2) > P_MIN
