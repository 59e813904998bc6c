"""Paired statistics of an ablation (`k3 ablate`): Student-t intervals over seeds, a bootstrap over the shared eval
windows, the A/A noise floor and the verdict per factor level.

    s = paired_t([0.012, 0.009, 0.015, 0.011, 0.010])        # arm minus base, one value per seed (same seed)
    s["mean"], s["std"], s["ci95"]                            # ci95: mean ± t(0.975, n-1) · std / sqrt(n)
    bootstrap_ci(diff_w, reps=2000, seed=0)                   # [W] per-window differences averaged over seeds
    verdict(s, boot, floor=aa_floor(aa))                      # ("worse", "worse by 0.0114 nats/token (...)")

A difference is always ``arm - base`` in nats per token of the final held-out loss: negative means the arm is better.
``std`` is the sample standard deviation (ddof = 1); with one seed it and the t interval are None. A zero-variance
difference has the degenerate interval [mean, mean].
"""

from __future__ import annotations

import math

import numpy as np

LEVEL = 0.95


# ---------------------------------------------------------------------------------------------- Student-t quantile
# scipy is not a dependency of k3jax (jax happens to pull it in, but we do not lean on a transitive dependency for
# one function): the t CDF is the regularized incomplete beta function, evaluated with the Lentz continued fraction
# (Numerical Recipes §6.4), and the quantile is found by bisection to double precision.

def _betacf(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the continued fraction converges fast here; else use the symmetry
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` > 0 degrees of freedom (e.g. t_quantile(0.975, 4) = 2.7764)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile: need 0 < p < 1 and df > 0 (got p={p}, df={df})")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):  # bisection: the CDF is monotone; 200 halvings reach the float spacing
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


# -------------------------------------------------------------------------------------------------- the intervals

def mean_std(values) -> dict:
    """{"per_seed", "n", "mean", "std"} (std: ddof = 1, None for one value)."""
    v = np.asarray(values, np.float64)
    return {"per_seed": [float(x) for x in v], "n": int(v.size), "mean": float(v.mean()) if v.size else None,
            "std": float(v.std(ddof=1)) if v.size > 1 else None}


def paired_t(diffs, level: float = LEVEL) -> dict:
    """Mean, std and the two-sided Student-t interval of paired differences (one per seed).

    Returns {"per_seed", "n", "mean", "std", "sem", "half_width", "ci95"}; std, sem, half_width and ci95 are None
    when n < 2."""
    out = mean_std(diffs)
    n = out["n"]
    if n < 2:
        return {**out, "sem": None, "half_width": None, "ci95": None}
    sem = out["std"] / math.sqrt(n)
    half = t_quantile(0.5 + level / 2.0, n - 1) * sem
    return {**out, "sem": sem, "half_width": half, "ci95": [out["mean"] - half, out["mean"] + half]}


def bootstrap_ci(diff_w, *, reps: int = 2000, level: float = LEVEL, seed: int = 0) -> list[float]:
    """Percentile bootstrap interval of the mean of ``diff_w`` [W] (per-window differences), resampling the windows
    with replacement ``reps`` times from numpy's PCG64 seeded with ``seed`` (deterministic)."""
    d = np.asarray(diff_w, np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError(f"bootstrap_ci: need a non-empty 1-D array of per-window differences, got shape {d.shape}")
    idx = np.random.default_rng(seed).integers(0, d.size, size=(reps, d.size))
    means = d[idx].mean(axis=1)
    lo, hi = np.quantile(means, [0.5 - level / 2.0, 0.5 + level / 2.0])
    return [float(lo), float(hi)]


def aa_floor(aa: dict | None) -> float | None:
    """The A/A noise floor: the largest |difference| the A/A interval allows, |mean| + half width (None without an
    A/A arm of at least 2 seeds). An arm whose effect is below it is indistinguishable from a reseeded base."""
    if not aa or aa.get("half_width") is None:
        return None
    return abs(aa["mean"]) + aa["half_width"]


def _covers_zero(ci) -> bool:
    return ci is not None and ci[0] <= 0.0 <= ci[1]


def verdict(paired: dict, boot: list[float] | None, floor: float | None) -> tuple[str, str]:
    """("better" | "worse" | "within noise" | "undetermined", a one-line reason).

    Within noise: the paired-t interval or the bootstrap interval covers zero, or |mean| is below the A/A floor.
    Undetermined: fewer than 2 seeds (no t interval)."""
    m = paired["mean"]
    if paired["ci95"] is None:
        return "undetermined", f"{m:+.4f} nats/token from {paired['n']} seed(s): need >= 2 seeds for an interval"
    lo, hi = paired["ci95"]
    why = []
    if _covers_zero(paired["ci95"]):
        why.append(f"the paired-t interval [{lo:+.4f}, {hi:+.4f}] covers 0")
    if _covers_zero(boot):
        why.append(f"the window bootstrap [{boot[0]:+.4f}, {boot[1]:+.4f}] covers 0")
    if floor is not None and abs(m) < floor:
        why.append(f"|{m:+.4f}| is below the A/A floor {floor:.4f}")
    if why:
        return "within noise", f"{m:+.4f} nats/token: " + "; ".join(why)
    word = "better" if m < 0 else "worse"
    tail = f"; A/A floor {floor:.4f}" if floor is not None else "; no A/A floor measured"
    return word, f"{word} by {abs(m):.4f} nats/token (paired-t 95% [{lo:+.4f}, {hi:+.4f}]{tail})"


__all__ = ["LEVEL", "aa_floor", "betainc", "bootstrap_ci", "mean_std", "paired_t", "t_cdf", "t_quantile", "verdict"]
