"""The QAT fine-tuning / pre-training loop: data-parallel jitted steps, orbax checkpoints with exact resume,
metrics JSONL, NaN/Inf skipping, SIGTERM handling and a final export in the official checkpoint layout.

    from k3jax.train.loop import TrainConfig, train
    summary = train(TrainConfig(preset="k3-tiny", steps=20, batch=8, seq_len=32, ckpt_dir="ck/", metrics="m.jsonl"))

Exact resume: the batch of step s is a pure function of (seed, s) (``k3jax.train.data.batch_at``), and the
checkpoint holds params (QB biases included), optimizer state, step, RNG and the bad-step streak. Re-running the
same command with the same ``ckpt_dir`` continues from the latest committed checkpoint and ends with parameters
bit-identical to an uninterrupted run. Orbax commits atomically (tmp dir + rename), so a run killed during an async
save resumes from the previous step that was saved.

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
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.config import ConfigError, K3Config, get_preset
from k3jax.train import data as tdata
from k3jax.train.optim import OptimConfig, make_optimizer, schedule
from k3jax.train.step import StepSpec, init_state, make_eval_step, make_train_step

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
    model_overrides: dict = field(default_factory=dict)
    strict_config: bool = False  # unknown keys in the --init checkpoint's config.json are errors
    fork: bool = False  # resume from ckpt_dir even if the run settings differ (e.g. switch QAT on mid-run)
    poison_steps: tuple[int, ...] = ()  # testing hook: (1-based) steps whose loss and gradient are made NaN

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
    return cfg.replace(qat=tc.qat, compute_dtype=tc.compute_dtype, param_dtype="float32", **tc.model_overrides)


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
    if tc.qat not in ("off", "weights", "weights+acts"):
        raise ValueError(f"--qat {tc.qat!r}: must be off, weights or weights+acts")
    if tc.compute_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--compute-dtype {tc.compute_dtype!r}: must be float32 or bfloat16")
    if not 0.0 < tc.heldout_frac < 1.0:
        raise ValueError(f"--heldout-frac must be in (0, 1), got {tc.heldout_frac}")
    if tc.max_bad_steps < 1 or tc.ckpt_every < 1 or tc.eval_every < 1 or tc.keep < 1:
        raise ValueError("--max-bad-steps, --ckpt-every, --eval-every and --keep must be >= 1")
    StepSpec(balance=tc.balance, qb_ema=tc.qb_ema, qk_tau=tc.qk_tau)  # validates the balance mode, ρ and τ
    OptimConfig(lr=tc.lr, total_steps=tc.total_steps or tc.steps, mode=tc.optimizer)


def make_data_mesh(n: int | None) -> Mesh:
    devs = jax.devices()
    n = len(devs) if n is None else n
    if not 1 <= n <= len(devs):
        raise ValueError(f"--devices {n}: {len(devs)} device(s) available")
    return Mesh(np.array(devs[:n]), ("data",))


# ---------------------------------------------------------------------------------------------------- checkpoints


def _manager(directory: str, tc: TrainConfig):
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=tc.keep, enable_async_checkpointing=tc.async_ckpt,
                                        create=True)
    return ocp.CheckpointManager(os.path.abspath(directory), options=opts)


def _flat(state: dict) -> dict:
    """Orbax-friendly view: the optimizer state (NamedTuples with empty MaskedNodes) is saved as its leaf list."""
    return dict(state, opt=jax.tree.leaves(state["opt"]))


def save_state(mngr, state: dict, meta: dict, *, force: bool = False) -> None:
    import orbax.checkpoint as ocp

    step = int(state["step"])
    # The train step donates its state; give the (async) writer its own buffers so the next step cannot overwrite
    # arrays that are still being serialized (on CPU a host view of a device buffer may be zero-copy).
    state = jax.tree.map(jnp.copy, state)
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_flat(state)),
                                            meta=ocp.args.JsonSave(meta)), force=force)


def restore_state(mngr, like: dict, step: int | None = None) -> tuple[dict, dict]:
    """(state, meta) restored into the shapes, dtypes and shardings of ``like`` (a freshly initialised state)."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step() if step is None else step
    flat = _flat(like)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), flat)
    r = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                   meta=ocp.args.JsonRestore()))
    st = dict(r["state"])
    st["opt"] = jax.tree.unflatten(jax.tree.structure(like["opt"]), st["opt"])
    return st, r["meta"]


def load_checkpoint_params(ckpt_dir: str, step: int | None = None) -> tuple[int, dict]:
    """(step, params as numpy) of a training checkpoint, on any device count (for comparisons, export, tests)."""
    import orbax.checkpoint as ocp

    mngr = ocp.CheckpointManager(os.path.abspath(ckpt_dir))
    step = mngr.latest_step() if step is None else step
    mngr.close()
    if step is None:
        raise ValueError(f"{ckpt_dir}: no committed checkpoint")
    path = os.path.join(os.path.abspath(ckpt_dir), str(step), "state")
    ck = ocp.PyTreeCheckpointer()
    meta = ck.metadata(path)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    r = ck.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    return step, r["params"]


# -------------------------------------------------------------------------------------------------------- the loop


class _Sigterm:
    def __init__(self):
        self.hit = False
        self.prev = None

    def __enter__(self):
        try:
            self.prev = signal.signal(signal.SIGTERM, self._handler)
        except ValueError:  # not the main thread: no handler (the run is then only stopped by its caller)
            self.prev = None
        return self

    def _handler(self, signum, frame):
        self.hit = True

    def __exit__(self, *exc):
        if self.prev is not None:
            signal.signal(signal.SIGTERM, self.prev)


def _init_params(cfg: K3Config, tc: TrainConfig, repl: NamedSharding):
    from k3jax.model import init_params

    if tc.init:
        from k3jax.checkpoint.load import load

        _, params = load(tc.init, cfg=cfg, shardings=lambda *a: repl, dtype=jnp.float32, progress=False,
                         strict_config=tc.strict_config)
        return params
    return jax.jit(lambda k: init_params(cfg, k), out_shardings=repl)(jax.random.key(tc.seed))


def _to_json(x):
    a = np.asarray(x)
    return a.item() if a.ndim == 0 else a.tolist()


def train(tc: TrainConfig, *, log=None) -> dict:
    """Run (or resume) training. Returns a summary dict; writes metrics JSONL / checkpoints / export as configured."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    # 1. every user-facing check, before any compute
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
    held_entropy = tdata.unigram_entropy(held, vocab)

    # 2. model, optimizer, state
    repl = NamedSharding(mesh, P())
    batch_sh = NamedSharding(mesh, P(None, "data"))
    total = tc.total_steps or tc.steps
    ocfg = OptimConfig(lr=tc.lr, total_steps=total, mode=tc.optimizer)
    params = _init_params(cfg, tc, repl)
    tx, _ = make_optimizer(params, ocfg)
    state = jax.jit(lambda p: init_state(p, tx, tc.seed), out_shardings=repl)(params)
    del params
    spec = StepSpec(balance=tc.balance, sign_gamma=tc.sign_gamma, qb_ema=tc.qb_ema, aux_alpha=tc.aux_alpha,
                    qk_clip=tc.qk_clip, qk_tau=tc.qk_tau)
    state_sh = jax.tree.map(lambda _: repl, state)
    step_fn = jax.jit(make_train_step(cfg, tx, spec), in_shardings=(state_sh, batch_sh, None),
                      out_shardings=(state_sh, None), donate_argnums=0)
    ev_sh = NamedSharding(mesh, P("data"))
    eval_fn = jax.jit(make_eval_step(cfg), in_shardings=(state_sh["params"], ev_sh))
    lr_at = schedule(tc.lr, ocfg)

    mngr = _manager(tc.ckpt_dir, tc) if tc.ckpt_dir else None
    meta = {"train": tc.resume_key(), "model": cfg.to_dict() if hasattr(cfg, "to_dict") else repr(cfg)}
    start = 0
    if mngr is not None and mngr.latest_step() is not None:
        state, old_meta = restore_state(mngr, state)
        diff = resume_diff(old_meta.get("train", {}), meta["train"])
        if diff and tc.fork:
            log(f"fork: resuming with changed {', '.join(diff)}")
        elif diff:
            raise ValueError(f"{tc.ckpt_dir}: checkpoint was written by a run with different {', '.join(diff)}; "
                             "use a fresh --ckpt-dir")
        start = int(state["step"])
        log(f"resumed from {tc.ckpt_dir} at step {start}")
    last_good = start if mngr is not None and mngr.latest_step() is not None else None

    flops_tok = peak = None
    if tc.metrics:
        from k3jax.bench.common import matmul_peak_flops
        from k3jax.train.flops import flops_per_token

        flops_tok = flops_per_token(cfg, state["params"], tc.seq_len)
        peak = tc.peak_flops or matmul_peak_flops(dtype=jnp.dtype(tc.compute_dtype))
    mfile = open(tc.metrics, "a", encoding="utf-8") if tc.metrics else None  # noqa: SIM115
    b = tc.batch // tc.micro_batches
    ev_windows = tdata.eval_windows(held, num=max(n_dev, tc.eval_windows // n_dev * n_dev), seq_len=tc.seq_len,
                                    vocab=vocab)

    def evaluate(params) -> float:
        tot = cnt = 0.0
        for i in range(0, len(ev_windows), b):
            chunk = ev_windows[i:i + b]
            if len(chunk) % n_dev:
                chunk = chunk[: len(chunk) // n_dev * n_dev]
            if not len(chunk):
                continue
            s, c = eval_fn(params, jax.device_put(chunk, ev_sh))
            tot, cnt = tot + float(s), cnt + float(c)
        return tot / cnt

    def write(rec):
        if mfile is not None:
            mfile.write(json.dumps(rec) + "\n")
            mfile.flush()

    bar = None
    if tc.progress if tc.progress is not None else sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step", file=sys.stderr)
    write({"event": "start", "step": start, "heldout_unigram_entropy": held_entropy, "devices": n_dev,
           "flops_per_token": flops_tok, "peak_flops": peak, "model": cfg.name, "qat": tc.qat})
    summary = {"start_step": start, "heldout_unigram_entropy": held_entropy, "skipped_steps": [], "evals": [],
               "losses": [], "qk_clip_events": 0, "stopped": None}
    step = start
    poison = {int(s) for s in tc.poison_steps}
    try:
        with _Sigterm() as term:
            while step < tc.steps:
                x = tdata.batch_at(train_toks, seed=tc.seed, step=step, batch=tc.batch, seq_len=tc.seq_len,
                                   vocab=vocab).reshape(tc.micro_batches, b, tc.seq_len + 1)
                t0 = time.perf_counter()
                state, m = step_fn(state, jax.device_put(x, batch_sh),
                                   jnp.float32(np.nan if step + 1 in poison else 0.0))
                m = jax.device_get(m)
                dt = time.perf_counter() - t0
                step += 1
                tps = tc.batch * tc.seq_len / dt
                clipped = np.argwhere(m["qk_clipped"])
                rec = {"step": step, "loss": float(m["ce"]), "total_loss": float(m["loss"]),
                       "grad_norm": float(m["grad_norm"]), "finite": bool(m["finite"]), "lr": float(lr_at(step - 1)),
                       "tokens_per_s": tps, "mfu": flops_tok * tps / peak if peak else None,
                       "load_max_over_mean": _to_json(m["load_ratio"]), "qb_bias_range": _to_json(m["bias_range"]),
                       "mla_max_logit": _to_json(np.max(m["max_logit"], axis=-1)) if m["max_logit"].size else [],
                       "qk_clip_events": [[int(i), int(h), float(m["max_logit"][i, h])] for i, h in clipped]}
                summary["losses"].append(rec["loss"])
                summary["qk_clip_events"] += len(clipped)
                if not rec["finite"]:
                    summary["skipped_steps"].append(step)
                    log(f"step {step}: non-finite loss or gradient (loss {rec['total_loss']}, grad norm "
                        f"{rec['grad_norm']}); update skipped")
                if len(clipped):
                    log(f"step {step}: QK-Clip on {len(clipped)} head(s) (τ = {tc.qk_tau})")
                bad = int(state["bad_streak"])
                if bad >= tc.max_bad_steps:
                    write(rec)
                    where = (f"last good checkpoint: step {last_good} in {tc.ckpt_dir}" if last_good is not None
                             else "no checkpoint was written")
                    summary.update(stopped="non-finite", step=step, params=state["params"])
                    err = TrainingStoppedError(f"stopped at step {step}: {bad} non-finite steps in a row "
                                               f"(steps {list(range(step - bad + 1, step + 1))}); {where}")
                    err.summary = summary
                    raise err
                if step % tc.eval_every == 0 or step == tc.steps:
                    rec["eval_loss"] = evaluate(state["params"])
                    summary["evals"].append((step, rec["eval_loss"]))
                write(rec)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
                if mngr is not None and bad == 0 and (step % tc.ckpt_every == 0 or step == tc.steps or term.hit):
                    save_state(mngr, state, meta, force=term.hit or step == tc.steps)
                    last_good = step
                if term.hit:
                    summary["stopped"] = "sigterm"
                    write({"event": "sigterm", "step": step, "checkpoint": last_good})
                    log(f"SIGTERM: saved step {last_good} to {tc.ckpt_dir}; exiting" if mngr is not None
                        else "SIGTERM: no --ckpt-dir, exiting without a checkpoint")
                    break
    finally:
        if mngr is not None:
            mngr.wait_until_finished()
            mngr.close()
        if bar is not None:
            bar.close()
        if mfile is not None:
            mfile.close()

    summary.update(step=step, final_loss=summary["losses"][-1] if summary["losses"] else None,
                   final_eval_loss=summary["evals"][-1][1] if summary["evals"] else None)
    summary["params"] = state["params"]
    if tc.export and summary["stopped"] is None:
        summary["export"] = export(state["params"], cfg, tc.export)
        log(f"exported to {tc.export}: {summary['export']['total_size']:,} payload bytes "
            f"({summary['export']['expert_format']} experts)")
    return summary


def export(params, cfg: K3Config, out_dir: str) -> dict:
    """Official-layout export: packed MXFP4 experts when QAT was on (the fake-quant grid is the export grid)."""
    from k3jax.checkpoint import save

    fmt = "mxfp4" if cfg.qat != "off" else "bf16"
    r = save(jax.device_get(params), cfg.replace(qat="off", compute_dtype="float32", expert_format=fmt), out_dir,
             overwrite=True)
    r["expert_format"] = fmt
    return r


__all__ = ["TrainConfig", "TrainingStoppedError", "export", "load_checkpoint_params", "resolve_model", "restore_state",
           "save_state", "train", "validate"]
