"""Loss-vs-compute fits and effective compute multipliers for a scaling study (`k3 ablate` with ``[scaling]``).

    fit = fit_curve(C, L)                        # L(C) = E + A·C^(−α) (or the power law E = 0), least squares
    fit["E"], fit["A"], fit["alpha"], fit["form"]
    compute_for(fit, 3.2)                        # the compute at which the fitted curve reaches loss 3.2 (inf: never)
    multiplier(base_fit, arm_loss, arm_compute)  # the compute the base needs for the arm's loss / the arm's compute

Points are weighted (``weights``: a scaling study passes 1 / each point's bootstrap variance, so a budget whose seeds
disagree by 0.4 nats does not set the slope that budgets agreeing to 0.004 nats should). The saturating form
L = E + A·C^(−α) is fitted by variable projection: for a fixed α the model is linear in (E, A),
so the sum of squares is profiled over α (a log grid, then golden-section refinement to the float spacing) and
(E, A) come from the 2×2 least-squares solve. With four points and noise, E is often not identified (the best E is
negative or the best α sits at the grid's edge: the points are as well fitted by a straight line in log-log); the
study then uses the power law L = A·C^(−α) (E = 0, an ordinary least-squares line of ln L on ln C), and says so.
Compute is centred at C0 (the geometric mean of the points) for conditioning: A is reported in the C^(−α) form.

Every function takes a leading batch axis where it says so, so a bootstrap's thousands of refits are one vectorized
call (numpy only; scipy is not a dependency — ``k3jax.analysis.paired`` says why).
"""

from __future__ import annotations

import math

import numpy as np

FORMS = ("auto", "saturating", "power")
ALPHA_GRID = np.exp(np.linspace(math.log(1e-3), math.log(4.0), 481))  # profiled α values (saturating form)
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def _linear_ea(x: np.ndarray, L: np.ndarray, alpha: np.ndarray, w: np.ndarray):
    """For each α [..., G]: weighted least-squares (E, a) of L ≈ E + a·exp(−α x) over the points [J] of each batch
    row [..., J] (weights w [J]); returns E, a, sse, each [..., G]."""
    z = np.exp(-alpha[..., None] * x)                       # [..., G, J]
    Lb = L[..., None, :]
    n = w.sum()
    sz, szz = (w * z).sum(-1), (w * z * z).sum(-1)
    sl, szl = (w * Lb).sum(-1), (w * z * Lb).sum(-1)
    det = n * szz - sz * sz
    det = np.where(np.abs(det) < 1e-300, 1e-300, det)
    a = (n * szl - sz * sl) / det
    E = (sl - a * sz) / n
    r = Lb - E[..., None] - a[..., None] * z
    return E, a, (w * r * r).sum(-1)


def _fit_saturating(x: np.ndarray, L: np.ndarray, w: np.ndarray) -> dict:
    """x [J] (centred ln C), L [B, J], weights w [J] -> {"E", "a", "alpha", "sse", "edge"} each [B]; ``edge``: the
    best α is at the grid's boundary (E not identified)."""
    B = L.shape[0]
    _, _, sse = _linear_ea(x, L, np.broadcast_to(ALPHA_GRID, (B, ALPHA_GRID.size)), w)
    i = np.argmin(sse, axis=-1)
    edge = (i == 0) | (i == ALPHA_GRID.size - 1)
    lg = np.log(ALPHA_GRID)
    lo = lg[np.clip(i - 1, 0, lg.size - 1)]
    hi = lg[np.clip(i + 1, 0, lg.size - 1)]

    def f(la):
        return _linear_ea(x, L, np.exp(la)[:, None], w)[2][:, 0]

    # golden-section search on ln α over the grid cells either side of the minimum (unimodal there), one new
    # evaluation per row per iteration
    c, d = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    fc, fd = f(c), f(d)
    for _ in range(60):
        left = fc < fd  # the minimum lies in [lo, d]
        hi, lo = np.where(left, d, hi), np.where(left, lo, c)
        new = np.where(left, hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo))
        fn = f(new)
        c, d, fc, fd = (np.where(left, new, d), np.where(left, c, new), np.where(left, fn, fd),
                        np.where(left, fc, fn))
    alpha = np.exp(0.5 * (lo + hi))
    E, a, sse = (v[:, 0] for v in _linear_ea(x, L, alpha[:, None], w))
    return {"E": E, "a": a, "alpha": alpha, "sse": sse, "edge": edge}


def _fit_power(x: np.ndarray, L: np.ndarray, w: np.ndarray) -> dict:
    """ln L = ln a − α x by weighted least squares, per batch row (a weight w on L is w·L² on ln L: Var(ln L) ≈
    Var(L) / L², with L the row's own values)."""
    y = np.log(L)
    wy = w * L * L
    wy = wy / wy.sum(-1, keepdims=True)
    xm = (wy * x).sum(-1, keepdims=True)
    ym = (wy * y).sum(-1, keepdims=True)
    slope = (wy * (x - xm) * (y - ym)).sum(-1) / (wy * (x - xm) ** 2).sum(-1)
    a = np.exp(ym[:, 0] - slope * xm[:, 0])
    pred = a[:, None] * np.exp(slope[:, None] * x)
    return {"E": np.zeros(L.shape[0]), "a": a, "alpha": -slope, "sse": (w * (L - pred) ** 2).sum(-1),
            "edge": np.zeros(L.shape[0], bool)}


def _weights(w, n: int) -> np.ndarray:
    w = np.ones(n) if w is None else np.asarray(w, np.float64)
    if w.shape != (n,) or np.any(w <= 0) or not np.all(np.isfinite(w)):
        raise ValueError(f"scaling fit: need {n} positive finite weights, got {w}")
    return w / w.sum()


def identified(C, L, weights=None) -> tuple[bool, str]:
    """Whether the saturating form identifies E on these points: its best α is inside the grid and its E lies in
    (0, min L), above rounding (an E within 1e-9·min L of 0 is the power law itself, whose exact points fit the
    saturating form at E = ±1e-14, the sign set by rounding). Returns (ok, the reason in words)."""
    x, _ = _centre(C)
    s = _fit_saturating(x, np.asarray(L, np.float64)[None], _weights(weights, x.size))
    E, alpha = float(s["E"][0]), float(s["alpha"][0])
    if bool(s["edge"][0]):
        return False, f"the best α ({alpha:.3g}) is at the edge of [{ALPHA_GRID[0]:g}, {ALPHA_GRID[-1]:g}]"
    lmin = float(np.min(L))
    if not 1e-9 * lmin < E < lmin:
        return False, f"the best E ({E:.4g}) is outside (0, min L = {lmin:.4f})"
    return True, f"E = {E:.4f}, α = {alpha:.4f}"


def _centre(C) -> tuple[np.ndarray, float]:
    C = np.asarray(C, np.float64)
    if C.ndim != 1 or C.size < 3 or np.any(C <= 0) or np.any(np.diff(C) <= 0):
        raise ValueError(f"scaling fit: need >= 3 increasing positive compute values, got {C}")
    c0 = float(np.exp(np.log(C).mean()))
    return np.log(C / c0), c0


def fit_many(C, L, form: str, weights=None) -> dict:
    """Fits of ``form`` ("saturating" or "power") to each row of L [B, J] over the compute points C [J], each point
    weighted by ``weights`` [J] (e.g. 1 / its variance; default equal): {"E", "A", "alpha", "a", "c0", "form",
    "sse"} (arrays [B]; A = a·c0^α, so L = E + A·C^(−α))."""
    x, c0 = _centre(C)
    L = np.atleast_2d(np.asarray(L, np.float64))
    if form not in ("saturating", "power"):
        raise ValueError(f"scaling fit: form must be 'saturating' or 'power', got {form!r}")
    w = _weights(weights, x.size)
    s = _fit_saturating(x, L, w) if form == "saturating" else _fit_power(x, L, w)
    with np.errstate(over="ignore"):
        A = s["a"] * np.exp(s["alpha"] * math.log(c0))
    return {"E": s["E"], "A": A, "alpha": s["alpha"], "a": s["a"], "c0": c0, "form": form, "sse": s["sse"]}


def fit_curve(C, L, form: str = "auto", weights=None) -> dict:
    """One fit (floats) of L [J] against C [J]; ``form="auto"`` takes the saturating form when ``identified`` and
    the power law otherwise, with the reason under "why"."""
    if form not in FORMS:
        raise ValueError(f"scaling fit: form must be one of {FORMS}, got {form!r}")
    why = f"form = {form!r} was asked for"
    if form == "auto":
        ok, why = identified(C, L, weights)
        form = "saturating" if ok else "power"
    f = fit_many(C, np.asarray(L, np.float64)[None], form, weights)
    return {k: (v if k in ("c0", "form") else float(v[0])) for k, v in f.items()} | {"why": why}


def loss_at(fit: dict, C) -> np.ndarray:
    """The fitted loss at compute C (broadcasts: fit arrays [B] against C [..., B] or [B, K] via ``[:, None]``)."""
    C = np.asarray(C, np.float64)
    return fit["E"] + fit["a"] * np.exp(-fit["alpha"] * np.log(C / fit["c0"]))


def compute_for(fit: dict, loss) -> np.ndarray:
    """The compute at which the fitted curve reaches ``loss``; inf where it never does (loss <= E)."""
    loss = np.asarray(loss, np.float64)
    gap = (loss - fit["E"]) / fit["a"]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = fit["c0"] * np.exp(-np.log(gap) / fit["alpha"])
    return np.where(gap > 0, out, np.inf)


def multiplier(base_fit: dict, arm_loss, arm_compute) -> np.ndarray:
    """Effective compute multiplier: the compute the base's fitted curve needs to reach ``arm_loss``, divided by the
    arm's compute (> 1: the arm is worth more compute than it spends; inf: the base never reaches that loss)."""
    return compute_for(base_fit, arm_loss) / np.asarray(arm_compute, np.float64)


def percentile_ci(x, level: float = 0.95) -> list[float]:
    """The percentile interval of bootstrap replicates (inf kept: an unbounded side)."""
    lo, hi = np.quantile(np.asarray(x, np.float64), [0.5 - level / 2.0, 0.5 + level / 2.0], method="linear")
    return [float(lo), float(hi)]


def bootstrap_weights(n_seeds: int, n_windows: int, reps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Resampling weights ([reps, S], [reps, W], rows sum to 1): seeds and held-out windows drawn with replacement,
    the same draws for every arm and budget (paired seeds, shared windows). A weighted mean with them equals the mean
    over the resampled indices."""
    rng = np.random.default_rng(seed)
    s = rng.integers(0, n_seeds, size=(reps, n_seeds))
    w = rng.integers(0, n_windows, size=(reps, n_windows))
    ws = np.stack([np.bincount(r, minlength=n_seeds) for r in s]).astype(np.float64) / n_seeds
    ww = np.stack([np.bincount(r, minlength=n_windows) for r in w]).astype(np.float64) / n_windows
    return ws, ww


def finite_or_none(x):
    """JSON has no infinity: inf -> None (the reports say "unbounded")."""
    if isinstance(x, list | tuple):
        return [finite_or_none(v) for v in x]
    return float(x) if math.isfinite(x) else None


__all__ = ["FORMS", "bootstrap_weights", "compute_for", "finite_or_none", "fit_curve", "fit_many", "identified",
           "loss_at", "multiplier", "percentile_ci"]
