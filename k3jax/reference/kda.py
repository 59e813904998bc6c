"""Float64 NumPy oracle for Kimi Delta Attention (docs/model.md §4), written as plain loops.

This is the bottom rung of the KDA ladder (docs/design.md §3.2): every JAX path (recurrent, chunked, Pallas, the layer)
is tested against it. Nothing here is fast; everything here is a line-by-line transcription of the spec:

- ``gate_safe`` / ``gate_softplus``: the two forget gates of §4.2.
- ``short_conv``: causal depthwise conv, tap ``conv_size - 1`` multiplies the current token, then SiLU (§4.1).
- ``l2norm``: z / sqrt(sum z^2 + 1e-6) (§2.3).
- ``kda_recurrent``: the token-by-token recurrence of §4.3, K-first state [K, V].
- ``kda_recurrent_records``: the same recurrence, returning the state after every token and every update vector u.
- ``kda_replay``: the state after n tokens of a piece from S_0 and the records, as one sum (a rollback's replay).
- ``gated_rmsnorm``: per-head RMSNorm over K (eps inside the rsqrt, on the mean), times o_norm, times sigmoid(gate).
- ``kda_layer``: the full token mixer of §4.1 on the k3jax parameter dict (``k3jax.model.params.init_kda``).

All arrays are converted to float64 NumPy first.
"""

from __future__ import annotations

import math

import numpy as np

L2NORM_EPS = 1e-6


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def sigmoid(z):
    z = _f64(z)
    out = np.empty_like(z)
    pos = z >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-z[pos]))
    ez = np.exp(z[~pos])
    out[~pos] = ez / (1.0 + ez)
    return out


def softplus(z):
    """log(1 + e^z), computed without overflow (exact in float64 for all z)."""
    z = _f64(z)
    return np.maximum(z, 0.0) + np.log1p(np.exp(-np.abs(z)))


def silu(z):
    z = _f64(z)
    return z * sigmoid(z)


def gate_safe(raw, dt_bias, A_log, lower_bound: float):
    """K3 safe gate: g = lb * sigmoid(exp(A_log[h]) * (raw + dt_bias[h, c])).  raw: [..., N, K]."""
    a = np.exp(_f64(A_log))[:, None]
    return lower_bound * sigmoid(a * (_f64(raw) + _f64(dt_bias)))


def gate_softplus(raw, dt_bias, A_log):
    """Kimi-Linear gate: g = -exp(A_log[h]) * softplus(raw + dt_bias[h, c]).  raw: [..., N, K]."""
    a = np.exp(_f64(A_log))[:, None]
    return -a * softplus(_f64(raw) + _f64(dt_bias))


def short_conv(u, w, tail=None):
    """Causal depthwise conv + SiLU.  u: [B, T, C]; w: [C, W]; tail: [B, W-1, C] earlier inputs (oldest first)."""
    u, w = _f64(u), _f64(w)
    B, T, C = u.shape
    W = w.shape[1]
    past = np.zeros((B, W - 1, C)) if tail is None else _f64(tail)
    ext = np.concatenate([past, u], axis=1)
    y = np.zeros((B, T, C))
    for t in range(T):
        for i in range(W):
            # ext index t + i holds u_{t - (W-1) + i}; tap W-1 multiplies the current token.
            y[:, t, :] += w[:, i] * ext[:, t + i, :]
    return silu(y), ext[:, ext.shape[1] - (W - 1):, :]


def l2norm(z, eps: float = L2NORM_EPS):
    z = _f64(z)
    return z / np.sqrt(np.sum(z * z, axis=-1, keepdims=True) + eps)


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None):
    """docs/model.md §4.3 for every batch row and head.

    q, k: [B, T, N, K]; v: [B, T, N, V]; g: [B, T, N, K] (log decay); beta: [B, T, N];
    initial_state: [B, N, K, V] (K-first) or None.  Returns o [B, T, N, V], final state [B, N, K, V].
    """
    q, k, v, g, beta = map(_f64, (q, k, v, g, beta))
    B, T, N, K = q.shape
    V = v.shape[-1]
    s = K ** -0.5 if scale is None else scale
    S = np.zeros((B, N, K, V)) if initial_state is None else _f64(initial_state).copy()
    o = np.zeros((B, T, N, V))
    for b in range(B):
        for h in range(N):
            St = S[b, h]
            for t in range(T):
                St = np.exp(g[b, t, h])[:, None] * St          # decay row c by exp(g_t[c])
                e = v[b, t, h] - St.T @ k[b, t, h]              # error on the decayed state
                St = St + beta[b, t, h] * np.outer(k[b, t, h], e)
                o[b, t, h] = St.T @ (s * q[b, t, h])             # read after the write
            S[b, h] = St
    return o, S


def kda_recurrent_records(k, v, g, beta, *, initial_state):
    """The §4.3 recurrence's states, written with the update vector u_t = beta_t (v_t - (Diag(exp g_t) S_{t-1})^T k_t),
    S_t = Diag(exp g_t) S_{t-1} + k_t u_t^T (the same update as ``kda_recurrent``, regrouped).

    k, g: [B, T, N, K]; v: [B, T, N, V]; beta: [B, T, N]; initial_state [B, N, K, V].
    Returns states [B, T, N, K, V] (after each token) and u [B, T, N, V]."""
    k, v, g, beta = map(_f64, (k, v, g, beta))
    B, T, N, K = k.shape
    states = np.zeros((B, T, N, K, v.shape[-1]))
    u = np.zeros(v.shape)
    for b in range(B):
        for h in range(N):
            St = _f64(initial_state)[b, h].copy()
            for t in range(T):
                St = np.exp(g[b, t, h])[:, None] * St
                u[b, t, h] = beta[b, t, h] * (v[b, t, h] - St.T @ k[b, t, h])
                St = St + np.outer(k[b, t, h], u[b, t, h])
                states[b, t, h] = St
    return states, u


def kda_replay(state, k, u, G, n):
    """S_n = Diag(exp G_n) S_0 + sum_{j=1..n} Diag(exp(G_n - G_j)) k_j u_j^T, G_j = g_1 + ... + g_j (G_0 = 0), per row.

    state [B, N, K, V] (S_0); k, G [B, T, N, K]; u [B, T, N, V]; n [B] ints in [0, T]. Returns [B, N, K, V]."""
    state, k, u, G = map(_f64, (state, k, u, G))
    B, T, N, K = k.shape
    out = np.zeros(state.shape)
    for b in range(B):
        m = int(n[b])
        for h in range(N):
            Gn = G[b, m - 1, h] if m > 0 else np.zeros(K)
            S = np.exp(Gn)[:, None] * state[b, h]
            for j in range(m):
                S = S + np.exp(Gn - G[b, j, h])[:, None] * np.outer(k[b, j, h], u[b, j, h])
            out[b, h] = S
    return out


def gated_rmsnorm(o, w, gate, eps: float):
    """RMSNorm over the last axis (eps on the mean), times w, times sigmoid(gate)."""
    o = _f64(o)
    r = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps)
    return r * _f64(w) * sigmoid(gate)


def kda_layer(p, x, *, gate_lower_bound, eps, cache=None):
    """The full KDA token mixer (docs/model.md §4.1) in float64.

    p: the parameter dict of ``init_kda``; x: [B, T, D].  ``cache`` (optional) is a dict with ``state``
    [B, N, K, V] and ``conv_q``/``conv_k``/``conv_v`` [B, W-1, N*K] (oldest first).  Returns (y [B, T, D],
    new_cache) with the same cache layout.
    """
    p = {name: _f64(val) for name, val in p.items()}
    x = _f64(x)
    B, T, _ = x.shape
    D_, N, K = p["wq"].shape
    cache = cache or {}

    def proj(w):  # [B, T, N*K], head-major columns (docs/model.md §2.1)
        return np.einsum("btd,dnk->btnk", x, w).reshape(B, T, -1)

    q, tq = short_conv(proj(p["wq"]), p["conv_q"], cache.get("conv_q"))
    k, tk = short_conv(proj(p["wk"]), p["conv_k"], cache.get("conv_k"))
    v, tv = short_conv(proj(p["wv"]), p["conv_v"], cache.get("conv_v"))
    q = l2norm(q.reshape(B, T, N, K))
    k = l2norm(k.reshape(B, T, N, K))
    v = v.reshape(B, T, N, -1)
    raw = np.einsum("btr,rnk->btnk", x @ p["f_a"], p["f_b"])
    if gate_lower_bound is None:
        g = gate_softplus(raw, p["dt_bias"], p["A_log"])
    else:
        g = gate_safe(raw, p["dt_bias"], p["A_log"], gate_lower_bound)
    beta = sigmoid(np.einsum("btd,dn->btn", x, p["w_beta"]))
    o, S = kda_recurrent(q, k, v, g, beta, scale=K ** -0.5, initial_state=cache.get("state"))
    if "w_gate" in p:
        gate = np.einsum("btd,dnk->btnk", x, p["w_gate"])
    else:
        gate = np.einsum("btr,rnk->btnk", x @ p["g_a"], p["g_b"])
    o = gated_rmsnorm(o, p["o_norm"], gate, eps)
    y = np.einsum("btnk,nkd->btd", o, p["wo"])
    return y, {"state": S, "conv_q": tq, "conv_k": tk, "conv_v": tv}


def default_scale(K: int) -> float:
    return 1.0 / math.sqrt(K)


GATE_KINDS = ("safe", "bound", "zero", "softplus", "extreme")


def random_inputs(seed: int, *, B: int, T: int, N: int, K: int, V: int, gate: str = "safe",
                  lower_bound: float = -5.0):
    """Float64 test inputs following docs/numerics.md §15.3: l2-normalised q, k; v ~ N(0, 1); beta = sigmoid(N(0, 1));
    a random K-first h0; and a gate family:

      safe      lb * sigmoid(8 N(0,1))                   (saturating safe gate, in (lb, 0))
      bound     exactly lb everywhere                    (the bound itself)
      zero      g = 0                                    (no decay)
      softplus  -exp(A_log) softplus(raw), A_log = log U(1, 16), raw ~ N(0, 1) * {1, 4, 8} per head
      extreme   softplus, plus hard resets g = -1000 on ~10% of (token, channel) entries

    ``gate`` is one kind for every head, or a tuple with one kind per head.
    Returns a dict q, k, v, g, beta, h0 of float64 arrays.
    """
    rng = np.random.default_rng(seed)
    q = l2norm(rng.standard_normal((B, T, N, K)), eps=0.0)
    k = l2norm(rng.standard_normal((B, T, N, K)), eps=0.0)
    v = rng.standard_normal((B, T, N, V))
    beta = sigmoid(rng.standard_normal((B, T, N)))
    h0 = rng.standard_normal((B, N, K, V))
    kinds = (gate,) * N if isinstance(gate, str) else tuple(gate)
    if len(kinds) != N:
        raise ValueError(f"gate needs one kind per head ({N}), got {kinds}")
    g = np.stack([_gate_family(rng, kind, h, (B, T, K), lower_bound) for h, kind in enumerate(kinds)], axis=2)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "h0": h0}


def _gate_family(rng, kind, head, shape, lower_bound):
    if kind == "safe":
        return lower_bound * sigmoid(8.0 * rng.standard_normal(shape))
    if kind == "bound":
        return np.full(shape, float(lower_bound))
    if kind == "zero":
        return np.zeros(shape)
    if kind in ("softplus", "extreme"):
        A = rng.uniform(1.0, 16.0)                       # exp(A_log), A_log = log U(1, 16)
        mult = (1.0, 4.0, 8.0)[head % 3]
        g = -A * softplus(rng.standard_normal(shape) * mult)
        if kind == "extreme":
            g = np.where(rng.uniform(size=shape) < 0.1, -1000.0, g)
        return g
    raise ValueError(f"gate must be one of {GATE_KINDS}, got {kind!r}")
