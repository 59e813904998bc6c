"""Routing metrics with explicit definitions. Pure NumPy over routing records; no model code.

Notation: E experts, k = experts per token, a token's routed set S = its top-k ids (by biased score,
docs/model.md §7.1). ``ids`` are int arrays [..., k] (leading axes: tokens; [B, T, k] where positions matter). Every
metric is defined in its docstring, with the paper whose definition it follows; where papers differ we say which one we
take.

The published analyses define their metrics slightly differently:
- load balance: DeepSeek-V3's MaxVio (max load / mean load − 1) is reported as ``maxvio`` next to max/mean;
- co-activation: OLMoE (Muennighoff et al., 2024) reports P(b | a) = #(a and b routed together) / #(a routed)
  over the top-k set; ``pairs="rank_adjacent"`` counts only experts adjacent in the ranking (the variant the project's
  routing-analysis brief attributes to OLMoE's analysis code; we did not check that code), named as such;
- specialization: OLMoE's token/domain specialization = the fraction of a token's (domain's) occurrences routed to
  the expert that receives it most often, compared with the k/E a uniform router gives;
- locality: Mixtral (Jiang et al., 2024, §5) measures how often consecutive tokens get the same experts.
"""

from __future__ import annotations

import json

import numpy as np

from k3jax.errors import InputError

BYTE_CLASSES = ("letter", "digit", "whitespace", "punctuation", "utf8_continuation", "other")


def _ids2(ids) -> np.ndarray:
    a = np.asarray(ids)
    if a.ndim < 1:
        raise ValueError(f"ids must have a trailing top-k axis, got shape {a.shape}")
    return a.reshape(-1, a.shape[-1]).astype(np.int64)


# --------------------------------------------------------------------------------------------------------- load

def expert_load(ids, num_experts: int) -> np.ndarray:
    """Exact assignment counts per expert: bincount of every selected id → int64 [E] (sums to tokens × k)."""
    a = np.asarray(ids).reshape(-1)
    if a.size and (a.min() < 0 or a.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}), got [{a.min()}, {a.max()}]")
    return np.bincount(a, minlength=num_experts).astype(np.int64)


def load_stats(load) -> dict:
    """Balance of one layer's load vector (counts per expert).

    - ``max_over_mean_load`` = max_e L_e / mean_e L_e; ``maxvio`` = that − 1 (DeepSeek-V3's MaxVio);
    - ``load_cv`` = std_e L_e / mean_e L_e (population std);
    - ``load_entropy_bits`` = −Σ p_e log2 p_e with p = L / Σ L (``max_entropy_bits`` = log2 E is perfect balance);
    - ``experts_unused`` = #{e : L_e = 0}.
    """
    L = np.asarray(load, np.float64)
    mean = L.mean() if L.size else 0.0
    tot = L.sum()
    p = L / tot if tot > 0 else np.zeros_like(L)
    nz = p[p > 0]
    mom = float(L.max() / mean) if mean > 0 else float("nan")
    return {
        "max_over_mean_load": mom,
        "maxvio": mom - 1.0,
        "load_cv": float(L.std() / mean) if mean > 0 else float("nan"),
        "load_entropy_bits": float(-(nz * np.log2(nz)).sum()),
        "max_entropy_bits": float(np.log2(L.size)) if L.size else 0.0,
        "experts_unused": int(np.sum(L == 0)),
    }


# -------------------------------------------------------------------------------------------------- co-activation

def coactivation_counts(ids, num_experts: int, pairs: str = "all") -> np.ndarray:
    """C[a, b] = number of tokens whose routed set pairs a with b (a != b), int64 [E, E].

    ``pairs="all"``: every ordered pair of distinct members of S (OLMoE's definition), so C is symmetric and
    row a sums to (k − 1) · L_a. ``pairs="rank_adjacent"``: only (S_r, S_{r+1}) and (S_{r+1}, S_r) for consecutive
    ranks r (the rank-adjacent variant); row a then sums to at most 2 L_a.
    """
    a = _ids2(ids)
    k = a.shape[1]
    if pairs == "all":
        rs = [(r, s) for r in range(k) for s in range(k) if r != s]
    elif pairs == "rank_adjacent":
        rs = [(r, r + 1) for r in range(k - 1)] + [(r + 1, r) for r in range(k - 1)]
    else:
        raise ValueError(f"pairs must be 'all' or 'rank_adjacent', got {pairs!r}")
    E = num_experts
    codes = np.concatenate([a[:, r] * E + a[:, s] for r, s in rs]) if rs else np.zeros(0, np.int64)
    return np.bincount(codes, minlength=E * E).reshape(E, E).astype(np.int64)


def coactivation(counts, load) -> np.ndarray:
    """P(b | a) = C[a, b] / L_a (float64 [E, E]; rows of unused experts are 0). With ``pairs="all"`` each row sums
    to k − 1; the uniform-router value of every off-diagonal entry is (k − 1) / (E − 1)."""
    C = np.asarray(counts, np.float64)
    L = np.asarray(load, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        P = np.where(L[:, None] > 0, C / L[:, None], 0.0)
    return P


def top_coactivated_pairs(P, n: int = 10) -> list[dict]:
    """The ``n`` largest off-diagonal entries of P(b | a): [{"a", "b", "p"}] in decreasing order."""
    P = np.array(P, np.float64)
    np.fill_diagonal(P, -np.inf)
    flat = np.argsort(P, axis=None)[::-1][:n]
    return [{"a": int(i // P.shape[1]), "b": int(i % P.shape[1]), "p": float(P.flat[i])} for i in flat]


# ------------------------------------------------------------------------------------------------- specialization

def byte_class(tokens) -> np.ndarray:
    """Class index (into ``BYTE_CLASSES``) of each byte token: ASCII letters, digits, whitespace (space and
    \\t \\n \\r \\v \\f), other printable ASCII punctuation and symbols, UTF-8 continuation bytes (0x80-0xBF),
    and everything else (control bytes, UTF-8 lead bytes 0xC0-0xFF, ids >= 256)."""
    t = np.asarray(tokens).astype(np.int64)
    out = np.full(t.shape, 5, np.int64)
    letter = ((t >= 65) & (t <= 90)) | ((t >= 97) & (t <= 122))
    digit = (t >= 48) & (t <= 57)
    ws = (t == 32) | ((t >= 9) & (t <= 13))
    punct = (t >= 33) & (t <= 126) & ~letter & ~digit
    cont = (t >= 0x80) & (t <= 0xBF)
    for i, m in enumerate((letter, digit, ws, punct, cont)):
        out[m] = i
    return out


def specialization_counts(keys, ids, num_keys: int, num_experts: int) -> np.ndarray:
    """N[v, e] = number of occurrences of key v (a token id, a byte class, ...) whose routed set contains e;
    int64 [num_keys, E]. ``keys`` [N] (or [B, T]) aligned with ``ids`` [N, k] (or [B, T, k])."""
    kk = np.asarray(keys).reshape(-1).astype(np.int64)
    a = _ids2(ids)
    if kk.shape[0] != a.shape[0]:
        raise ValueError(f"{kk.shape[0]} keys for {a.shape[0]} routed tokens")
    codes = (kk[:, None] * num_experts + a).reshape(-1)
    return np.bincount(codes, minlength=num_keys * num_experts).reshape(num_keys, num_experts).astype(np.int64)


def specialization(counts, occurrences, k: int, min_count: int = 10) -> dict:
    """OLMoE-style specialization from ``specialization_counts`` and per-key occurrence counts.

    spec(v) = max_e N[v, e] / n_v: the fraction of key v's occurrences routed (among their top-k) to v's most
    frequent expert, in [k/E, 1]; a router that ignores the key gives ≈ k/E (a little more on few occurrences).
    Only keys with n_v ≥ ``min_count`` count. Returns ``mean`` (unweighted over qualifying keys),
    ``weighted_mean`` (by n_v), ``keys`` (how many qualified), ``random_baseline`` = k/E, ``per_key``
    {v: spec(v)} and ``top_expert`` {v: argmax_e N[v, e]}.
    """
    N = np.asarray(counts, np.int64)
    n = np.asarray(occurrences, np.int64)
    q = np.nonzero(n >= min_count)[0]
    E = N.shape[1]
    spec = N[q].max(axis=1) / n[q] if q.size else np.zeros(0)
    return {
        "mean": float(spec.mean()) if q.size else float("nan"),
        "weighted_mean": float((spec * n[q]).sum() / n[q].sum()) if q.size else float("nan"),
        "keys": int(q.size),
        "random_baseline": k / E,
        "per_key": {int(v): float(s) for v, s in zip(q, spec)},
        "top_expert": {int(v): int(N[v].argmax()) for v in q},
    }


def shuffle_labels(ids, num_experts: int, seed: int = 0) -> np.ndarray:
    """The label-shuffled baseline: each token's routed set mapped through its own random permutation of the E
    expert labels (so per-token structure — k distinct experts — is kept, any consistency across tokens is not)."""
    a = np.asarray(ids)
    flat = _ids2(a)
    rng = np.random.default_rng(seed)
    perms = np.argsort(rng.random((flat.shape[0], num_experts)), axis=1)
    return np.take_along_axis(perms, flat, axis=1).reshape(a.shape)


def shuffled_baseline(keys, ids, num_experts: int, k: int, *, seed: int = 0, min_count: int = 10) -> dict:
    """Token and byte-class specialization means (``token``, ``byte_class``) of the label-shuffled routing
    (``shuffle_labels``) of byte tokens ``keys`` [N] routed to ``ids`` [N, k]: the baseline a learned router must
    beat besides k/E."""
    kk = np.asarray(keys).reshape(-1).astype(np.int64)
    sh = shuffle_labels(ids, num_experts, seed=seed)
    V, cls = int(kk.max()) + 1, byte_class(kk)
    nc = len(BYTE_CLASSES)
    return {"token": specialization(specialization_counts(kk, sh, V, num_experts), np.bincount(kk, minlength=V), k,
                                    min_count)["mean"],
            "byte_class": specialization(specialization_counts(cls, sh, nc, num_experts),
                                         np.bincount(cls, minlength=nc), k, min_count)["mean"]}


# ------------------------------------------------------------------------------------------- agreement and drift

def set_overlap(ids_a, ids_b) -> np.ndarray:
    """|S_a ∩ S_b| / k per token for two aligned routed-set arrays [..., k] → float64 [...]."""
    a, b = np.asarray(ids_a), np.asarray(ids_b)
    if a.shape != b.shape:
        raise ValueError(f"routed sets of different shapes {a.shape} and {b.shape}")
    k = a.shape[-1]
    return (a[..., :, None] == b[..., None, :]).any(-1).sum(-1) / k


def cross_layer_agreement(ids_l, ids_next) -> float:
    """Mean over tokens of |S_l ∩ S_{l'}| / k for the same token in two MoE layers (expert indices compared as
    labels: layers share no weights, so this measures whether routing reuses the same slots across depth)."""
    return float(set_overlap(ids_l, ids_next).mean())


def stickiness(ids_btk) -> dict:
    """Per-position locality (Mixtral §5): for consecutive positions t, t+1 of the same sequence, ``set`` = mean
    |S_t ∩ S_{t+1}| / k and ``top1`` = P(top-1 expert repeats). ``ids_btk`` [B, T, k]; NaN for T < 2."""
    a = np.asarray(ids_btk)
    if a.ndim != 3:
        raise ValueError(f"stickiness needs ids [B, T, k], got shape {a.shape}")
    if a.shape[1] < 2:
        return {"set": float("nan"), "top1": float("nan")}
    return {"set": float(set_overlap(a[:, :-1], a[:, 1:]).mean()),
            "top1": float((a[:, :-1, 0] == a[:, 1:, 0]).mean())}


def drift(ids_a, ids_b) -> dict:
    """Routing drift between two checkpoints on the same tokens (e.g. before/after a QAT fine-tune):
    ``saturation`` = mean |top-k(A) ∩ top-k(B)| / k (OLMoE's router saturation, 1 = unchanged) and ``top1`` =
    P(the top-1 expert is the same)."""
    a, b = np.asarray(ids_a), np.asarray(ids_b)
    return {"saturation": float(set_overlap(a, b).mean()), "top1": float((a[..., 0] == b[..., 0]).mean())}


# ------------------------------------------------------------------------------------------------ QB trajectories

def qb_trajectory(metrics_path) -> dict:
    """Quantile Balancing over a ``k3 train --metrics`` JSONL file: ``steps``, ``load_max_over_mean`` [steps,
    layers] (per-step max/mean load per MoE layer, as the train step measures it) and ``qb_bias_range`` [steps,
    layers] (max − min of each layer's bias). Events and steps without these fields are skipped."""
    steps, load, bias = [], [], []
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if "event" in r or "load_max_over_mean" not in r:
                continue
            steps.append(int(r["step"]))
            load.append(r["load_max_over_mean"])
            bias.append(r.get("qb_bias_range", [np.nan] * len(r["load_max_over_mean"])))
    if not steps:
        raise InputError(f"{metrics_path}: no training steps with load_max_over_mean")
    return {"steps": np.asarray(steps), "load_max_over_mean": np.asarray(load, np.float64),
            "qb_bias_range": np.asarray(bias, np.float64)}


__all__ = ["BYTE_CLASSES", "byte_class", "coactivation", "coactivation_counts", "cross_layer_agreement", "drift",
           "expert_load", "load_stats", "qb_trajectory", "set_overlap", "shuffle_labels", "shuffled_baseline",
           "specialization",
           "specialization_counts", "stickiness", "top_coactivated_pairs"]
