"""Float64 NumPy reference of the DSpark draft (k3jax/draft/network.py) and of its rotary embedding
(k3jax/ops/rope.py): plain loops over pairs, heads, queries and anchors, written from the definitions.

    spec = rope_ref(dim, theta, scaling)                          # (inv_freq [Hr/2], cos/sin scale, attention scale)
    y = rotate_ref(x, pos, spec)                                  # one vector [Hr] at one position
    base, h = propose_ref(p, dcfg, taps, anchor, embed, head)     # one row: context taps [P, n, Dt]
    logits, conf = train_logits_ref(p, dcfg, taps, tokens, anchors, embed, head, segment_ids=None)

``p`` is the draft's parameter dict (``nnx.state(model, nnx.Param).to_pure_dict()``, any array type): context_proj
[n·Dt, D], context_norm, layers {i: {input_norm, post_norm, attn: MLA leaves, mlp: GLU leaves}}, final_norm,
markov_w1 / markov_w2 [W, r], conf_w [D (+ r)], conf_b [1]. ``dcfg`` is read by attribute (a DraftConfig).
"""

from __future__ import annotations

import math

import numpy as np

from k3jax.reference.model import f64, glu, rms_norm, sigmoid


def rope_ref(dim: int, theta: float, scaling=None) -> tuple[np.ndarray, float, float]:
    """(inv_freq [dim/2], cos/sin scale, softmax-scale multiplier); ``scaling``: None or a YaRN record with
    factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim."""

    def m(s, a):
        return 1.0 if s <= 1 else 0.1 * a * math.log(s) + 1.0

    inv = np.array([theta ** (-2.0 * i / dim) for i in range(dim // 2)])
    if scaling is None:
        return inv, 1.0, 1.0
    L0, s = scaling.original_max_position_embeddings, scaling.factor
    # pair index whose wavelength fits `turns` times into L0 positions
    pair = lambda turns: dim * math.log(L0 / (turns * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    lo, hi = max(math.floor(pair(scaling.beta_fast)), 0), min(math.ceil(pair(scaling.beta_slow)), dim - 1)
    if lo == hi:
        hi += 0.001
    out = np.empty_like(inv)
    for i in range(dim // 2):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)       # 0: keep the frequency, 1: interpolate (÷ factor)
        out[i] = inv[i] * (1 - ramp) + inv[i] / s * ramp
    return out, m(s, scaling.mscale) / m(s, scaling.mscale_all_dim), m(s, scaling.mscale_all_dim) ** 2


def rotate_ref(x, pos: int, spec) -> np.ndarray:
    """Interleaved rotation of one vector x [Hr] at position ``pos``: pair i = channels (2i, 2i+1)."""
    inv, scale, _ = spec
    y = np.empty(len(x))
    for i in range(len(x) // 2):
        c, s = math.cos(pos * inv[i]) * scale, math.sin(pos * inv[i]) * scale
        y[2 * i] = x[2 * i] * c - x[2 * i + 1] * s
        y[2 * i + 1] = x[2 * i] * s + x[2 * i + 1] * c
    return y


def _features(P, dcfg, taps):
    """taps [T, n, Dt] → context features [T, D]."""
    return rms_norm(taps.reshape(taps.shape[0], -1) @ P["context_proj"], P["context_norm"], dcfg.rms_norm_eps)


def _latent(a, x, pos, spec, eps):
    """One token's (c_kv [R], rotated k_rope [Hr]) through a layer's kv_a."""
    R = a["kv_a_norm"].shape[0]
    ckv = x @ a["kv_a"]
    return rms_norm(ckv[:R], a["kv_a_norm"], eps), rotate_ref(ckv[R:], pos, spec)


def _block(P, dcfg, ctx, x, positions, spec):
    """Block inputs x [Q, D] at ``positions`` over context features ctx [(feature [D], position)...], every query
    seeing every context entry and every block position → final-normed h [Q, D]."""
    eps = dcfg.rms_norm_eps
    Hn, Hr = dcfg.qk_nope_head_dim, dcfg.qk_rope_head_dim
    scale = spec[2] / math.sqrt(Hn + Hr)
    h = np.array(x)
    for i in range(dcfg.num_hidden_layers):
        lp = P["layers"][i]
        a = lp["attn"]
        xn = rms_norm(h, lp["input_norm"], eps)
        keys = [_latent(a, f, t, spec, eps) for f, t in ctx] + [_latent(a, xn[j], positions[j], spec, eps)
                                                              for j in range(len(xn))]
        o = np.zeros((len(xn), dcfg.num_attention_heads, dcfg.v_head_dim))
        for j in range(len(xn)):
            q = np.einsum("r,rnh->nh", rms_norm(xn[j] @ a["q_a"], a["q_a_norm"], eps), a["q_b"])
            for n in range(dcfg.num_attention_heads):
                qr = rotate_ref(q[n, Hn:], positions[j], spec)
                s = np.array([(q[n, :Hn] @ (c @ a["kv_b"][:, n, :Hn]) + qr @ kr) * scale for c, kr in keys])
                w = np.exp(s - s.max())
                w /= w.sum()
                o[j, n] = sum(wk * (c @ a["kv_b"][:, n, Hn:]) for wk, (c, _) in zip(w, keys))
        h = h + np.einsum("qnv,nvd->qd", o, a["wo"])
        h = h + glu(lp["mlp"], rms_norm(h, lp["post_norm"], eps), dcfg.hidden_act, 4.0, 25.0)
    return rms_norm(h, P["final_norm"], eps)


def _confidence(P, dcfg, h, prev):
    D = dcfg.hidden_size
    z = h @ P["conf_w"][:D] + P["conf_b"][0]
    if dcfg.confidence_head_with_markov:
        z = z + P["markov_w1"][prev] @ P["conf_w"][D:]
    return sigmoid(z)


def propose_ref(params, dcfg, taps, anchor: int, embed, head):
    """One row: context taps [P, n, Dt] of positions 0..P-1, the anchor token → (base_logits [K, W], h [K, D])."""
    P = f64(params)
    taps, embed, head = (np.asarray(a, np.float64) for a in (taps, embed, head))
    spec = rope_ref(dcfg.qk_rope_head_dim, dcfg.rope_theta, dcfg.rope_scaling)
    feats = _features(P, dcfg, taps)
    n_ctx, K = len(feats), dcfg.block_size
    x = embed[[anchor] + [dcfg.mask_token_id] * K]
    h = _block(P, dcfg, [(feats[t], t) for t in range(n_ctx)], x, [n_ctx + i for i in range(K + 1)], spec)[1:]
    return h @ head, h


def train_logits_ref(params, dcfg, taps, tokens, anchors, embed, head, segment_ids=None):
    """One row: taps [T, n, Dt], tokens [T], anchors [A] → (logits [A, K, W] with the teacher-forced Markov bias,
    conf [A, K] or None)."""
    P = f64(params)
    taps, embed, head = (np.asarray(a, np.float64) for a in (taps, embed, head))
    tokens = np.asarray(tokens)
    spec = rope_ref(dcfg.qk_rope_head_dim, dcfg.rope_theta, dcfg.rope_scaling)
    feats = _features(P, dcfg, taps)
    T, K = len(tokens), dcfg.block_size
    logits, conf = [], []
    for a in anchors:
        a = int(a)
        ctx = [(feats[t], t) for t in range(a) if segment_ids is None or segment_ids[t] == segment_ids[a]]
        x = embed[[tokens[a]] + [dcfg.mask_token_id] * K]
        h = _block(P, dcfg, ctx, x, [a + i for i in range(K + 1)], spec)[1:]
        prev = [tokens[min(a + i - 1, T - 1)] for i in range(1, K + 1)]
        logits.append(np.stack([h[i] @ head + P["markov_w2"] @ P["markov_w1"][prev[i]] for i in range(K)]))
        if dcfg.enable_confidence_head:
            conf.append([_confidence(P, dcfg, h[i], prev[i]) for i in range(K)])
    return np.stack(logits), (np.array(conf) if dcfg.enable_confidence_head else None)
