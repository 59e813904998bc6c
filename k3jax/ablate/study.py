"""Scaling studies for `k3 ablate`: every arm of an ablation file at >= 4 compute budgets, with tuned baselines and a
built-in calibration (the fits and multipliers are ``k3jax.analysis.scaling_report``'s; the [scaling], ``tune`` and
``calibration`` schema is ``k3jax.ablate.parse``'s).

    study = load_study("experiments/ablations/scaling.toml")         # parse + resolve every budget: no training
    done = run_study(study, "runs/scaling")                          # per budget: tuning runs, then the grid

Every guarantee of a single ablation holds per budget: each budget is an ordinary checked ``Spec`` (one factor,
paired seeds, shared init where shapes match, one token stream and one set of held-out windows), run as an ordinary
`k3 ablate` directory. A tuned setting counts as declared by its factor; the tuning windows sit midway between the
evaluation windows (``k3jax.ablate.resolve.eval_windows(arm, tuning=True)``), so the value is chosen on data the
comparison never scores. Output directory::

    study.json                the resolved study it belongs to (a different file is refused: exit 2)
    tune/<budget>/            the tuning runs (an ablate directory; runs/<run>/seed-<s0>-tune/)
    budgets/<budget>/         the budget's ablation after tuning (an ablate directory: results.json/md, curves.png)
    results.json  results.md  scaling.png

Budgets run smallest first; a killed study re-run with the same command resumes (finished runs are not redone, and
a budget's tuning choice is read back from its finished tuning runs, so the evaluation grid is the same one).

Over N workers (``run_study_share``, `k3 ablate --worker I/N`) each budget's tuning runs and its grid are two phases
(``k3jax.ablate.share``): a worker trains its share of every tuning phase first, then of each grid once that
budget's tuning phase is complete in the directory (waiting for the other workers' runs), the grid resolved from
those records as ``run_study`` resolves it; ``run_study(report_only=True)`` then reads everything back.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from dataclasses import dataclass

from k3jax.ablate.decoding import load_decoding
from k3jax.ablate.parse import file_kind, parse, parse_level, read_toml
from k3jax.ablate.resolve import level_tables, make_arm, resolve, violations, with_overrides
from k3jax.ablate.runner import Job, claim_dir, collect, grid, init_plan, run_grid
from k3jax.ablate.share import IncompleteError, Share, wait_until
from k3jax.ablate.spec import TRAIN_KEYS, AblationSpecError, BudgetDecl, Factor, FactorDecl, Spec, SpecFile, err, sha256
from k3jax.config import ConfigError, K3Config
from k3jax.model import abstract_params
from k3jax.train.flops import flops_per_token

MIN_SPAN = 8.0  # the largest budget's compute over the smallest's
WIDTH_FIELDS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "routed_expert_hidden_size",
                "q_lora_rank", "kv_lora_rank")
HEAD_FIELDS = ("kda_num_heads", "mla_num_heads")


# ------------------------------------------------------------------------------------------------- resolution

def widen(cfg: K3Config, m: float, where: str) -> K3Config:
    """``cfg`` at ``m`` x its width: the hidden, FFN, expert and low-rank sizes (rounded to multiples of 8) and the
    head counts (rounded, >= 1) scale; head dims, layer and expert counts stay."""
    if m == 1.0:
        return cfg
    over = {f: max(8, 8 * round(getattr(cfg, f) * m / 8)) for f in WIDTH_FIELDS if getattr(cfg, f) is not None}
    over |= {f: max(1, round(getattr(cfg, f) * m)) for f in HEAD_FIELDS}
    try:
        return cfg.replace(**over)
    except ConfigError as e:
        raise AblationSpecError(f"{where}: width {m:g} of {cfg.name}: {e}") from e


def run_flops(arm) -> float:
    """Training FLOPs of one run of ``arm``: (6 · active matmul parameters + attention) per token x its tokens
    (``k3jax.train.flops.flops_per_token``)."""
    return flops_per_token(arm.cfg, abstract_params(arm.cfg, arm.run), arm.train["seq_len"]) * arm.derived["tokens"]


def _with_picks(f: FactorDecl, picks: dict) -> FactorDecl:
    """Factor ``f`` with each level's tuned settings set to ``picks[level]``."""
    def tables(cfg):
        return {lv: t | {"train": t.get("train", {}) | picks[lv]} for lv, t in level_tables(f, cfg).items()}
    return dataclasses.replace(f, levels=tables)


def _calibration(parsed: SpecFile) -> FactorDecl | None:
    return next((f for f in parsed.factors if f.calibration is not None), None)


def calibrate(spec: Spec, pb: SpecFile, cal: FactorDecl, budget: BudgetDecl, others: list[tuple]) -> Spec:
    """``spec`` plus the calibration factor: the base at k x its steps (the same eval interval). ``others``: the
    other budgets as (name, width, base steps)."""
    base, k = spec.base, cal.calibration
    where = f"{cal.where}.k"
    n = base.train["steps"] * k
    if abs(n - round(n)) > 1e-9 or round(n) < 1:
        raise err(where, f"k = {k:g} x {base.train['steps']} steps at budget {budget.name!r} is not a whole number "
                         "of steps; pick k so that k x steps is whole at every budget (e.g. 1.5 with power-of-two "
                         "step counts)")
    n = round(n)
    for name, width, steps in others:
        if width == budget.width and steps == n:
            raise err(where, f"k = {k:g} at budget {budget.name!r} trains {n} steps: budget {name!r}'s base "
                             "run exactly, so the estimator would read a point it already has; pick another k")
    level = "x" + f"{k:g}".replace(".", "_").replace("-", "_")
    pc = dataclasses.replace(pb, budget=("steps", n), eval_every=base.train["eval_every"])
    arm = make_arm(pc, f"calibration={level}", "calibration", level, base.cfg, {}, where)
    arm = dataclasses.replace(arm, run_id=arm.name)
    fac = Factor("calibration", cal.keys, cal.varies, (), 0.0, {"base": "base", level: arm.name}, "base")
    bad = violations(fac, base, arm)
    if bad:  # the base at other steps differs in steps, tokens and the data order only; anything else is a bug
        raise RuntimeError(f"calibration level differs from the base outside its declaration: {bad}")
    return dataclasses.replace(spec, factors=spec.factors + (fac,), arms=spec.arms | {arm.name: arm},
                               runs=spec.runs | {arm.name: arm},
                               fingerprint=sha256({"spec": spec.fingerprint, "calibration": arm.flat}))


def tuning_spec(pb: SpecFile, spec: Spec) -> tuple[Spec, tuple[Job, ...]] | None:
    """The tuning runs of one budget — every level of every tuned factor at every candidate, at the first seed — as a
    Spec (its runs include the base, so the seed init is shared as in the grid) and their jobs; None if nothing is
    tuned."""
    base = spec.base
    arms = {}
    for f in pb.factors:
        for level, table in (level_tables(f, base.cfg).items() if f.tune else ()):
            lw = f"{f.where} level {level!r}"
            model_over, train_over = parse_level(table, lw)
            cfg = with_overrides(base.cfg, model_over, lw)
            for combo in itertools.product(*f.tune.values()):
                picks = dict(zip(f.tune, combo))
                name = f"{f.name}={level}~" + ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                                       for k, v in picks.items())
                arms[name] = make_arm(pb, name, f.name, level, cfg, train_over | picks, lw)
    if not arms:
        return None
    first = {sha256(base.flat): "base"}
    arms = {n: dataclasses.replace(a, run_id=first.setdefault(sha256(a.flat), n)) for n, a in arms.items()}
    runs = {"base": base} | {a.run_id: arms[a.run_id] for a in arms.values() if a.run_id != "base"}
    s0 = spec.seeds[0]
    jobs = tuple(Job(rid, s0, "tune") for rid in dict.fromkeys(a.run_id for a in arms.values()))
    tspec = dataclasses.replace(spec, name=f"{spec.name}~tune", seeds=(s0,), factors=(), arms={"base": base} | arms,
                                runs=runs, aa={"seed_offset": None, "repeat": False},
                                fingerprint=sha256({"tune": {n: a.flat for n, a in arms.items()}, "seed": s0}))
    return tspec, jobs


@dataclass(frozen=True)
class Budget:
    name: str
    kind: str  # "tokens" | "steps"
    amount: int
    width: float
    parsed: SpecFile  # the file's parse at this budget (untuned)
    spec: Spec  # the budget's ablation before tuning (calibration included)
    tuning: Spec | None
    tune_jobs: tuple = ()


@dataclass(frozen=True)
class Study:
    path: str
    name: str
    description: str
    budgets: tuple[Budget, ...]
    fit: str
    bootstrap: int
    calibration: float | None
    fingerprint: str
    window: int | None = None  # budgets per local fit of the multipliers (None: the report's LOCAL_WINDOW)


def resolve_study(parsed: SpecFile) -> Study:
    """Every budget of a parsed scaling file resolved and checked (``resolve`` per budget, plus the calibration level
    and the tuning runs); refuses budgets that do not increase in compute or span < 8x."""
    path, sc = parsed.path, parsed.scaling
    cal = _calibration(parsed)
    specs, pbs = [], []
    for b in sc.budgets:
        where = f"{path}: [scaling] budgets ({b.name!r})"
        pbs.append(dataclasses.replace(parsed, name=f"{parsed.name}/{b.name}", budget=(b.kind, b.amount),
                                       base_cfg=widen(parsed.base_cfg, b.width, where)))
        specs.append(resolve(pbs[-1]))
    steps = [(b.name, b.width, s.base.train["steps"]) for b, s in zip(sc.budgets, specs)]
    budgets, flops = [], []
    for b, pb, spec in zip(sc.budgets, pbs, specs):
        if cal is not None:
            spec = calibrate(spec, pb, cal, b, [o for o in steps if o[0] != b.name])
        tuned = tuning_spec(pb, spec)
        budgets.append(Budget(b.name, b.kind, b.amount, b.width, pb, spec, *(tuned or (None, ()))))
        flops.append(run_flops(spec.base))
    for i in range(1, len(flops)):
        if flops[i] <= flops[i - 1]:
            raise err(f"{path}: [scaling] budgets[{i}]", f"{budgets[i].name!r} has {flops[i]:.3g} training FLOPs, "
                                                         f"not more than {budgets[i - 1].name!r}'s {flops[i - 1]:.3g}:"
                                                         " budgets must increase in compute")
    if flops[-1] / flops[0] < MIN_SPAN:
        raise err(f"{path}: [scaling] budgets", f"span {flops[-1] / flops[0]:.2f}x in training FLOPs; a scaling fit "
                                                f"needs >= {MIN_SPAN:g}x")
    return Study(path, parsed.name, parsed.description, tuple(budgets), sc.fit, sc.bootstrap,
                 None if cal is None else cal.calibration,
                 # a window given in the file is part of the fingerprint; the default is not, so studies written
                 # before the key existed keep their directories
                 sha256({"budgets": [(b.name, b.spec.fingerprint, b.tuning and b.tuning.fingerprint) for b in budgets],
                         "fit": sc.fit, "bootstrap": sc.bootstrap}
                        | ({} if sc.window is None else {"window": sc.window})), sc.window)


def load_study(path: str) -> Study:
    """Parse and resolve the scaling file at ``path`` (no training)."""
    parsed = parse(path)
    if parsed.scaling is None:
        raise AblationSpecError(f"{path}: not a scaling study (no [scaling] table)")
    return resolve_study(parsed)


def load(path: str) -> Spec | Study:
    """An ablation file: a ``Spec``, a ``Study`` when it has [scaling], or a ``DecodingSpec`` (a ``Spec``) when its
    kind is "decoding" (parsed, resolved and checked; no training, no weight read)."""
    if file_kind(read_toml(path), path) == "decoding":
        return load_decoding(path)
    parsed = parse(path)
    return resolve_study(parsed) if parsed.scaling is not None else resolve(parsed)


# ---------------------------------------------------------------------------------------------------- running

def pick(budget: Budget, records: dict) -> tuple[dict, dict]:
    """From a budget's finished tuning runs: ({factor: {level: {setting: value}}}, the tuning table
    {factor: {level: {"candidates": [{"values", "loss"}], "chosen"}}}), each level's value the one of lowest mean
    loss on the tuning windows (ties: the first candidate)."""
    by_run = {job.run_id: rec for job, rec in records.items()}
    picks, table = {}, {}
    for name, arm in budget.tuning.arms.items():
        if name == "base":
            continue
        cands = table.setdefault(arm.factor, {}).setdefault(arm.level, {"candidates": []})["candidates"]
        f = next(f for f in budget.parsed.factors if f.name == arm.factor)
        values = {k: arm.train[k] for k in f.tune}
        losses = by_run[arm.run_id]["tuning_window_losses"]
        cands.append({"values": values, "loss": sum(losses) / len(losses)})
    for fname, levels in table.items():
        for level, t in levels.items():
            best = min(t["candidates"], key=lambda c: c["loss"])
            t["chosen"] = best["values"]
            picks.setdefault(fname, {})[level] = best["values"]
    return picks, table


def evaluation_spec(budget: Budget, picks: dict, calibration: FactorDecl | None) -> Spec:
    """The budget's ablation with each tuned level at its picked values (re-resolved and re-checked)."""
    if not picks:
        return budget.spec
    pb = dataclasses.replace(budget.parsed, factors=tuple((_with_picks(f, picks[f.name]) if f.name in picks else f)
                                                          for f in budget.parsed.factors))
    spec = resolve(pb)
    if calibration is not None:
        b = BudgetDecl(budget.name, budget.kind, budget.amount, budget.width)
        spec = calibrate(spec, pb, calibration, b, [])
    return spec


def claim_study(study: Study, out: str, *, create: bool = True) -> None:
    """``out`` becomes this study's directory (study.json), or is refused (AblationSpecError) when it holds another
    file's results or anything else (``runner.claim_dir``: safe when several workers claim it at once; ``create``
    False: a report, which needs it claimed already)."""
    def refuse(old: dict) -> AblationSpecError:
        return AblationSpecError(f"--out {out}: holds the results of a different scaling study ({old.get('file')}, "
                                 f"name {old.get('name')!r}): its budgets, arms, tuning or fit settings differ; use "
                                 "a fresh --out")

    claim_dir(out, "study.json", {"fingerprint": study.fingerprint, "file": study.path, "name": study.name,
                                  "budgets": [b.name for b in study.budgets]}, refuse, create=create)


def _missing(phase: str, jobs: list) -> str:
    return f"{phase}: {', '.join(j.label for j in jobs)}"


def run_study(study: Study, out: str, *, progress: bool | None = None, log=None,
              report_only: bool = False) -> list[dict] | None:
    """Run (or resume) every budget: its tuning runs, then its grid. Returns per budget {"budget", "spec", "records",
    "init", "tuning"}, or None when SIGTERM stopped it (re-run the same call to continue). ``report_only``: train
    nothing, read the records from ``out``, and raise ``IncompleteError`` naming every run that is not there (a budget
    whose tuning is incomplete: its tuning runs; its grid is not known before them)."""
    claim_study(study, out, create=not report_only)
    cal = _calibration(study.budgets[0].parsed)
    done, missing = [], []
    for b in study.budgets:
        picks, table = {}, {}
        tdir, gdir = os.path.join(out, "tune", b.name), os.path.join(out, "budgets", b.name)
        if b.tuning is not None:
            if report_only:
                recs, absent = collect(b.tuning, tdir, list(b.tune_jobs))
                if absent:
                    missing.append(_missing(f"tune/{b.name}", absent) + f" (and budgets/{b.name}, which they tune)")
                    continue
            else:
                got = run_grid(b.tuning, tdir, progress=progress, log=log, jobs=list(b.tune_jobs))
                if got is None:
                    return None
                recs = got[0]
            picks, table = pick(b, recs)
        spec = evaluation_spec(b, picks, cal)
        if report_only:
            recs, absent = collect(spec, gdir, grid(spec))
            if absent:
                missing.append(_missing(f"budgets/{b.name}", absent))
                continue
            got = recs, init_plan(spec, gdir)[1]
        else:
            got = run_grid(spec, gdir, progress=progress, log=log)
            if got is None:
                return None
        done.append({"budget": b, "spec": spec, "records": got[0], "init": got[1], "tuning": table})
    if missing:
        raise IncompleteError(f"--out {out}: runs missing, so no report: {'; '.join(missing)}")
    return done


def run_study_share(study: Study, out: str, share: Share, *, progress: bool | None = None,
                    log=None) -> dict[str, dict] | None:
    """Worker ``share``'s part of the study (``k3jax.ablate.share``): its runs of every tuning phase first (they
    depend on nothing), then, budget by budget, its runs of the grid, each grid once its tuning phase is complete in
    ``out`` (waiting for the other workers' runs), resolved from those records exactly as ``run_study`` resolves it.
    Returns {phase: {Job: record}} of this worker's runs, or None when SIGTERM stopped it."""
    claim_study(study, out)
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cal = _calibration(study.budgets[0].parsed)
    done = {}
    for b in study.budgets:
        if b.tuning is not None:
            phase = f"tune/{b.name}"
            got = run_grid(b.tuning, os.path.join(out, phase), progress=progress, log=log, jobs=list(b.tune_jobs),
                           share=share, phase=phase)
            if got is None:
                return None
            done[phase] = got[0]
    for b in study.budgets:
        picks = {}
        if b.tuning is not None:
            tdir, jobs = os.path.join(out, "tune", b.name), list(b.tune_jobs)

            def probe(spec=b.tuning, tdir=tdir, jobs=jobs):
                recs, absent = collect(spec, tdir, jobs)
                return (recs if not absent else None), (f"{len(absent)} of {len(jobs)} runs not finished "
                                                        f"({', '.join(j.label for j in absent)})")

            picks, _ = pick(b, wait_until(probe, f"tune/{b.name}, which budgets/{b.name} needs", share=share,
                                          log=say))
        phase = f"budgets/{b.name}"
        got = run_grid(evaluation_spec(b, picks, cal), os.path.join(out, phase), progress=progress, log=log,
                       share=share, phase=phase)
        if got is None:
            return None
        done[phase] = got[0]
    return done


def _point(budget: str, arm, seeds, per_run: dict, reported: float | None) -> dict:
    c = run_flops(arm)
    return {"budget": budget, "run": arm.run_id, "tokens": arm.derived["tokens"], "flops": c,
            "reported_flops": c if reported is None else reported, "seeds": list(seeds),
            "window_losses": [per_run[arm.run_id][s] for s in seeds],
            "settings": {k: arm.train[k] for k in TRAIN_KEYS if k != "devices" and k in arm.train}}


def points(done: list[dict]) -> dict:
    """The study's measurements as plain data for ``k3jax.analysis.scaling_report``: {"series": {key: [per budget:
    {budget, run, tokens, flops, reported_flops, seeds, window_losses [S][W], settings}]}, "factors": {factor:
    {reference, tuned, levels: {level: key}, true}}}. Series: "base", "base~aa" (the A/A seeds) and one per factor
    level, "factor=level", followed across budgets by (factor, level): tuning may give a level another arm at each
    budget. A tuned factor's reference is its own base level; the calibration level reports the base's compute."""
    series: dict[str, list] = {}
    factors: dict[str, dict] = {}
    for d in done:
        spec, recs = d["spec"], d["records"]
        per_run: dict[str, dict] = {}
        for job, r in recs.items():
            if job.tag == "":
                per_run.setdefault(job.run_id, {})[job.seed] = r["window_losses"]
        base_flops = run_flops(spec.base)

        def add(key, arm, seeds, reported=None, budget=d["budget"].name, per_run=per_run):
            series.setdefault(key, []).append(_point(budget, arm, seeds, per_run, reported))

        add("base", spec.base, spec.seeds)
        if spec.aa_seeds:
            add("base~aa", spec.base, spec.aa_seeds)
        for f in spec.factors:
            ref = f"{f.name}={f.base_level}" if f.tune else "base"
            if f.tune:
                add(ref, spec.arms[f.levels[f.base_level]], spec.seeds)
            entry = factors.setdefault(f.name, {"reference": ref, "tuned": sorted(f.tune), "levels": {}})
            for level, arm_name in f.levels.items():
                if level == f.base_level:
                    continue
                key = f"{f.name}={level}"
                add(key, spec.arms[arm_name], spec.seeds, base_flops if f.name == "calibration" else None)
                entry["levels"][level] = key
                if f.name == "calibration":
                    entry["true"] = spec.arms[arm_name].train["steps"] / spec.base.train["steps"]
    return {"series": series, "factors": factors}


__all__ = ["MIN_SPAN", "Budget", "Study", "calibrate", "claim_study", "evaluation_spec", "load", "load_study", "pick",
           "points", "resolve_study", "run_flops", "run_study", "run_study_share", "tuning_spec", "widen"]
