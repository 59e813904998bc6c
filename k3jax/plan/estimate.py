"""Closed-form figures of a plan, from the config and the rules alone (nothing lowered): the program's argument
bytes per device (``estimate_arguments``), Muon's Newton–Schulz FLOPs (``newton_schulz_flops``) and the FLOPs of one
step (``model_flops``: 6 · N_active · tokens and the mode's terms; N_active is ``k3jax.model.active_params``, the
one count ``k3 plan`` reports too). The AOT planner (``k3jax.plan.aot``) prints them beside the compiler's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3jax.config import K3Config
from k3jax.layers.experts import parse_packed_name, split_packed
from k3jax.layers.lora import is_adapter
from k3jax.model import active_params
from k3jax.model.cache import cache_leaf_axes, cache_shapes
from k3jax.optim.dist_muon import loops, one_group, pool_plan, route, view_spec
from k3jax.optim.optimizer import OptimConfig, leaf_rule, whole_leaf_rule
from k3jax.plan.spec import SERVING, PlanSpec, plan_params, run_settings, with_defaults
from k3jax.pytree import key_names, path_str
from k3jax.sharding import placement as place
from k3jax.sharding.context_parallel import ContextParallel
from k3jax.sharding.rules import logical_to_spec, param_specs

# (block, leaf) the official checkpoint stores as F32 (tests/golden/k3/tensors.tsv.gz: e_score_correction_bias, and
# A_log, dt_bias, the q/k/v conv1d weights and o_norm of every KDA layer); every other non-expert tensor is BF16
F32_STORED = {("moe", "bias"), *(("kda", k) for k in ("A_log", "dt_bias", "conv_q", "conv_k", "conv_v", "o_norm"))}


def _per_device(shape, pspec, sizes) -> float:
    ways = 1
    for ax in pspec:
        for a in (ax,) if isinstance(ax, str) else (ax or ()):
            ways *= sizes[a]
    return math.prod(shape) / ways


def _with_specs(tree, specs) -> list:
    """[((path, leaf), PartitionSpec)] of a params tree and its ``param_specs``."""
    return list(zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(
        specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)), strict=True))


def estimate_arguments(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str) -> dict:
    """Closed-form bytes per device of the program's arguments: for every parameter of the config (shape from the
    config), its elements per device under the rules' shardings × the bytes the mode stores per element —
    forward: the checkpoint's dtypes — 4 for the tensors it stores F32 (``F32_STORED``), 2 (BF16) for every other
    weight, 1 per packed MXFP4 byte / E8M0 scale; train and frozen-experts: 4 (fp32
    master) + optimizer state (Muon: one moment, AdamW: two, each of ``--opt-state-dtype``'s size, 4 bytes by default;
    the frozen router bias: 0), packed experts
    as stored. Plus the tokens (int32, split over the batch axes). Step counters, the RNG key and Muon's
    Newton–Schulz coefficients are left out (bytes). ``gradient_bytes``: 4 per trainable element (the lower bound's
    gradient term; not an argument)."""

    spec = with_defaults(spec)[0]
    abstract = plan_params(cfg, spec)
    specs = param_specs(cfg, strategy, sizes, abstract)
    m = jnp.dtype(spec.opt_state_dtype).itemsize  # bytes per stored moment
    state_per_label = {"muon": m, "adam_decay": 2 * m, "adam_nodecay": 2 * m, "frozen": 0}
    out = {"weights": 0.0, "optimizer": 0.0, "packed_experts": 0.0, "tokens": 0.0, "gradient_bytes": 0.0}
    for (path, leaf), pspec in _with_specs(abstract, specs):
        n = _per_device(leaf.shape, pspec, sizes)
        if parse_packed_name(key_names(path)[-1]):
            out["packed_experts"] += n
        elif spec.mode in SERVING or (spec.mode == "lora" and not is_adapter(key_names(path)[-1])):
            names = key_names(path)     # BF16 (a lora plan's frozen base too), F32 where the checkpoint stores it
            out["weights"] += (4 if tuple(names[-2:]) in F32_STORED or leaf.dtype == jnp.float32 else 2) * n
        elif spec.mode == "lora":       # an adapter: fp32, AdamW's two moments, a gradient
            out["weights"] += 4 * n
            out["optimizer"] += 2 * jnp.dtype(spec.opt_state_dtype).itemsize * n
            out["gradient_bytes"] += 4 * n
        else:
            label = leaf_rule(path, leaf)[0]
            out["weights"] += 4 * n
            out["optimizer"] += state_per_label[label] * n
            out["gradient_bytes"] += 0 if label == "frozen" else 4 * n
    small = spec.mode == "decode" and place.small_batch(strategy, sizes, spec.batch)
    ways = 1 if small else place.token_parallel(strategy, sizes)
    out["tokens"] = 4 * spec.batch * (spec.seq_len + (spec.mode not in SERVING)) / ways
    out["cache"] = cache_bytes(cfg, spec, sizes, strategy)["per_device"] if spec.mode in ("prefill", "decode") else 0.0
    out["total"] = out["weights"] + out["optimizer"] + out["packed_experts"] + out["tokens"] + out["cache"]
    return out


def cache_bytes(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str) -> dict:
    """Bytes of a prefill / decode plan's hybrid cache (``model.cache.cache_shapes`` for --batch rows of --context
    positions, the scanned layout): ``global``, ``per_device`` under the cache's shardings
    (``placement.cache_shardings``: the small-batch rule replicates it), and the per-device split into the KDA
    state + conv tails and the MLA latent."""

    spec = with_defaults(spec)[0]
    context = None
    if place.uses_context(strategy, sizes):                  # a context-parallel prefill: the sequence's split

        context = ContextParallel(sizes, strategy, batch=spec.batch)
    rules = place.cache_rules(strategy, context)
    small = context is None and spec.mode == "decode" and place.small_batch(strategy, sizes, spec.batch)
    shapes = cache_shapes(cfg, spec.batch, spec.context, run_settings(cfg, spec), stacked=True)
    out = {"global": 0.0, "per_device": 0.0, "kda_per_device": 0.0, "mla_per_device": 0.0}
    for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        name = key_names(path)[-1]
        logical = tuple(None if small and a == "batch" else a for a in cache_leaf_axes(key_names(path), x.ndim))
        n = _per_device(x.shape, logical_to_spec(logical, x.shape, rules, sizes), sizes) * x.dtype.itemsize
        out["global"] += math.prod(x.shape) * x.dtype.itemsize
        out["per_device"] += n
        if name in ("c_kv", "k_rope"):
            out["mla_per_device"] += n
        elif name != "lengths":
            out["kda_per_device"] += n
    return out


def newton_schulz_flops(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str, ns_steps: int) -> dict:
    """Matmul FLOPs of Muon's Newton–Schulz in one optimizer step, from the config and the optimizer's rules: per
    orthogonalized [m, n] block (per head / per expert / per layer, ``optim.optimizer.leaf_rule``), a = min(m, n),
    b = max(m, n), each step is A = X·Xᵀ (2a²b), A·A (2a³), (c₁A + c₂A²)·X (2a²b) — optax's quintic iteration.
    ``global``: each block once. ``per_device``: what one device computes under ``spec.muon_layout`` —
    owner (``optim.dist_muon``): the blocks its pools hand it, padding included (``pool_plan``: a pool of P blocks
    held alike by a group of g devices costs each ceil(P / g) blocks; a stack updated one layer group at a time,
    ``dist_muon.loops``, pools per group: its pools' ``per_device`` are per group, their names say how many;
    ``padding`` = per_device × devices / global - 1); layer: each leaf's share if the work split as its sharding
    splits the leaf (a replicated leaf is orthogonalized whole on every device) — the ideal XLA misses there: it
    computes X·Xᵀ of a sharded block in pieces but may hold A whole and square it on every device (on v6e-256 each
    shared-expert block's 6144² A·A, 9/10 of the frozen step's optimizer FLOPs, experiments/LOG.md)."""

    out = {"global": 0.0, "per_device": 0.0, "padding": 0.0}
    if spec.mode in SERVING:  # no optimizer step
        return out
    abstract = split_packed(plan_params(cfg, spec))[0]  # packed (frozen) experts are not optimized
    specs = param_specs(cfg, strategy, sizes, abstract)
    flops = lambda a, b: ns_steps * (4.0 * a * a * b + 2.0 * a ** 3)  # noqa: E731  one [a, b] block, a <= b
    routes, per_group, groups = [], [], 1
    for (path, leaf), pspec in _with_specs(abstract, specs):
        label, dims, view = whole_leaf_rule(path, leaf, OptimConfig())
        if label != "muon":
            continue
        shape = tuple(view or leaf.shape)
        vspec = view_spec(pspec, tuple(leaf.shape), shape, path_str(path)) if view else pspec
        r = route(shape, dims, vspec, sizes)
        f = r.view.count * flops(*r.view.key)
        out["global"] += f
        out["per_device"] += f * _per_device(leaf.shape, pspec, sizes) / math.prod(leaf.shape)  # layer layout
        if loops(shape, leaf.dtype, vspec, sizes, key_names(path)[0] == "groups"):  # updated group by group
            d1, s1 = one_group(dims, vspec)
            per_group.append((route(shape[1:], d1, s1, sizes), leaf.dtype))
            groups = shape[0]
        else:
            routes.append((r, leaf.dtype))
    if spec.muon_layout == "owner":
        pools = [(k, p, 1) for k, p in pool_plan(routes, sizes).items()]
        pools += [(k, p, groups) for k, p in pool_plan(per_group, sizes).items()]
        out["per_device"] = sum(n * p["per_device"] * flops(k[0], k[1]) for k, p, n in pools)
        out["pools"] = {f"{k[0]}x{k[1]} {k[2]} over {'x'.join(k[3]) or 'its owners'}"
                        + (f", per layer group x{n}" if n > 1 else ""): {**p, "blocks": p["blocks"] * n}
                        for k, p, n in pools}
    devices = math.prod(sizes.values())
    out["padding"] = out["per_device"] * devices / out["global"] - 1 if out["global"] else 0.0
    return out


def attention_flops(cfg: K3Config, spec: PlanSpec) -> float:
    """Per sequence, the FLOPs of a prefill / decode step that no parameter count holds: MLA's scores and weighted
    sums over the cached keys, and KDA's state read and update (~4·K·V per head per token, as train/flops.py).
    Decode (absorbed): each head scores the latent and the shared key slice and sums latents, 2·(2·R + Hr) per key,
    over --context keys. Prefill (materialized, causal from an empty cache): 2·(Hn + Hr + V) per (query, key) pair,
    T(T+1)/2 pairs. The up-projections of the latent are ``kv_b`` products, counted in N_active."""
    spec = with_defaults(spec)[0]
    T, N = spec.seq_len, cfg.mla_num_heads
    if spec.mode == "decode":
        mla = 2.0 * N * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * spec.context
    else:
        mla = 2.0 * N * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * T * (T + 1) / 2
    kda = 4.0 * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * T
    return cfg.num_mla_layers * mla + cfg.num_kda_layers * kda


def lora_active_params(cfg: K3Config, spec: PlanSpec) -> float:
    """Adapter parameters one token runs through in a lora plan: every dense adapter, and the routed experts'
    adapters times top-k / E."""

    total = 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(plan_params(cfg, spec))[0]:
        names = key_names(path)
        if is_adapter(names[-1]):
            share = cfg.num_experts_per_token / cfg.num_experts if "experts" in names else 1.0
            total += math.prod(x.shape) * share
    return total


def model_flops(cfg: K3Config, spec: PlanSpec, sizes: dict | None = None, strategy: str | None = None) -> dict:
    """FLOPs of one step from the config: ``6 · N_active · tokens`` (train; the issue's check), with the terms a
    mode changes — forward 2·N, prefill and decode 2·N plus the attention over the cache (``attention_flops``),
    frozen experts 6·N_other + 4·N_experts (no expert weight gradients), and the
    recompute of one forward (+2·N) under a remat policy that saves nothing of the layer; with the mesh
    (``sizes``, ``strategy``), plus the optimizer's Newton–Schulz split over the devices (``newton_schulz_flops``:
    per device x devices, so a replicated block counts once per device, as the compiled program's total does).
    ``useful``: the same without the remat recompute (the roofline's compute term)."""

    spec = with_defaults(spec)[0]
    n_active, n_exp = active_params(cfg)
    tokens = spec.batch * spec.seq_len
    six = 6.0 * n_active * tokens
    if spec.mode == "forward":
        expected = 2.0 * n_active * tokens
    elif spec.mode in ("prefill", "decode"):
        expected = 2.0 * n_active * tokens + spec.batch * attention_flops(cfg, spec)
    elif spec.mode == "frozen-experts":
        expected = (6.0 * (n_active - n_exp) + 4.0 * n_exp) * tokens
    elif spec.mode == "lora":  # frozen base: forward + activation gradients; adapters: 6 per active parameter
        expected = (4.0 * n_active + 6.0 * lora_active_params(cfg, spec)) * tokens
    else:
        expected = six
    useful = expected
    if spec.mode != "forward" and spec.remat in ("full", "group", "nothing_saveable"):
        expected += 2.0 * n_active * tokens
    out = {"active_params": n_active, "tokens": tokens, "six_n_tokens": six, "model": expected}
    if sizes is not None and spec.mode != "lora":  # lora: AdamW, no Newton–Schulz
        ns = newton_schulz_flops(cfg, spec, sizes, strategy, OptimConfig().ns_steps)
        out["newton_schulz"] = ns["global"]
        out["newton_schulz_split"] = ns["per_device"] * math.prod(sizes.values())
        out["newton_schulz_padding"] = ns["padding"]
        if "pools" in ns:
            out["newton_schulz_pools"] = ns["pools"]
        expected += out["newton_schulz_split"]
        useful += out["newton_schulz_split"]
    out["expected"] = expected
    out["useful"] = useful  # the mode's model FLOPs (+ Newton–Schulz split): no remat recompute, no padding
    return out


__all__ = ["F32_STORED", "attention_flops", "cache_bytes", "estimate_arguments", "model_flops",
           "newton_schulz_flops"]
