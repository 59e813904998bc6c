"""Routing metrics on hand-built routings with known answers, and label-permutation equivariance."""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3jax.analysis import metrics as am

E, K = 8, 2


def uniform_routing(n_rounds=3):
    """Every expert pair {2i, 2i+1} in turn: each expert gets the same load."""
    ids = np.array([[2 * i, 2 * i + 1] for _ in range(n_rounds) for i in range(E // 2)])
    return ids


def test_uniform_load():
    ids = uniform_routing()
    L = am.expert_load(ids, E)
    assert L.tolist() == [3] * E and L.sum() == ids.size
    s = am.load_stats(L)
    assert s["max_over_mean_load"] == 1.0 and s["maxvio"] == 0.0 and s["load_cv"] == 0.0
    assert s["load_entropy_bits"] == pytest.approx(3.0) and s["max_entropy_bits"] == 3.0 and s["experts_unused"] == 0


def test_one_expert_takes_everything():
    L = np.zeros(E, np.int64)
    L[5] = 40
    s = am.load_stats(L)
    assert s["max_over_mean_load"] == E and s["maxvio"] == E - 1 and s["experts_unused"] == E - 1
    assert s["load_entropy_bits"] == 0.0 and s["load_cv"] == pytest.approx(np.sqrt(E - 1))


def test_two_experts_always_together():
    ids = np.array([[3, 6]] * 10 + [[0, 1], [1, 2], [2, 0]])
    C = am.coactivation_counts(ids, E)
    P = am.coactivation(C, am.expert_load(ids, E))
    assert P[3, 6] == 1.0 and P[6, 3] == 1.0 and P[3].sum() == K - 1
    assert P[0, 1] == 0.5 and P[0, 2] == 0.5 and P[4].sum() == 0.0  # expert 4 unused: a zero row
    assert (C == C.T).all()
    assert am.top_coactivated_pairs(P, 2)[0]["p"] == 1.0 and {p["a"] for p in am.top_coactivated_pairs(P, 2)} == {3, 6}


def test_rank_adjacent_pairs_only_consecutive_ranks():
    ids = np.array([[0, 1, 2]])
    full = am.coactivation_counts(ids, 4, "all")
    adj = am.coactivation_counts(ids, 4, "rank_adjacent")
    assert full[0, 2] == 1 and adj[0, 2] == 0 and adj[0, 1] == adj[1, 2] == adj[1, 0] == 1
    with pytest.raises(ValueError, match="pairs"):
        am.coactivation_counts(ids, 4, "nearby")


def test_token_always_sent_to_the_same_expert():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 5, 400)
    ids = np.stack([keys, (keys + 1 + rng.integers(0, E - 1, 400)) % E], axis=1)  # top-1 = the key's own expert
    N = am.specialization_counts(keys, ids, 5, E)
    sp = am.specialization(N, np.bincount(keys, minlength=5), K, min_count=10)
    assert sp["keys"] == 5 and sp["mean"] == 1.0 and sp["weighted_mean"] == 1.0
    assert sp["top_expert"] == {v: v for v in range(5)} and sp["random_baseline"] == K / E
    shuffled = am.shuffle_labels(ids, E, seed=1)
    sps = am.specialization(am.specialization_counts(keys, shuffled, 5, E), np.bincount(keys, minlength=5), K)
    assert sps["mean"] < 0.5  # consistency destroyed: close to k/E = 0.25 (plus small-sample excess)
    assert (np.sort(shuffled, 1)[:, :-1] != np.sort(shuffled, 1)[:, 1:]).all()  # still k distinct experts


def test_specialization_ignores_rare_keys():
    keys = np.array([0] * 12 + [1] * 3)
    ids = np.array([[0, 1]] * 15)
    sp = am.specialization(am.specialization_counts(keys, ids, 2, E), np.bincount(keys), K, min_count=10)
    assert sp["keys"] == 1 and list(sp["per_key"]) == [0]


def test_byte_classes():
    t = np.frombuffer("aZ09 \t\n.-~é\x01".encode(), np.uint8)
    got = [am.BYTE_CLASSES[c] for c in am.byte_class(t)]
    assert got == ["letter", "letter", "digit", "digit", "whitespace", "whitespace", "whitespace", "punctuation",
                   "punctuation", "punctuation", "other", "utf8_continuation", "other"]


def test_overlap_stickiness_cross_layer_and_drift():
    a = np.array([[[0, 1], [0, 1], [2, 3], [3, 2]]])  # [B=1, T=4, k=2]
    st_ = am.stickiness(a)
    assert st_["set"] == pytest.approx((1 + 0 + 1) / 3) and st_["top1"] == pytest.approx(1 / 3)
    b = np.array([[[0, 5], [6, 7], [2, 3], [2, 4]]])
    assert am.cross_layer_agreement(a, b) == pytest.approx((0.5 + 0 + 1 + 0.5) / 4)
    d = am.drift(a, b)
    assert d["saturation"] == pytest.approx(0.5) and d["top1"] == pytest.approx(0.5)
    assert am.drift(a, a) == {"saturation": 1.0, "top1": 1.0}
    assert np.isnan(am.stickiness(a[:, :1])["set"])


def test_qb_trajectory(tmp_path):
    p = tmp_path / "m.jsonl"
    rows = [{"event": "start", "step": 0}, {"step": 1, "load_max_over_mean": [2.0, 1.5], "qb_bias_range": [0.1, 0.2]},
            {"step": 2, "load_max_over_mean": [1.2, 1.1], "qb_bias_range": [0.3, 0.2]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    q = am.qb_trajectory(p)
    assert q["steps"].tolist() == [1, 2] and q["load_max_over_mean"][1].tolist() == [1.2, 1.1]
    (tmp_path / "e.jsonl").write_text('{"event": "start"}\n')
    with pytest.raises(ValueError, match="no training steps"):
        am.qb_trajectory(tmp_path / "e.jsonl")


def test_bad_ids_are_refused():
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        am.expert_load(np.array([[0, 8]]), E)


@given(st.integers(0, 2**31 - 1))
def test_permuting_expert_labels_permutes_outputs_and_keeps_scalars(seed):
    rng = np.random.default_rng(seed)
    n, V = 60, 6
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).reshape(3, 20, K)
    keys = rng.integers(0, V, (3, 20))
    perm = rng.permutation(E)
    pid = perm[ids]
    L, Lp = am.expert_load(ids, E), am.expert_load(pid, E)
    np.testing.assert_array_equal(Lp[perm], L)
    s, sp = am.load_stats(L), am.load_stats(Lp)
    for k in s:
        assert s[k] == pytest.approx(sp[k]), k
    for pairs in ("all", "rank_adjacent"):
        C, Cp = am.coactivation_counts(ids, E, pairs), am.coactivation_counts(pid, E, pairs)
        np.testing.assert_array_equal(Cp[np.ix_(perm, perm)], C)
    N, Np = am.specialization_counts(keys, ids, V, E), am.specialization_counts(keys, pid, V, E)
    np.testing.assert_array_equal(Np[:, perm], N)
    occ = np.bincount(keys.reshape(-1), minlength=V)
    a, b = am.specialization(N, occ, K, 1), am.specialization(Np, occ, K, 1)
    assert a["mean"] == pytest.approx(b["mean"]) and a["per_key"] == pytest.approx(b["per_key"])
    # the top expert maps through the permutation (up to ties: argmax picks the lowest label among equals)
    assert all(Np[v, e] == N[v].max() for v, e in b["top_expert"].items())
    assert am.stickiness(ids) == am.stickiness(pid)
    assert am.cross_layer_agreement(ids, ids[:, ::-1]) == am.cross_layer_agreement(pid, pid[:, ::-1])
    assert am.drift(ids, ids[::-1]) == am.drift(pid, pid[::-1])


def test_shuffled_baseline_matches_its_definition():
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 200, 500)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(500)])
    got = am.shuffled_baseline(keys, ids, E, K, seed=4)
    sh = am.shuffle_labels(ids, E, seed=4)
    want = am.specialization(am.specialization_counts(keys, sh, 200, E), np.bincount(keys, minlength=200), K)
    assert got["token"] == want["mean"] and 0 < got["byte_class"] <= 1
