"""Closed-form figures of a plan, from the config and the rules alone (nothing lowered): the program's argument
bytes per device (``estimate_arguments``), Muon's Newton–Schulz FLOPs (``newton_schulz_flops``) and the FLOPs of one
step (``model_flops``: 6 · N_active · tokens and the mode's terms; N_active is ``k3jax.model.active_params``, the
one count ``k3 plan`` reports too). The AOT planner (``k3jax.plan.aot``) prints them beside the compiler's.

A verify plan also runs a DSpark draft (``plan_draft``: ``DraftConfig.for_target``, for kimi-k3 the published
draft's shape) whose weights are split like the target's non-expert weights (the same rules column over the logical
axes its parameters carry; a dimension the mesh does not divide stays whole) and whose context cache rows follow the
target cache's rows: ``draft_bytes``; its KDA verify records (``k3jax.model.rollback``) are temporaries of the step:
``record_bytes``; its draft's FLOPs: ``draft_flops``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.draft.config import DraftConfig
from k3jax.draft.network import DraftModel, draft_cache
from k3jax.layers.experts import parse_packed_name, split_packed
from k3jax.layers.lora import is_adapter
from k3jax.model import active_params
from k3jax.model.cache import cache_leaf_axes, cache_shapes, capacity
from k3jax.model.rollback import with_records
from k3jax.optim.dist_muon import loops, one_group, pool_plan, route, view_spec
from k3jax.optim.optimizer import OptimConfig, leaf_rule, whole_leaf_rule
from k3jax.plan.spec import CACHED, SERVING, STEP_MODES, PlanSpec, plan_params, run_settings, with_defaults
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
    whole = spec.mode in STEP_MODES and place.whole_rows(strategy, sizes, spec.batch)
    ways = 1 if whole else place.token_parallel(strategy, sizes)
    out["tokens"] = 4 * spec.batch * (spec.seq_len + (spec.mode not in SERVING)) / ways
    out["cache"] = cache_bytes(cfg, spec, sizes, strategy)["per_device"] if spec.mode in CACHED else 0.0
    out["draft"] = 0.0
    if spec.mode == "verify":  # the draft's weights and its context cache are arguments too
        d = draft_bytes(cfg, spec, sizes, strategy)
        out["draft"] = d["params_per_device"] + d["cache_per_device"]
    out["total"] = (out["weights"] + out["optimizer"] + out["packed_experts"] + out["tokens"] + out["cache"]
                    + out["draft"])
    return out


def _leaf_bytes(x, logical: tuple, rules, sizes: dict, small: bool, name: str, lenient: bool = False) -> float:
    """Bytes per device of one cache / draft leaf with logical axes ``logical`` under ``rules`` (``small``: the
    small-batch rule, rows on every device)."""
    logical = tuple(None if small and a == "batch" else a for a in logical)
    return _per_device(x.shape, logical_to_spec(logical, x.shape, rules, sizes, name=name, lenient=lenient),
                       sizes) * x.dtype.itemsize


def cache_bytes(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str) -> dict:
    """Bytes of a prefill / decode plan's hybrid cache (``model.cache.cache_shapes`` for --batch rows of --context
    positions, the scanned layout): ``global``, ``per_device`` under the cache's shardings
    (``placement.cache_shardings``: the small-batch rule replicates it; the latent's rows may take the heads' axis,
    ``placement.cache_leaf_rules``), and the per-device split into the KDA
    state + conv tails and the MLA latent."""

    spec = with_defaults(spec)[0]
    context = None
    if place.uses_context(strategy, sizes):                  # a context-parallel prefill: the sequence's split

        context = ContextParallel(sizes, strategy, batch=spec.batch)
    rules = place.cache_rules(strategy, context)
    small = context is None and spec.mode in STEP_MODES and place.small_batch(strategy, sizes, spec.batch)
    shapes = cache_shapes(cfg, spec.batch, spec.context, run_settings(cfg, spec), stacked=True)
    out = {"global": 0.0, "per_device": 0.0, "kda_per_device": 0.0, "mla_per_device": 0.0}
    for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        names = key_names(path)
        name, logical, fixed = names[-1], cache_leaf_axes(names, x.ndim), small or context is not None
        n = _leaf_bytes(x, logical, place.cache_leaf_rules(strategy, sizes, rules, names, logical, x.shape, fixed),
                        sizes, small, path_str(path))
        out["global"] += math.prod(x.shape) * x.dtype.itemsize
        out["per_device"] += n
        if name in ("c_kv", "k_rope"):
            out["mla_per_device"] += n
        elif name != "lengths":
            out["kda_per_device"] += n
    return out


def plan_draft(cfg: K3Config, spec: PlanSpec) -> DraftConfig:
    """The draft a verify plan runs: ``DraftConfig.for_target(cfg)`` drafting ``--draft-tokens`` per block (for
    kimi-k3: the published K3 DSpark draft's dimensions — 5 dense MLA layers of width 7168, 64 heads, MLP 14336,
    taps 2, 23, 47, 71, 89, Markov rank 256)."""
    return DraftConfig.for_target(cfg, block_size=with_defaults(spec)[0].draft_tokens)


def abstract_draft(dcfg: DraftConfig, dtype="bfloat16") -> tuple:
    """(graphdef, parameters as ShapeDtypeStructs, their logical axes) of a ``dtype`` draft (weights and compute in
    BF16 as the target's serving weights); ``nnx.merge(graphdef, parameters)`` rebuilds the module."""
    model = nnx.eval_shape(lambda: DraftModel(dcfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    gdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    axes = nnx.State.from_flat_path({p: tuple(v.get_metadata()["axes"]) for p, v in flat}).to_pure_dict()
    return gdef, state.to_pure_dict(), axes


def draft_specs(params, axes, strategy: str, sizes: dict):
    """PartitionSpec per draft parameter: the target's rules column over the draft's logical axes (its MLA, MLP and
    context projection carry the target's names), a dimension the mesh does not divide left whole."""
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, tuple))
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    return jax.tree.unflatten(tree, [logical_to_spec(a, x.shape, strategy, sizes, name=path_str(p), lenient=True)
                                     for (p, x), a in zip(leaves, flat_axes, strict=True)])


DRAFT_CACHE_AXES = ("batch", None, None)  # c_kv [B, S, R], k_rope [B, S, Hr]: rows like the target cache's rows


def draft_cache_shapes(cfg: K3Config, spec: PlanSpec, dcfg: DraftConfig) -> dict:
    """The draft's context cache for --batch rows, as many positions as the target cache holds."""
    run = run_settings(cfg, spec)
    return jax.eval_shape(lambda: draft_cache(dcfg, spec.batch, capacity(cfg, spec.context, run),
                                              jnp.dtype(run.compute_dtype)))


def draft_cache_logical(names: tuple, ndim: int) -> tuple:
    return ("batch",) if names[-1] == "lengths" else DRAFT_CACHE_AXES[:ndim]


def draft_bytes(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str) -> dict:
    """Bytes of a verify plan's draft: ``params_global`` / ``params_per_device`` (BF16, ``draft_specs``) and
    ``cache_global`` / ``cache_per_device`` (rows over the token axes, or on every device under the small-batch
    rule)."""
    spec = with_defaults(spec)[0]
    dcfg = plan_draft(cfg, spec)
    _, params, axes = abstract_draft(dcfg)
    specs = jax.tree.leaves(draft_specs(params, axes, strategy, sizes),
                            is_leaf=lambda a: isinstance(a, jax.sharding.PartitionSpec))
    leaves = jax.tree.leaves(params)
    out = {"params_global": float(sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)),
           "params_per_device": float(sum(_per_device(x.shape, ps, sizes) * x.dtype.itemsize
                                          for x, ps in zip(leaves, specs, strict=True))),
           "params": float(sum(math.prod(x.shape) for x in leaves)), "cache_global": 0.0, "cache_per_device": 0.0}
    small = place.small_batch(strategy, sizes, spec.batch)
    for path, x in jax.tree_util.tree_flatten_with_path(draft_cache_shapes(cfg, spec, dcfg))[0]:
        out["cache_global"] += math.prod(x.shape) * x.dtype.itemsize
        out["cache_per_device"] += _leaf_bytes(x, draft_cache_logical(key_names(path), x.ndim), strategy, sizes,
                                               small, path_str(path))
    return out


def record_bytes(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str, mode: str | None = None) -> dict:
    """Bytes of the verify records (``rollback.with_records`` for a piece of K + 1 tokens, ``mode`` "copy" |
    "replay", default the plan's) on a verify plan's cache: ``global``, ``per_device`` under the cache's shardings
    (``CACHE_AXES``: rows over the token axes — every row on each device under the small-batch rule —, KDA heads
    over the heads' axes), and ``per_device_by_leaf``."""
    spec = with_defaults(spec)[0]
    mode = mode or spec.rollback
    base = cache_shapes(cfg, spec.batch, spec.context, run_settings(cfg, spec), stacked=True)
    rec = jax.eval_shape(lambda c: with_records(c, cfg, spec.draft_tokens + 1, mode), base)
    small = place.small_batch(strategy, sizes, spec.batch)
    out = {"mode": mode, "global": 0.0, "per_device": 0.0, "per_device_by_leaf": {}}
    for path, x in jax.tree_util.tree_flatten_with_path(rec)[0]:
        names = key_names(path)
        if not str(names[-1]).startswith("rec_"):
            continue
        n = _leaf_bytes(x, cache_leaf_axes(names, x.ndim), strategy, sizes, small, path_str(path))
        out["global"] += math.prod(x.shape) * x.dtype.itemsize
        out["per_device"] += n
        by = out["per_device_by_leaf"]
        by[names[-1]] = by.get(names[-1], 0.0) + n
    return out


def draft_flops(dcfg: DraftConfig, keys: int) -> dict:
    """Per row, the FLOPs of the draft's part of one verify step as ``k3jax.draft.network`` computes it (2 per
    multiply-add): ``append`` — the K + 1 verified positions' context features (context_proj over the n taps) and
    every layer's kv_a of them (an upper bound: a row appends only what it keeps); ``block`` — the K + 1 block tokens
    through every layer's projections and MLP; ``attention`` — every layer's dense attention over ``keys`` context
    positions + the block: the keys and values materialised from all of them through kv_b (2·(S + Q)·R·N·(Hn + V)),
    scores and weighted sums; ``head`` — the target's lm_head for K slots and the Markov bias (rank r)."""
    D, Q, K = dcfg.hidden_size, dcfg.block_size + 1, dcfg.block_size
    N, R, Hn, Hr, V = (dcfg.num_attention_heads, dcfg.kv_lora_rank, dcfg.qk_nope_head_dim, dcfg.qk_rope_head_dim,
                       dcfg.v_head_dim)
    L, W = dcfg.num_hidden_layers, dcfg.vocab_size
    proj = (D * dcfg.q_lora_rank + dcfg.q_lora_rank * N * (Hn + Hr) + D * (R + Hr) + N * V * D
            + 3 * D * dcfg.intermediate_size)
    S = keys + Q
    out = {"append": 2.0 * Q * (dcfg.num_target_layers * dcfg.target_hidden_size * D + L * D * (R + Hr)),
           "block": 2.0 * Q * L * proj,
           "attention": 2.0 * L * (S * R * N * (Hn + V) + Q * N * S * (Hn + Hr + V)),
           "head": 2.0 * K * W * (D + dcfg.markov_rank)}
    out["total"] = sum(out.values())
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
    if spec.mode in STEP_MODES:  # verify: each of the piece's T queries over (at most) --context keys
        mla = 2.0 * N * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * spec.context * T
    else:
        mla = 2.0 * N * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * T * (T + 1) / 2
    kda = 4.0 * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * T
    return cfg.num_mla_layers * mla + cfg.num_kda_layers * kda


def lora_active_params(cfg: K3Config, spec: PlanSpec) -> float:
    """Adapter parameters one token runs through in a lora plan: every dense adapter, and the routed experts'
    adapters times top-k / E — a shared A (``LoRAConfig.experts_shared_a``: [..., in, r], one axis short of its
    B [..., E, r, out]) times top-k: each of a token's top-k rows runs it."""
    leaves = {key_names(p): x for p, x in jax.tree_util.tree_flatten_with_path(plan_params(cfg, spec))[0]}
    total = 0.0
    for names, x in leaves.items():
        if is_adapter(names[-1]):
            share = 1.0
            if "experts" in names:
                b = leaves.get((*names[:-1], names[-1][:-1] + "b"))
                shared = names[-1].endswith("_lora_a") and b is not None and len(x.shape) == len(b.shape) - 1
                share = cfg.num_experts_per_token / (1 if shared else cfg.num_experts)
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
    elif spec.mode in CACHED:
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
    if spec.mode == "verify":  # + the draft's append and proposal, per row (over the target cache's positions)
        out["draft"] = spec.batch * draft_flops(plan_draft(cfg, spec),
                                                capacity(cfg, spec.context, run_settings(cfg, spec)))["total"]
        expected += out["draft"]
        useful += out["draft"]
        out["model"] = expected
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


__all__ = ["DRAFT_CACHE_AXES", "F32_STORED", "abstract_draft", "attention_flops", "cache_bytes", "draft_bytes",
           "draft_cache_logical", "draft_cache_shapes", "draft_flops", "draft_specs", "estimate_arguments",
           "model_flops", "newton_schulz_flops", "plan_draft", "record_bytes"]
