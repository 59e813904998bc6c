"""The serving mesh a decode / prefill / verify plan compiles when ``--mesh`` is not given: a short documented list of
candidate (mesh, rules column) pairs for the target's chips, ranked by a closed-form step time; the best one is
compiled (``k3 plan --compile --mode decode | prefill | verify`` without ``--mesh``; ``--compare-layouts`` compiles
all). Verify ranks decode's candidates with its own step (the piece's tokens, records and draft in the bytes; the
target's collectives only).

    rows = rank_layouts(cfg, target, spec)          # [{mesh, strategy, estimate_s, reason, ...}], best first
    choice = choose_layout(cfg, target, spec)       # {"candidates": rows, "chosen": rows[0], "why": ...}

Candidates on N chips (at most four; a pair whose mesh the rules cannot place on the model — a dimension that does
not divide, ``spec.check`` —, or ``serve`` for a prefill, is listed with its error and never chosen):
    tensor=4,expert=N/4  ep_tp   today's serving mesh (experiments/LOG.md's slice table): heads / FFN over tensor
    tensor=8,expert=N/8  ep_tp   the same with the non-expert weights split 8 ways
    tensor=4,expert=N/4  serve   non-expert weights over all N chips: heads over tensor, the width over expert
    expert=N             serve   every weight over the expert axis alone (the width split N ways)

The estimate (seconds per step, per chip; nothing lowered):
    hbm_s        ``floor.bytes_floor``'s total — the weights the step's tokens reach, cache and io, each read once
                 — plus the packed expert stacks relaid out per layer where their minor dim is off the 128 lanes
                 (``relaid_bytes``), over the chip's HBM bandwidth
    collective_s per layer, the activation collectives the layout implies (``layer_collectives``), each its launch
                 plus hop latency on the slice's torus (``hardware.collective_latency_s`` over ``axis_links``) plus
                 the bytes it moves over the chip's ICI bandwidth
    estimate_s   hbm_s + collective_s: at decode both sit on the critical path (a layer's reads wait on the
                 previous layer's collective), so they add, as ``hardware.roofline`` adds collective latency
A cpu:N target has no published figures; its candidates are ranked with v5p's (the ranking, not the seconds, is
what it needs). A candidate whose estimated arguments exceed the chip's HBM ranks after every one that fits.
"""

from __future__ import annotations

import math
from dataclasses import replace

from k3jax.config import K3Config
from k3jax.errors import InputError
from k3jax.model.network import GRAM_POSITIONS
from k3jax.plan.estimate import estimate_arguments
from k3jax.plan.floor import bytes_floor
from k3jax.plan.hardware import CHIPS, Target, axis_links, collective_hops, collective_latency_s, topology_dims
from k3jax.plan.spec import STEP_MODES, PlanSpec, check, with_defaults
from k3jax.sharding import placement as place
from k3jax.sharding.row_split import latent_cache_rows
from k3jax.sharding.rules import mesh_axes_of

# (tensor ways, rules column, why it is a candidate); the expert axis takes the rest of the chips
CANDIDATES = (
    (4, "ep_tp", "today's serving mesh: non-expert weights split over tensor = 4 only"),
    (8, "ep_tp", "non-expert weights split over tensor = 8"),
    (4, "serve", "non-expert weights over all chips: heads over tensor = 4, the width over expert"),
    (1, "serve", "every weight over the expert axis alone: the width split over all chips"),
)
LAYOUT_MODES = ("prefill", "decode", "verify")  # the serving modes with a cache; the other modes take --mesh
ACTIVATION_BYTES = 2  # the serving modes compute in BF16


def candidate_meshes(devices: int) -> list[tuple[str, str, str]]:
    """[(mesh, strategy, reason)] of ``CANDIDATES`` on ``devices`` chips: those whose tensor ways divide them,
    without repeats."""
    out = []
    for t, strategy, reason in CANDIDATES:
        if devices % t:
            continue
        row = (place.format_mesh({"tensor": t, "expert": devices // t}), strategy, reason)
        if row[:2] not in [r[:2] for r in out]:
            out.append(row)
    return out


def layer_collectives(cfg: K3Config, spec: PlanSpec, sizes: dict, strategy: str) -> list[tuple[str, tuple, float]]:
    """[(kind, mesh axes, bytes per device)] of the activation collectives of one step, every layer's, at the
    mode's local tokens (the small-batch rule: every row), as XLA combines them. Each carries one residual-width
    activation [tokens, d] in BF16 (the partial sums are of that order or smaller; at decode the latency dominates):
      norms      with the width split (``embed``), each sublayer's input reduces over it: the AttnRes mix's logits,
                 then the norm's sum of squares over the mix — one all-reduce for both in a piece of at most
                 ``GRAM_POSITIONS`` positions, whose norms read the mix's Gram matrix (``k3jax.ops.attn_res``) —
                 or, without AttnRes, the norm's own
      attention  the input projections' partial sums over the width's axes; the output projection's over the
                 heads' axes (its output keeps the width split)
      FFN        the input projections' over the width's axes — at a MoE layer one all-reduce with the router's and
                 the LatentMoE down projection's (they contract the same input); the output projection's over the
                 hidden's (``mlp``) axes. LatentMoE up maps the routed sum onto the width split locally.
      MoE        with every row on every device (``placement.whole_rows``) one psum over the experts' and their
                 hidden's axes — and, where the width is whole (the router [D, E] split by its experts), the scores
                 and the chosen weights gathered over the experts' axes (two all-reduces: 463 compiled against 454
                 counted on v5p-512 expert=64,tensor=8) —, else the dispatch and combine all-to-alls over the expert
                 axis (A latent rows per token)
      embedding  with its rows split (``vocab``'s axes, where the vocabulary divides), the token gather is a
                 masked local gather and one all-reduce of the gathered rows
      caches     where the caches' rows are split (``placement.kernel_rows``; not the small-batch rule) and the
                 latent's rows take the heads' axis too (``row_split.latent_cache_rows``): per MLA layer three
                 all-to-alls over that axis (the queries' two parts, the output) and W_UK / W_UV gathered whole over
                 it; with the stream's rows whole each mixer's per-row output is all-gathered over the rows' axes
                 (``RowSplit.leave``)."""
    spec = with_defaults(spec)[0]
    ax = lambda name: mesh_axes_of(name, strategy, sizes)  # noqa: E731
    emb, heads, mlp, experts, emlp = ax("embed"), ax("heads"), ax("mlp"), ax("experts"), ax("expert_mlp")
    step = spec.mode in STEP_MODES
    small = step and place.small_batch(strategy, sizes, spec.batch)
    whole = step and place.whole_rows(strategy, sizes, spec.batch)
    split = not small and place.kernel_rows(strategy, sizes, spec.batch)     # the caches' rows over the token axes
    row_axes = place.token_axes(strategy, sizes)
    swap = split and latent_cache_rows(sizes, row_axes, heads, spec.batch) != latent_cache_rows(
        sizes, row_axes, (), spec.batch)                                       # the latent's rows take heads too
    rows = spec.batch if whole else spec.batch / place.token_parallel(strategy, sizes)
    tokens = rows * spec.seq_len
    act = tokens * cfg.hidden_size * ACTIVATION_BYTES
    union = lambda *a: tuple(dict.fromkeys(x for t in a for x in t))  # noqa: E731
    norms = 2 if cfg.uses_attn_res and spec.seq_len > GRAM_POSITIONS else 1   # reductions before a projection
    out = [("all-reduce", vocab, act)] if (vocab := mesh_axes_of("vocab", strategy, sizes, cfg.vocab_size)) else []
    w_ukv = cfg.kv_lora_rank * cfg.mla_num_heads * ACTIVATION_BYTES   # W_UK / W_UV per head dim, gathered whole
    for layer in range(cfg.num_layers):
        moe = cfg.is_moe(layer)
        if swap and cfg.is_mla(layer):
            out += [("all-to-all", heads, act)] * 3
            out += [("all-gather", heads, w_ukv * d) for d in (cfg.qk_nope_head_dim, cfg.v_head_dim)]
        if split and whole:
            out.append(("all-gather", row_axes, act))
        if emb:                                           # per sublayer: its mix and norm, its input projections
            out += [("all-reduce", emb, act)] * (2 * (norms + 1))
        if heads:
            out.append(("all-reduce", heads, act))
        if mlp and (not moe or cfg.num_shared_experts):
            out.append(("all-reduce", mlp, act))
        if not moe:
            continue
        if whole and (experts or emlp):
            out.append(("all-reduce", union(experts, emlp), act))
            if experts and not emb:
                out += [("all-reduce", experts, tokens * cfg.num_experts * 4)] * 2
        elif experts:
            width = cfg.routed_expert_hidden_size if cfg.is_latent_moe else cfg.hidden_size
            moved = tokens * cfg.num_experts_per_token * width * ACTIVATION_BYTES
            out += [("all-to-all", experts, moved), ("all-to-all", experts, moved)]
    return out


def collective_seconds(collectives, sizes: dict, chip, dims) -> tuple[float, float]:
    """(latency seconds, bandwidth seconds) of ``collectives`` on a slice of ``dims`` chips: each its launch and hop
    latency, and its bytes moved — a ring all-reduce sends 2(n-1)/n of them, an all-to-all (n-1)/n — over the
    chip's ICI bandwidth."""
    links = axis_links(place.axis_sizes(sizes), dims, chip)
    latency = volume = 0.0
    for kind, axes, nbytes in collectives:
        n = math.prod(sizes[a] for a in axes)
        latency += collective_latency_s(chip, collective_hops(kind, [lk for a in axes for lk in links[a]]))
        volume += (2 if kind == "all-reduce" else 1) * (n - 1) / n * nbytes
    return latency, volume / chip.ici_bandwidth


def relaid_bytes(cfg: K3Config, sizes: dict, strategy: str) -> float:
    """HBM bytes per chip and step of the packed expert stacks the kernels cannot read in place: a stack whose local
    packed minor dimension is off the 128 lanes is stored in another layout than the kernel's, so each layer's slice
    is relaid out (read and written) before its call (``mxfp4_matmul.api.layer_groups``). kimi-k3's w2 over tensor 8
    (F / 8 / 2 = 192 bytes): 27 GB per chip of the B = 64 decode on v5p-64, which the floor does not see, so the
    ranking put tensor=8,expert=8 first at 19.5 ms estimated against 54.1 ms compiled (experiments/LOG.md,
    2026-12-07). The scales (1/16 of the bytes) are sliced on every mesh and left out."""
    ax = lambda name: math.prod(sizes[a] for a in mesh_axes_of(name, strategy, sizes))  # noqa: E731
    E, F = cfg.num_experts / ax("experts"), cfg.moe_intermediate_size / ax("expert_mlp")
    P = cfg.routed_expert_hidden_size if cfg.is_latent_moe else cfg.hidden_size
    per_layer = sum(E * n * k / 2 for n, k in ((F, P), (F, P), (P, F)) if (k / 2) % 128)   # w1, w3 [F, P/2]; w2
    return 2 * per_layer * sum(cfg.is_moe(l) for l in range(cfg.num_layers))


def estimate_layout(cfg: K3Config, target: Target, spec: PlanSpec) -> dict:
    """The closed-form step time of ``spec`` (its mesh and strategy set) on ``target`` (module docstring);
    InputError when the rules cannot place it."""
    sizes, strategy = check(cfg, target, spec)
    spec = with_defaults(replace(spec, strategy=strategy, platform=target.platform))[0]
    # serve splits the width over the expert axis; a prefill splits its rows over it as well, and XLA then moves
    # activations and weights around every projection (kimi-k3, B = 64 at 128K on v5p-64, expert=64 serve: 221.6 ms
    # per step compiled, 218 GB of collectives per chip, against 20.2 ms estimated; experiments/LOG.md 2026-12-06
    # session 25). Decode and verify keep every row whole on every chip under serve (``placement.whole_rows``).
    if strategy == "serve" and spec.mode not in STEP_MODES:
        raise InputError(f"--strategy serve: a column for decode and verify steps, whose rows sit whole on every "
                         f"chip; --mode {spec.mode} splits its rows over the axis serve splits the width over")
    chip = target.chip or CHIPS["v5p"]
    floor = bytes_floor(cfg, spec, sizes, strategy)
    latency, volume = collective_seconds(layer_collectives(cfg, spec, sizes, strategy), sizes, chip,
                                         topology_dims(target))
    args = estimate_arguments(cfg, spec, sizes, strategy)["total"]
    read = floor["total"] + relaid_bytes(cfg, sizes, strategy)
    hbm = read / chip.hbm_bandwidth
    return {"hbm_s": hbm, "collective_latency_s": latency, "collective_bandwidth_s": volume,
            "estimate_s": hbm + latency + volume, "bytes_per_device": read,
            "collectives_per_step": len(layer_collectives(cfg, spec, sizes, strategy)),
            "argument_bytes_per_device": args, "fits_estimate": args <= chip.hbm_bytes}


def rank_layouts(cfg: K3Config, target: Target, spec: PlanSpec) -> list[dict]:
    """Every candidate of ``candidate_meshes(target.devices)`` with its estimate (``estimate_layout``) or, when the
    rules cannot place it, its ``error``; placeable ones first — those whose arguments fit the chip's HBM, by
    estimate_s —, then those that do not fit, then the errors."""
    rows = []
    for mesh, strategy, reason in candidate_meshes(target.devices):
        row = {"mesh": mesh, "strategy": strategy, "reason": reason}
        try:
            row.update(estimate_layout(cfg, target, replace(spec, mesh=mesh, strategy=strategy)))
        except InputError as e:
            row.update(estimate_s=None, error=str(e))
        rows.append(row)
    return sorted(rows, key=lambda r: (r["estimate_s"] is None, not r.get("fits_estimate", False),
                                       r["estimate_s"] or 0.0))


def choose_layout(cfg: K3Config, target: Target, spec: PlanSpec) -> dict:
    """{"candidates": ranked rows, "chosen": the first, "why": a sentence}; InputError naming --mesh when no
    candidate can be placed."""
    if spec.mode not in LAYOUT_MODES:
        raise InputError(f"--compile --mode {spec.mode} needs --mesh (the serving modes {', '.join(LAYOUT_MODES)} "
                         "choose one)")
    rows = rank_layouts(cfg, target, spec)
    best = rows[0]
    if best["estimate_s"] is None and len({r["error"] for r in rows}) == 1:  # not the mesh's fault: say what is
        raise InputError(rows[0]["error"])
    if best["estimate_s"] is None:
        raise InputError(f"--mesh not given and no candidate mesh places {cfg.name} on {target.spec}: "
                         + "; ".join(f"{r['mesh']} ({r['strategy']}): {r['error']}" for r in rows))
    runner = next((r for r in rows[1:] if r["estimate_s"] is not None), None)
    chip = target.chip.name if target.chip else "v5p's figures (a cpu target has none)"
    why = (f"lowest closed-form step time on {chip}: {best['estimate_s'] * 1e3:,.2f} ms (HBM "
           f"{best['hbm_s'] * 1e3:,.2f} ms for {best['bytes_per_device'] / 1e9:,.2f} GB/chip, collectives "
           f"{(best['collective_latency_s'] + best['collective_bandwidth_s']) * 1e3:,.2f} ms)")
    if runner:
        why += f"; next {runner['mesh']} ({runner['strategy']}) {runner['estimate_s'] * 1e3:,.2f} ms"
    if not best["fits_estimate"]:
        why += "; no candidate's estimated arguments fit the chip's HBM"
    return {"candidates": rows, "chosen": {"mesh": best["mesh"], "strategy": best["strategy"]}, "why": why}


__all__ = ["CANDIDATES", "LAYOUT_MODES", "candidate_meshes", "choose_layout", "collective_seconds",
           "estimate_layout", "layer_collectives", "rank_layouts", "relaid_bytes"]
