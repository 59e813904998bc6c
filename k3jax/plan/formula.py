"""The formula planner (`k3 plan` without --compile): parameters, checkpoint bytes and per-device memory of a
config, from its shapes and the name map alone — no weight allocated, nothing compiled.

    plan = build_plan(get_preset("kimi-k3"), ("8xB300", "64xH200"), context=131072, batch=4)
    rows = shard_rows(cfg)     # the text shards: file, bytes, header length and sha256

Counts: ``total_params`` counts the k3jax parameter tree (A_log as [H]: 96 per KDA layer for K3);
``checkpoint_params`` counts the stored tensors (A_log padded to 128, packed U8 = 2 weights per byte, E8M0 scales
not counted). ``active_params`` is what one token touches (``k3jax.model.counts``, the one definition): top-k of the
routed experts, everything else in full including ``lm_head``, the input embedding and the router bias excluded.

Memory per device: weights in the checkpoint format (routed experts as stored — MXFP4 packed + scales for K3 — all
else BF16/F32 as stored), routed experts of every MoE layer split evenly over the devices (ceil), all other tensors
replicated; plus per-sequence caches (KDA fp32 state [H, K, V] and fp32 conv windows per KDA layer; MLA absorbed
latent cache kv_lora + rope values per token per MLA layer in bf16), with the batch's sequences divided over the
devices (data-parallel attention, ceil). Activations, workspace and framework overhead are not included. The
per-sequence cache is also given at 2^20 = 1,048,576 tokens (``memory.cache_bytes_per_sequence_at_1m``: the KDA
part is fixed, only the MLA layers grow), beside what a plain materialized KV cache would take there (per MLA layer
and token N (qk_nope + qk_rope) key and N v_head_dim value entries, bf16:
``memory.plain_kv_cache_bytes_per_sequence_at_1m``) and the ratio of the two.
"""

from __future__ import annotations

import math
from collections import defaultdict

from k3jax.checkpoint.name_map import default_layout, hf_tensors, leaf_shapes, shard_tensors
from k3jax.checkpoint.safetensors_layout import shard_layout
from k3jax.errors import InputError
from k3jax.model import abstract_params, count_params
from k3jax.model.counts import active_leaf
from k3jax.plan.hardware import DEFAULT_HARDWARE, parse_hardware

DEFAULT_CONTEXT = 131072
MILLION_CONTEXT = 1_048_576  # the per-sequence cache totals are also given at 2^20 tokens
CACHE_VALUE_BYTES = 2  # MLA cache values (latent and plain) in bf16; KDA state and conv windows fp32

ASSUMPTIONS = (
    "weights in checkpoint format: routed experts as stored (MXFP4 packed + E8M0 scales for K3), others BF16/F32",
    "routed experts of each MoE layer split evenly over all devices (ceil(E / devices) per device); "
    "every other tensor replicated on every device",
    "KDA: fp32 recurrent state [H, K, V] + fp32 conv windows [3, W-1, H*K] per KDA layer per sequence",
    "MLA: absorbed latent cache (kv_lora_rank + qk_rope_head_dim) bf16 values per token per MLA layer",
    "plain KV cache (for comparison only): materialized per-head keys N (qk_nope + qk_rope) and values "
    "N v_head_dim, bf16, per token per MLA layer; KDA state and conv windows as above",
    "sequences divided over devices (data-parallel attention): ceil(batch / devices) sequences per device",
    "activations, workspace, allocator and framework overhead are not included; GB = 10^9 bytes",
)


def _component(path: tuple) -> str:
    if path[0] != "layers":
        return {"embed": "embed", "lm_head": "lm_head"}.get(path[0], "norms_and_attn_res")
    kind = path[2]
    if kind in ("kda", "mla"):
        return f"{kind}_attention"
    if kind == "mlp":
        return "dense_mlp"
    if kind == "moe":
        return {"experts": "routed_experts", "shared": "shared_experts", "router": "router",
                "bias": "router_bias", "down": "latent_proj", "up": "latent_proj",
                "latent_norm": "latent_proj"}[path[3]]
    return "norms_and_attn_res"


def specs_with_fallback(cfg):
    """Name-map tensors, falling back to bf16 experts when the widths do not fit MXFP4 groups (noted)."""
    try:
        return hf_tensors(cfg), cfg.expert_format, None
    except InputError as e:
        if cfg.expert_format != "mxfp4":
            raise
        return hf_tensors(cfg, expert_format="bf16"), "bf16", f"experts listed as bf16: {e}"


def build_plan(cfg, meshes=DEFAULT_HARDWARE, context: int = DEFAULT_CONTEXT, batch: int = 1) -> dict:
    if context < 0 or batch < 1:
        raise InputError(f"--context must be >= 0 and --batch >= 1 (got {context}, {batch})")
    mesh_info = [(m, *parse_hardware(m)) for m in meshes]
    params = abstract_params(cfg)
    specs, fmt, note = specs_with_fallback(cfg)

    comp_params, comp_active = defaultdict(int), defaultdict(int)
    layer_params, layer_active = defaultdict(int), defaultdict(int)
    for path, shape in leaf_shapes(cfg).items():
        n = math.prod(shape)
        comp = _component(path)
        comp_params[comp] += n
        active = active_leaf(cfg, path, n)
        comp_active[comp] += active
        key = path[1] if path[0] == "layers" else "model"
        layer_params[key] += n
        layer_active[key] += active
    total = count_params(params)
    assert total == sum(comp_params.values())

    layer_bytes, expert_bytes, dtype_bytes, dtype_count = defaultdict(int), defaultdict(int), defaultdict(int), \
        defaultdict(int)
    for s in specs:
        b = s.nbytes
        layer_bytes["model" if s.layer is None else s.layer] += b
        dtype_bytes[s.dtype] += b
        dtype_count[s.dtype] += 1
        if s.expert is not None:
            expert_bytes[s.layer] += b
    ckpt_bytes = sum(dtype_bytes.values())

    layers = []
    for l in range(cfg.num_layers):
        layers.append({"layer": l, "attention": "mla" if cfg.is_mla(l) else "kda",
                       "ffn": "moe" if cfg.is_moe(l) else "dense", "params": layer_params[l],
                       "active": layer_active[l], "bytes": layer_bytes[l]})

    # ---- memory per device
    routed_total = sum(expert_bytes.values())
    replicated = ckpt_bytes - routed_total
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    kda_state_seq = cfg.num_kda_layers * H * K * K * 4
    kda_conv_seq = cfg.num_kda_layers * 3 * (W - 1) * H * K * 4
    mla_token = cfg.num_mla_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * CACHE_VALUE_BYTES
    N = cfg.mla_num_heads
    plain_token = cfg.num_mla_layers * N * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) \
        * CACHE_VALUE_BYTES
    # per sequence at 2^20 tokens: the KDA state and conv windows are fixed, only the MLA layers grow
    fixed_seq = kda_state_seq + kda_conv_seq
    cache_1m = fixed_seq + MILLION_CONTEXT * mla_token
    plain_1m = fixed_seq + MILLION_CONTEXT * plain_token
    mesh_out = []
    for name, n, gpu, cap in mesh_info:
        per_dev_experts = -(-cfg.num_experts // n)
        weights = replicated + sum(b // cfg.num_experts * per_dev_experts for b in expert_bytes.values())
        seqs = -(-batch // n)
        kda = seqs * (kda_state_seq + kda_conv_seq)
        mla = seqs * context * mla_token
        used = weights + kda + mla
        mesh_out.append({"mesh": name, "devices": n, "gpu": gpu, "device_bytes": cap,
                         "experts_per_device_per_layer": per_dev_experts, "sequences_per_device": seqs,
                         "weights_bytes": weights, "weights_bytes_fully_sharded": -(-ckpt_bytes // n),
                         "kda_state_bytes": kda, "mla_cache_bytes": mla,
                         "total_bytes": used, "free_bytes": cap - used, "fits": used <= cap})

    out = {
        "preset": cfg.name,
        "layout": default_layout(cfg),
        "expert_format": fmt,
        "total_params": total,
        "total_params_note": "k3jax parameter tree; A_log counted as [H] (unpadded)",
        "checkpoint_params": sum(s.num_params for s in specs),
        "checkpoint_params_note": "stored tensors: A_log padding included, packed U8 = 2 weights/byte, "
                                  "E8M0 scales not counted",
        "active_params": sum(comp_active.values()),
        "active_params_note": "per token, excluding the input embedding: top-k routed experts, the rest in full "
                              "(incl. lm_head); router bias excluded",
        "active_params_with_embedding": sum(comp_active.values()) + (
            0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size),
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_tensors": len(specs),
        "routed_expert_bytes": routed_total,
        "bytes_by_dtype": dict(sorted(dtype_bytes.items())),
        "tensors_by_dtype": dict(sorted(dtype_count.items())),
        "components": {k: {"params": comp_params[k], "active": comp_active[k]} for k in sorted(comp_params)},
        "model_level": {"params": layer_params["model"], "active": layer_active["model"],
                        "bytes": layer_bytes["model"]},
        "layers": layers,
        "memory": {"context": context, "batch": batch, "kda_state_bytes_per_sequence": kda_state_seq,
                   "kda_conv_bytes_per_sequence": kda_conv_seq, "mla_cache_bytes_per_token": mla_token,
                   "mla_cache_dtype": "bfloat16", "kda_cache_dtype": "float32",
                   "plain_kv_cache_bytes_per_token": plain_token,
                   "context_1m": MILLION_CONTEXT, "cache_bytes_per_sequence_at_1m": cache_1m,
                   "plain_kv_cache_bytes_per_sequence_at_1m": plain_1m,
                   "plain_kv_over_latent_cache_at_1m": plain_1m / cache_1m,
                   "replicated_weight_bytes": replicated, "assumptions": list(ASSUMPTIONS), "meshes": mesh_out},
    }
    if note:
        out["notes"] = [note]
    return out


def shard_rows(cfg) -> list[dict]:
    """One row per text shard: file, file size, header length N, header sha256 (from the name map alone)."""
    _, fmt, _ = specs_with_fallback(cfg)
    rows = []
    for f, specs in shard_tensors(cfg, expert_format=fmt):
        lay = shard_layout((s.name, s.dtype, s.shape) for s in specs)
        rows.append({"file": f, "bytes": lay.file_bytes, "header_len": lay.header_len,
                     "header_sha256": lay.header_sha256, "tensors": len(specs)})
    return rows


__all__ = ["ASSUMPTIONS", "CACHE_VALUE_BYTES", "DEFAULT_CONTEXT", "MILLION_CONTEXT", "build_plan", "shard_rows",
           "specs_with_fallback"]
