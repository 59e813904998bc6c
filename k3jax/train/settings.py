"""The settings of a training run: ``TrainConfig``, the one declaration of each setting — its default, what it
means, its `k3 train` flag (the flags are generated from it: k3jax/cli/train.py), the values it takes, whether a
resume must keep it and whether `k3 ablate` may vary it (each field's ``Setting``) —, their validation, and how they
resolve to a model config, a mesh, run settings and step settings; read by `k3 train`, `k3 run` (the corpus split a
trained model held out), `k3 plan` (its train programs run these settings), the loop and the ablations.

    tc = TrainConfig(preset="k3-tiny", steps=20, batch=8, seq_len=32)
    cfg = resolve_model(tc)                 # --preset / --init, compared before any array is read
    mesh, strategy = resolve_mesh(tc, cfg)  # --mesh / --devices / --strategy, checked against the parameters
    validate(tc, place.token_parallel(strategy, mesh))
    settings = run_settings(tc, cfg)        # RunConfig: fp32 masters, --qat, --compute-dtype, --layer-stack, --remat

Everything the user can get wrong is checked here, before the first compile, and raises ``InputError`` (`k3 train`
exits 2). Settings marked ``resume`` (``RESUME_KEYS``) change which batches / updates a run produces: a resume with
different values is refused (``resume_diff``); those marked ``ablate`` are the training keys an ablation file may set
(``ablatable_keys``). jax and the step / optimizer modules load inside the functions that resolve a run, not when
`k3` builds its flags from this module.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from k3jax.config import (
    DTYPES,
    KERNELS,
    LAYER_STACKS,
    QAT_MODES,
    REMAT_POLICIES,
    K3Config,
    LoRAConfig,
    RunConfig,
    architecture_diff,
    default_run,
    from_hf,
    get_preset,
    with_kernels,
)
from k3jax.errors import InputError

if TYPE_CHECKING:  # jax and the step / optimizer modules load when a run is resolved, not when `k3` builds its flags
    from jax.sharding import Mesh

    from k3jax.train.step import StepSpec

# The default corpus of a run (and of `k3 run`'s held-out figure): the first 4 MiB of --data (the stdlib sources),
# its last 5% held out.
CORPUS_BYTES = 4 << 20
HELDOUT_FRAC = 0.05
# The matmul operand dtypes a run trains in: RunConfig's, less float64 (a reference dtype, not a training one).
TRAIN_DTYPES = tuple(d for d in DTYPES if d != "float64")
# Choice lists whose home imports jax, repeated here so that `k3` builds its flags without jax (tests/train/
# test_settings.py holds them equal): k3jax.optim.optimizer.MODES, k3jax.optim.balance.MODES, "auto" and
# k3jax.optim.dist_muon.LAYOUTS, k3jax.sharding.rules.STRATEGIES.
OPTIMIZERS = ("per_head", "full", "adamw")
BALANCE_MODES = ("qb", "sign", "aux", "off")
MUON_LAYOUTS = ("auto", "layer", "owner")
STRATEGIES = ("single", "fsdp", "ep", "ep_tp", "fsdp_ep_tp", "zero3_ep_tp", "serve")
_DEFAULT = object()


@dataclass(frozen=True)
class Setting:
    """What `k3 train`, a resume and `k3 ablate` know of one ``TrainConfig`` field (its ``metadata["setting"]``).
    ``help`` may name ``{default}`` (with a format spec) and ``{choices}``."""

    help: str = ""
    group: str | None = None  # the `k3 train --help` group of its flag (model, run, data, output); None: no flag
    flag: str | None = None  # the flag that names it in messages (default: --name with a flag, else the name)
    choices: tuple = ()  # the values it takes (the flag's choices and ``validate``'s check)
    kind: str = "value"  # the flag: value; on (a switch); off (--no-NAME clears it); either (--NAME / --no-NAME);
    #                      many (zero or more values)
    metavar: str | None = None
    resume: bool = False  # changes which batches / updates a run produces: a resume with another value is refused
    before: Any = _DEFAULT  # what a checkpoint that predates the key ran with, where that is not the default
    ablate: bool | str = False  # an ablation file's train key; "later": added after shipped studies existed


def setting(default, help: str = "", *, compare: bool = True, repr: bool = True, **kw):  # noqa: A002
    """A ``TrainConfig`` field: its default and its ``Setting`` (``kw``)."""
    return field(default=default, compare=compare, repr=repr, metadata={"setting": Setting(help, **kw)})


@dataclass(frozen=True)
class TrainConfig:
    # ---- model (the order of each group is `k3 train --help`'s)
    preset: str | None = setting("k3-mini", "start from scratch with this preset (default {default})", group="model",
                                 metavar="NAME", resume=True)
    init: str | None = setting(None, "start from this checkpoint directory (its config must match --preset when both "
                               "are given); the run's own checkpoints are --ckpt-dir", group="model", metavar="DIR",
                               resume=True)
    strict_config: bool = setting(False, "unknown keys in --init's config.json are errors", group="model", kind="on")
    qat: str = setting("off", "quantization-aware training: fake-quantize to MXFP4 the routed experts' weights, or "
                       "weights and activations ({choices}; default {default})", group="model", choices=QAT_MODES,
                       resume=True, ablate=True)
    compute_dtype: str = setting("float32", "matmul operand dtype; master params and optimizer state stay fp32",
                                 group="model", choices=TRAIN_DTYPES, resume=True, ablate=True)
    layer_stack: str = setting("loop", "the repeating layer group unrolled, or one lax.scan (compile time flat in "
                               "depth; equal up to reduction order)", group="model", choices=LAYER_STACKS)
    remat: str = setting("none", "per-layer activation checkpointing: none, full (keep only each layer's inputs), "
                         "group (a scanned group's backward without the per-layer checkpoint inside it) or a "
                         "jax.checkpoint_policies name; the same math, less activation memory, more recompute",
                         group="model", choices=REMAT_POLICIES)  # the same math: not a resume key
    kernels: str = setting("auto", "auto (Pallas kernels on GPU/TPU where one runs on the mesh, else XLA), xla, or "
                           "pallas (all; interpreted on CPU; exit 2 if one cannot run)", group="model", choices=KERNELS)
    # ---- run
    steps: int = setting(300, "optimizer steps to train for (default {default})", group="run")
    total_steps: int | None = setting(None, "the LR schedule's length (default: steps)", flag="--steps", resume=True)
    batch: int = setting(16, "global sequences per optimizer step", group="run", resume=True, ablate=True)
    micro_batches: int = setting(1, "gradient-accumulation micro-batches per step", group="run", resume=True,
                                 ablate=True)
    seq_len: int = setting(128, "tokens per sequence (default {default})", group="run", resume=True, ablate=True)
    lr: float = setting(3e-3, "peak learning rate of the cosine schedule, after a 1% linear warm-up (default "
                        "{default})", group="run", resume=True, ablate=True)
    optimizer: str = setting("per_head", "per_head (Muon per head, the default), full, or adamw (the default with "
                             "--lora)", group="run", choices=OPTIMIZERS, resume=True, ablate=True)  # OptimConfig.mode
    opt_state_dtype: str = setting("float32", "dtype the optimizer's moments are stored in (float32 default, "
                                   "bfloat16); master weights and the update's arithmetic stay float32", group="run",
                                   resume=True, ablate="later")
    muon_layout: str = setting("auto", "where Muon's Newton-Schulz runs: owner (each block whole on one device of the "
                               "mesh), layer (one layer at a time, where the rules put it); auto: owner on > 1 device",
                               group="run", choices=MUON_LAYOUTS, resume=True, before="layer", ablate="later")
    balance: str = setting("qb", "expert balancing: Quantile Balancing (K3), DeepSeek sign rule, auxiliary loss, "
                           "none", group="run", choices=BALANCE_MODES, resume=True, ablate=True)
    sign_gamma: float = setting(1e-3, "the sign rule's bias step", resume=True, ablate=True)
    qb_ema: float = setting(0.0, "QB only: bias = centre(rho * bias + (1 - rho) * b-hat), an EMA of the per-step "
                            "target (docs/model.md §8.2; default 0 = plain QB)", group="run", resume=True, ablate=True)
    aux_alpha: float = setting(1e-2, "the auxiliary balancing loss's weight", resume=True, ablate=True)
    qk_clip: bool = setting(True, "turn QK-Clip off (by default each MLA head whose max attention logit exceeds "
                            "--qk-tau has its query/key weights scaled back after the step)", group="run", kind="off",
                            flag="--no-qk-clip", resume=True, ablate=True)
    qk_tau: float = setting(100.0, "QK-Clip's threshold tau on a head's max attention logit (default {default:g})",
                            group="run", resume=True, ablate=True)
    seed: int = setting(0, "seed of the initial parameters and the data order (default {default})", group="run",
                        resume=True)
    devices: int | None = setting(None, "data-parallel devices (default: all); the same as --mesh data=N",
                                  group="run", ablate=True)  # excludes mesh
    mesh: str | None = setting(None, "device mesh over data, fsdp, expert, context, tensor (e.g. data=2,expert=4); "
                               "parameters, optimizer state and batches are placed by the sharding rules; context=N "
                               "splits each sequence N ways (--seq-len a multiple of N, >= 3 tokens per shard)",
                               group="run", metavar="AXIS=N,...")
    # LoRA adapters (k3jax/layers/lora.py) trained over the frozen base; an MXFP4 --init keeps its routed experts as
    # the packed bytes (QLoRA); --export then writes the adapters only, in PEFT's layout (k3jax/checkpoint/peft.py)
    lora: LoRAConfig | None = setting(None, "train LoRA adapters only, over the frozen base (targets: attn, shared, "
                                      "dense, experts; default rank=16,alpha=32,targets=attn+shared+experts); an "
                                      "MXFP4 --init keeps its routed experts packed (QLoRA); --export writes the "
                                      "adapters in PEFT's layout", group="run", metavar="rank=R,alpha=A,targets=T+T",
                                      resume=True)
    # the packed leaves live in state["frozen"], outside gradients and the optimizer
    frozen_experts: bool = setting(False, "keep --init's routed experts as their MXFP4 bytes, frozen (run by the "
                                   "grouped MXFP4 matmul); attention, router, shared experts and norms train",
                                   group="run", kind="on", resume=True)
    strategy: str | None = setting(None, "sharding rules column: " + ", ".join(STRATEGIES) + " (default: from the "
                                   "mesh axes, e.g. data+expert -> ep)", group="run", metavar="NAME")
    # ---- data
    data: tuple[str, ...] = setting((), "text files, JSONL of {{\"text\": ...}} lines, or chat JSONL of "
                                    "{{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} lines (rendered by "
                                    "the --init checkpoint's chat template, or the byte presets' built-in one; loss "
                                    "on assistant tokens only) (default: the Python stdlib sources); each file, line "
                                    "or conversation is a document", group="data", kind="many", resume=True)
    # document boundaries carried beside the tokens: KDA / conv / MLA restart at each, no prediction across one
    # (k3jax.train.data); False: today's plain windows of the token stream, for ablations
    packing_masks: bool = setting(True, "let KDA, its conv and MLA run across document boundaries in a packed "
                                  "sequence (the behaviour before document masks, for ablations); by default each "
                                  "document is mixed on its own and no prediction crosses a boundary", group="data",
                                  kind="off", flag="--no-packing-masks", resume=True, before=False)
    max_bytes: int = setting(CORPUS_BYTES, "read at most this many bytes of --data (default {default:,})",
                             group="data", resume=True)
    heldout_frac: float = setting(HELDOUT_FRAC, "fraction of the corpus, at its end, held out for the evaluation "
                                  "(default {default})", group="data", resume=True)
    eval_every: int = setting(50, "score the held-out data every this many steps, and at the last (default "
                              "{default})", group="data")
    eval_windows: int = setting(32, "held-out windows scored at each evaluation")
    eval_at_start: bool = setting(False, "also score the initial parameters (step 0)", group="data", kind="on")
    # ---- output
    ckpt_dir: str | None = setting(None, "this run's directory of orbax checkpoints (resumes from the latest one); a "
                                   "checkpoint to start from is --init", group="output", metavar="DIR")
    ckpt_every: int = setting(50, "save a checkpoint in --ckpt-dir every this many steps, and at the last (default "
                              "{default})", group="output")
    keep: int = setting(3, "checkpoints kept in --ckpt-dir, the latest ones (default {default})", group="output")
    async_ckpt: bool = setting(True, "checkpoints written in the background")
    metrics: str | None = setting(None, "metrics JSONL file (appended)", group="output")
    tensorboard: str | None = setting(None, "also write the metrics as TensorBoard event files in this directory",
                                      group="output", metavar="DIR")
    export: str | None = setting(None, "write the final model in the official layout here", group="output")
    fork: bool = setting(False, "resume from --ckpt-dir even if settings differ (e.g. switch --qat on from a "
                         "checkpoint of a QAT-off run)", group="output", kind="on")
    max_bad_steps: int = setting(3, "stop after this many non-finite steps in a row", group="output")
    progress: bool | None = setting(None, "a progress bar on stderr (default: when stderr is a terminal)",
                                    group="output", kind="either")
    overwrite: bool = setting(False, "replace --export's directory when it exists and is not empty (else refused "
                              "before any compute); it is replaced only once the new export is complete",
                              group="output", kind="on")
    log_every: int = setting(10, "without a progress bar (stderr not a terminal, or --no-progress): print step, "
                             "loss, tokens/s and eta to stderr every N steps (default {default}; 0: never)",
                             group="output", metavar="N")
    # ---- the API only
    peak_flops: float | None = setting(None, "the MFU's peak (None: measure an XLA matmul at start-up)")
    poison_steps: tuple[int, ...] = setting((), "testing hook: (1-based) steps whose loss and gradient are made NaN")
    # `k3 ablate`'s arms: an architecture to build instead of --preset (give preset=None), and the initial parameter
    # state dict as a function of (cfg, run settings) instead of the random init from `seed` (the shared seed init)
    model: K3Config | None = setting(None, "an architecture to build instead of --preset (give preset=None)")
    init_fn: Callable[[K3Config, RunConfig], dict] | None = setting(
        None, "the initial parameters as a function of (cfg, run settings) instead of the random init", compare=False,
        repr=False)

    def replace(self, **kw) -> TrainConfig:
        return dataclasses.replace(self, **kw)

    def resume_key(self) -> dict:
        d = {k: getattr(self, k) for k in RESUME_KEYS}
        d["data"] = list(d["data"])
        d["total_steps"] = self.total_steps or self.steps
        d["lora"] = None if self.lora is None else self.lora.record()
        return d


SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in dataclasses.fields(TrainConfig)}
RESUME_KEYS = tuple(k for k, s in SETTINGS.items() if s.resume)


def flag_of(name: str) -> str:
    """The flag that names setting ``name`` in messages (its own name where it has none)."""
    s = SETTINGS[name]
    return s.flag or (f"--{name.replace('_', '-')}" if s.group else name)


def ablatable_keys() -> tuple[str, ...]:
    """The training settings an ablation file may set (``[base] train`` / a level's ``train``)."""
    return tuple(k for k, s in SETTINGS.items() if s.ablate)


def later_ablatable_keys() -> tuple[str, ...]:
    """The ablatable settings added after ablation files and their recorded directories existed: an arm's resolved
    settings hold one only when it differs from the default, so earlier files keep their fingerprints."""
    return tuple(k for k, s in SETTINGS.items() if s.ablate == "later")


def _before_key() -> dict:
    """A resume key's value for a checkpoint that does not record it: what runs before the key existed ran with."""
    return {k: s.before for k, s in SETTINGS.items() if s.resume and s.before is not _DEFAULT}


def resume_diff(saved: dict, now: dict) -> list[str]:
    """Settings (``RESUME_KEYS``) that differ between a checkpoint's run and this one. A key the checkpoint does
    not record (added to k3jax after it was written, e.g. ``qb_ema``) counts as that setting's default (or, where
    runs before it ran otherwise, as that: ``Setting.before``)."""
    defaults = TrainConfig().resume_key() | _before_key()
    return sorted(k for k in now if saved.get(k, defaults[k]) != now[k])


def resume_refusal(saved: dict, now: dict, diff: list[str]) -> str:
    """Why a checkpoint whose settings differ (``diff``, from ``resume_diff``) is not resumed, each setting named
    by its flag with the checkpoint's value and this run's, and the way past it: --fork (or a fresh --ckpt-dir)."""
    defaults = TrainConfig().resume_key() | _before_key()

    def show(k: str) -> str:
        note = " (the LR schedule's length)" if k == "total_steps" else ""
        return f"{flag_of(k)} {saved.get(k, defaults[k])!r} then, {now[k]!r} now{note}"

    return (f"the checkpoint was written with different settings: {'; '.join(show(k) for k in diff)}. Pass --fork "
            "to resume from it anyway (the run then is not the one these settings give from the start), or use a "
            "fresh --ckpt-dir")


# ---------------------------------------------------------------------------------------------------------- setup


def resolve_model(tc: TrainConfig) -> K3Config:
    """The model config from --preset and/or --init, compared before any array is read."""
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
    from k3jax.train.step import StepSpec  # jax: loaded when a run is resolved (the module docstring)

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
    _check_choice(tc, "optimizer")
    if tc.batch % tc.micro_batches:
        raise InputError(f"--batch {tc.batch} is not divisible by --micro-batches {tc.micro_batches}")
    b = tc.batch // tc.micro_batches
    if b % n_dev:
        raise InputError(f"micro-batch size {b} (= --batch {tc.batch} / --micro-batches {tc.micro_batches}) is not "
                         f"divisible by the {n_dev} {split}")
    for name in ("qat", "compute_dtype", "layer_stack", "remat"):
        _check_choice(tc, name)
    if not 0.0 < tc.heldout_frac < 1.0:
        raise InputError(f"--heldout-frac must be in (0, 1), got {tc.heldout_frac}")
    _check_choice(tc, "balance")
    if not 0.0 <= tc.qb_ema < 1.0:
        raise InputError(f"--qb-ema must lie in [0, 1), got {tc.qb_ema}")
    if not tc.qk_tau > 0:
        raise InputError(f"--qk-tau must be > 0, got {tc.qk_tau}")
    StepSpec(balance=tc.balance, qb_ema=tc.qb_ema, qk_tau=tc.qk_tau)  # validates the balance mode, ρ and τ
    optim_config(resolve_muon_layout(tc, 1))  # validates the optimizer's settings ("auto" resolves later, per mesh)


def _check_choice(tc: TrainConfig, name: str) -> None:
    """InputError naming the flag unless setting ``name`` is one of its choices."""
    value, choices = getattr(tc, name), SETTINGS[name].choices
    if value not in choices:
        allowed = " or ".join(choices) if len(choices) == 2 else "one of " + ", ".join(choices)
        raise InputError(f"{flag_of(name)} {value!r}: must be {allowed}")


def optim_config(tc: TrainConfig):
    """The run's ``OptimConfig`` (validated: bad values are InputErrors naming the flag)."""
    from k3jax.optim.optimizer import OptimConfig  # jax: loaded when a run is resolved

    return OptimConfig(lr=tc.lr, total_steps=tc.total_steps or tc.steps, mode=tc.optimizer,
                       state_dtype=tc.opt_state_dtype, muon_layout=tc.muon_layout)


def resolve_muon_layout(tc: TrainConfig, devices: int) -> TrainConfig:
    """``tc`` with ``muon_layout`` "auto" made concrete for a mesh of ``devices``: the resolved value is what a
    checkpoint records (the two layouts' optimizer states differ in structure), and a resume whose mesh resolves
    the other way is refused naming the flag that keeps the checkpoint's layout."""
    from k3jax.optim.dist_muon import LAYOUTS  # jax: loaded when a run is resolved

    if tc.muon_layout == "auto":
        return tc.replace(muon_layout="owner" if devices > 1 else "layer")
    if tc.muon_layout not in LAYOUTS:
        raise InputError(f"--muon-layout {tc.muon_layout!r}: must be auto or one of {LAYOUTS}")
    return tc


def make_data_mesh(n: int | None) -> Mesh:
    """The data-parallel mesh over the first ``n`` devices (default: all), in ``jax.devices()`` order; its fsdp,
    expert and tensor axes have size 1, so ``P("data")`` / ``P(None, "data")`` shard over the ``n`` devices."""
    import jax  # loaded when a run is resolved (the module docstring)

    from k3jax.sharding import make_mesh  # jax: loaded when a run is resolved

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
    import jax  # loaded when a run is resolved (the module docstring)

    from k3jax.sharding import make_mesh  # jax: loaded when a run is resolved
    from k3jax.sharding import placement as place  # jax: loaded when a run is resolved

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
    from k3jax.train.step import StepSpec  # jax: loaded when a run is resolved

    if tc.lora is not None:
        return StepSpec(balance="off", qk_clip=False)
    return StepSpec(balance=tc.balance, sign_gamma=tc.sign_gamma, qb_ema=tc.qb_ema, aux_alpha=tc.aux_alpha,
                    qk_clip=tc.qk_clip, qk_tau=tc.qk_tau)


def keeps_packed(tc: TrainConfig, cfg: K3Config) -> bool:
    """Whether the run holds the --init checkpoint's routed experts as their MXFP4 bytes, frozen: --frozen-experts,
    or LoRA over an MXFP4 checkpoint (QLoRA: adapters over the packed experts, never a dequantized stack)."""
    return tc.frozen_experts or (tc.lora is not None and bool(tc.init) and cfg.expert_format == "mxfp4")



def run_settings(tc: TrainConfig, cfg: K3Config, *, param_dtype: str = "float32", platform: str | None = None,
                 mesh=None, rows: bool = False) -> RunConfig:
    """Which run settings a training run's model runs with — the one answer for `k3 train` (the loop), `k3 plan`'s
    train programs and `k3 ablate`'s arms: the config's own run settings (``config.default_run``) with the run's
    QAT mode, compute dtype, layer stack, remat policy and LoRA adapters, parameters in ``param_dtype`` (fp32
    master weights; a plan's LoRA base is held in bf16, its adapters are fp32 whatever the base: layers/lora.py),
    and ``--kernels`` for ``platform`` (None: the one being compiled for) over ``mesh`` (a Mesh or its axis sizes;
    None: one device; ``rows``: whole sequences split by row, ``placement.kernel_rows``) — ``config.with_kernels``."""
    run = default_run(cfg, qat=tc.qat, compute_dtype=tc.compute_dtype, param_dtype=param_dtype,
                      layer_stack=tc.layer_stack, remat=tc.remat, lora=tc.lora)
    if platform is None:
        from k3jax.layers.backends import kernel_target  # jax: loaded when a run is resolved
        platform = kernel_target()
    sizes = {} if mesh is None else dict(getattr(mesh, "shape", mesh))
    return with_kernels(run, tc.kernels, platform, context=sizes.get("context", 1) > 1,
                        devices=math.prod(sizes.values()) if sizes else 1, rows=rows)


__all__ = ["BALANCE_MODES", "CORPUS_BYTES", "HELDOUT_FRAC", "MUON_LAYOUTS", "OPTIMIZERS", "RESUME_KEYS", "SETTINGS",
           "STRATEGIES", "TRAIN_DTYPES", "Setting", "TrainConfig", "ablatable_keys", "check_frozen", "flag_of",
           "keeps_packed", "later_ablatable_keys", "make_data_mesh", "optim_config", "resolve_mesh", "resolve_model",
           "resolve_muon_layout", "resume_diff", "resume_refusal", "run_settings", "setting", "step_spec", "validate"]
