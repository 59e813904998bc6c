"""`k3 ablate`'s runner: every (arm, seed) of a checked ablation file as a resumable `k3 train` run (the
statistics and tables are ``k3jax.analysis.ablate_report``'s; ``k3jax.ablate.report.run`` does both).

    spec = load_spec("experiments/smoke.toml")                       # k3jax.ablate.resolve
    records, init = run_grid(spec, "runs/smoke")                     # None if SIGTERM stopped the grid

Output directory::

    ablation.json             the resolved file it belongs to (a different file is refused: exit 2)
    init_plan.json            whose init each leaf of each run starts from, and per run how much is the base's
    seeds/seed-<s>.npz        the seed checkpoint: each seed's initial values, shared by every arm (same_init.py)
    runs/<run>/seed-<s>/      ckpt/ (orbax, resumable), metrics.jsonl, result.json (written last, atomically)
    results.json  results.md  curves.png

Runs are in-process calls of ``k3jax.train.loop.train`` rather than `k3 train` subprocesses: the grid pays the
interpreter and JAX start-up once, the final parameters are at hand for the per-window eval, and a failure is a
Python exception with its message. Each run resumes from its own ``ckpt/`` (bit-identical, as `k3 train` does), and
a run with a ``result.json`` for the same configuration is not redone, so a killed `k3 ablate` re-run with the same
command finishes with the results of an uninterrupted one. The grid goes seed by seed, so an interrupted grid
already holds complete pairs. Every arm reads the same token stream (the batch of step s is a function of (seed, s))
and is evaluated on the same held-out windows.

With a ``share`` (``k3jax.ablate.share``: `k3 ablate --worker I/N`) ``run_grid`` trains only that worker's runs;
several workers may fill one directory at once. Each run directory is written by the one worker that owns the run;
ablation.json is published exclusively (``publish_json``: the first worker's copy stays, every worker compares it);
init_plan.json and the seed checkpoints are written, atomically, by the phase's owner before it trains anything,
and the other workers wait for them (``share.wait_until``) instead of writing their own.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
import optax
from tqdm import tqdm

from k3jax.ablate.resolve import eval_windows
from k3jax.ablate.same_init import arm_params, init_summary, sharing_plan, write_seed_checkpoint
from k3jax.ablate.share import Share, wait_until
from k3jax.ablate.spec import AblationSpecError, Spec, sha256
from k3jax.checkpoint.atomic import staged_file
from k3jax.model import forward
from k3jax.train import loop
from k3jax.train.settings import TrainConfig


@dataclass(frozen=True)
class Job:
    run_id: str
    seed: int
    tag: str = ""  # "repeat": the A/A determinism rerun, in its own directory

    @property
    def label(self) -> str:
        return f"{self.run_id}@{self.seed}" + (f"-{self.tag}" if self.tag else "")

    def dir(self, out: str) -> str:
        return os.path.join(out, "runs", self.run_id, f"seed-{self.seed}" + (f"-{self.tag}" if self.tag else ""))


def grid(spec: Spec) -> list[Job]:
    """Every run, seed-major: at each seed the distinct configurations, then the A/A base at seed + offset; the
    determinism repeat (the base at the first seed, again) last."""
    jobs = []
    for i, s in enumerate(spec.seeds):
        jobs += [Job(rid, s) for rid in spec.runs]
        if spec.aa_seeds:
            jobs.append(Job("base", spec.aa_seeds[i]))
    if spec.aa.get("repeat"):
        jobs.append(Job("base", spec.seeds[0], "repeat"))
    return jobs


def write_json(path: str, obj) -> None:
    """``obj`` as indented JSON with sorted keys at ``path``, written atomically (``checkpoint.atomic.staged_file``)."""
    with staged_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=list)
        f.write("\n")


def read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------ the output directory

def _identity(spec: Spec) -> dict:
    return {"fingerprint": spec.fingerprint, "file": spec.path, "name": spec.name, "seeds": list(spec.seeds),
            "aa": spec.aa, "arms": {n: {"flat": a.flat, "derived": a.derived} for n, a in spec.arms.items()}}


def publish_json(path: str, obj) -> bool:
    """Write ``obj`` at ``path`` as ``write_json`` does, unless a file is there already: True when this call wrote it.
    Exclusive even between processes on several machines (a uniquely named temporary file, then a hard link, which
    fails when ``path`` exists), so two workers claiming one directory at once keep the first copy whole."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, sort_keys=True, default=list)
            f.write("\n")
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: a rename, exclusive only up to this check
            if os.path.exists(path):
                return False
            os.replace(tmp, path)
            return True
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def claim_dir(out: str, name: str, identity: dict, refuse: Callable[[dict], AblationSpecError], *,
              create: bool = True) -> None:
    """Make ``out`` the directory of the file ``identity`` describes (its file ``name``: ablation.json, study.json),
    or refuse: ``refuse(the recorded identity)`` when ``out`` belongs to another file (another fingerprint), an
    AblationSpecError when it holds anything else, or (``create`` False: a report) when it holds no ``name``. Safe
    when several workers claim ``out`` at once: another worker's temporary copy of ``name`` is not "anything else",
    and a directory another worker claimed since the first look is compared like any claimed one."""
    meta = os.path.join(out, name)
    if not os.path.isfile(meta):
        if not create:
            raise AblationSpecError(f"--out {out}: holds no {name}, so nothing to report; run `k3 ablate FILE --out "
                                    f"{out}` (or its --worker processes) first")
        entries = [e for e in (os.listdir(out) if os.path.isdir(out) else []) if not e.startswith(f"{name}.tmp-")]
        if entries and name not in entries:
            raise AblationSpecError(f"--out {out}: not empty and holds no {name}; use a fresh --out")
        if name not in entries:
            publish_json(meta, identity)  # False: another worker was first; its copy is compared below
    old = read_json(meta)
    if old.get("fingerprint") != identity["fingerprint"]:
        raise refuse(old)


def claim_out(spec: Spec, out: str, *, create: bool = True) -> None:
    """Make ``out`` this file's directory, or refuse (AblationSpecError) one holding a different file's results
    (``claim_dir``; ``create`` False: a report, which needs the directory claimed already)."""
    new = _identity(spec)

    def refuse(old: dict) -> AblationSpecError:
        what = [k for k in ("seeds", "aa") if old.get(k) != new[k]]
        what += [f"arm {n!r}" for n in sorted(set(old.get("arms", {})) | set(new["arms"]))
                 if old.get("arms", {}).get(n) != new["arms"].get(n)]
        return AblationSpecError(f"--out {out}: holds the results of a different ablation file ({old.get('file')}, "
                                 f"name {old.get('name')!r}); {spec.path} differs in "
                                 f"{', '.join(what) or 'its factors or settings'}: use a fresh --out")

    claim_dir(out, "ablation.json", new, refuse, create=create)


# ------------------------------------------------------------------------------------------------- one run

@functools.lru_cache(maxsize=8)
def _window_scorer(cfg, run):
    """(params, tokens [b, T + 1]) -> [b] mean cross-entropy per window, jitted once per configuration (the seeds of
    an arm reuse its trace)."""
    return jax.jit(lambda p, t: optax.softmax_cross_entropy_with_integer_labels(
        forward(p, t[:, :-1], cfg, run), t[:, 1:]).mean(axis=-1))


def window_losses(params, arm, *, tuning: bool = False) -> np.ndarray:
    """[N] float64: mean next-token cross-entropy (nats) of each of the arm's held-out windows (``tuning``: its tuning
    windows), scored in micro-batch chunks (the last chunk padded with zero rows, so one compiled shape)."""
    w = eval_windows(arm, tuning=tuning).tokens
    b = min(len(w), arm.train["batch"] // arm.train["micro_batches"])
    score = _window_scorer(arm.cfg, arm.run)
    out = []
    for i in range(0, len(w), b):
        chunk = w[i:i + b]
        pad = np.concatenate([chunk, np.zeros((b - len(chunk), w.shape[1]), w.dtype)]) if len(chunk) < b else chunk
        out.append(np.asarray(score(params, pad), np.float64)[:len(chunk)])
    return np.concatenate(out)


def read_metrics(path: str) -> dict:
    """From a (possibly resumed, so repeated) metrics JSONL: the eval curve, the skipped steps and the steady-state
    step throughput (the first step after each start compiles, so it is left out)."""
    evals, tps, skipped, warm = {}, [], set(), True
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("event") == "start":
                warm = True
                continue
            if "step" not in rec or "loss" not in rec:
                continue
            if not rec["finite"]:
                skipped.add(rec["step"])
            if "eval_loss" in rec:
                evals[rec["step"]] = rec["eval_loss"]
            if not warm:
                tps.append(rec["tokens_per_s"])
            warm = False
    steps = sorted(evals)
    return {"curve": {"step": steps, "eval_loss": [evals[s] for s in steps]}, "skipped_steps": sorted(skipped),
            "tokens_per_s": float(np.median(tps)) if tps else None}


def seed_path(out: str, seed: int) -> str:
    return os.path.join(out, "seeds", f"seed-{seed}.npz")


def seed_checkpoint(spec: Spec, out: str, plan: dict, seed: int) -> str:
    """The seed checkpoint of ``seed`` in ``out`` (``same_init.write_seed_checkpoint``), written if missing."""
    path = seed_path(out, seed)
    if not os.path.isfile(path):
        runs = spec.runs if seed in spec.seeds else {"base": spec.runs["base"]}  # the A/A seeds run the base only
        write_seed_checkpoint(path, runs, plan, seed)
    return path


def finished(spec: Spec, out: str, job: Job) -> dict | None:
    """The result record of ``job`` in ``out`` if the run finished with the configuration it has in ``spec``."""
    arm = spec.runs[job.run_id]
    res_path = os.path.join(job.dir(out), "result.json")
    if os.path.isfile(res_path):
        rec = read_json(res_path)
        if rec.get("key") == sha256({"flat": arm.flat, "seed": job.seed, "tag": job.tag}):
            return rec
    return None


def collect(spec: Spec, out: str, jobs: list[Job]) -> tuple[dict, list[Job]]:
    """({Job: result record} of the finished ``jobs``, the unfinished ones), in the order of ``jobs``; trains
    nothing."""
    records, missing = {}, []
    for job in jobs:
        rec = finished(spec, out, job)
        if rec is None:
            missing.append(job)
        else:
            records[job] = rec
    return records, missing


def run_job(spec: Spec, out: str, job: Job, plan: dict, *, progress: bool, log) -> dict | None:
    """Train (or resume, or skip if finished) one run; its result record, or None if SIGTERM stopped it."""
    arm = spec.runs[job.run_id]
    d = job.dir(out)
    key = sha256({"flat": arm.flat, "seed": job.seed, "tag": job.tag})
    done = finished(spec, out, job)
    if done is not None:
        return done
    os.makedirs(d, exist_ok=True)
    ckpt = seed_checkpoint(spec, out, plan, job.seed)

    def init_fn(cfg, settings):
        if settings != arm.run:
            raise RuntimeError(f"{job.label}: the train loop's run settings {settings} are not the arm's {arm.run}")
        with np.load(ckpt) as z:
            return arm_params(arm, plan, z)

    # packing_masks False: a study trains on the plain token windows its records were made with (and its own
    # held-out windows, window_losses, are plain ones); document masks are not an ablation factor (yet)
    tc = TrainConfig(preset=None, model=arm.cfg, seed=job.seed, ckpt_dir=os.path.join(d, "ckpt"),
                     ckpt_every=spec.output["ckpt_every"], keep=1, metrics=os.path.join(d, "metrics.jsonl"),
                     progress=progress, init_fn=init_fn, **({"packing_masks": False} | arm.train))
    t0 = time.perf_counter()
    summary = loop.train(tc, log=lambda m: log(f"[{job.label}] {m}"))
    wall = time.perf_counter() - t0
    if summary["stopped"] == "sigterm":
        return None
    losses = window_losses(summary["params"], arm)
    final = float(losses.mean())
    loop_final = summary["final_eval_loss"]  # None when the run had already finished before a kill
    if loop_final is not None and abs(loop_final - final) > 1e-4 * max(1.0, abs(final)):
        raise RuntimeError(f"{job.label}: per-window eval {final:.6f} disagrees with the train loop's eval "
                           f"{loop_final:.6f}: the windows are not the loop's")
    m = read_metrics(tc.metrics)
    rec = {"key": key, "run": job.run_id, "seed": job.seed, "tag": job.tag, "steps": arm.train["steps"],
           "final_eval_loss": final, "window_losses": [float(x) for x in losses], "curve": m["curve"],
           "skipped_steps": m["skipped_steps"],
           "timing": {"wall_s": wall, "tokens_per_s": m["tokens_per_s"], "resumed_at_step": summary["start_step"]}}
    if job.tag == "tune":  # a scaling study's tuning run: also scored on the windows between the evaluation windows
        rec["tuning_window_losses"] = [float(x) for x in window_losses(summary["params"], arm, tuning=True)]
    write_json(os.path.join(d, "result.json"), rec)
    if not spec.output["keep_checkpoints"]:
        shutil.rmtree(tc.ckpt_dir, ignore_errors=True)
    return rec


# ------------------------------------------------------------------------------------------------- the grid

class _StopFlag:
    """SIGTERM between runs stops the grid before the next one (during a run, the train loop's handler saves a
    checkpoint and returns); the previous handler is restored on exit."""

    hit = False

    def __enter__(self):
        try:
            self.prev = signal.signal(signal.SIGTERM, lambda signum, frame: setattr(self, "hit", True))
        except ValueError:  # not the main thread
            self.prev = None
        return self

    def __exit__(self, *exc):
        if self.prev is not None:
            signal.signal(signal.SIGTERM, self.prev)


def init_plan(spec: Spec, out: str) -> tuple[dict, dict]:
    """The sharing plan of the seed init and its summary per run, kept in init_plan.json (computing it draws each
    run's init twice; a resumed grid reads it back)."""
    saved = _saved_plan(spec, out)
    if saved is not None:
        return saved
    plan = sharing_plan(spec.runs)
    summary = {rid: init_summary(spec.runs, plan, arm) for rid, arm in spec.runs.items()}
    write_json(os.path.join(out, "init_plan.json"),
               {"fingerprint": spec.fingerprint, "summary": summary,
                "owners": {rid: {"/".join(map(str, k)): o for k, o in owners.items()} for rid, owners in plan.items()}})
    return plan, summary


def _saved_plan(spec: Spec, out: str) -> tuple[dict, dict] | None:
    path = os.path.join(out, "init_plan.json")
    if not os.path.isfile(path):
        return None
    saved = read_json(path)
    if saved.get("fingerprint") != spec.fingerprint:
        return None
    plan = {rid: {tuple(int(p) if p.isdigit() else p for p in k.split("/")): o for k, o in owners.items()}
            for rid, owners in saved["owners"].items()}
    return plan, saved["summary"]


def shared_files(spec: Spec, out: str, jobs: list[Job], share: Share, phase: str, log) -> tuple[dict, dict] | None:
    """A worker's side of the files the runs of ``jobs`` (a phase) share: the phase's owner (``share.owns_shared``)
    writes init_plan.json and every seed checkpoint its runs need; any other worker with runs left to train waits
    for the plan and the seed checkpoints of those runs. The plan and its summary (None: nothing left to train
    here, so nothing to wait for)."""
    if share.owns_shared(phase):
        plan, summary = init_plan(spec, out)
        for seed in dict.fromkeys(j.seed for j in jobs):
            seed_checkpoint(spec, out, plan, seed)
        return plan, summary
    todo = [j for j in share.mine(phase, jobs) if finished(spec, out, j) is None]
    if not todo:
        return None
    seeds = list(dict.fromkeys(j.seed for j in todo))
    owner = share.worker_of(phase, 0)

    def probe():
        saved = _saved_plan(spec, out)
        absent = [] if saved is not None else ["init_plan.json"]
        absent += [f"seeds/seed-{s}.npz" for s in seeds if not os.path.isfile(seed_path(out, s))]
        return (saved if not absent else None), f"{', '.join(absent)} (written by worker {owner})"

    where = f"{phase}'s shared files" if phase else "the shared files"
    return wait_until(probe, where, share=share, log=log)


def run_grid(spec: Spec, out: str, *, progress: bool | None = None, log=None, jobs: list[Job] | None = None,
             share: Share | None = None, phase: str = "") -> tuple[dict, dict | None] | None:
    """Run (or resume) every job of ``grid(spec)`` (or ``jobs``) in ``out``. Returns ({Job: result record}, the init
    summary per run), or None when SIGTERM stopped the grid (re-run the same call to continue). With ``share``: only
    that worker's jobs of the phase named ``phase`` (its records; the summary None when it had nothing left to
    train), the shared files written by their owner (``shared_files``)."""
    progress = sys.stderr.isatty() if progress is None else progress
    claim_out(spec, out)
    phase_jobs = grid(spec) if jobs is None else jobs
    jobs = phase_jobs if share is None else share.mine(phase, phase_jobs)
    bar = tqdm(total=len(jobs), desc=f"ablate {spec.name}", unit="run", file=sys.stderr) if progress else None

    def say(msg: str) -> None:
        if log is not None:
            log(msg)
        elif bar is not None:
            bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    if share is None:
        plan, init = init_plan(spec, out)
    else:
        got = shared_files(spec, out, phase_jobs, share, phase, say)
        plan, init = got if got is not None else ({}, None)
    records = {}
    try:
        with _StopFlag() as stop:
            for job in jobs:
                if stop.hit:
                    say(f"SIGTERM: stopped before {job.label}; re-run the same command to continue")
                    return None
                if bar is not None:
                    bar.set_postfix_str(job.label)
                rec = run_job(spec, out, job, plan, progress=progress, log=say)
                if rec is None:
                    say(f"SIGTERM: {job.label} saved its checkpoint; re-run the same command to continue")
                    return None
                records[job] = rec
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return records, init


__all__ = ["Job", "claim_dir", "claim_out", "collect", "finished", "grid", "init_plan", "publish_json", "read_json",
           "read_metrics", "run_grid", "run_job", "seed_checkpoint", "seed_path", "shared_files", "window_losses",
           "write_json"]
