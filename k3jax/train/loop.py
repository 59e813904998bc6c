"""The QAT fine-tuning / pre-training loop: jitted steps on any mesh the rules table describes, orbax checkpoints
with exact resume, metrics JSONL, NaN/Inf skipping, SIGTERM handling and a final export in the official layout.

    from k3jax.train.loop import train
    from k3jax.train.settings import TrainConfig
    summary = train(TrainConfig(preset="k3-tiny", steps=20, batch=8, seq_len=32, ckpt_dir="ck/", metrics="m.jsonl"))
    summary = train(TrainConfig(preset="k3-mini", mesh="data=2,expert=4", strategy="ep", ...))   # sharded

Placement (``k3jax.sharding.placement``): ``mesh`` (axis sizes) and ``strategy`` (a rules-table column; default
from the mesh's axes) place parameters, optimizer state (Muon momentum and AdamW moments beside their parameter),
the QB bias buffers and every batch; nothing the rules shard is replicated. XLA inserts the FSDP gathers and
gradient reductions from those shardings; the MoE layers run through the expert-parallel shard_map dispatch when
the rules shard the experts. On more than one device Muon's Newton–Schulz is owner-computed (``--muon-layout auto``
→ owner, ``k3jax.train.dist_muon``): each block whole on one device, returned to its parameter's sharding. Without
``mesh``, ``devices`` N keeps meaning a 1-D data mesh.
Checkpoints are saved sharded and restore onto whatever mesh the resuming run builds (orbax reshards), so a run
may resume on a different mesh shape.

Exact resume: the batch of step s is a pure function of (seed, s) (``k3jax.train.data``), and the
checkpoint holds params (QB biases included), optimizer state, step, RNG and the bad-step streak. Re-running the
same command with the same ``ckpt_dir`` continues from the latest committed checkpoint (``k3jax.train.ckpt``) and
ends with parameters bit-identical to an uninterrupted run.

The run's settings, their defaults and every check of them live in ``k3jax.train.settings`` (``InputError`` before
the first compile: `k3 train` exits 2); the records written to ``--metrics`` in ``k3jax.train.records``.
"""

from __future__ import annotations

import functools
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

from k3jax.checkpoint.save import export_trained
from k3jax.config import K3Config, RunConfig
from k3jax.errors import InputError
from k3jax.layers.experts import merge_trees, packed_form, split_packed
from k3jax.layers.lora import split_adapters
from k3jax.sharding import param_shardings
from k3jax.sharding import placement as place
from k3jax.sharding.rules import param_specs
from k3jax.train import data as tdata
from k3jax.train.ckpt import manager, read_meta, restore_state, save_state
from k3jax.train.evaluate import Windows, heldout_loss, make_scorer
from k3jax.train.flops import flops_per_token, matmul_peak_flops
from k3jax.train.optim import OptimConfig, make_optimizer, schedule
from k3jax.train.records import MetricsFile, compile_ahead, compile_summary, step_record
from k3jax.train.settings import (
    TrainConfig,
    check_frozen,
    keeps_packed,
    optim_config,
    resolve_mesh,
    resolve_model,
    resolve_muon_layout,
    resume_diff,
    run_settings,
    step_spec,
    validate,
)
from k3jax.train.step import init_state, make_train_step


class TrainingStoppedError(RuntimeError):
    """Too many non-finite steps in a row; the message names the steps and the last good checkpoint."""


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
    data: tdata.TrainData
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
    mfile: MetricsFile = field(default_factory=lambda: MetricsFile(None))
    bar: Any = None

    def write(self, rec: dict) -> None:
        self.mfile.write(rec)


def _prepare(tc: TrainConfig, log) -> _Run:
    """Every user-facing check, before any compute; loads and splits the corpus."""
    cfg = resolve_model(tc)  # a ConfigError is an InputError
    check_frozen(tc, cfg)
    mesh, strategy = resolve_mesh(tc, cfg)
    tc = resolve_muon_layout(tc, mesh.devices.size)
    n_dev = place.token_parallel(strategy, mesh)  # ways a batch is split (data-parallel width)
    axes = place.token_axes(strategy, mesh)
    validate(tc, n_dev, f"ways the batch is split (mesh axes {', '.join(axes)})" if tc.mesh else
             "data-parallel devices")
    if place.uses_context(strategy, mesh):   # the micro-batch takes the token axes, the sequence the context axis
        from k3jax.sharding.context_parallel import ContextParallel

        ContextParallel(mesh, strategy, batch=tc.batch // tc.micro_batches).check(tc.seq_len, "--seq-len")
    data = tdata.prepare(tc, cfg, n_dev, log)
    return _Run(tc=tc, cfg=cfg, settings=run_settings(tc, cfg), mesh=mesh, strategy=strategy, log=log, data=data,
                train_toks=data.train_toks, eval_set=data.eval_set, vocab=data.vocab, held_entropy=data.held_entropy)


@dataclass(frozen=True)
class _Programs:
    """The placement and jitted programs of one (model, run settings, optimizer, step settings, mesh)."""

    param_sh: Any  # NamedSharding per parameter leaf (packed experts included)
    init_params: Callable  # key -> the random initial parameters, placed
    init_adapters: Callable  # key -> fresh LoRA adapters alone (B = 0), placed: beside a loaded base
    tx: Any  # the optimizer
    init_state: Callable  # (params, frozen, seed) -> the train state, placed
    state_sh: dict
    batch_sh: NamedSharding  # [M, b, T + 1]: b is split
    dispatch: Any  # the MoE's expert-parallel dispatch, or None
    step: Callable  # (state, tokens, poison) -> (state, metrics)
    score: Callable  # the held-out scorer (k3jax.train.evaluate.make_scorer)


@functools.lru_cache(maxsize=8)
def _programs(cfg: K3Config, settings: RunConfig, ocfg: OptimConfig, spec, strategy: str, mesh: Mesh,
              frozen_experts: bool, micro_batch: int) -> _Programs:
    """A run's programs, built once per process for each key: runs that differ only in their seed, data, length,
    initial parameters or outputs — `k3 ablate`'s seeds, a resumed run, a notebook's or a test's repeated runs —
    reuse the jitted init, train step and scorer, and JAX reuses their compiled executables (a k3-tiny train step is
    ~35 s of XLA:CPU compile, its random init ~20 s: experiments/LOG.md 2026-12-03, session 13)."""
    from k3jax.model import abstract_params, init_params

    abstract = abstract_params(cfg, settings)
    if frozen_experts:
        abstract = packed_form(abstract)
    param_sh = param_shardings(cfg, strategy, mesh, abstract)
    trained, frozen = _split(abstract, settings)
    tx, _ = make_optimizer(trained, ocfg, mesh=mesh, specs=param_specs(cfg, strategy, mesh, trained))
    init = lambda p, f, seed: init_state(p, tx, seed, frozen=f or None)  # noqa: E731
    state_sh = place.state_shardings(cfg, strategy, mesh, jax.eval_shape(init, trained, frozen, 0))
    batch_sh = place.batch_sharding(strategy, mesh, 3, batch_dim=1)
    dispatch = place.expert_dispatch(strategy, mesh, batch=micro_batch)   # with a context axis: the sequence split
    return _Programs(
        param_sh=param_sh,
        init_params=jax.jit(lambda k: init_params(cfg, k, settings), out_shardings=param_sh),
        init_adapters=jax.jit(lambda k: _split(init_params(cfg, k, settings), settings)[0],
                              out_shardings=_split(param_sh, settings)[0]),
        tx=tx, init_state=jax.jit(init, out_shardings=state_sh), state_sh=state_sh, batch_sh=batch_sh,
        dispatch=dispatch,
        step=jax.jit(make_train_step(cfg, settings, tx, spec, dispatch=dispatch),
                     in_shardings=(state_sh, batch_sh, None), out_shardings=(state_sh, None), donate_argnums=0),
        score=make_scorer(cfg, settings, params_sharding=_full(state_sh),
                          batch_sharding=place.batch_sharding(strategy, mesh, 2), dispatch=dispatch))


def _init_params(cfg: K3Config, settings: RunConfig, tc: TrainConfig, prog: _Programs, log=None):
    """The initial parameters placed with the programs' parameter shardings."""
    if tc.init_fn is not None:
        return jax.device_put(tc.init_fn(cfg, settings), prog.param_sh)
    if tc.init:
        from k3jax.checkpoint.load import load

        st: dict = {}
        base_sh = _split(prog.param_sh, settings)[1] if settings.lora else prog.param_sh
        _, params = load(tc.init, cfg=cfg, shardings=base_sh, dtype=jnp.float32, progress=tc.progress,
                         strict_config=tc.strict_config, stats=st, keep_experts_packed=keeps_packed(tc, cfg))
        if settings.lora:
            params = merge_trees(params, prog.init_adapters(jax.random.key(tc.seed)))
        if log is not None:
            log(f"loaded {tc.init}: {st['bytes_read'] / 2**20:,.1f} MiB read in {st['seconds']:.1f} s "
                f"({st['bytes_read'] / 2**20 / max(st['seconds'], 1e-9):,.0f} MiB/s), "
                f"{place.bytes_per_device(params) / 2**20:,.1f} MiB of parameters per device")
        return params
    return prog.init_params(jax.random.key(tc.seed))


def _build(run: _Run) -> None:
    """Parameters and optimizer state placed by the rules, the train state, the jitted train step and the
    held-out scorer (``_programs``: built once per process for each model, settings and mesh)."""
    tc, cfg = run.tc, run.cfg
    ocfg = optim_config(tc)
    packed = keeps_packed(tc, cfg)
    prog = _programs(cfg, run.settings, ocfg, step_spec(tc), run.strategy, run.mesh, packed,
                     tc.batch // tc.micro_batches)
    params = _init_params(cfg, run.settings, tc, prog, run.log)
    params, frozen = _split(params, run.settings)
    if split_packed(frozen)[1] and not packed:
        raise InputError("the initial parameters hold packed routed experts (w*_packed / w*_scale): they can only "
                         "be trained frozen (frozen_experts=True, `k3 train --frozen-experts`)")
    run.state_sh, run.batch_sh, run.dispatch = prog.state_sh, prog.batch_sh, prog.dispatch
    run.state = prog.init_state(params, frozen, tc.seed)
    del params, frozen
    run.step_fn, run.score = prog.step, prog.score
    run.lr_at = schedule(tc.lr, ocfg)
    run.meta = {"train": tc.resume_key(), "model": cfg.to_dict() if hasattr(cfg, "to_dict") else repr(cfg)}


def _resume(run: _Run) -> None:
    """Continue from the latest checkpoint in --ckpt-dir, if any, refusing changed run settings unless --fork."""
    tc = run.tc
    run.mngr = manager(tc.ckpt_dir, keep=tc.keep, async_save=tc.async_ckpt) if tc.ckpt_dir else None
    if run.mngr is None or run.mngr.latest_step() is None:
        return
    old_meta = read_meta(run.mngr)
    diff = resume_diff(old_meta.get("train", {}), run.meta["train"])
    if "muon_layout" in diff:  # the optimizer state's structure differs: nothing to restore into, even with --fork
        saved = old_meta["train"].get("muon_layout", "layer")
        raise InputError(f"{tc.ckpt_dir}: checkpoint's optimizer state has the {saved!r} Muon layout, this run's is "
                         f"{run.meta['train']['muon_layout']!r}; resume with --muon-layout {saved}")
    if diff and not tc.fork:  # refused from the saved settings alone: no array is read
        raise InputError(f"{tc.ckpt_dir}: checkpoint was written by a run with different {', '.join(diff)}; "
                         "use a fresh --ckpt-dir")
    run.state, _ = restore_state(run.mngr, run.state)
    if diff:
        run.log(f"fork: resuming with changed {', '.join(diff)}")
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
    run.mfile = MetricsFile(tc.metrics)
    if tc.progress if tc.progress is not None else sys.stderr.isatty():
        from tqdm import tqdm
        run.bar = tqdm(total=tc.steps, initial=run.start, desc="train", unit="step", file=sys.stderr)
    run.write({"event": "start", "step": run.start, "heldout_unigram_entropy": run.held_entropy,
               "devices": run.mesh.devices.size, "mesh": dict(run.mesh.shape), "strategy": run.strategy,
               "param_bytes_per_device": place.bytes_per_device(_full(run.state)),
               "opt_state_bytes_per_device": place.bytes_per_device(run.state["opt"]),
               "flops_per_token": run.flops_tok, "peak_flops": run.peak, "model": run.cfg.name, "qat": tc.qat})


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


def _split(tree, settings: RunConfig) -> tuple[dict, dict]:
    """(trained leaves, frozen leaves) of a params tree (or of its shardings): with LoRA the adapters alone train
    and the whole base is frozen; otherwise only packed routed experts are frozen (``--frozen-experts``)."""
    if settings.lora is not None:
        return split_adapters(tree)
    return split_packed(tree)


def _full(state: dict):
    """The whole parameter tree of a train state (or of its shardings): the trained leaves and any frozen ones."""
    return merge_trees(state["params"], state.get("frozen"))


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
    run.step_fn, rec = compile_ahead(run.step_fn, run.state, x, poison)
    rec.update(param_bytes_per_device=place.bytes_per_device(_full(run.state)),
               opt_state_bytes_per_device=place.bytes_per_device(run.state["opt"]))
    run.log(compile_summary(rec, place.format_mesh(run.mesh), run.strategy))
    run.write(rec)


def _step_loop(run: _Run, summary: dict, term: _Sigterm) -> int:
    """Steps ``run.start + 1 .. tc.steps`` (or until SIGTERM); returns the last step taken."""
    tc = run.tc
    b = tc.batch // tc.micro_batches
    poison = {int(s) for s in tc.poison_steps}
    step = run.start
    while step < tc.steps:
        x = jax.tree.map(lambda a: a.reshape(tc.micro_batches, b, *a.shape[1:]),
                         run.data.batch(seed=tc.seed, step=step, batch=tc.batch, seq_len=tc.seq_len))
        x, p = jax.device_put(x, run.batch_sh), jnp.float32(np.nan if step + 1 in poison else 0.0)
        if step == run.start:
            _compile_step(run, x, p)
        t0 = time.perf_counter()
        run.state, m = run.step_fn(run.state, x, p)
        m = jax.device_get(m)
        dt = time.perf_counter() - t0
        step += 1
        rec = step_record(m, step, dt, tokens=tc.batch * tc.seq_len, lr=run.lr_at(step - 1),
                          flops_per_token=run.flops_tok, peak_flops=run.peak)
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
        run.mfile.close()

    summary.update(step=step, final_loss=summary["losses"][-1] if summary["losses"] else None,
                   final_eval_loss=summary["evals"][-1][1] if summary["evals"] else None, params=_full(run.state))
    if tc.export and summary["stopped"] is None and run.settings.lora is not None:
        from k3jax.checkpoint.peft import save_adapter

        summary["export"] = save_adapter(summary["params"], run.cfg, run.settings, tc.export, base=tc.init)
        log(f"adapters written to {tc.export} (PEFT layout)")
    elif tc.export and summary["stopped"] is None:
        summary["export"] = export_trained(summary["params"], run.cfg, run.settings.qat, tc.export)
        log(f"exported to {tc.export}: {summary['export']['total_size']:,} payload bytes "
            f"({summary['export']['expert_format']} experts)")
    return summary


__all__ = ["TrainingStoppedError", "build", "train"]
