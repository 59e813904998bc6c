"""The QAT fine-tuning / pre-training loop: jitted steps on any mesh the rules table describes, orbax checkpoints
with exact resume, metrics JSONL, NaN/Inf skipping, SIGTERM handling and a final export in the official layout.

    from k3jax.train.loop import TrainConfig, train
    summary = train(TrainConfig(preset="k3-tiny", steps=20, batch=8, seq_len=32, ckpt_dir="ck/", metrics="m.jsonl"))
    summary = train(TrainConfig(preset="k3-mini", mesh="data=2,expert=4", strategy="ep", ...))   # sharded

Placement (``k3jax.sharding.placement``): ``mesh`` (axis sizes) and ``strategy`` (a rules-table column; default
from the mesh's axes) place parameters, optimizer state (Muon momentum and AdamW moments beside their parameter),
the QB bias buffers and every batch; nothing the rules shard is replicated. XLA inserts the FSDP gathers and
gradient reductions from those shardings; the MoE layers run through the expert-parallel shard_map dispatch when
the rules shard the experts. Per-head / per-expert Muon runs Newton–Schulz with heads / experts as its batch axis,
so a sharded block is orthogonalized where it lives; a matrix whose contraction dimensions the rules shard (fsdp)
is gathered by XLA for its Newton–Schulz step. Without ``mesh``, ``devices`` N keeps meaning a 1-D data mesh.
Checkpoints are saved sharded and restore onto whatever mesh the resuming run builds (orbax reshards), so a run
may resume on a different mesh shape.

Exact resume: the batch of step s is a pure function of (seed, s) (``k3jax.train.data.batch_at``), and the
checkpoint holds params (QB biases included), optimizer state, step, RNG and the bad-step streak. Re-running the
same command with the same ``ckpt_dir`` continues from the latest committed checkpoint (``k3jax.train.ckpt``) and
ends with parameters bit-identical to an uninterrupted run.

Everything the user can get wrong (preset, corpus, batch divisibility, steps, --init config) is checked before the
first compile and raises ValueError (`k3 train` → exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from k3jax.config import QAT_MODES, REMAT_POLICIES, ConfigError, K3Config, RunConfig, default_run, get_preset
from k3jax.sharding import make_mesh, param_shardings, param_specs
from k3jax.sharding import placement as place
from k3jax.train import data as tdata
from k3jax.train.ckpt import load_checkpoint_params, manager, restore_state, save_state
from k3jax.train.evaluate import Windows, heldout_loss, make_scorer, spaced_windows
from k3jax.train.flops import flops_per_token, matmul_peak_flops
from k3jax.train.optim import OptimConfig, make_optimizer, schedule
from k3jax.train.step import StepSpec, init_state, make_train_step

# Fields that change which batches / updates a run produces: a resume with different values is refused.
_RESUME_KEYS = ("preset", "init", "seed", "batch", "micro_batches", "seq_len", "lr", "optimizer", "qat",
                "compute_dtype", "balance", "sign_gamma", "qb_ema", "aux_alpha", "qk_clip", "qk_tau", "data",
                "max_bytes", "heldout_frac", "total_steps", "frozen_experts")


def resume_diff(saved: dict, now: dict) -> list[str]:
    """Settings (``_RESUME_KEYS``) that differ between a checkpoint's run and this one. A key the checkpoint does
    not record (added to k3jax after it was written, e.g. ``qb_ema``) counts as that setting's default."""
    defaults = TrainConfig().resume_key()
    return sorted(k for k in now if saved.get(k, defaults[k]) != now[k])


class TrainingStoppedError(RuntimeError):
    """Too many non-finite steps in a row; the message names the steps and the last good checkpoint."""


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
    optimizer: str = "per_head"  # OptimConfig.mode
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
    max_bad_steps: int = 3
    devices: int | None = None  # data-parallel width (default: all devices); excludes mesh
    mesh: str | None = None  # "data=2,expert=4": axis sizes over data, fsdp, expert, tensor (placement by the rules)
    strategy: str | None = None  # rules-table column (k3jax.sharding.rules.STRATEGIES); default from the mesh axes
    # routed experts kept as the --init checkpoint's MXFP4 bytes and frozen; attention, router, shared experts and
    # norms train (the packed leaves live in state["frozen"], outside gradients and the optimizer)
    frozen_experts: bool = False
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
        return d


# ---------------------------------------------------------------------------------------------------------- setup


def resolve_model(tc: TrainConfig) -> K3Config:
    """The model config from --preset and/or --init, compared before any array is read."""
    from k3jax.checkpoint.save import architecture_diff
    from k3jax.config import from_hf

    if tc.model is not None:
        if tc.preset or tc.init:
            raise ValueError("TrainConfig.model replaces --preset and --init: give preset=None and no init")
        return tc.model
    cfg = get_preset(tc.preset) if tc.preset else None
    if tc.init:
        cfg_file = os.path.join(tc.init, "config.json")
        if not os.path.isfile(cfg_file):
            raise ValueError(f"--init {tc.init}: no config.json (not a checkpoint directory)")
        ck_cfg = from_hf(cfg_file, strict=tc.strict_config)
        if cfg is not None:
            diff = architecture_diff(ck_cfg, cfg)
            if diff:
                raise ValueError(f"--init {tc.init}: checkpoint config does not match --preset {tc.preset} "
                                 f"(differs in {', '.join(diff)})")
        else:
            cfg = ck_cfg
    if cfg is None:
        raise ValueError("give --preset or --init")
    return cfg


def validate(tc: TrainConfig, n_dev: int, split: str = "data-parallel devices") -> None:
    """The run's own settings; ``n_dev``: how many ways each micro-batch is split (``split`` names them)."""
    if tc.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {tc.steps}")
    if tc.batch < 1 or tc.micro_batches < 1 or tc.seq_len < 1:
        raise ValueError("--batch, --micro-batches and --seq-len must be >= 1")
    if tc.batch % tc.micro_batches:
        raise ValueError(f"--batch {tc.batch} is not divisible by --micro-batches {tc.micro_batches}")
    b = tc.batch // tc.micro_batches
    if b % n_dev:
        raise ValueError(f"micro-batch size {b} (= batch {tc.batch} / {tc.micro_batches} micro-batches) is not "
                         f"divisible by the {n_dev} {split}")
    if tc.qat not in QAT_MODES:
        raise ValueError(f"--qat {tc.qat!r}: must be one of {', '.join(QAT_MODES)}")
    if tc.compute_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--compute-dtype {tc.compute_dtype!r}: must be float32 or bfloat16")
    if tc.layer_stack not in ("loop", "scan"):
        raise ValueError(f"--layer-stack {tc.layer_stack!r}: must be loop or scan")
    if tc.remat not in REMAT_POLICIES:
        raise ValueError(f"--remat {tc.remat!r}: must be one of {', '.join(REMAT_POLICIES)}")
    if not 0.0 < tc.heldout_frac < 1.0:
        raise ValueError(f"--heldout-frac must be in (0, 1), got {tc.heldout_frac}")
    if tc.max_bad_steps < 1 or tc.ckpt_every < 1 or tc.eval_every < 1 or tc.keep < 1:
        raise ValueError("--max-bad-steps, --ckpt-every, --eval-every and --keep must be >= 1")
    StepSpec(balance=tc.balance, qb_ema=tc.qb_ema, qk_tau=tc.qk_tau)  # validates the balance mode, ρ and τ
    OptimConfig(lr=tc.lr, total_steps=tc.total_steps or tc.steps, mode=tc.optimizer)


def make_data_mesh(n: int | None) -> Mesh:
    """The data-parallel mesh over the first ``n`` devices (default: all), in ``jax.devices()`` order; its fsdp,
    expert and tensor axes have size 1, so ``P("data")`` / ``P(None, "data")`` shard over the ``n`` devices."""
    devs = jax.devices()
    n = len(devs) if n is None else n
    if not 1 <= n <= len(devs):
        raise ValueError(f"--devices {n}: {len(devs)} device(s) available")
    return make_mesh({"data": n}, devices=devs[:n])


def _check_frozen(tc: TrainConfig, cfg: K3Config) -> None:
    """--frozen-experts needs packed experts to freeze; QAT of the experts needs their master weights."""
    if not tc.frozen_experts:
        return
    if not tc.init:
        raise ValueError("--frozen-experts keeps the routed experts as a checkpoint's MXFP4 bytes: give --init")
    if cfg.expert_format != "mxfp4":
        raise ValueError(f"--frozen-experts: --init {tc.init} stores its routed experts as {cfg.expert_format}, not "
                         "MXFP4 bytes (export a QAT run, or save with expert_format='mxfp4')")
    if tc.qat == "weights":
        raise ValueError(f"--qat weights trains the routed experts on the MXFP4 grid, but --frozen-experts holds "
                         f"{tc.init}'s experts as packed bytes without master weights; drop --frozen-experts to "
                         "QAT the experts (from their dequantized values), or use --qat weights+acts to quantize "
                         "the expert inputs over the frozen experts")


def resolve_mesh(tc: TrainConfig, cfg: K3Config) -> tuple[Mesh, str]:
    """(mesh, strategy) of a run, every check before any compile: axis names and sizes, the device count, the
    strategy's name, and that each parameter dimension the rules shard divides by its mesh axes."""
    if tc.mesh is None:
        if tc.strategy is not None:
            raise ValueError("--strategy needs --mesh (without it the run is data-parallel over --devices)")
        return make_data_mesh(tc.devices), "fsdp"  # data-only mesh: fsdp has size 1 → replicated params
    if tc.devices is not None:
        raise ValueError("give --mesh or --devices, not both (--devices N is --mesh data=N)")
    sizes = place.parse_mesh(tc.mesh)
    need, have = math.prod(sizes.values()), len(jax.devices())
    if need > have:
        raise ValueError(f"--mesh {tc.mesh}: needs {need} devices, {have} available")
    strategy = place.check_strategy(tc.strategy or place.default_strategy(sizes))
    try:
        param_specs(cfg, strategy, sizes)  # names the parameter, dimension and mesh axes that do not divide
    except ValueError as e:
        raise ValueError(f"--mesh {tc.mesh} --strategy {strategy}: {e}") from None
    return make_mesh(sizes, devices=jax.devices()[:need]), strategy


# -------------------------------------------------------------------------------------------------------- the loop


class _Sigterm:
    """``with _Sigterm() as term``: ``term.hit`` turns True on SIGTERM; the previous handler is restored on exit."""

    hit = False

    def __enter__(self):
        try:
            self.prev = signal.signal(signal.SIGTERM, lambda signum, frame: setattr(self, "hit", True))
        except ValueError:  # not the main thread: no handler (the run is then only stopped by its caller)
            self.prev = None
        return self

    def __exit__(self, *exc):
        if self.prev is not None:
            signal.signal(signal.SIGTERM, self.prev)


@dataclass
class _Run:
    """One run's context: filled by ``_prepare`` (checks and data), ``_build`` (state and jitted functions),
    ``_resume`` and ``_open_outputs``; the step loop reads it and advances ``state`` / ``last_good``."""

    tc: TrainConfig
    cfg: K3Config
    settings: RunConfig
    mesh: Mesh
    strategy: str
    log: Callable[[str], None]
    train_toks: np.ndarray
    eval_set: Windows
    vocab: int
    held_entropy: float
    state: dict | None = None
    step_fn: Callable | None = None
    state_sh: dict | None = None
    dispatch: Any = None
    score: Callable | None = None
    batch_sh: NamedSharding | None = None
    lr_at: Callable | None = None
    mngr: Any = None
    meta: dict = field(default_factory=dict)
    start: int = 0
    last_good: int | None = None
    flops_tok: float | None = None
    peak: float | None = None
    mfile: Any = None
    bar: Any = None

    def write(self, rec: dict) -> None:
        if self.mfile is not None:
            self.mfile.write(json.dumps(rec) + "\n")
            self.mfile.flush()


def _prepare(tc: TrainConfig, log) -> _Run:
    """Every user-facing check, before any compute; loads and splits the corpus."""
    try:
        cfg = resolve_model(tc)
    except ConfigError as e:
        raise ValueError(str(e)) from e
    _check_frozen(tc, cfg)
    mesh, strategy = resolve_mesh(tc, cfg)
    n_dev = place.token_parallel(strategy, mesh)  # ways a batch is split (data-parallel width)
    axes = place.token_axes(strategy, mesh)
    validate(tc, n_dev, f"ways the batch is split (mesh axes {', '.join(axes)})" if tc.mesh else
             "data-parallel devices")
    tokens = tdata.load_corpus(tc.data, max_bytes=tc.max_bytes)
    train_toks, held = tdata.split(tokens, tc.heldout_frac)
    tdata.check_size(train_toks, tc.seq_len, "training")
    tdata.check_size(held, tc.seq_len, "held-out")
    vocab = min(cfg.vocab_size, 256)
    if cfg.vocab_size < 256:
        log(f"vocab {cfg.vocab_size} < 256: tokens are byte % {cfg.vocab_size}")
    # the periodic eval's fixed windows: eval_windows rounded down to a multiple of the devices (at least one each)
    eval_set = spaced_windows(held, num=max(n_dev, tc.eval_windows // n_dev * n_dev), seq_len=tc.seq_len,
                              vocab=vocab)
    settings = default_run(cfg, qat=tc.qat, compute_dtype=tc.compute_dtype, param_dtype="float32",  # fp32 master
                           layer_stack=tc.layer_stack, remat=tc.remat)
    return _Run(tc=tc, cfg=cfg, settings=settings, mesh=mesh, strategy=strategy, log=log, train_toks=train_toks,
                eval_set=eval_set, vocab=vocab, held_entropy=tdata.unigram_entropy(held, vocab))


def _init_params(cfg: K3Config, settings: RunConfig, tc: TrainConfig, shardings, log=None):
    """The initial parameters placed with ``shardings`` (a NamedSharding per leaf)."""
    from k3jax.model import init_params

    if tc.init_fn is not None:
        return jax.device_put(tc.init_fn(cfg, settings), shardings)
    if tc.init:
        from k3jax.checkpoint.load import load

        st: dict = {}
        _, params = load(tc.init, cfg=cfg, shardings=shardings, dtype=jnp.float32, progress=tc.progress,
                         strict_config=tc.strict_config, stats=st, keep_experts_packed=tc.frozen_experts)
        if log is not None:
            log(f"loaded {tc.init}: {st['bytes_read'] / 2**20:,.1f} MiB read in {st['seconds']:.1f} s "
                f"({st['bytes_read'] / 2**20 / max(st['seconds'], 1e-9):,.0f} MiB/s), "
                f"{place.bytes_per_device(params) / 2**20:,.1f} MiB of parameters per device")
        return params
    return jax.jit(lambda k: init_params(cfg, k, settings), out_shardings=shardings)(jax.random.key(tc.seed))


def step_spec(tc: TrainConfig) -> StepSpec:
    return StepSpec(balance=tc.balance, sign_gamma=tc.sign_gamma, qb_ema=tc.qb_ema, aux_alpha=tc.aux_alpha,
                    qk_clip=tc.qk_clip, qk_tau=tc.qk_tau)


def _build(run: _Run) -> None:
    """Parameters and optimizer state placed by the rules, the train state, the jitted train step and the
    held-out scorer."""
    from k3jax.model import abstract_params

    tc, cfg = run.tc, run.cfg
    run.batch_sh = place.batch_sharding(run.strategy, run.mesh, 3, batch_dim=1)  # [M, b, T + 1]: b is split
    ocfg = OptimConfig(lr=tc.lr, total_steps=tc.total_steps or tc.steps, mode=tc.optimizer)
    abstract = abstract_params(cfg, run.settings)
    if tc.frozen_experts:
        abstract = place.packed_form(abstract)
    param_sh = param_shardings(cfg, run.strategy, run.mesh, abstract)
    params = _init_params(cfg, run.settings, tc, param_sh, run.log)
    params, frozen = place.split_packed(params)
    if frozen and not tc.frozen_experts:
        raise ValueError("the initial parameters hold packed routed experts (w*_packed / w*_scale): they can only "
                         "be trained frozen (frozen_experts=True, `k3 train --frozen-experts`)")
    tx, _ = make_optimizer(params, ocfg)
    init = lambda p, f: init_state(p, tx, tc.seed, frozen=f or None)  # noqa: E731
    run.state_sh = place.state_shardings(cfg, run.strategy, run.mesh, jax.eval_shape(init, params, frozen))
    run.state = jax.jit(init, out_shardings=run.state_sh)(params, frozen)
    del params, frozen
    run.dispatch = place.expert_dispatch(run.strategy, run.mesh)
    run.step_fn = jax.jit(make_train_step(cfg, run.settings, tx, step_spec(tc), dispatch=run.dispatch),
                          in_shardings=(run.state_sh, run.batch_sh, None), out_shardings=(run.state_sh, None),
                          donate_argnums=0)
    run.score = make_scorer(cfg, run.settings, params_sharding=_full(run.state_sh),
                            batch_sharding=place.batch_sharding(run.strategy, run.mesh, 2), dispatch=run.dispatch)
    run.lr_at = schedule(tc.lr, ocfg)
    run.meta = {"train": tc.resume_key(), "model": cfg.to_dict() if hasattr(cfg, "to_dict") else repr(cfg)}


def _resume(run: _Run) -> None:
    """Continue from the latest checkpoint in --ckpt-dir, if any, refusing changed run settings unless --fork."""
    tc = run.tc
    run.mngr = manager(tc.ckpt_dir, keep=tc.keep, async_save=tc.async_ckpt) if tc.ckpt_dir else None
    if run.mngr is None or run.mngr.latest_step() is None:
        return
    run.state, old_meta = restore_state(run.mngr, run.state)
    diff = resume_diff(old_meta.get("train", {}), run.meta["train"])
    if diff and tc.fork:
        run.log(f"fork: resuming with changed {', '.join(diff)}")
    elif diff:
        raise ValueError(f"{tc.ckpt_dir}: checkpoint was written by a run with different {', '.join(diff)}; "
                         "use a fresh --ckpt-dir")
    run.start = int(run.state["step"])
    run.log(f"resumed from {tc.ckpt_dir} at step {run.start}")
    run.last_good = run.start


def _open_outputs(run: _Run) -> None:
    """MFU terms and the metrics file (--metrics), the progress bar; writes the metrics' start record."""
    tc = run.tc
    if tc.metrics:
        from k3jax.model import abstract_params

        run.flops_tok = flops_per_token(run.cfg, abstract_params(run.cfg, run.settings), tc.seq_len)
        run.peak = tc.peak_flops or matmul_peak_flops(dtype=jnp.dtype(tc.compute_dtype))
    run.mfile = open(tc.metrics, "a", encoding="utf-8") if tc.metrics else None  # noqa: SIM115
    if tc.progress if tc.progress is not None else sys.stderr.isatty():
        from tqdm import tqdm
        run.bar = tqdm(total=tc.steps, initial=run.start, desc="train", unit="step", file=sys.stderr)
    run.write({"event": "start", "step": run.start, "heldout_unigram_entropy": run.held_entropy,
               "devices": run.mesh.devices.size, "mesh": dict(run.mesh.shape), "strategy": run.strategy,
               "param_bytes_per_device": place.bytes_per_device(_full(run.state)),
               "opt_state_bytes_per_device": place.bytes_per_device(run.state["opt"]),
               "flops_per_token": run.flops_tok, "peak_flops": run.peak, "model": run.cfg.name, "qat": tc.qat})


def _to_json(x):
    a = np.asarray(x)
    return a.item() if a.ndim == 0 else a.tolist()


def _step_record(run: _Run, m: dict, step: int, dt: float) -> dict:
    """The metrics record of (1-based) ``step`` from the step's metrics ``m`` and its wall time ``dt``."""
    tc = run.tc
    tps = tc.batch * tc.seq_len / dt
    clipped = np.argwhere(m["qk_clipped"])
    return {"step": step, "loss": float(m["ce"]), "total_loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
            "finite": bool(m["finite"]), "lr": float(run.lr_at(step - 1)), "tokens_per_s": tps,
            "mfu": run.flops_tok * tps / run.peak if run.peak else None,
            "load_max_over_mean": _to_json(m["load_ratio"]), "qb_bias_range": _to_json(m["bias_range"]),
            "mla_max_logit": _to_json(np.max(m["max_logit"], axis=-1)) if m["max_logit"].size else [],
            "qk_clip_events": [[int(i), int(h), float(m["max_logit"][i, h])] for i, h in clipped]}


def _note_step(run: _Run, rec: dict, summary: dict) -> None:
    """Summary bookkeeping and log lines for skipped (non-finite) steps and QK-Clip events."""
    step, n_clipped = rec["step"], len(rec["qk_clip_events"])
    summary["losses"].append(rec["loss"])
    summary["qk_clip_events"] += n_clipped
    if not rec["finite"]:
        summary["skipped_steps"].append(step)
        run.log(f"step {step}: non-finite loss or gradient (loss {rec['total_loss']}, grad norm "
                f"{rec['grad_norm']}); update skipped")
    if n_clipped:
        run.log(f"step {step}: QK-Clip on {n_clipped} head(s) (τ = {run.tc.qk_tau})")


def _stop_diverged(run: _Run, rec: dict, summary: dict, bad: int) -> None:
    """``bad`` (the non-finite streak) reached --max-bad-steps: write the record and raise TrainingStoppedError."""
    step = rec["step"]
    run.write(rec)
    where = (f"last good checkpoint: step {run.last_good} in {run.tc.ckpt_dir}" if run.last_good is not None
             else "no checkpoint was written")
    summary.update(stopped="non-finite", step=step, params=_full(run.state))
    err = TrainingStoppedError(f"stopped at step {step}: {bad} non-finite steps in a row "
                               f"(steps {list(range(step - bad + 1, step + 1))}); {where}")
    err.summary = summary
    raise err


def _full(state: dict):
    """The whole parameter tree of a train state (or of its shardings): the trained leaves and any frozen ones."""
    return place.merge_trees(state["params"], state.get("frozen"))


def _evaluate(run: _Run) -> float:
    """Held-out loss (nats per token) over the run's fixed eval windows, a micro-batch at a time."""
    b = run.tc.batch // run.tc.micro_batches
    return heldout_loss(_full(run.state), run.eval_set, batch=b, score=run.score)[0]


def _finish_step(run: _Run, rec: dict, summary: dict, term: _Sigterm) -> bool:
    """Eval, metrics record, progress, checkpoint and SIGTERM handling after one step; False: stop the loop."""
    tc, step = run.tc, rec["step"]
    bad = int(run.state["bad_streak"])
    if bad >= tc.max_bad_steps:
        _stop_diverged(run, rec, summary, bad)
    if step % tc.eval_every == 0 or step == tc.steps:
        rec["eval_loss"] = _evaluate(run)
        summary["evals"].append((step, rec["eval_loss"]))
    run.write(rec)
    if run.bar is not None:
        run.bar.update(1)
        run.bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
    if run.mngr is not None and bad == 0 and (step % tc.ckpt_every == 0 or step == tc.steps or term.hit):
        save_state(run.mngr, run.state, run.meta, force=term.hit or step == tc.steps)
        run.last_good = step
    if not term.hit:
        return True
    summary["stopped"] = "sigterm"
    run.write({"event": "sigterm", "step": step, "checkpoint": run.last_good})
    run.log(f"SIGTERM: saved step {run.last_good} to {tc.ckpt_dir}; exiting" if run.mngr is not None
            else "SIGTERM: no --ckpt-dir, exiting without a checkpoint")
    return False


def _compile_step(run: _Run, x, poison) -> None:
    """Compile the train step ahead of its first call and say what it costs: one log line and a ``compile``
    metrics record (compile seconds, the compiler's per-device argument / output / temporary bytes, and the placed
    state's bytes on the fullest device)."""
    t0 = time.perf_counter()
    lowered = run.step_fn.lower(run.state, x, poison)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    ma = compiled.memory_analysis()
    mem = {} if ma is None else {"argument_bytes_per_device": int(ma.argument_size_in_bytes),
                                 "output_bytes_per_device": int(ma.output_size_in_bytes),
                                 "temp_bytes_per_device": int(ma.temp_size_in_bytes)}
    rec = {"event": "compile", "lower_s": t1 - t0, "compile_s": t2 - t1, **mem,
           "param_bytes_per_device": place.bytes_per_device(_full(run.state)),
           "opt_state_bytes_per_device": place.bytes_per_device(run.state["opt"])}
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    run.log(f"train step compiled in {t2 - t0:.1f} s (lower {t1 - t0:.1f} s) on mesh "
            f"{place.format_mesh(run.mesh)} ({run.strategy}): per device "
            + (f"{mib(mem['argument_bytes_per_device'])} arguments, {mib(mem['temp_bytes_per_device'])} "
               "temporaries; " if mem else "")
            + f"parameters {mib(rec['param_bytes_per_device'])}, optimizer state "
              f"{mib(rec['opt_state_bytes_per_device'])}")
    run.write(rec)
    run.step_fn = compiled


def _step_loop(run: _Run, summary: dict, term: _Sigterm) -> int:
    """Steps ``run.start + 1 .. tc.steps`` (or until SIGTERM); returns the last step taken."""
    tc = run.tc
    b = tc.batch // tc.micro_batches
    poison = {int(s) for s in tc.poison_steps}
    step = run.start
    while step < tc.steps:
        x = tdata.batch_at(run.train_toks, seed=tc.seed, step=step, batch=tc.batch, seq_len=tc.seq_len,
                           vocab=run.vocab).reshape(tc.micro_batches, b, tc.seq_len + 1)
        x, p = jax.device_put(x, run.batch_sh), jnp.float32(np.nan if step + 1 in poison else 0.0)
        if step == run.start:
            _compile_step(run, x, p)
        t0 = time.perf_counter()
        run.state, m = run.step_fn(run.state, x, p)
        m = jax.device_get(m)
        dt = time.perf_counter() - t0
        step += 1
        rec = _step_record(run, m, step, dt)
        _note_step(run, rec, summary)
        if not _finish_step(run, rec, summary, term):
            break
    return step


def build(tc: TrainConfig, *, log=None) -> _Run:
    """A run's context without taking a step: every check, the corpus, the placed train state (``.state``, its
    shardings ``.state_sh``), the MoE ``.dispatch`` and the jitted ``.step_fn`` (for tests and notebooks that
    inspect shardings and gradients)."""
    run = _prepare(tc, log or (lambda msg: print(msg, file=sys.stderr, flush=True)))
    _build(run)
    return run


def train(tc: TrainConfig, *, log=None) -> dict:
    """Run (or resume) training. Returns a summary dict; writes metrics JSONL / checkpoints / export as configured."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    run = _prepare(tc, log)
    _build(run)
    _resume(run)
    _open_outputs(run)
    summary = {"start_step": run.start, "heldout_unigram_entropy": run.held_entropy, "skipped_steps": [],
               "evals": [], "losses": [], "qk_clip_events": 0, "stopped": None}
    if tc.eval_at_start and run.start == 0:
        summary["evals"].append((0, _evaluate(run)))
        run.write({"event": "eval", "step": 0, "eval_loss": summary["evals"][0][1]})
    try:
        with _Sigterm() as term:
            step = _step_loop(run, summary, term)
    finally:
        if run.mngr is not None:
            run.mngr.wait_until_finished()
            run.mngr.close()
        if run.bar is not None:
            run.bar.close()
        if run.mfile is not None:
            run.mfile.close()

    summary.update(step=step, final_loss=summary["losses"][-1] if summary["losses"] else None,
                   final_eval_loss=summary["evals"][-1][1] if summary["evals"] else None, params=_full(run.state))
    if tc.export and summary["stopped"] is None:
        summary["export"] = export(summary["params"], run.cfg, run.settings, tc.export)
        log(f"exported to {tc.export}: {summary['export']['total_size']:,} payload bytes "
            f"({summary['export']['expert_format']} experts)")
    return summary


def export(params, cfg: K3Config, settings: RunConfig, out_dir: str) -> dict:
    """Official-layout export: packed MXFP4 experts when QAT was on (the fake-quant grid is the export grid)."""
    from k3jax.checkpoint import save
    from k3jax.model.functional import packed_expert_paths

    # packed experts (a frozen-expert run) are written as their own bytes
    fmt = "mxfp4" if settings.qat != "off" or packed_expert_paths(params) else "bf16"
    r = save(jax.device_get(params), cfg.replace(expert_format=fmt), out_dir, overwrite=True)
    r["expert_format"] = fmt
    return r


__all__ = ["TrainConfig", "TrainingStoppedError", "build", "export", "load_checkpoint_params", "resolve_mesh",
           "resolve_model", "restore_state", "save_state", "train", "validate"]
