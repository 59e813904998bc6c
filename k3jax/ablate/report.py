"""`k3 ablate`'s work from a loaded file to its tables: run (or resume) an ablation's grid or a scaling study's
budgets, then write the reports (``k3jax.analysis.ablate_report``: results.json/md, curves.png;
``k3jax.analysis.scaling_report``: a study's fits and multipliers); and the descriptions ``k3 ablate --check``
prints. `k3 ablate` only parses its flags and prints what these return.

    spec = load("experiments/smoke.toml")              # k3jax.ablate.study.load: a Spec, or a Study with [scaling]
    results = run(spec, "/tmp/smoke")                  # the results.json content; None if SIGTERM stopped it
    print(markdown(spec, results))

    run_share(spec, "/tmp/smoke", parse_worker("0/2"))  # one of two workers sharing /tmp/smoke: its runs only
    results = run(spec, "/tmp/smoke", report_only=True)  # once both are done; IncompleteError names any missing run
"""

from __future__ import annotations

import os
import time

from k3jax.ablate.decoding import DecodingSpec, describe_decoding, resolved_decoding
from k3jax.ablate.decoding_run import claim_decoding, decoding_markdown, failed_decoding_repeat, run_decoding
from k3jax.ablate.resolve import format_diff
from k3jax.ablate.runner import claim_out, collect, grid, init_plan, read_json, run_grid
from k3jax.ablate.share import IncompleteError, Share
from k3jax.ablate.spec import Spec
from k3jax.ablate.study import Study, claim_study, points, run_flops, run_study, run_study_share
from k3jax.analysis import ablate_report, scaling_report
from k3jax.errors import InputError


def run_ablation(spec: Spec, out: str, *, progress: bool | None = None, log=None,
                 report_only: bool = False) -> dict | None:
    """Run (or resume) ``spec``'s grid in ``out`` and write results.json, results.md and curves.png. Returns the
    results, or None when SIGTERM stopped the grid. ``report_only``: train nothing; ``IncompleteError`` names the runs
    that are not in ``out``."""
    t0 = time.perf_counter()
    if report_only:
        claim_out(spec, out, create=False)
        records, missing = collect(spec, out, grid(spec))
        if missing:
            raise IncompleteError(f"--out {out}: {len(missing)} of {len(records) + len(missing)} runs missing, so "
                                  f"no report: {', '.join(j.label for j in missing)}")
        done = records, init_plan(spec, out)[1]
    else:
        done = run_grid(spec, out, progress=progress, log=log)
    if done is None:
        return None
    records, init = done
    results = ablate_report.assemble(spec, records, init)
    results["timing"] = {"this_invocation_s": time.perf_counter() - t0,
                         "runs_wall_s": sum(r["timing"]["wall_s"] for r in records.values())}
    ablate_report.write_all(results, out)
    return results


def run_scaling(st: Study, out: str, *, progress: bool | None = None, log=None,
                report_only: bool = False) -> dict | None:
    """Run (or resume) the scaling study ``st`` in ``out``: each budget's tuning runs and grid (each budget's
    directory gets its own results.json/md, curves.png), then the fits and multipliers (results.json, results.md,
    scaling.png in ``out``). Returns the results, or None when SIGTERM stopped it. ``report_only``: train nothing
    (``study.run_study``)."""
    t0 = time.perf_counter()
    done = run_study(st, out, progress=progress, log=log, report_only=report_only)
    if done is None:
        return None
    repeats = {}
    for d in done:
        r = ablate_report.assemble(d["spec"], d["records"], d["init"])
        r["timing"] = {"runs_wall_s": sum(x["timing"]["wall_s"] for x in d["records"].values())}
        ablate_report.write_all(r, os.path.join(out, "budgets", d["budget"].name))
        repeats[d["budget"].name] = r["aa"]["repeat"]
    s0 = done[0]["spec"]
    meta = {"name": st.name, "description": st.description, "file": os.path.basename(st.path),
            "fingerprint": st.fingerprint, "seeds": list(s0.seeds),
            "budgets": [{"name": d["budget"].name, "tokens": d["spec"].base.derived["tokens"],
                         "width": d["budget"].width, "flops": run_flops(d["spec"].base)} for d in done]}
    results = scaling_report.assemble(meta, points(done), {d["budget"].name: d["tuning"] for d in done if d["tuning"]},
                                      form=st.fit, reps=st.bootstrap,
                                      **({} if st.window is None else {"window": st.window}))
    wall = [x["timing"]["wall_s"] for d in done for x in d["records"].values()]
    for d in done:
        for job in d["budget"].tune_jobs:
            wall.append(read_json(os.path.join(job.dir(os.path.join(out, "tune", d["budget"].name)),
                                               "result.json"))["timing"]["wall_s"])
    results["repeat"] = repeats  # per budget: the A/A determinism repeat (None: the file asks for none)
    results["timing"] = {"this_invocation_s": time.perf_counter() - t0, "runs_wall_s": sum(wall), "runs": len(wall)}
    scaling_report.write_all(results, out)
    return results


def run(spec: Spec | Study, out: str, *, progress: bool | None = None, log=None,
        report_only: bool = False) -> dict | None:
    """Run (or resume) a loaded ablation file in ``out`` and write its reports (``run_ablation`` / ``run_scaling``);
    the results, or None when SIGTERM stopped it (re-run the same call to continue). ``report_only``: train nothing,
    report the runs in ``out`` (written by workers: ``run_share``), or raise ``IncompleteError`` naming the missing
    ones. A decoding study (``k3jax.ablate.decoding_run``) always returns its results."""
    if isinstance(spec, DecodingSpec):
        return run_decoding(spec, out, progress=progress, log=log, report_only=report_only)
    return (run_scaling if isinstance(spec, Study) else run_ablation)(spec, out, progress=progress, log=log,
                                                                      report_only=report_only)


def run_share(spec: Spec | Study, out: str, share: Share, *, progress: bool | None = None, log=None) -> dict | None:
    """Worker ``share``'s runs of a loaded ablation file in ``out`` (``k3jax.ablate.share``; several workers fill one
    ``out`` at once, each its own runs), no report: {"worker": "I/N", "phases": {phase: [its runs' labels]}}, or None
    when SIGTERM stopped it (re-run the same call to continue). Once every worker is done, ``run`` reports."""
    if isinstance(spec, DecodingSpec):
        raise InputError("--worker: a decoding study runs in one process on one machine (its arms' tokens/s are "
                         "compared with each other); run it without --worker")
    if isinstance(spec, Study):
        done = run_study_share(spec, out, share, progress=progress, log=log)
    else:
        got = run_grid(spec, out, progress=progress, log=log, share=share)
        done = None if got is None else {"": got[0]}
    if done is None:
        return None
    return {"worker": share.label, "phases": {phase or ".": [j.label for j in recs] for phase, recs in done.items()}}


def claim(spec: Spec | Study, out: str, *, create: bool = True) -> None:
    """``out`` becomes the file's output directory, or is refused (AblationSpecError) when it holds another file's
    results or anything else (``runner.claim_out`` / ``study.claim_study``; ``create`` False: a report, which
    needs the directory claimed already)."""
    if isinstance(spec, DecodingSpec):
        return claim_decoding(spec, out, create=create)
    (claim_study if isinstance(spec, Study) else claim_out)(spec, out, create=create)


def markdown(spec: Spec | Study, results: dict) -> str:
    """results.md's text for ``run``'s results."""
    if isinstance(spec, DecodingSpec):
        return decoding_markdown(results)
    return (scaling_report if isinstance(spec, Study) else ablate_report).markdown(results)


def failed_repeats(spec: Spec | Study, results: dict) -> dict:
    """{budget ("" for a plain ablation): the A/A determinism repeat} for every repeat whose two runs differ (a
    decoding study's: its A/A run when its tokens differ from the base's)."""
    if isinstance(spec, DecodingSpec):
        rep = failed_decoding_repeat(results)
        return {} if rep is None else {"": rep}
    repeats = results["repeat"] if isinstance(spec, Study) else {"": results["aa"]["repeat"]}
    return {b: rep for b, rep in repeats.items() if rep is not None and not rep["identical"]}


# ------------------------------------------------------------------------------------------------- --check

def describe_spec(spec: Spec) -> str:
    """Every arm of ``spec``: its counts, token budget and its difference from the base."""
    lines = [f"{spec.path}: {spec.name!r}, seeds {list(spec.seeds)}, {len(spec.runs)} distinct configuration(s), "
             f"fingerprint {spec.fingerprint[:12]}"]
    for n, a in spec.arms.items():
        same = f" (runs as {a.run_id})" if a.run_id != n else ""
        d = a.derived
        lines.append(f"{n}{same}: params {d['params']:,}, active {d['active_params']:,}, {d['tokens']:,} tokens "
                     f"({a.train['steps']} steps)")
        if n != "base":
            lines.append(format_diff(spec.base, a))
    return "\n".join(lines)


def describe_study(st: Study) -> str:
    """A study's budgets (tokens, width, compute, runs) and its largest budget's arms."""
    runs = 0
    lines = [f"{st.path}: scaling study {st.name!r}, {len(st.budgets)} budgets, fit {st.fit!r}, "
             f"{st.bootstrap} bootstrap resamples, fingerprint {st.fingerprint[:12]}"]
    for b in st.budgets:
        n = len(grid(b.spec)) + len(b.tune_jobs)
        runs += n
        lines.append(f"budget {b.name}: {b.spec.base.derived['tokens']:,} tokens, width {b.width:g}, base "
                     f"{run_flops(b.spec.base):.3g} FLOPs; {n} runs ({len(b.tune_jobs)} tuning)")
    lines.append(f"{runs} runs in all (tuned levels that pick another value run once more at each seed)")
    lines.append(f"budget {st.budgets[-1].name}'s arms:")
    lines.append(describe_spec(st.budgets[-1].spec))
    return "\n".join(lines)


def describe(spec: Spec | Study) -> str:
    """What `k3 ablate --check` prints."""
    if isinstance(spec, DecodingSpec):
        return describe_decoding(spec)
    return describe_study(spec) if isinstance(spec, Study) else describe_spec(spec)


def resolved(spec: Spec | Study) -> dict:
    """What `k3 ablate --check --json` prints: the fingerprint and every arm's flat settings and derived values (a
    study's per budget, with its tuning runs; a decoding study's decoding settings)."""
    if isinstance(spec, DecodingSpec):
        return resolved_decoding(spec)

    def arms(s):
        return {n: {"run": a.run_id, "flat": a.flat, "derived": a.derived} for n, a in s.arms.items()}
    doc = ({"budgets": {b.name: {"arms": arms(b.spec), "tuning_runs": [j.run_id for j in b.tune_jobs]}
                        for b in spec.budgets}} if isinstance(spec, Study) else {"arms": arms(spec)})
    return {"fingerprint": spec.fingerprint} | doc


__all__ = ["claim", "describe", "describe_spec", "describe_study", "failed_repeats", "markdown", "resolved", "run",
           "run_ablation", "run_scaling", "run_share"]
