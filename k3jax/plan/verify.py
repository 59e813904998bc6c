"""Speculative verify plans (``k3 plan --compile --mode verify --draft-tokens K``): one step of exact speculative
decoding at full size on the plan's mesh, and what it is worth against a decode step on the same slice.

    fn, args = verify_program(cfg, spec, mesh, strategy, run=run, params=abstract, dispatch=dispatch, small=small)
    out["verify"] = verify_report(cfg, target, spec, sizes, strategy, out, decode_plan)

The step (what ``k3jax.draft.speculative.speculative_step`` does for greedy rows, as one program): the target
``advance``s a piece [B, K + 1] = [anchor, d_1..d_K] on the scanned cache layout with verify records for it
(``rollback.with_records``, ``--rollback copy | replay``; made inside the step, so they are temporaries, not
arguments) and the draft's taps, every position's logits (``last_only=False``); greedy acceptance
(``accept_greedy``: n [B] drafted tokens kept and the bonus token) gives the traced keep = n + 1; ``rolled_back``
rebuilds the KDA states and conv tails and drops the rejected latents; the draft appends the kept positions' taps
to its context cache (``append_context``) and drafts K more from the bonus token (``propose`` + the Markov bias,
greedy). Out: n, the next anchor and the K drafted ids (int32; the logits [B, K + 1, W] stay inside the step), the
target cache and the draft cache, both donated as decode donates its cache.

The draft is ``DraftConfig.for_target(cfg)`` (kimi-k3: the published K3 DSpark draft's shape,
``estimate.plan_draft``), BF16. Its weights are split like the target's non-expert weights — the plan's rules column
over the logical axes its parameters carry (``estimate.draft_specs``): at full size they are 4.8 GB, which every
chip would read every step if replicated (~1.7 ms of v5p HBM time); split, each chip reads its share, and the
draft's width splits over the mesh axes the target's ``embed`` does (the taps, embedding and lm_head it reads are
the target's). Its context cache rows follow the target cache's rows (over the token axes, or on every chip under
the small-batch rule).

``--context C`` is the keys the piece's last token attends to, as for decode: the caches hold C - K - 1 positions
before the step, so the verify and the decode plans have the same cache arguments.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from k3jax.config import K3Config
from k3jax.draft.speculative import accept_greedy
from k3jax.model.cache import advance, cache_shapes
from k3jax.model.rollback import record_bytes as model_record_bytes
from k3jax.model.rollback import rolled_back, with_records
from k3jax.plan.estimate import (
    abstract_draft,
    draft_bytes,
    draft_cache_logical,
    draft_cache_shapes,
    draft_specs,
    plan_draft,
    record_bytes,
)
from k3jax.plan.hardware import Target
from k3jax.plan.layouts import estimate_layout
from k3jax.plan.spec import PlanSpec, run_settings, with_defaults
from k3jax.pytree import key_names, path_str
from k3jax.sharding import placement as place
from k3jax.sharding.rules import logical_to_spec, param_shardings

ACCEPTANCE_LENGTHS = (2.0, 3.0, 3.5, 4.0)  # tokens emitted per verify step (the K3 draft reports ~3.4-3.5)
# A published serving figure: keeping a copy of the KDA state per verified position (a "copy" rollback) for K3 at
# tensor parallelism 8 with 8 sequence slots takes 28.9 GiB on each rank. Ours is per chip under our mesh
# (verify_report's ``published`` sets the two side by side).
PUBLISHED_COPY_GIB_PER_RANK = 28.9
PUBLISHED_SLOTS = 8


def _sds(shapes, shardings):
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def verify_program(cfg: K3Config, spec: PlanSpec, mesh, strategy: str, *, run, params, dispatch, small: bool,
                   whole: bool | None = None):
    """One verify step (module docstring) → (jitted fn(params, piece, cache, draft params, draft cache), abstract
    arguments with their shardings). ``params``: the target's parameter tree (arrays or ShapeDtypeStructs);
    ``small``: the small-batch rule (rows and both caches on every device); ``whole``: the pieces on every device
    (``placement.whole_rows``; default ``small``)."""
    spec = with_defaults(spec)[0]
    B, K = spec.batch, spec.draft_tokens
    T = K + 1
    dcfg = plan_draft(cfg, spec)
    taps = tuple(dcfg.target_layer_ids)
    p_sh = param_shardings(cfg, strategy, mesh, params)
    shapes = cache_shapes(cfg, B, spec.context, run, stacked=True)
    c_sh = place.cache_shardings(strategy, mesh, shapes, replicated=small)
    rows_whole = small if whole is None else whole
    tok_sh = place.batch_sharding(strategy, mesh, 2, replicated=rows_whole)
    gdef, dparams, daxes = abstract_draft(dcfg, run.param_dtype)
    d_sh = jax.tree.map(lambda ps: NamedSharding(mesh, ps), draft_specs(dparams, daxes, strategy, mesh),
                        is_leaf=lambda a: isinstance(a, jax.sharding.PartitionSpec))
    dshapes = draft_cache_shapes(cfg, spec, dcfg)

    def dc_one(path, x):
        logical = tuple(None if small else a for a in draft_cache_logical(key_names(path), x.ndim))
        return NamedSharding(mesh, logical_to_spec(logical, x.shape, strategy, mesh, name=path_str(path)))

    dc_sh = jax.tree_util.tree_map_with_path(dc_one, dshapes)
    cdt = jnp.dtype(run.compute_dtype)
    # the draft's embedded tokens: rows as the pieces' and the width split as the draft's weights, whatever split
    # the target's embedding has (serve's rows over every chip left them whole, and XLA then gathered every draft
    # weight and the lm_head whole on every chip: B = 64 verify on v5p-64 expert=64, 62.2 -> 67.9 ms of HBM time)
    h_spec = logical_to_spec((None if rows_whole else "batch", None, "embed"), (B, T, cfg.hidden_size), strategy,
                             mesh, name="the draft's embedded tokens")
    draft_pin = partial(jax.lax.with_sharding_constraint, shardings=NamedSharding(mesh, h_spec))

    def step(p, piece, cache, dp, dcache):
        start = cache["lengths"]
        rec = with_records(cache, cfg, T, spec.rollback)
        logits, rec, hidden = advance(p, piece, jnp.full((B,), T, jnp.int32), rec, cfg=cfg, run=run, absorbed=True,
                                      last_only=False, dispatch=dispatch, taps=taps)
        n, bonus = accept_greedy(logits, piece[:, 1:])
        keep = n + 1                                       # the anchor and d_1..d_n
        cache = rolled_back(rec, cfg, keep, start=start, mode=spec.rollback)
        draft = nnx.merge(gdef, dp)
        dcache = draft.append_context(dcache, hidden, keep)
        embed = p["embed"].astype(cdt)
        head = (embed.T if cfg.tie_word_embeddings else p["lm_head"]).astype(cdt)
        base, _ = draft.propose(dcache, bonus, embed=embed, head=head, pin=draft_pin)
        prev, ids = bonus, []
        for i in range(K):                                 # the Markov bias needs the token before: in order
            prev = jnp.argmax(base[:, i] + draft.markov_bias(prev), axis=-1).astype(jnp.int32)
            ids.append(prev)
        return (n, bonus, jnp.stack(ids, axis=1)), cache, dcache

    fn = jax.jit(step, in_shardings=(p_sh, tok_sh, c_sh, d_sh, dc_sh), out_shardings=(None, c_sh, dc_sh),
                 donate_argnums=(2, 4))
    return fn, (_sds(params, p_sh), jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=tok_sh), _sds(shapes, c_sh),
                _sds(dparams, d_sh), _sds(dshapes, dc_sh))


def decode_baseline_spec(spec: PlanSpec) -> PlanSpec:
    """The decode plan a verify plan is measured against: the same mesh, rules column, batch and --context."""
    return replace(spec, mode="decode", seq_len=1, draft_tokens=None, rollback=None)


def _step_s(plan: dict | None):
    r = (plan or {}).get("roofline") or {}
    return r.get("step_s")


def verify_report(cfg: K3Config, target: Target, spec: PlanSpec, sizes: dict, strategy: str, out: dict,
                  decode: dict | None) -> dict:
    """The ``verify`` block of a verify plan's JSON: draft_tokens; step_s (the compiled roofline's, None without a
    chip) and decode_step_s (``decode``: the decode plan compiled on the same mesh, or None); step_ratio = verify /
    decode; implied_speedup at each of ``ACCEPTANCE_LENGTHS`` = tokens per verify x decode_step_s / step_s — from
    the compiled roofline when both have one, else from the closed-form step estimates (``layouts.estimate_layout``;
    ``basis`` says which); rollback_bytes_per_chip for copy and replay (the records under the cache's shardings);
    draft_params_bytes; the draft's shape and placement; the published copy-rollback figure beside ours."""
    spec = with_defaults(spec)[0]
    K = spec.draft_tokens
    dspec = decode_baseline_spec(spec)
    est_v, est_d = (estimate_layout(cfg, target, s)["estimate_s"] for s in (spec, dspec))
    step, dstep = _step_s(out), _step_s(decode)
    basis = "compiled roofline" if step and dstep else "closed-form estimate"
    v, d = (step, dstep) if step and dstep else (est_v, est_d)
    rec = {m: record_bytes(cfg, spec, sizes, strategy, m) for m in ("copy", "replay")}
    draft = draft_bytes(cfg, spec, sizes, strategy)
    dcfg = plan_draft(cfg, spec)
    T = K + 1
    ours = model_record_bytes(cfg, PUBLISHED_SLOTS, T, "copy", run_settings(cfg, spec))
    report = {
        "draft_tokens": K, "rollback": spec.rollback, "piece_tokens": T,
        "step_s": step, "decode_step_s": dstep,
        "step_ratio": step / dstep if step and dstep else None,
        "estimate_step_s": est_v, "decode_estimate_step_s": est_d, "estimate_step_ratio": est_v / est_d,
        "basis": basis,
        "implied_speedup": {str(a): a * d / v for a in ACCEPTANCE_LENGTHS},
        "tokens_per_s": {str(a): spec.batch * a / v for a in ACCEPTANCE_LENGTHS},
        "rollback_bytes_per_chip": {m: r["per_device"] for m, r in rec.items()},
        "rollback_bytes_global": {m: r["global"] for m, r in rec.items()},
        "draft_params": draft["params"], "draft_params_bytes": draft["params_global"],
        "draft_params_bytes_per_chip": draft["params_per_device"],
        "draft_cache_bytes_per_chip": draft["cache_per_device"],
        "draft": {"layers": dcfg.num_hidden_layers, "hidden_size": dcfg.hidden_size,
                  "intermediate_size": dcfg.intermediate_size, "heads": dcfg.num_attention_heads,
                  "q_lora_rank": dcfg.q_lora_rank, "kv_lora_rank": dcfg.kv_lora_rank,
                  "markov_rank": dcfg.markov_rank, "target_layer_ids": list(dcfg.target_layer_ids),
                  "placement": f"split like the target's non-expert weights ({strategy} over its logical axes)",
                  "cache_placement": "rows like the target cache's rows"},
        "output": "n, the next anchor and the K drafted ids (int32); the logits stay inside the step",
        "published": {
            "copy_rollback_gib_per_rank": PUBLISHED_COPY_GIB_PER_RANK, "source": "a published serving figure",
            "measures": f"a copy of K3's KDA state per verified position for {PUBLISHED_SLOTS} sequence slots, on "
                        "each rank of a tensor-parallel-8 deployment",
            "ours_same_slots_whole_gib": ours / 2**30,
            "ours_same_slots_eighth_of_heads_gib": ours / 8 / 2**30,
            "how_they_differ": (
                f"our copy records for the same {PUBLISHED_SLOTS} rows and a piece of {T} positions are "
                f"{ours / 2**30:.1f} GiB with every KDA head's state on one device ({ours / 8 / 2**30:.1f} GiB with "
                "the heads split 8 ways)" + (
                    ": the published per-rank figure is of the first order, as if each rank held every head's "
                    "states" if 0.5 < PUBLISHED_COPY_GIB_PER_RANK * 2**30 / ours < 2 else
                    f"; the published figure is K3's, and {cfg.name} is not its size")
                + ". rollback_bytes_per_chip is this plan's own: its --batch rows, split over the token axes (all "
                "of them on every chip under the small-batch rule), and the KDA heads split over the heads' mesh "
                "axes"),
        },
    }
    if decode is not None:
        r = decode.get("roofline") or {}
        report["decode"] = {k: decode[k] for k in ("fits", "peak_bytes_per_device", "compile_s") if k in decode}
        report["decode"].update({k: r[k] for k in ("step_s", "bound", "memory_s", "bytes_floor_s") if k in r})
    return report


__all__ = ["ACCEPTANCE_LENGTHS", "PUBLISHED_COPY_GIB_PER_RANK", "PUBLISHED_SLOTS", "decode_baseline_spec",
           "verify_program", "verify_report"]
