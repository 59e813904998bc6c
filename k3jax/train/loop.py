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
→ owner, ``k3jax.optim.dist_muon``): each block whole on one device, returned to its parameter's sharding. Without
``mesh``, ``devices`` N keeps meaning a 1-D data mesh.
Checkpoints are saved sharded and restore onto whatever mesh the resuming run builds (orbax reshards), so a run
may resume on a different mesh shape.

Exact resume: the batch of step s is a pure function of (seed, s) (``k3jax.train.data``), and the
checkpoint holds params (QB biases included), optimizer state, step, RNG and the bad-step streak. Re-running the
same command with the same ``ckpt_dir`` continues from the latest committed checkpoint (``k3jax.train.ckpt``) and
ends with parameters bit-identical to an uninterrupted run; re-running a finished one takes no step (its summary's
``complete`` is True). A checkpoint written with different settings (``settings.resume_diff``: a changed ``steps``
too, which sets the LR schedule's length) is refused before any compute unless ``fork``.

SIGTERM — and SIGINT with ``train(..., sigint=True)``, as `k3 train` calls it — finishes the current step, saves a
checkpoint and returns (``stopped``: "sigterm" / "sigint"); a second SIGINT raises KeyboardInterrupt at once.
``export`` is checked before any compute (an existing non-empty directory only with ``overwrite``) and written
through a temporary sibling renamed into place (``k3jax.checkpoint.atomic``).

The run's settings, their defaults and every check of them live in ``k3jax.train.settings`` (``InputError`` before
the first compile: `k3 train` exits 2); the records written to ``--metrics`` in ``k3jax.train.records``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from tqdm import tqdm

from k3jax import distributed as dist
from k3jax.checkpoint.atomic import check_out_dir
from k3jax.checkpoint.peft import save_adapter
from k3jax.checkpoint.save import export_trained
from k3jax.config import K3Config, RunConfig
from k3jax.errors import InputError
from k3jax.layers.experts import split_packed
from k3jax.model import abstract_params
from k3jax.optim.optimizer import schedule
from k3jax.sharding import placement as place
from k3jax.sharding.context_parallel import ContextParallel
from k3jax.train import data as tdata
from k3jax.train.ckpt import manager, read_meta, restore_state, run_record, save_state, trained_settings
from k3jax.train.control import Stop
from k3jax.train.evaluate import Windows, heldout_loss
from k3jax.train.flops import flops_per_token, matmul_peak_flops
from k3jax.train.program import full_params, initial_params, programs, trained_and_frozen
from k3jax.train.records import MetricsFile, compile_ahead, compile_summary, progress_line, step_record
from k3jax.train.settings import (
    TrainConfig,
    check_frozen,
    flag_of,
    keeps_packed,
    optim_config,
    resolve_mesh,
    resolve_model,
    resolve_muon_layout,
    resume_diff,
    resume_refusal,
    run_settings,
    step_spec,
    validate,
)

# Settings every process of a job must share besides the resume keys: where it writes and what it is asked to do.
_SAME_IN_EVERY_PROCESS = ("mesh", "devices", "strategy", "data", "ckpt_dir", "ckpt_every", "export", "eval_every",
                          "keep", "max_bad_steps")


class TrainingStoppedError(RuntimeError):
    """Too many non-finite steps in a row; the message names the steps and the last good checkpoint."""


# -------------------------------------------------------------------------------------------------------- the loop


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
    saved: int | None = None  # the step of the checkpoint in --ckpt-dir this run resumes from
    forked: list = field(default_factory=list)  # the settings --fork lets differ from that checkpoint's
    start: int = 0
    last_good: int | None = None
    flops_tok: float | None = None
    peak: float | None = None
    mfile: MetricsFile = field(default_factory=lambda: MetricsFile(None))
    bar: Any = None
    step_times: list = field(default_factory=list)  # seconds of each step taken in this process (--log-every)

    def write(self, rec: dict) -> None:
        self.mfile.write(rec)


def _prepare(tc: TrainConfig, log) -> _Run:
    """Every user-facing check, before any compute (every process of a job started with the same settings and
    data); loads and splits the corpus."""
    dist.agree(tc.resume_key() | {k: getattr(tc, k) for k in _SAME_IN_EVERY_PROCESS}, flag=flag_of)
    if tc.export:  # refused before anything runs, not after training (the write itself: export_trained)
        check_out_dir(tc.export, overwrite=tc.overwrite, flag="--export", hint="pass --overwrite")
    cfg = resolve_model(tc)  # a ConfigError is an InputError
    check_frozen(tc, cfg)
    mesh, strategy = resolve_mesh(tc, cfg)
    tc = resolve_muon_layout(tc, mesh.devices.size)
    n_dev = place.token_parallel(strategy, mesh)  # ways a batch is split (data-parallel width)
    axes = place.token_axes(strategy, mesh)
    validate(tc, n_dev, f"ways the batch is split (mesh axes {', '.join(axes)})" if tc.mesh else
             "data-parallel devices")
    if place.uses_context(strategy, mesh):   # the micro-batch takes the token axes, the sequence the context axis
        ContextParallel(mesh, strategy, batch=tc.batch // tc.micro_batches).check(tc.seq_len, "--seq-len")
    data = tdata.prepare(tc, cfg, n_dev, log)
    dist.agree({"data": _data_identity(data)}, what="data", flag=lambda _: "--data (its contents)")
    settings = run_settings(tc, cfg, mesh=mesh, rows=place.kernel_rows(strategy, mesh, tc.batch // tc.micro_batches))
    return _Run(tc=tc, cfg=cfg, settings=settings, mesh=mesh, strategy=strategy, log=log, data=data,
                train_toks=data.train_toks, eval_set=data.eval_set, vocab=data.vocab, held_entropy=data.held_entropy,
                meta={"train": tc.resume_key(), "run": run_record(settings),
                      "model": cfg.to_dict() if hasattr(cfg, "to_dict") else repr(cfg)})


def _data_identity(data) -> str:
    """What tells two processes' data apart: the shards' manifest, or a digest of the in-memory corpus."""
    if hasattr(data, "state"):
        return json.dumps(data.state()["manifest"], sort_keys=True, default=str)
    h = hashlib.sha256()
    for a in (data.train.tokens, data.train.doc, data.eval_set.tokens):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _build(run: _Run) -> None:
    """Parameters and optimizer state placed by the rules, the train state, the jitted train step and the
    held-out scorer (``program.programs``: built once per process for each model, settings and mesh)."""
    tc, cfg = run.tc, run.cfg
    ocfg = optim_config(tc)
    packed = keeps_packed(tc, cfg)
    prog = programs(cfg, run.settings, ocfg, step_spec(tc), run.strategy, run.mesh, packed,
                     tc.batch // tc.micro_batches)
    params = initial_params(cfg, run.settings, tc, prog, run.log)
    params, frozen = trained_and_frozen(params, run.settings)
    if split_packed(frozen)[1] and not packed:
        raise InputError("the initial parameters hold packed routed experts (w*_packed / w*_scale): they can only "
                         "be trained frozen (frozen_experts=True, `k3 train --frozen-experts`)")
    run.state_sh, run.batch_sh, run.dispatch = prog.state_sh, prog.batch_sh, prog.dispatch
    run.state = prog.init_state(params, frozen, tc.seed)
    del params, frozen
    run.step_fn, run.score = prog.step, prog.score
    run.lr_at = schedule(tc.lr, ocfg)


def _open_ckpt(run: _Run) -> None:
    """The checkpoint manager over --ckpt-dir and, when it holds a checkpoint, its step (``run.saved``) once the
    settings it was written with are checked against this run's: before any compute, no array read. A changed
    setting is refused unless --fork; a changed Muon layout always (nothing to restore into)."""
    tc = run.tc
    run.mngr = manager(tc.ckpt_dir, keep=tc.keep, async_save=tc.async_ckpt) if tc.ckpt_dir else None
    if run.mngr is None or run.mngr.latest_step() is None:
        return
    meta = read_meta(run.mngr)
    old = meta.get("train", {})
    diff = resume_diff(old, run.meta["train"])
    if "muon_layout" in diff:  # the optimizer state's structure differs: nothing to restore into, even with --fork
        saved = old.get("muon_layout", "layer")
        raise InputError(f"{tc.ckpt_dir}: checkpoint's optimizer state has the {saved!r} Muon layout, this run's is "
                         f"{run.meta['train']['muon_layout']!r}; resume with --muon-layout {saved}")
    if diff and not tc.fork:
        raise InputError(f"--ckpt-dir {tc.ckpt_dir}: {resume_refusal(old, run.meta['train'], diff)}")
    if hasattr(run.data, "check_state") and not tc.fork:  # streamed shards: the checkpoint's must be these
        run.data.check_state(meta.get("data"))
    run.saved, run.forked = int(run.mngr.latest_step()), diff
    # the QAT rounding rules travel with the trained model: its weight rule is the grid the export packs onto
    run.settings = trained_settings(meta, run.settings)
    run.meta["run"] = run_record(run.settings)


def _restore(run: _Run) -> None:
    """Continue from the checkpoint ``_open_ckpt`` found, if any: its state restored into the built one's shapes
    and shardings."""
    if run.saved is None:
        return
    run.state, _ = restore_state(run.mngr, run.state)
    if run.forked:
        run.log(f"fork: resuming with changed {', '.join(run.forked)}")
    run.start = int(run.state["step"])
    run.log(f"resumed from {run.tc.ckpt_dir} at step {run.start}")
    run.last_good = run.start


def _complete_note(run: _Run) -> str:
    """The log line of a re-run whose checkpoint already holds its last step."""
    tc = run.tc
    more = ("raise --steps and add --fork (--steps is also the LR schedule's length)" if tc.total_steps is None
            else "raise --steps")
    return (f"{tc.ckpt_dir}: the run is complete (checkpoint at step {run.saved}, --steps {tc.steps}); no step "
            f"taken. To train further, {more}")


def _open_outputs(run: _Run) -> None:
    """MFU terms and the metrics file (--metrics), the progress bar; writes the metrics' start record."""
    tc = run.tc
    if tc.metrics:
        run.flops_tok = flops_per_token(run.cfg, abstract_params(run.cfg, run.settings), tc.seq_len)
        run.peak = tc.peak_flops or matmul_peak_flops(dtype=jnp.dtype(tc.compute_dtype))
    main = dist.is_main()  # one process writes the job's metrics, event files and progress
    run.mfile = MetricsFile(tc.metrics if main else None, tensorboard=tc.tensorboard if main else None)
    if main and (tc.progress if tc.progress is not None else sys.stderr.isatty()):
        run.bar = tqdm(total=tc.steps, initial=run.start, desc="train", unit="step", file=sys.stderr)
    run.write({"event": "start", "step": run.start, "heldout_unigram_entropy": run.held_entropy,
               "devices": run.mesh.devices.size, "mesh": dict(run.mesh.shape), "strategy": run.strategy,
               "param_bytes_per_device": place.bytes_per_device(full_params(run.state)),
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
    summary.update(stopped="non-finite", step=step, params=full_params(run.state))
    err = TrainingStoppedError(f"stopped at step {step}: {bad} non-finite steps in a row "
                               f"(steps {list(range(step - bad + 1, step + 1))}); {where}")
    err.summary = summary
    raise err


def _evaluate(run: _Run) -> float:
    """Held-out loss (nats per token) over the run's fixed eval windows, a micro-batch at a time."""
    b = run.tc.batch // run.tc.micro_batches
    return heldout_loss(full_params(run.state), run.eval_set, batch=b, score=run.score)[0]


def _finish_step(run: _Run, rec: dict, summary: dict, stop: Stop) -> bool:
    """Eval, metrics record, progress, checkpoint and SIGTERM / SIGINT handling after one step; False: stop the
    loop."""
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
    elif tc.log_every and step % tc.log_every == 0:  # no progress bar (not a terminal, --no-progress): a line
        recent = run.step_times[-tc.log_every:]
        run.log(progress_line(step, tc.steps, rec["loss"], tokens_per_s=tc.batch * tc.seq_len * len(recent) /
                              max(sum(recent), 1e-9), eta_s=(tc.steps - step) * sum(recent) / len(recent)))
    hit = stop.poll()  # the same in every process
    if run.mngr is not None and bad == 0 and (step % tc.ckpt_every == 0 or step == tc.steps or hit):
        if hasattr(run.data, "state"):  # the loader's position travels with the checkpoint
            run.meta["data"] = run.data.state(step)
        save_state(run.mngr, run.state, run.meta, force=bool(hit) or step == tc.steps)
        run.last_good = step
    if not hit:
        return True
    summary["stopped"] = hit
    run.write({"event": hit, "step": step, "checkpoint": run.last_good})
    saved = (f"saved step {run.last_good} to {tc.ckpt_dir}" if run.last_good is not None
             else f"no checkpoint saved (step {step} was not finite)")
    run.log(f"{hit.upper()}: {saved}; exiting" if run.mngr is not None
            else f"{hit.upper()}: no --ckpt-dir, exiting without a checkpoint")
    return False


def _compile_step(run: _Run, x, poison) -> None:
    """Compile the train step ahead of its first call and say what it costs: one log line and a ``compile``
    metrics record (compile seconds, the compiler's per-device argument / output / temporary bytes, and the placed
    state's bytes on the fullest device)."""
    run.step_fn, rec = compile_ahead(run.step_fn, run.state, x, poison)
    rec.update(param_bytes_per_device=place.bytes_per_device(full_params(run.state)),
               opt_state_bytes_per_device=place.bytes_per_device(run.state["opt"]))
    run.log(compile_summary(rec, place.format_mesh(run.mesh), run.strategy))
    run.write(rec)


def _global_batch(run: _Run, step: int, rows: np.ndarray):
    """Step ``step``'s batch [M, b, ...] placed by ``run.batch_sh``, this process making only the rows ``rows``
    (global row m * b + r of the step's batch) its devices hold."""
    tc = run.tc
    lead = (tc.micro_batches, tc.batch // tc.micro_batches)
    local = run.data.batch(seed=tc.seed, step=step, batch=tc.batch, seq_len=tc.seq_len, rows=rows)
    return jax.tree.map(lambda a: dist.from_process_rows(run.batch_sh, (*lead, *a.shape[1:]), rows, a, row_axes=2),
                        local)


def _step_loop(run: _Run, summary: dict, stop: Stop) -> int:
    """Steps ``run.start + 1 .. tc.steps`` (or until SIGTERM / SIGINT); returns the last step taken."""
    tc = run.tc
    b = tc.batch // tc.micro_batches
    poison = {int(s) for s in tc.poison_steps}
    rows = dist.process_rows(run.batch_sh, (tc.micro_batches, b, tc.seq_len + 1), row_axes=2)
    step = run.start
    while step < tc.steps:
        x, p = _global_batch(run, step, rows), jnp.float32(np.nan if step + 1 in poison else 0.0)
        if step == run.start:
            _compile_step(run, x, p)
        t0 = time.perf_counter()
        run.state, m = run.step_fn(run.state, x, p)
        m = jax.device_get(m)
        dt = time.perf_counter() - t0
        run.step_times.append(dt)
        step += 1
        rec = step_record(m, step, dt, tokens=tc.batch * tc.seq_len, lr=run.lr_at(step - 1),
                          flops_per_token=run.flops_tok, peak_flops=run.peak)
        _note_step(run, rec, summary)
        if not _finish_step(run, rec, summary, stop):
            break
    return step


def build(tc: TrainConfig, *, log=None) -> _Run:
    """A run's context without taking a step: every check, the corpus, the placed train state (``.state``, its
    shardings ``.state_sh``), the MoE ``.dispatch`` and the jitted ``.step_fn`` (for tests and notebooks that
    inspect shardings and gradients)."""
    run = _prepare(tc, _job_log(log))
    _build(run)
    return run


def _job_log(log):
    """The run's log function (default: a line on stderr), in process 0 of a job only."""
    if not dist.is_main():
        return lambda msg: None
    return log or (lambda msg: print(msg, file=sys.stderr, flush=True))


def _close(run: _Run) -> None:
    """Wait for the checkpoint writes, close the manager, the progress bar and the metrics file."""
    if run.mngr is not None:
        run.mngr.wait_until_finished()
        run.mngr.close()
    if run.bar is not None:
        run.bar.close()
    run.mfile.close()


def train(tc: TrainConfig, *, log=None, sigint: bool = False, need_params: bool = True) -> dict:
    """Run (or resume) training. Returns a summary dict; writes metrics JSONL / checkpoints / export as configured.

    ``sigint``: Ctrl-C stops the run as SIGTERM does (the step finished, a checkpoint saved, ``stopped`` "sigint");
    a second one raises KeyboardInterrupt. ``need_params`` False: a re-run of a finished run (``complete``) returns
    without building its state (``params`` None; `k3 train`, unless it exports)."""
    log = _job_log(log)
    run = _prepare(tc, log)
    summary = {"start_step": 0, "heldout_unigram_entropy": run.held_entropy, "skipped_steps": [], "evals": [],
               "losses": [], "qk_clip_events": 0, "stopped": None, "complete": False}
    try:
        _open_ckpt(run)
        if run.saved is not None and run.saved >= run.tc.steps:  # a finished run: no step, no metrics record
            log(_complete_note(run))
            summary.update(complete=True, start_step=run.saved)
            if not (need_params or tc.export):
                summary.update(step=run.saved, final_loss=None, final_eval_loss=None, params=None)
                return summary
        _build(run)
        _restore(run)
        summary["start_step"] = step = run.start
        if not summary["complete"]:
            _open_outputs(run)
            if tc.eval_at_start and run.start == 0:
                summary["evals"].append((0, _evaluate(run)))
                run.write({"event": "eval", "step": 0, "eval_loss": summary["evals"][0][1]})
            with Stop(sigint) as stop:
                step = _step_loop(run, summary, stop)
    finally:
        _close(run)

    summary.update(step=step, final_loss=summary["losses"][-1] if summary["losses"] else None,
                   final_eval_loss=summary["evals"][-1][1] if summary["evals"] else None,
                   params=full_params(run.state))
    if tc.export and summary["stopped"] is None:  # again: the directory may have been made while the run trained
        check_out_dir(tc.export, overwrite=tc.overwrite, flag="--export", hint="pass --overwrite")
    if tc.export and summary["stopped"] is None and run.settings.lora is not None:
        summary["export"] = save_adapter(summary["params"], run.cfg, run.settings, tc.export, base=tc.init,
                                         overwrite=tc.overwrite)
        log(f"adapters written to {tc.export} (PEFT layout)")
    elif tc.export and summary["stopped"] is None:
        summary["export"] = export_trained(summary["params"], run.cfg, run.settings, tc.export,
                                           overwrite=tc.overwrite)
        log(f"exported to {tc.export}: {summary['export']['total_size']:,} payload bytes "
            f"({summary['export']['expert_format']} experts)")
    return summary


__all__ = ["TrainingStoppedError", "build", "train"]
