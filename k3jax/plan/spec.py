"""What a plan is asked for: the mode, mesh, batch and sequence of a full-size program (``PlanSpec``), the defaults
a plan fills in (the program one deploys at full size), the run settings and parameter form of each mode, and every
check before a compile.

Modes (each the program a user runs, with the rules table's shardings and the expert-parallel dispatch when the
rules shard the experts; the layer stack scanned; the train modes are `k3 train`'s step with the settings of
``train_config``):
    forward         serving prefill in the stored form: BF16 weights, routed experts as packed MXFP4 bytes,
                    tokens [B, T] → logits [B, T, V] (f32)
    train           the QAT fine-tune step (``k3jax.train.step``): fp32 master weights, per-head Muon / AdamW state,
                    QAT weights+acts (MXFP4 expert weights, MXFP8 expert inputs), QB, QK-Clip; tokens [1, B, T+1]
    frozen-experts  the same step with the routed experts frozen as packed MXFP4 bytes (``k3 train
                    --frozen-experts``): no expert master weights, gradients or optimizer state; QAT of the expert
                    inputs (``qat="weights+acts"`` over packed experts quantizes the activations only)
    lora            the QLoRA step (``k3 train --lora``): LoRA adapters of rank ``lora_rank`` on every target
                    (attention, shared experts, dense FFN, each routed expert) train in fp32 with AdamW over a frozen
                    base — BF16 non-expert weights, the routed experts as packed MXFP4 bytes —; no balancing, no
                    QK-Clip, MXFP8 expert inputs
    prefill         serving, the forward with the cache written (``model.cache.advance``): tokens [B, T] into an
                    empty hybrid cache of ``context`` positions (default T) → the last token's logits [B, V] and the
                    cache (fp32 KDA state + conv tails, the MLA latent), cache donated
    decode          serving, one decode step of B sequences at context C (``--context``): the cache holds C - 1
                    tokens, the step appends one per row and attends over C keys (absorbed MLA, reading only filled
                    key blocks) → logits [B, V] and the cache, donated
    verify          serving, one speculative step of B sequences at context C with K drafted tokens
                    (``--draft-tokens``, ``k3jax.plan.verify``): the target extends a piece of K + 1 tokens with
                    verify records, keeps a greedy-accepted prefix (``rollback``, ``--rollback copy | replay``), and
                    a DSpark draft of the published shape appends the kept positions' taps and drafts K more; the
                    cache holds C - K - 1 tokens, so the piece's last token attends over C keys as a decode step's
                    does; caches donated

The serving modes (forward, prefill, decode, verify) hold BF16 weights and the routed experts as packed MXFP4
bytes, run through the Pallas kernel under expert parallelism on a TPU target. Prefill, decode and verify without a
mesh take the best of a few candidate meshes and rules columns (``serve`` among them) by a closed-form step time
(``k3jax.plan.layouts``); every other mode needs its mesh. Prefill, decode and verify place the cache by the
rules (``model.cache.CACHE_AXES``: rows over the token axes, KDA heads over the heads' axes); a batch smaller than
the token axes' ways takes the small-batch rule (``sharding.placement.small_batch``: rows and cache replicated, each
device runs its local experts on every row, one psum), in decode and verify only (``STEP_MODES``); there the
``serve`` column keeps every row on every device at any batch and splits only the caches by rows where the batch
divides (``sharding.placement.whole_rows``). Verify takes decode's defaults and serving candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from k3jax.config import (
    LORA_TARGETS,
    PACKED_KERNELS,
    REMAT_POLICIES,
    K3Config,
    RunConfig,
    default_run,
    with_kernels,
)
from k3jax.config.lora import lora_keys, parse_lora
from k3jax.errors import InputError
from k3jax.layers.experts import packed_form
from k3jax.model import abstract_params
from k3jax.optim.optimizer import OptimConfig
from k3jax.plan.hardware import LIBTPU_HINT, Target, libtpu_installed
from k3jax.sharding import placement as place
from k3jax.sharding.context_parallel import ContextParallel
from k3jax.sharding.rules import STRATEGIES
from k3jax.train.settings import TrainConfig
from k3jax.train.settings import run_settings as train_run_settings

MODES = ("forward", "train", "frozen-experts", "lora", "prefill", "decode", "verify")
TRAIN_MODES = ("train", "frozen-experts", "lora")  # a backward and an optimizer
SERVING = ("forward", "prefill", "decode", "verify")  # BF16 weights + packed MXFP4 experts, no backward
CACHED = ("prefill", "decode", "verify")  # the serving modes with a hybrid cache
STEP_MODES = ("decode", "verify")  # a few tokens per row on a filled cache: the small-batch rule applies
ROLLBACKS = ("copy", "replay")  # verify: how the KDA state is rebuilt after a rejection (k3jax.model.rollback)


@dataclass(frozen=True)
class PlanSpec:
    mode: str
    mesh: str | None  # None: prefill / decode choose one (k3jax.plan.layouts.choose_layout); others need it
    batch: int
    seq_len: int
    remat: str | None = None  # None: "auto" for the train modes (PLAN_REMAT_AUTO), "none" for the serving modes
    capacity_factor: float | None = None  # the expert-parallel buckets (-1: worst case, dropless; None: PLAN_CAPACITY)
    strategy: str | None = None  # rules column (None: plan_strategy of the mesh axes)
    packed_kernel: str | None = None  # --packed-kernel: auto, pallas, tiles; None: as --kernels picks (RunConfig)
    context: int | None = None  # decode / verify: keys the (last) token attends; prefill: cache length (None: T)
    opt_state_dtype: str | None = None  # optimizer moments' storage (OptimConfig.state_dtype; None: PLAN_OPT_STATE)
    muon_layout: str = "owner"  # train modes: where Newton–Schulz runs (OptimConfig.muon_layout; owner-compute)
    lora_rank: int = 16  # lora: the adapters' rank (alpha = 2 rank, every target)
    lora: str = ""  # lora: a --lora spec in k3 train's vocabulary over those defaults (``plan_lora``)
    kernels: str = "auto"  # --kernels (config.with_kernels) for the target's platform
    platform: str = "tpu"  # the platform the plan compiles for (its --target's)
    draft_tokens: int | None = None  # verify: K drafted tokens per step (the piece is K + 1; None: PLAN_DRAFT_TOKENS)
    rollback: str | None = None  # verify: "copy" | "replay" (None: PLAN_ROLLBACK)


# A plan's defaults are the program one would deploy at full size, not the small-model defaults of ``k3 train``:
# dropless static buffers must hold every token routed to one device (at kimi-k3 / v5p-512 56x the balanced load:
# terabytes per chip), a 93-layer train step without remat keeps every layer's activations, and non-expert weights
# over fsdp alone leave ~100 GB/chip of fp32 state (experiments/LOG.md, 2026-12-02 session 10). Each default a plan
# used is reported under ``defaults`` in its JSON; the flags override them (``--capacity-factor -1`` is dropless).
PLAN_CAPACITY = 1.25
# The QAT step stores its moments in bf16 (``k3 train --opt-state-dtype bfloat16``; masters and arithmetic fp32):
# fp32 master + gradient + momentum of the routed experts are 63.8 GB of a v5p-512 chip's 95 GiB, and with fp32
# moments the step peaks 3.5 GB over the compiler's budget; bf16 moments fit it at 94.2 GB. The k3-micro ablation
# found no effect on the loss (+0.0011 ± 0.0025 nats; experiments/LOG.md 2026-12-05). frozen-experts keeps fp32 (its
# state is the non-expert weights'); ``k3 train`` keeps fp32 (small models, memory not binding).
PLAN_OPT_STATE = {"train": "bfloat16"}
# The train modes' remat is "auto": chosen by the compiled program's memory, per mode and slice — "group" (the
# group's backward without a checkpoint per layer inside it: one forward fewer; the v5p-512 frozen plan's HBM
# traffic 51.8 → 42.1 TB per chip, peak 42.0 → 53.6 GB, experiments/LOG.md 2026-12-05 session 21) where it fits the
# chip, "full" (a checkpoint per layer, the least activation memory) where it must. ``aot.compile_plan`` compiles
# the policies of PLAN_REMAT_AUTO in order and keeps the first that fits, reporting each it tried.
PLAN_REMAT_DEFAULT = "auto"
PLAN_REMAT_AUTO = ("group", "full")
# Decode runs dropless (-1): its worst-case buffer is small (B = 64 over expert = 16: 4 rows per chip, a 1,024-row
# receive buffer per MoE layer), and a dropped assignment changes the token a server emits.
PLAN_DECODE_CAPACITY = -1.0
# Verify: the published K3 draft's block (7 drafted tokens, a piece of 8), and the rollback that keeps every state of
# the piece (one pick, no arithmetic; replay stores ~20x less and sums it back, k3jax/model/rollback.py).
PLAN_DRAFT_TOKENS = 7
PLAN_ROLLBACK = "copy"


def plan_strategy(sizes: dict) -> str:
    """The rules column of a plan: ``zero3_ep_tp`` when the mesh has fsdp and expert axes (every non-expert weight
    over fsdp x expert, as full-size training state needs), otherwise the mesh's default (``default_strategy``)."""
    s = place.axis_sizes(sizes)
    return "zero3_ep_tp" if s["fsdp"] > 1 and s["expert"] > 1 else place.default_strategy(sizes)


def with_defaults(spec: PlanSpec) -> tuple[PlanSpec, dict]:
    """(``spec`` with every unset field filled, the filled fields and their values)."""
    d = {}
    if spec.remat is None:
        d["remat"] = "none" if spec.mode in SERVING else PLAN_REMAT_DEFAULT
    if spec.capacity_factor is None:
        d["capacity_factor"] = PLAN_DECODE_CAPACITY if spec.mode in STEP_MODES else PLAN_CAPACITY
    if spec.mode == "verify" and spec.draft_tokens is None:
        d["draft_tokens"] = PLAN_DRAFT_TOKENS
    if spec.mode == "verify" and spec.rollback is None:
        d["rollback"] = PLAN_ROLLBACK
    if spec.context is None and spec.mode == "prefill":
        d["context"] = spec.seq_len
    if spec.strategy is None and spec.mesh is not None:
        d["strategy"] = plan_strategy(place.parse_mesh(spec.mesh))
    quiet = {}  # filled, but a serving mode has no optimizer to report it for
    if spec.opt_state_dtype is None:
        (quiet if spec.mode in SERVING else d)["opt_state_dtype"] = PLAN_OPT_STATE.get(spec.mode, "float32")
    return replace(spec, **d, **quiet), d


def train_config(spec: PlanSpec) -> TrainConfig:
    """The `k3 train` settings whose train step a train-mode plan compiles (``k3jax.train.program``): QAT
    weights+acts, bf16 matmuls, the layer stack scanned, the plan's remat, optimizer-state dtype and Muon layout;
    lora: AdamW over the adapters of ``plan_lora``, the base as loaded. The schedule's peak and length are constants
    of the program, not its shape: 2e-3 over 1,000 steps (``OptimConfig``'s defaults when plans began)."""
    spec = with_defaults(spec)[0]
    lora = spec.mode == "lora"
    return TrainConfig(preset=None, steps=1000, lr=2e-3, batch=spec.batch, seq_len=spec.seq_len,
                       optimizer="adamw" if lora else "per_head", opt_state_dtype=spec.opt_state_dtype,
                       muon_layout=spec.muon_layout, qat="weights+acts", compute_dtype="bfloat16", layer_stack="scan",
                       remat=spec.remat, frozen_experts=spec.mode == "frozen-experts", kernels=spec.kernels,
                       lora=plan_lora(spec) if lora else None)


def run_settings(cfg: K3Config, spec: PlanSpec) -> RunConfig:
    """How the mode's model runs. Serving: BF16 weights, the layer stack scanned (prefill / decode: the scanned cache
    layout of model.cache runs the group as a scan), no remat. The train modes: `k3 train`'s run settings of
    ``train_config(spec)`` (``k3jax.train.settings.run_settings``); lora holds its frozen base in BF16. Both with
    ``spec.kernels`` for the target's platform over the plan's mesh (``config.with_kernels``; ``--packed-kernel``
    wins over it). Remat "auto" reads as its first policy: what the checks and estimates ask of a run (shapes,
    kernels) does not depend on it, and ``aot.compile_plan`` compiles each policy it tries by name."""
    spec = with_defaults(spec)[0]
    if spec.remat == "auto":
        spec = replace(spec, remat=PLAN_REMAT_AUTO[0])
    sizes = place.axis_sizes(place.parse_mesh(spec.mesh))
    rows = spec.strategy in STRATEGIES and place.kernel_rows(spec.strategy, sizes, spec.batch)  # else check() says
    if spec.mode not in SERVING:
        run = train_run_settings(train_config(spec), cfg, param_dtype="bfloat16" if spec.mode == "lora" else "float32",
                                 platform=spec.platform, mesh=sizes, rows=rows)
        return run if spec.packed_kernel is None else run.replace(packed_kernel=spec.packed_kernel)
    run = default_run(cfg, layer_stack="scan", remat="none", compute_dtype="bfloat16", param_dtype="bfloat16")
    return with_kernels(run, spec.kernels, spec.platform, context=sizes["context"] > 1,
                        devices=math.prod(sizes.values()), rows=rows, packed_kernel=spec.packed_kernel)


def check(cfg: K3Config, target: Target, spec: PlanSpec) -> tuple[dict, str]:
    """(mesh sizes, strategy) after every check a plan needs before it compiles; InputError naming the value.
    Unset fields of ``spec`` are checked as ``with_defaults`` fills them."""
    if spec.mode not in MODES:
        raise InputError(f"--mode {spec.mode!r}: unknown; known: {', '.join(MODES)}")
    if spec.mesh is None:  # the serving modes choose theirs before they get here (k3jax.plan.layouts)
        raise InputError(f"--compile --mode {spec.mode} needs --mesh (e.g. --mesh fsdp=8,expert=64)")
    spec, _ = with_defaults(spec)
    if spec.remat not in (*REMAT_POLICIES, "auto"):
        raise InputError(f"--remat {spec.remat!r}: unknown policy; known: auto, {', '.join(REMAT_POLICIES)}")
    if spec.mode in SERVING and spec.remat != "none":
        raise InputError(f"--remat {spec.remat}: remat trades memory of the backward pass; --mode {spec.mode} has "
                         "none")
    if spec.packed_kernel is not None and spec.packed_kernel not in PACKED_KERNELS:
        raise InputError(f"--packed-kernel {spec.packed_kernel!r}: unknown; known: {', '.join(PACKED_KERNELS)}")
    if spec.batch < 1 or spec.seq_len < 1:
        raise InputError(f"--batch {spec.batch} --seq-len {spec.seq_len}: both must be >= 1")
    limit = cfg.extra.get("max_position_embeddings") or float("inf")  # the release's (config.json), if it states one
    if spec.seq_len > limit:
        raise InputError(f"--seq-len {spec.seq_len}: above {cfg.name}'s max_position_embeddings {limit}")
    if spec.mode == "decode" and spec.context is None:
        raise InputError("--mode decode needs --context (the keys each row attends to: the cache holds context - 1)")
    _check_verify(spec)
    if spec.context is not None:
        if spec.mode not in CACHED:
            raise InputError(f"--context {spec.context}: the cache's length; --mode {spec.mode} has no cache")
        low = spec.seq_len if spec.mode in ("prefill", "verify") else 1
        if not low <= spec.context <= limit:
            least = {"prefill": "at least --seq-len, ", "verify": "at least the piece's K + 1 tokens, "}
            raise InputError(f"--context {spec.context}: must lie in [{low}, {limit}] (--mode {spec.mode}: "
                             f"{least.get(spec.mode, '')}at most {cfg.name}'s max_position_embeddings)")
    if spec.mode == "decode" and spec.seq_len != 1:
        raise InputError(f"--seq-len {spec.seq_len}: a decode step is one token per row (its context is --context)")
    if spec.opt_state_dtype != "float32":
        if spec.mode in SERVING:
            raise InputError(f"--opt-state-dtype {spec.opt_state_dtype}: --mode {spec.mode} has no optimizer")
        OptimConfig(state_dtype=spec.opt_state_dtype)  # a float dtype, or InputError naming the flag
    if spec.muon_layout != "owner":
        if spec.mode in SERVING:
            raise InputError(f"--muon-layout {spec.muon_layout}: --mode {spec.mode} has no optimizer")
        OptimConfig(muon_layout=spec.muon_layout)
    if not (spec.capacity_factor == -1 or spec.capacity_factor > 0):
        raise InputError(f"--capacity-factor {spec.capacity_factor}: must be > 0 or -1 (worst case, dropless)")
    if spec.mode in ("frozen-experts", "lora") and cfg.expert_format != "mxfp4":
        raise InputError(f"--mode {spec.mode}: {cfg.name} stores its routed experts as {cfg.expert_format}, "
                         "not MXFP4 bytes")
    if spec.lora_rank != 16 and spec.mode != "lora":
        raise InputError(f"--lora-rank {spec.lora_rank}: --mode {spec.mode} has no adapters")
    if spec.lora and spec.mode != "lora":
        raise InputError(f"--lora {spec.lora}: --mode {spec.mode} has no adapters")
    if spec.lora_rank != 16 and "rank" in lora_keys(spec.lora):
        raise InputError(f"--lora-rank {spec.lora_rank} and --lora {spec.lora}: give the rank once")
    plan_lora(spec)  # valid settings, or a ConfigError naming the field
    sizes, strategy = place.resolve_mesh(spec.mesh, devices=target.devices, exact=True, where=f"--target {target.spec}",
                                         strategy=spec.strategy, cfg=cfg, params=plan_params(cfg, spec))
    spec = replace(spec, platform=target.platform)
    if run_settings(cfg, spec).packed_kernel == "pallas" and target.platform == "cpu":   # --kernels pallas: checked
        flag = "--packed-kernel" if spec.packed_kernel == "pallas" else "--kernels"
        raise InputError(f"{flag} pallas --target {target.spec}: the packed-expert Pallas kernel compiles for TPU "
                         "targets (Mosaic); a cpu target plans the XLA tile loop (--packed-kernel auto or tiles)")
    if place.uses_context(strategy, sizes):                   # the batch takes the token axes it divides
        if spec.mode in STEP_MODES:
            step = "a decode step is one token" if spec.mode == "decode" else "a verify step is K + 1 tokens"
            raise InputError(f"--mesh {spec.mesh} --mode {spec.mode}: a context axis splits sequences, and {step} "
                             "per row (plan the prefill with it: --mode prefill)")
        ContextParallel(sizes, strategy, batch=spec.batch).check(spec.seq_len, "--seq-len")
    elif spec.mode in STEP_MODES:
        place.small_batch(strategy, sizes, spec.batch)       # divides, or the small-batch rule, or InputError
    else:
        ways = place.token_parallel(strategy, sizes)
        if spec.batch % ways:
            raise InputError(f"--batch {spec.batch}: not divisible by the {ways} ways the batch is split (mesh axes "
                             f"{', '.join(place.token_axes(strategy, sizes))})")
    if target.platform == "tpu" and not libtpu_installed():
        raise InputError(f"--target {target.spec}: libtpu is not installed; {LIBTPU_HINT}")
    return sizes, strategy


def _check_verify(spec: PlanSpec) -> None:
    """The verify flags: --draft-tokens / --rollback only with --mode verify; K >= 1; the piece is K + 1 tokens;
    --context."""
    if spec.mode != "verify":
        for flag, v in (("--draft-tokens", spec.draft_tokens), ("--rollback", spec.rollback)):
            if v is not None:
                raise InputError(f"{flag} {v}: a speculative verify step's; --mode {spec.mode} has none "
                                 "(--mode verify)")
        return
    K = spec.draft_tokens
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise InputError(f"--draft-tokens {K}: must be an integer >= 1 (tokens drafted per verify step)")
    if spec.rollback not in ROLLBACKS:
        raise InputError(f"--rollback {spec.rollback!r}: unknown; known: {', '.join(ROLLBACKS)}")
    if spec.seq_len != K + 1:
        raise InputError(f"--seq-len {spec.seq_len}: a verify step's piece is the anchor and the K drafted tokens, "
                         f"--draft-tokens {K} + 1 = {K + 1}")
    if spec.context is None:
        raise InputError("--mode verify needs --context (the keys the piece's last token attends to: the cache "
                         "holds context - K - 1)")


def plan_params(cfg: K3Config, spec: PlanSpec) -> dict:
    """The mode's parameter tree as ShapeDtypeStructs: the routed experts packed where the mode holds MXFP4 bytes."""
    p = abstract_params(cfg, run_settings(cfg, spec))
    return packed_form(p) if spec.mode in (*SERVING, "frozen-experts", "lora") else p


def plan_lora(spec: PlanSpec):
    """The adapters of a lora plan: ``spec.lora``'s settings (k3 train's ``--lora`` vocabulary, e.g.
    ``experts_shared_a=true``) over the plan's defaults — rank ``spec.lora_rank``, alpha 2·rank, every target."""
    rank = lora_keys(spec.lora).get("rank", spec.lora_rank)
    return parse_lora(spec.lora, rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS)


__all__ = ["CACHED", "MODES", "PLAN_CAPACITY", "PLAN_DECODE_CAPACITY", "PLAN_DRAFT_TOKENS", "PLAN_OPT_STATE",
           "PLAN_REMAT_AUTO", "PLAN_REMAT_DEFAULT", "PLAN_ROLLBACK", "ROLLBACKS", "SERVING", "STEP_MODES",
           "TRAIN_MODES", "PlanSpec", "check",
           "plan_lora", "plan_params", "plan_strategy", "run_settings", "train_config", "with_defaults"]
