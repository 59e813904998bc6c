"""Float64 NumPy reference of the K3 network (docs/model.md §1.3, §3, §5, §6, §7, §13), written from the spec with plain
loops over tokens, heads and experts. KDA layers use k3jax.reference.kda.

    logits = ref_forward(view, tokens, cfg)     # view: {"layers": [layer dict, ...], "embed", ...} (any array
                                                # type), e.g. k3jax.model.unstack(state, cfg); tokens [B, T]

The oracle reads one dict per decoder layer and knows nothing of how the model stores (stacks) them.
"""

from __future__ import annotations

import math

import numpy as np

from k3jax.config import K3Config
from k3jax.reference.kda import kda_layer as kda_ref


def f64(tree):
    if isinstance(tree, dict):
        return {k: f64(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [f64(v) for v in tree]
    return np.asarray(tree, dtype=np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def rms_norm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def situ_glu(a, b, beta1, beta2):
    return beta1 * np.tanh(a / beta1) * sigmoid(a) * (beta2 * np.tanh(b / beta2))


def swiglu(a, b):
    return a * sigmoid(a) * b


def glu(p, x, act, beta1, beta2):
    a, b = x @ p["w_gate"], x @ p["w_up"]
    h = situ_glu(a, b, beta1, beta2) if act == "situ" else swiglu(a, b)
    return h @ p["w_down"]


def attn_res(sources, query, gain, eps):
    """AR over a list of [T, D] sources, token by token."""
    T = sources[0].shape[0]
    out = np.zeros_like(sources[0])
    for t in range(T):
        z = np.array([np.sum(v[t] / math.sqrt(np.mean(v[t] ** 2) + eps) * gain * query) for v in sources])
        a = np.exp(z - z.max())
        a /= a.sum()
        out[t] = sum(ai * v[t] for ai, v in zip(a, sources))
    return out


def mla(p, x, norm_eps):
    """Gated MLA on one sequence x [T, D], naive causal softmax per head."""
    T, _ = x.shape
    rkv = p["kv_a_norm"].shape[0]
    hr = p["kv_a"].shape[1] - rkv
    if "q_a" in p:
        q = np.einsum("tr,rnh->tnh", rms_norm(x @ p["q_a"], p["q_a_norm"], norm_eps), p["q_b"])
    else:
        q = np.einsum("td,dnh->tnh", x, p["wq"])
    N, hqk = q.shape[1], q.shape[2]
    hn = hqk - hr
    ckv = x @ p["kv_a"]
    c_kv = rms_norm(ckv[:, :rkv], p["kv_a_norm"], norm_eps)
    k_r = ckv[:, rkv:]
    kv = np.einsum("tr,rnh->tnh", c_kv, p["kv_b"])
    V = kv.shape[-1] - hn
    o = np.zeros((T, N, V))
    for h in range(N):
        k = np.concatenate([kv[:, h, :hn], k_r], axis=-1)  # [T, hqk]
        v = kv[:, h, hn:]
        for t in range(T):
            s = (k[: t + 1] @ q[t, h]) / math.sqrt(hqk)
            w = np.exp(s - s.max())
            o[t, h] = (w / w.sum()) @ v[: t + 1]
    if "w_gate" in p:
        o = sigmoid(np.einsum("td,dnv->tnv", x, p["w_gate"])) * o
    return np.einsum("tnv,nvd->td", o, p["wo"])


def route(x, router, bias, top_k, renormalize, rsf):
    """One token x [D] → (ids, weights, scores, cutoff)."""
    s = sigmoid(x @ router)
    biased = s + bias
    order = sorted(range(len(s)), key=lambda e: (-biased[e], e))
    ids = order[:top_k]
    cutoff = biased[order[top_k]] if top_k < len(s) else -np.inf
    sel = s[ids]
    w = sel / sel.sum() if renormalize else sel
    return ids, rsf * w, s, cutoff


def moe(p, x, *, top_k, act, beta1, beta2, renormalize, rsf, eps, record=None):
    """x [T, D] → y [T, D], token by token, looping over the selected experts. ``record`` (a list) gets one
    (ids, k-th biased score, (k+1)-th biased score) per token."""
    T, D = x.shape
    y = np.zeros((T, D))
    ex = p["experts"]
    for t in range(T):
        ids, w, s, cutoff = route(x[t], p["router"], p["bias"], top_k, renormalize, rsf)
        if record is not None:
            record.append((list(ids), float(s[ids[-1]] + p["bias"][ids[-1]]), float(cutoff)))
        z = x[t] @ p["down"] if "down" in p else x[t]
        u = np.zeros_like(z)
        for e, we in zip(ids, w):
            a, b = z @ ex["w1"][e], z @ ex["w3"][e]
            h = situ_glu(a, b, beta1, beta2) if act == "situ" else swiglu(a, b)
            u += we * (h @ ex["w2"][e])
        if "down" in p:
            if "latent_norm" in p:
                u = rms_norm(u, p["latent_norm"], eps)
            u = u @ p["up"]
        y[t] = u
    if "shared" in p:
        y = y + glu(p["shared"], x, act, beta1, beta2)
    return y


def ref_forward(params, tokens, cfg: K3Config, routing: dict | None = None):
    """Float64 logits [B, T, W] following docs/model.md §1.3 literally (one sequence at a time).

    ``routing`` (a dict), if given, is filled {decoder layer: [per sequence: [per token: (ids, k-th biased score,
    (k+1)-th biased score)]]} for every MoE layer."""
    if not isinstance(params.get("layers"), list | tuple):
        raise ValueError("ref_forward takes the per-layer view {'layers': [...], ...} (k3jax.model.unstack)")
    P = f64(params)
    tokens = np.asarray(tokens)
    eps = cfg.rms_norm_eps
    b1, b2 = cfg.situ_beta, cfg.situ_linear_beta
    out = []
    for seq in tokens:
        emb = P["embed"][seq]

        def mixer(lp, h):
            if "mla" in lp:
                return mla(lp["mla"], h, cfg.mla_norm_eps)
            y, _ = kda_ref(lp["kda"], h[None], gate_lower_bound=cfg.kda_gate_lower_bound, eps=eps)
            return y[0]

        def ffn(lp, h, l):
            if "moe" in lp:
                rec = None
                if routing is not None:
                    rec = []
                    routing.setdefault(l, []).append(rec)
                return moe(lp["moe"], h, top_k=cfg.num_experts_per_token, act=cfg.hidden_act, beta1=b1, beta2=b2,
                           renormalize=cfg.moe_renormalize, rsf=cfg.routed_scaling_factor, eps=eps, record=rec)
            return glu(lp["mlp"], h, cfg.hidden_act, b1, b2)

        if cfg.uses_attn_res:
            blocks, part = [], emb
            for l, lp in enumerate(P["layers"]):
                h = part if not blocks else attn_res(blocks + [part], lp["attn_res"]["query"],
                                                     lp["attn_res"]["gain"], eps)
                if l % cfg.attn_res_block_size == 0:
                    blocks.append(part)
                    part = None
                a = mixer(lp, rms_norm(h, lp["input_norm"], eps))
                part = a if part is None else part + a
                h = attn_res(blocks + [part], lp["mlp_res"]["query"], lp["mlp_res"]["gain"], eps)
                part = part + ffn(lp, rms_norm(h, lp["post_norm"], eps), l)
            h = attn_res(blocks + [part], P["out_res"]["query"], P["out_res"]["gain"], eps)
        else:
            h = emb
            for l, lp in enumerate(P["layers"]):
                h = h + mixer(lp, rms_norm(h, lp["input_norm"], eps))
                h = h + ffn(lp, rms_norm(h, lp["post_norm"], eps), l)
        head = P["embed"].T if cfg.tie_word_embeddings else P["lm_head"]
        out.append(rms_norm(h, P["final_norm"], eps) @ head)
    return np.stack(out)
