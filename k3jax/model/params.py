"""The k3jax parameter tree and its initializers (SPEC §2.1, §11.3).

The model is a set of pure functions over a nested-dict pytree; this file fixes that tree. Kernels are
[in, out]; head-major outputs are split into explicit axes. Per-layer leaves are kept separate (a list of layer
dicts) so checkpoints and host memory peaks scale with one layer, never with the whole stack.

    params = {
      "embed":      [W, D]                       token embedding (same orientation as HF)
      "layers":     [layer_0, ..., layer_{L-1}]
      "final_norm": [D]
      "out_res":    {"gain": [D], "query": [D]}  output AttnRes (only with attn_res_block_size)
      "lm_head":    [D, W]                       absent when tie_word_embeddings
    }
    layer = {
      "input_norm": [D], "post_norm": [D],
      "attn_res": {"gain", "query"}, "mlp_res": {"gain", "query"}      (AttnRes only)
      "kda": {...}  or  "mla": {...}
      "mlp": {...}  or  "moe": {...}
    }
    kda = {wq, wk, wv: [D, N, K]; conv_q, conv_k, conv_v: [N*K, Wc]; f_a: [D, K]; f_b: [K, N, K];
           dt_bias: [N, K]; A_log: [N]; w_beta: [D, N]; w_gate: [D, N, K] (full rank) or g_a: [D, K], g_b: [K, N, K];
           o_norm: [K]; wo: [N, K, D]}
    mla = {q_a: [D, Rq], q_a_norm: [Rq], q_b: [Rq, N, Hqk]  (q-LoRA)  or  wq: [D, N, Hqk];
           kv_a: [D, Rkv + Hr]; kv_a_norm: [Rkv]; kv_b: [Rkv, N, Hn + V];
           w_gate: [D, N, V] (output gate); wo: [N, V, D]}
    mlp = {w_gate: [D, I], w_up: [D, I], w_down: [I, D]}
    moe = {router: [D, E]; bias: [E] (QB buffer, float32, not trained);
           experts: {w1: [E, P, F], w3: [E, P, F], w2: [E, F, P]};
           shared: {w_gate: [D, S], w_up: [D, S], w_down: [S, D]}   (S = num_shared * F; absent if 0)
           down: [D, P], up: [P, D], latent_norm: [P]               (LatentMoE only; P = latent width)}

Leaves stored F32 in the official checkpoint (A_log, dt_bias, conv weights, o_norm, the router bias) are kept
at least float32 whatever ``param_dtype`` is.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import K3Config

INIT_STD = 0.02  # HF initializer_range

_F32_LEAVES = frozenset({"A_log", "dt_bias", "conv_q", "conv_k", "conv_v", "o_norm", "bias"})


def _normal(key, shape, dtype, std=INIT_STD):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _at_least_f32(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def init_kda(key, *, d: int, num_heads: int, head_dim: int, conv_size: int, full_rank_gate: bool,
             gate_lower_bound: float | None, dtype=jnp.float32) -> dict:
    """KDA token-mixer parameters (SPEC §4.1). Gate init follows fla (SPEC §4.2): safe gate A_log = 0,
    softplus gate A_log = log U(1, 16); dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1)."""
    N, K = num_heads, head_dim
    ks = jax.random.split(key, 12)
    f32 = _at_least_f32(dtype)
    # Short-conv weights: PyTorch Conv1d default (kaiming-uniform, fan_in = kernel size for a depthwise conv).
    bound = 1.0 / math.sqrt(conv_size)
    conv = lambda k: jax.random.uniform(k, (N * K, conv_size), f32, -bound, bound)  # noqa: E731
    dt = jnp.exp(jax.random.uniform(ks[9], (N, K), f32, math.log(1e-3), math.log(1e-1)))
    dt_bias = dt + jnp.log(-jnp.expm1(-dt))  # inverse softplus
    if gate_lower_bound is None:
        A_log = jnp.log(jax.random.uniform(ks[10], (N,), f32, 1.0, 16.0))
    else:
        A_log = jnp.zeros((N,), f32)
    p = {
        "wq": _normal(ks[0], (d, N, K), dtype),
        "wk": _normal(ks[1], (d, N, K), dtype),
        "wv": _normal(ks[2], (d, N, K), dtype),
        "conv_q": conv(ks[3]),
        "conv_k": conv(ks[4]),
        "conv_v": conv(ks[5]),
        "f_a": _normal(ks[6], (d, K), dtype),
        "f_b": _normal(ks[7], (K, N, K), dtype),
        "dt_bias": dt_bias.astype(f32),
        "A_log": A_log,
        "w_beta": _normal(ks[8], (d, N), dtype),
        "o_norm": jnp.ones((K,), f32),
        "wo": _normal(ks[11], (N, K, d), dtype),
    }
    kg = jax.random.fold_in(key, 99)
    if full_rank_gate:
        p["w_gate"] = _normal(kg, (d, N, K), dtype)
    else:
        k1, k2 = jax.random.split(kg)
        p["g_a"] = _normal(k1, (d, K), dtype)
        p["g_b"] = _normal(k2, (K, N, K), dtype)
    return p


def init_mla(key, *, d: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int, qk_nope_head_dim: int,
             qk_rope_head_dim: int, v_head_dim: int, output_gate: bool, dtype=jnp.float32) -> dict:
    """Gated MLA parameters (SPEC §5.1)."""
    N, Hn, Hr, V = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    ks = jax.random.split(key, 6)
    p = {}
    if q_lora_rank:
        k1, k2 = jax.random.split(ks[0])
        p["q_a"] = _normal(k1, (d, q_lora_rank), dtype)
        p["q_a_norm"] = jnp.ones((q_lora_rank,), dtype)
        p["q_b"] = _normal(k2, (q_lora_rank, N, Hn + Hr), dtype)
    else:
        p["wq"] = _normal(ks[0], (d, N, Hn + Hr), dtype)
    p["kv_a"] = _normal(ks[1], (d, kv_lora_rank + Hr), dtype)
    p["kv_a_norm"] = jnp.ones((kv_lora_rank,), dtype)
    p["kv_b"] = _normal(ks[2], (kv_lora_rank, N, Hn + V), dtype)
    if output_gate:
        p["w_gate"] = _normal(ks[3], (d, N, V), dtype)
    p["wo"] = _normal(ks[4], (N, V, d), dtype)
    return p


def init_glu(key, *, d: int, hidden: int, dtype=jnp.float32) -> dict:
    """A gated FFN (SiTU-GLU or SwiGLU): dense layer-0 MLP and the fused shared experts."""
    k1, k2, k3 = jax.random.split(key, 3)
    return {"w_gate": _normal(k1, (d, hidden), dtype), "w_up": _normal(k2, (d, hidden), dtype),
            "w_down": _normal(k3, (hidden, d), dtype)}


def init_moe(key, *, d: int, num_experts: int, expert_hidden: int, num_shared: int, latent: int | None,
             latent_norm: bool, dtype=jnp.float32) -> dict:
    """Stable LatentMoE (latent is not None) or a standard MoE (SPEC §7.1, §13)."""
    E, F = num_experts, expert_hidden
    P = latent if latent is not None else d
    ks = jax.random.split(key, 8)
    p = {
        "router": _normal(ks[0], (d, E), dtype),
        "bias": jnp.zeros((E,), _at_least_f32(dtype)),
        "experts": {
            "w1": _normal(ks[1], (E, P, F), dtype),
            "w3": _normal(ks[2], (E, P, F), dtype),
            "w2": _normal(ks[3], (E, F, P), dtype),
        },
    }
    if num_shared:
        p["shared"] = init_glu(ks[4], d=d, hidden=num_shared * F, dtype=dtype)
    if latent is not None:
        p["down"] = _normal(ks[5], (d, P), dtype)
        p["up"] = _normal(ks[6], (P, d), dtype)
        if latent_norm:
            p["latent_norm"] = jnp.ones((P,), dtype)
    return p


def init_attn_res(d: int, dtype=jnp.float32) -> dict:
    """AttnRes pseudo-query (zero: the first mix is uniform, SPEC §3.3) and key-norm gain (ones)."""
    return {"gain": jnp.ones((d,), dtype), "query": jnp.zeros((d,), dtype)}


def init_layer(key, cfg: K3Config, l: int, dtype) -> dict:
    d = cfg.hidden_size
    ka, kf = jax.random.split(key)
    layer = {"input_norm": jnp.ones((d,), dtype), "post_norm": jnp.ones((d,), dtype)}
    if cfg.uses_attn_res:
        layer["attn_res"] = init_attn_res(d, dtype)
        layer["mlp_res"] = init_attn_res(d, dtype)
    if cfg.is_mla(l):
        layer["mla"] = init_mla(ka, d=d, num_heads=cfg.mla_num_heads, q_lora_rank=cfg.q_lora_rank,
                                kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                                qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                                output_gate=cfg.mla_output_gate, dtype=dtype)
    else:
        layer["kda"] = init_kda(ka, d=d, num_heads=cfg.kda_num_heads, head_dim=cfg.kda_head_dim,
                                conv_size=cfg.kda_conv_size, full_rank_gate=cfg.kda_full_rank_gate,
                                gate_lower_bound=cfg.kda_gate_lower_bound, dtype=dtype)
    if cfg.is_moe(l):
        layer["moe"] = init_moe(kf, d=d, num_experts=cfg.num_experts, expert_hidden=cfg.moe_intermediate_size,
                                num_shared=cfg.num_shared_experts, latent=cfg.routed_expert_hidden_size,
                                latent_norm=cfg.latent_moe_use_norm, dtype=dtype)
    else:
        layer["mlp"] = init_glu(kf, d=d, hidden=cfg.intermediate_size, dtype=dtype)
    return layer


def init_params(cfg: K3Config, key) -> dict:
    """Random parameters for ``cfg`` (dtype ``cfg.param_dtype``). Use under ``jax.eval_shape`` for full size."""
    dtype = jnp.dtype(cfg.param_dtype)
    d, Wv = cfg.hidden_size, cfg.vocab_size
    k_emb, k_head, k_layers = jax.random.split(key, 3)
    params = {
        "embed": _normal(k_emb, (Wv, d), dtype),
        "layers": [init_layer(jax.random.fold_in(k_layers, l), cfg, l, dtype) for l in range(cfg.num_layers)],
        "final_norm": jnp.ones((d,), dtype),
    }
    if cfg.uses_attn_res:
        params["out_res"] = init_attn_res(d, dtype)
    if not cfg.tie_word_embeddings:
        params["lm_head"] = _normal(k_head, (d, Wv), dtype)
    return params


def abstract_params(cfg: K3Config) -> dict:
    """ShapeDtypeStructs of the parameter tree; allocates nothing (works for the full 2.78T model)."""
    return jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))


def count_params(tree) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(tree)))
