"""The QAT fine-tuning / pre-training loop: data-parallel jitted steps, orbax checkpoints with exact resume,
metrics JSONL, NaN/Inf skipping, SIGTERM handling and a final export in the official checkpoint layout.

    from k3jax.train.loop import TrainConfig, train
    summary = train(TrainConfig(preset="k3-tiny", steps=20, batch=8, seq_len=32, ckpt_dir="ck/", metrics="m.jsonl"))

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
from jax.sharding import PartitionSpec as P

from k3jax.config import QAT_MODES, ConfigError, K3Config, RunConfig, default_run, get_preset
from k3jax.sharding import make_mesh
from k3jax.train import data as tdata
from k3jax.train.ckpt import load_checkpoint_params, manager, restore_state, save_state
from k3jax.train.evaluate import Windows, heldout_loss, make_scorer, spaced_windows
from k3jax.train.flops import flops_per_token, matmul_peak_flops
from k3jax.train.optim import OptimConfig, make_optimizer, schedule
from k3jax.train.step import StepSpec, init_state, make_train_step

# Fields that change which batches / updates a run produces: a resume with different values is refused.
_RESUME_KEYS = ("preset", "init", "seed", "batch", "micro_batches", "seq_len", "lr", "optimizer", "qat",
                "compute_dtype", "balance", "sign_gamma", "qb_ema", "aux_alpha", "qk_clip", "qk_tau", "data",
                "max_bytes", "heldout_frac", "total_steps")


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
    devices: int | None = None  # data-parallel width (default: all devices)
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


def validate(tc: TrainConfig, n_dev: int) -> None:
    if tc.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {tc.steps}")
    if tc.batch < 1 or tc.micro_batches < 1 or tc.seq_len < 1:
        raise ValueError("--batch, --micro-batches and --seq-len must be >= 1")
    if tc.batch % tc.micro_batches:
        raise ValueError(f"--batch {tc.batch} is not divisible by --micro-batches {tc.micro_batches}")
    b = tc.batch // tc.micro_batches
    if b % n_dev:
        raise ValueError(f"micro-batch size {b} (= batch {tc.batch} / {tc.micro_batches} micro-batches) is not "
                         f"divisible by the {n_dev} data-parallel devices")
    if tc.qat not in QAT_MODES:
        raise ValueError(f"--qat {tc.qat!r}: must be one of {', '.join(QAT_MODES)}")
    if tc.compute_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--compute-dtype {tc.compute_dtype!r}: must be float32 or bfloat16")
    if tc.layer_stack not in ("loop", "scan"):
        raise ValueError(f"--layer-stack {tc.layer_stack!r}: must be loop or scan")
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
    log: Callable[[str], None]
    train_toks: np.ndarray
    eval_set: Windows
    vocab: int
    held_entropy: float
    state: dict | None = None
    step_fn: Callable | None = None
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
    mesh = make_data_mesh(tc.devices)
    n_dev = mesh.devices.size
    validate(tc, n_dev)
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
                           layer_stack=tc.layer_stack)
    return _Run(tc=tc, cfg=cfg, settings=settings, mesh=mesh, log=log, train_toks=train_toks, eval_set=eval_set,
                vocab=vocab, held_entropy=tdata.unigram_entropy(held, vocab))


def _init_params(cfg: K3Config, settings: RunConfig, tc: TrainConfig, repl: NamedSharding):
    from k3jax.model import init_params

    if tc.init_fn is not None:
        return jax.device_put(tc.init_fn(cfg, settings), repl)
    if tc.init:
        from k3jax.checkpoint.load import load

        _, params = load(tc.init, cfg=cfg, shardings=lambda *a: repl, dtype=jnp.float32, progress=False,
                         strict_config=tc.strict_config)
        return params
    return jax.jit(lambda k: init_params(cfg, k, settings), out_shardings=repl)(jax.random.key(tc.seed))


def _build(run: _Run) -> None:
    """Parameters (replicated), optimizer, train state, the jitted train step and the held-out scorer."""
    tc, cfg = run.tc, run.cfg
    repl = NamedSharding(run.mesh, P())
    run.batch_sh = NamedSharding(run.mesh, P(None, "data"))  # [M, b, T + 1]: the b sequences are data-parallel
    ocfg = OptimConfig(lr=tc.lr, total_steps=tc.total_steps or tc.steps, mode=tc.optimizer)
    params = _init_params(cfg, run.settings, tc, repl)
    tx, _ = make_optimizer(params, ocfg)
    run.state = jax.jit(lambda p: init_state(p, tx, tc.seed), out_shardings=repl)(params)
    del params
    spec = StepSpec(balance=tc.balance, sign_gamma=tc.sign_gamma, qb_ema=tc.qb_ema, aux_alpha=tc.aux_alpha,
                    qk_clip=tc.qk_clip, qk_tau=tc.qk_tau)
    state_sh = jax.tree.map(lambda _: repl, run.state)
    run.step_fn = jax.jit(make_train_step(cfg, run.settings, tx, spec), in_shardings=(state_sh, run.batch_sh, None),
                          out_shardings=(state_sh, None), donate_argnums=0)
    run.score = make_scorer(cfg, run.settings, params_sharding=state_sh["params"],
                            batch_sharding=NamedSharding(run.mesh, P("data")))
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
        run.flops_tok = flops_per_token(run.cfg, run.state["params"], tc.seq_len)
        run.peak = tc.peak_flops or matmul_peak_flops(dtype=jnp.dtype(tc.compute_dtype))
    run.mfile = open(tc.metrics, "a", encoding="utf-8") if tc.metrics else None  # noqa: SIM115
    if tc.progress if tc.progress is not None else sys.stderr.isatty():
        from tqdm import tqdm
        run.bar = tqdm(total=tc.steps, initial=run.start, desc="train", unit="step", file=sys.stderr)
    run.write({"event": "start", "step": run.start, "heldout_unigram_entropy": run.held_entropy,
               "devices": run.mesh.devices.size, "flops_per_token": run.flops_tok, "peak_flops": run.peak,
               "model": run.cfg.name, "qat": tc.qat})


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
    summary.update(stopped="non-finite", step=step, params=run.state["params"])
    err = TrainingStoppedError(f"stopped at step {step}: {bad} non-finite steps in a row "
                               f"(steps {list(range(step - bad + 1, step + 1))}); {where}")
    err.summary = summary
    raise err


def _evaluate(run: _Run) -> float:
    """Held-out loss (nats per token) over the run's fixed eval windows, a micro-batch at a time."""
    b = run.tc.batch // run.tc.micro_batches
    return heldout_loss(run.state["params"], run.eval_set, batch=b, score=run.score)[0]


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


def _step_loop(run: _Run, summary: dict, term: _Sigterm) -> int:
    """Steps ``run.start + 1 .. tc.steps`` (or until SIGTERM); returns the last step taken."""
    tc = run.tc
    b = tc.batch // tc.micro_batches
    poison = {int(s) for s in tc.poison_steps}
    step = run.start
    while step < tc.steps:
        x = tdata.batch_at(run.train_toks, seed=tc.seed, step=step, batch=tc.batch, seq_len=tc.seq_len,
                           vocab=run.vocab).reshape(tc.micro_batches, b, tc.seq_len + 1)
        t0 = time.perf_counter()
        run.state, m = run.step_fn(run.state, jax.device_put(x, run.batch_sh),
                                   jnp.float32(np.nan if step + 1 in poison else 0.0))
        m = jax.device_get(m)
        dt = time.perf_counter() - t0
        step += 1
        rec = _step_record(run, m, step, dt)
        _note_step(run, rec, summary)
        if not _finish_step(run, rec, summary, term):
            break
    return step


def train(tc: TrainConfig, *, log=None) -> dict:
    """Run (or resume) training. Returns a summary dict; writes metrics JSONL / checkpoints / export as configured."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    run = _prepare(tc, log)
    _build(run)
    _resume(run)
    _open_outputs(run)
    summary = {"start_step": run.start, "heldout_unigram_entropy": run.held_entropy, "skipped_steps": [],
               "evals": [], "losses": [], "qk_clip_events": 0, "stopped": None}
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
                   final_eval_loss=summary["evals"][-1][1] if summary["evals"] else None, params=run.state["params"])
    if tc.export and summary["stopped"] is None:
        summary["export"] = export(run.state["params"], run.cfg, run.settings, tc.export)
        log(f"exported to {tc.export}: {summary['export']['total_size']:,} payload bytes "
            f"({summary['export']['expert_format']} experts)")
    return summary


def export(params, cfg: K3Config, settings: RunConfig, out_dir: str) -> dict:
    """Official-layout export: packed MXFP4 experts when QAT was on (the fake-quant grid is the export grid)."""
    from k3jax.checkpoint import save

    fmt = "mxfp4" if settings.qat != "off" else "bf16"
    r = save(jax.device_get(params), cfg.replace(expert_format=fmt), out_dir, overwrite=True)
    r["expert_format"] = fmt
    return r


__all__ = ["TrainConfig", "TrainingStoppedError", "export", "load_checkpoint_params", "resolve_model", "restore_state",
           "save_state", "train", "validate"]
