"""The settings of a training run: ``TrainConfig`` (every field, its default and what it means), their
validation, and how they resolve to a model config, a mesh, run settings and step settings — read by `k3 train`
(its flags and defaults), `k3 run` (the corpus split a trained model held out), the loop and the ablation checker.

    tc = TrainConfig(preset="k3-tiny", steps=20, batch=8, seq_len=32)
    cfg = resolve_model(tc)                 # --preset / --init, compared before any array is read
    mesh, strategy = resolve_mesh(tc, cfg)  # --mesh / --devices / --strategy, checked against the parameters
    validate(tc, place.token_parallel(strategy, mesh))
    settings = run_settings(tc, cfg)        # RunConfig: fp32 masters, --qat, --compute-dtype, --layer-stack, --remat

Everything the user can get wrong is checked here, before the first compile, and raises ``InputError`` (`k3 train`
exits 2). Fields listed in ``_RESUME_KEYS`` change which batches / updates a run produces: a resume with different
values is refused (``resume_diff``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from k3jax.config import QAT_MODES, REMAT_POLICIES, K3Config, LoRAConfig, RunConfig, default_run, get_preset
from k3jax.errors import InputError

if TYPE_CHECKING:  # jax and the step / optimizer modules load when a run is resolved, not when `k3` builds its flags
    from jax.sharding import Mesh

    from k3jax.train.step import StepSpec

# Fields that change which batches / updates a run produces: a resume with different values is refused.
_RESUME_KEYS = ("preset", "init", "seed", "batch", "micro_batches", "seq_len", "lr", "optimizer", "qat",
                "compute_dtype", "balance", "sign_gamma", "qb_ema", "aux_alpha", "qk_clip", "qk_tau", "data",
                "max_bytes", "heldout_frac", "total_steps", "frozen_experts", "opt_state_dtype", "muon_layout",
                "packing_masks", "lora")
# What a checkpoint that predates a key ran with, where that is not the key's default: every run before
# --muon-layout existed used the per-layer Newton–Schulz, every run before --no-packing-masks mixed across documents.
_BEFORE_KEY = {"muon_layout": "layer", "packing_masks": False}
# The `k3 train` flag of each resume key that has one (the rest are TrainConfig fields only).
_FLAG = {"preset": "--preset", "init": "--init", "seed": "--seed", "batch": "--batch",
         "micro_batches": "--micro-batches", "seq_len": "--seq-len", "lr": "--lr", "optimizer": "--optimizer",
         "qat": "--qat", "compute_dtype": "--compute-dtype", "balance": "--balance", "qb_ema": "--qb-ema",
         "qk_clip": "--no-qk-clip", "qk_tau": "--qk-tau", "data": "--data", "max_bytes": "--max-bytes",
         "heldout_frac": "--heldout-frac", "total_steps": "--steps", "frozen_experts": "--frozen-experts",
         "opt_state_dtype": "--opt-state-dtype", "muon_layout": "--muon-layout", "packing_masks": "--no-packing-masks",
         "lora": "--lora"}


def resume_diff(saved: dict, now: dict) -> list[str]:
    """Settings (``_RESUME_KEYS``) that differ between a checkpoint's run and this one. A key the checkpoint does
    not record (added to k3jax after it was written, e.g. ``qb_ema``) counts as that setting's default."""
    defaults = TrainConfig().resume_key() | _BEFORE_KEY
    return sorted(k for k in now if saved.get(k, defaults[k]) != now[k])


def resume_refusal(saved: dict, now: dict, diff: list[str]) -> str:
    """Why a checkpoint whose settings differ (``diff``, from ``resume_diff``) is not resumed, each setting named
    by its flag with the checkpoint's value and this run's, and the way past it: --fork (or a fresh --ckpt-dir)."""
    defaults = TrainConfig().resume_key() | _BEFORE_KEY

    def show(k: str) -> str:
        note = " (the LR schedule's length)" if k == "total_steps" else ""
        return f"{_FLAG.get(k, k)} {saved.get(k, defaults[k])!r} then, {now[k]!r} now{note}"

    return (f"the checkpoint was written with different settings: {'; '.join(show(k) for k in diff)}. Pass --fork "
            "to resume from it anyway (the run then is not the one these settings give from the start), or use a "
            "fresh --ckpt-dir")


@dataclass(frozen=True)
class TrainConfig:
    preset: str | None = "k3-mini"
    init: str | None = None  # checkpoint directory (official/HF layout) to start from
    steps: int = 300
    total_steps: int | None = None  # LR-schedule length (default: steps)
    batch: int = 16  # global sequences per optimizer step
    micro_batches: int = 1
    seq_len: int = 128
    lr: float = 3e-3
    optimizer: str = "per_head"  # OptimConfig.mode (`k3 train --lora` defaults to "adamw")
    opt_state_dtype: str = "float32"  # OptimConfig.state_dtype: the moments' storage (master weights stay fp32)
    muon_layout: str = "auto"  # OptimConfig.muon_layout; auto: "owner" on a mesh of > 1 device, else "layer"
    qat: str = "off"
    compute_dtype: str = "float32"
    layer_stack: str = "loop"  # RunConfig.layer_stack: "scan" compiles the repeating layer group once
    remat: str = "none"  # RunConfig.remat: per-layer jax.checkpoint policy (same math: not a resume key)
    balance: str = "qb"
    sign_gamma: float = 1e-3
    qb_ema: float = 0.0
    aux_alpha: float = 1e-2
    qk_clip: bool = True
    qk_tau: float = 100.0
    seed: int = 0
    data: tuple[str, ...] = ()
    # document boundaries carried beside the tokens: KDA / conv / MLA restart at each, no prediction across one
    # (k3jax.train.data); False: today's plain windows of the token stream, for ablations
    packing_masks: bool = True
    max_bytes: int = 4 << 20
    heldout_frac: float = 0.05
    eval_every: int = 50
    eval_windows: int = 32
    ckpt_dir: str | None = None
    ckpt_every: int = 50
    keep: int = 3
    async_ckpt: bool = True
    metrics: str | None = None
    export: str | None = None
    overwrite: bool = False  # an existing non-empty export directory is replaced (else refused before any compute)
    log_every: int = 10  # without a progress bar (not a terminal, --no-progress): a stderr line every N steps; 0: none
    max_bad_steps: int = 3
    devices: int | None = None  # data-parallel width (default: all devices); excludes mesh
    mesh: str | None = None  # "data=2,expert=4": axis sizes over data, fsdp, expert, tensor (placement by the rules)
    strategy: str | None = None  # rules-table column (k3jax.sharding.rules.STRATEGIES); default from the mesh axes
    # routed experts kept as the --init checkpoint's MXFP4 bytes and frozen; attention, router, shared experts and
    # norms train (the packed leaves live in state["frozen"], outside gradients and the optimizer)
    frozen_experts: bool = False
    # LoRA adapters (k3jax/layers/lora.py) trained over the frozen base; an MXFP4 --init keeps its routed experts as
    # the packed bytes (QLoRA); --export then writes the adapters only, in PEFT's layout (k3jax/checkpoint/peft.py)
    lora: LoRAConfig | None = None
    eval_at_start: bool = False  # held-out loss of the initial parameters too (a step-0 point of the eval curve)
    progress: bool | None = None
    peak_flops: float | None = None  # None: measure an XLA matmul at start-up
    strict_config: bool = False  # unknown keys in the --init checkpoint's config.json are errors
    fork: bool = False  # resume from ckpt_dir even if the run settings differ (e.g. switch QAT on mid-run)
    poison_steps: tuple[int, ...] = ()  # testing hook: (1-based) steps whose loss and gradient are made NaN
    # `k3 ablate`'s arms: an architecture to build instead of --preset (give preset=None), and the initial parameter
    # state dict as a function of (cfg, run settings) instead of the random init from `seed` (the shared seed init)
    model: K3Config | None = None
    init_fn: Callable[[K3Config, RunConfig], dict] | None = field(default=None, compare=False, repr=False)

    def replace(self, **kw) -> TrainConfig:
        return dataclasses.replace(self, **kw)

    def resume_key(self) -> dict:
        d = {k: getattr(self, k) for k in _RESUME_KEYS}
        d["data"] = list(d["data"])
        d["total_steps"] = self.total_steps or self.steps
        d["lora"] = None if self.lora is None else dataclasses.asdict(self.lora) | {"targets": list(self.lora.targets)}
        return d


# ---------------------------------------------------------------------------------------------------------- setup


def resolve_model(tc: TrainConfig) -> K3Config:
    """The model config from --preset and/or --init, compared before any array is read."""
    from k3jax.config import architecture_diff, from_hf

    if tc.model is not None:
        if tc.preset or tc.init:
            raise InputError("TrainConfig.model replaces --preset and --init: give preset=None and no init")
        return tc.model
    cfg = get_preset(tc.preset) if tc.preset else None
    if tc.init:
        cfg_file = os.path.join(tc.init, "config.json")
        if not os.path.isfile(cfg_file):
            raise InputError(f"--init {tc.init}: no config.json (not a checkpoint directory)")
        ck_cfg = from_hf(cfg_file, strict=tc.strict_config)
        if cfg is not None:
            diff = architecture_diff(ck_cfg, cfg)
            if diff:
                raise InputError(f"--init {tc.init}: checkpoint config does not match --preset {tc.preset} "
                                 f"(differs in {', '.join(diff)})")
        else:
            cfg = ck_cfg
    if cfg is None:
        raise InputError("give --preset or --init")
    return cfg


def validate(tc: TrainConfig, n_dev: int, split: str = "data-parallel devices") -> None:
    """The run's own settings; ``n_dev``: how many ways each micro-batch is split (``split`` names them)."""
    from k3jax.train.balance import MODES as BALANCE
    from k3jax.train.optim import MODES as OPTIMIZERS
    from k3jax.train.step import StepSpec

    for flag, value in (("--steps", tc.steps), ("--batch", tc.batch), ("--micro-batches", tc.micro_batches),
                        ("--seq-len", tc.seq_len), ("--max-bytes", tc.max_bytes),
                        ("--max-bad-steps", tc.max_bad_steps), ("--ckpt-every", tc.ckpt_every),
                        ("--eval-every", tc.eval_every), ("--keep", tc.keep), ("eval_windows", tc.eval_windows)):
        if value < 1:
            raise InputError(f"{flag} must be >= 1, got {value}")
    if tc.total_steps is not None and tc.total_steps < 1:
        raise InputError(f"total_steps (the LR schedule's length) must be >= 1, got {tc.total_steps}")
    if tc.log_every < 0:
        raise InputError(f"--log-every must be >= 0 (0: no lines), got {tc.log_every}")
    if not tc.lr > 0:  # also NaN
        raise InputError(f"--lr must be > 0, got {tc.lr}")
    if tc.optimizer not in OPTIMIZERS:
        raise InputError(f"--optimizer {tc.optimizer!r}: must be one of {', '.join(OPTIMIZERS)}")
    if tc.batch % tc.micro_batches:
        raise InputError(f"--batch {tc.batch} is not divisible by --micro-batches {tc.micro_batches}")
    b = tc.batch // tc.micro_batches
    if b % n_dev:
        raise InputError(f"micro-batch size {b} (= --batch {tc.batch} / --micro-batches {tc.micro_batches}) is not "
                         f"divisible by the {n_dev} {split}")
    if tc.qat not in QAT_MODES:
        raise InputError(f"--qat {tc.qat!r}: must be one of {', '.join(QAT_MODES)}")
    if tc.compute_dtype not in ("float32", "bfloat16"):
        raise InputError(f"--compute-dtype {tc.compute_dtype!r}: must be float32 or bfloat16")
    if tc.layer_stack not in ("loop", "scan"):
        raise InputError(f"--layer-stack {tc.layer_stack!r}: must be loop or scan")
    if tc.remat not in REMAT_POLICIES:
        raise InputError(f"--remat {tc.remat!r}: must be one of {', '.join(REMAT_POLICIES)}")
    if not 0.0 < tc.heldout_frac < 1.0:
        raise InputError(f"--heldout-frac must be in (0, 1), got {tc.heldout_frac}")
    if tc.balance not in BALANCE:
        raise InputError(f"--balance {tc.balance!r}: must be one of {', '.join(BALANCE)}")
    if not 0.0 <= tc.qb_ema < 1.0:
        raise InputError(f"--qb-ema must lie in [0, 1), got {tc.qb_ema}")
    if not tc.qk_tau > 0:
        raise InputError(f"--qk-tau must be > 0, got {tc.qk_tau}")
    StepSpec(balance=tc.balance, qb_ema=tc.qb_ema, qk_tau=tc.qk_tau)  # validates the balance mode, ρ and τ
    optim_config(resolve_muon_layout(tc, 1))  # validates the optimizer's settings ("auto" resolves later, per mesh)


def optim_config(tc: TrainConfig):
    """The run's ``OptimConfig`` (validated: bad values are InputErrors naming the flag)."""
    from k3jax.train.optim import OptimConfig

    return OptimConfig(lr=tc.lr, total_steps=tc.total_steps or tc.steps, mode=tc.optimizer,
                       state_dtype=tc.opt_state_dtype, muon_layout=tc.muon_layout)


def resolve_muon_layout(tc: TrainConfig, devices: int) -> TrainConfig:
    """``tc`` with ``muon_layout`` "auto" made concrete for a mesh of ``devices``: the resolved value is what a
    checkpoint records (the two layouts' optimizer states differ in structure), and a resume whose mesh resolves
    the other way is refused naming the flag that keeps the checkpoint's layout."""
    from k3jax.train.dist_muon import LAYOUTS

    if tc.muon_layout == "auto":
        return tc.replace(muon_layout="owner" if devices > 1 else "layer")
    if tc.muon_layout not in LAYOUTS:
        raise InputError(f"--muon-layout {tc.muon_layout!r}: must be auto or one of {LAYOUTS}")
    return tc


def make_data_mesh(n: int | None) -> Mesh:
    """The data-parallel mesh over the first ``n`` devices (default: all), in ``jax.devices()`` order; its fsdp,
    expert and tensor axes have size 1, so ``P("data")`` / ``P(None, "data")`` shard over the ``n`` devices."""
    import jax

    from k3jax.sharding import make_mesh

    devs = jax.devices()
    n = len(devs) if n is None else n
    if not 1 <= n <= len(devs):
        raise InputError(f"--devices {n}: {len(devs)} device(s) available")
    return make_mesh({"data": n}, devices=devs[:n])


def check_frozen(tc: TrainConfig, cfg: K3Config) -> None:
    """--frozen-experts needs packed experts to freeze; QAT of the experts needs their master weights."""
    if not tc.frozen_experts:
        return
    if not tc.init:
        raise InputError("--frozen-experts keeps the routed experts as a checkpoint's MXFP4 bytes: give --init")
    if cfg.expert_format != "mxfp4":
        raise InputError(f"--frozen-experts: --init {tc.init} stores its routed experts as {cfg.expert_format}, not "
                         "MXFP4 bytes (export a QAT run, or save with expert_format='mxfp4')")
    if tc.qat == "weights":
        raise InputError(f"--qat weights trains the routed experts on the MXFP4 grid, but --frozen-experts holds "
                         f"{tc.init}'s experts as packed bytes without master weights; drop --frozen-experts to "
                         "QAT the experts (from their dequantized values), or use --qat weights+acts to quantize "
                         "the expert inputs over the frozen experts")


def resolve_mesh(tc: TrainConfig, cfg: K3Config) -> tuple[Mesh, str]:
    """(mesh, strategy) of a run, every check before any compile: axis names and sizes, the device count, the
    strategy's name, and that each parameter dimension the rules shard divides by its mesh axes."""
    import jax

    from k3jax.sharding import make_mesh
    from k3jax.sharding import placement as place

    if tc.mesh is None:
        if tc.strategy is not None:
            raise InputError("--strategy needs --mesh (without it the run is data-parallel over --devices)")
        return make_data_mesh(tc.devices), "fsdp"  # data-only mesh: fsdp has size 1 → replicated params
    if tc.devices is not None:
        raise InputError("give --mesh or --devices, not both (--devices N is --mesh data=N)")
    sizes, strategy = place.resolve_mesh(tc.mesh, devices=len(jax.devices()), strategy=tc.strategy, cfg=cfg)
    return make_mesh(sizes, devices=jax.devices()[:math.prod(sizes.values())]), strategy


def step_spec(tc: TrainConfig) -> StepSpec:
    """The train step's own settings (balancing, QK-Clip) of a run. With --lora the base stays as loaded: no
    router-bias balancing and no QK-Clip (both would edit frozen base weights that an adapter does not carry)."""
    from k3jax.train.step import StepSpec

    if tc.lora is not None:
        return StepSpec(balance="off", qk_clip=False)
    return StepSpec(balance=tc.balance, sign_gamma=tc.sign_gamma, qb_ema=tc.qb_ema, aux_alpha=tc.aux_alpha,
                    qk_clip=tc.qk_clip, qk_tau=tc.qk_tau)


def keeps_packed(tc: TrainConfig, cfg: K3Config) -> bool:
    """Whether the run holds the --init checkpoint's routed experts as their MXFP4 bytes, frozen: --frozen-experts,
    or LoRA over an MXFP4 checkpoint (QLoRA: adapters over the packed experts, never a dequantized stack)."""
    return tc.frozen_experts or (tc.lora is not None and bool(tc.init) and cfg.expert_format == "mxfp4")



def run_settings(tc: TrainConfig, cfg: K3Config) -> RunConfig:
    """How the run's model runs: the config's own run settings (``config.default_run``) with fp32 master weights
    and the run's QAT mode, compute dtype, layer stack and remat policy."""
    return default_run(cfg, qat=tc.qat, compute_dtype=tc.compute_dtype, param_dtype="float32",
                       layer_stack=tc.layer_stack, remat=tc.remat, lora=tc.lora)


__all__ = ["TrainConfig", "check_frozen", "keeps_packed", "make_data_mesh", "optim_config", "resolve_mesh",
           "resolve_model",
           "resolve_muon_layout", "resume_diff", "resume_refusal", "run_settings", "step_spec", "validate"]
