"""Running a decoding study (``k3jax.ablate.decoding``) and its tables: every (arm, seed) generates from the study's
prompts, per category, in one process on one model; results.json and results.md.

    spec = load_decoding("experiments/ablations/speculative.toml")
    results = run_decoding(spec, "runs/speculative")          # resumes: finished runs are read back
    print(decoding_markdown(results))

Output directory (an ablation's layout, ``k3jax.ablate.runner``)::

    ablation.json             the resolved file it belongs to (a different file is refused: exit 2)
    runs/<run>/seed-<s>/      result.json: per category the figures of ``k3jax.draft.measure.measure``
    runs/base/seed-<s>-aa/    the A/A arm: the base again
    results.json  results.md

Runs go seed by seed, each seed's arms in file order and then the A/A run, so a slow spell of a shared machine
lands on neighbouring arms alike; the A/A arm shows how far tokens/s moves between two runs of the same settings.
Compiles are kept out of tokens/s twice over: the first time a configuration runs in the process it generates once
untimed first (a warm-up on the first category; the categories share their shapes), and the timed figure leaves
out the first decode / verify step. So a killed study that resumes in a fresh process measures as a whole one does.

results.json (wall-clock figures under ``timing`` keys, so ``k3jax.analysis.ablate_report.strip_timing`` leaves
what two runs agree on)::

    schema        "k3jax.ablate.decoding/1"
    spec          {name, description, file, fingerprint, seeds, model, dtype, prompts: {categories, count, length,
                   max_new_tokens, sha256}}
    arms          {arm: {run, factor, level, decoding: {the keys in effect}, changes: {key: [base, arm]},
                         categories: {cat: {acceptance_length: {per_seed, n, mean, std} | None (no draft),
                                            target_forwards_per_token: {...}, rows_equal_base,
                                            timing: {tokens_per_s: {...}, tokens_per_s_over_base}}}}}
                  "base~aa" is the base run again (with [aa] repeat)
    factors       {factor: {keys, base_level, levels: {level: {arm}}}}
    aa            {repeat, identical: the A/A tokens equal the base's at every seed and category (None: no A/A)}
    timing        {this_invocation_s, runs_wall_s}
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from k3jax.ablate.decoding import DecodingSpec, decoding_of, inert
from k3jax.ablate.runner import Job, claim_dir, collect, write_json
from k3jax.ablate.share import IncompleteError
from k3jax.ablate.spec import AblationSpecError, canonical, sha256
from k3jax.analysis.ablate_report import write_text
from k3jax.analysis.paired import mean_std
from k3jax.draft.measure import make_drafter, measure, rows_equal
from k3jax.model.generate import Sampling

SCHEMA = "k3jax.ablate.decoding/1"


def decoding_grid(spec: DecodingSpec) -> list[Job]:
    """Every run, seed-major: at each seed the distinct configurations, then the A/A base (tag "aa")."""
    jobs = []
    for s in spec.seeds:
        jobs += [Job(rid, s) for rid in spec.runs]
        if spec.aa["repeat"]:
            jobs.append(Job("base", s, "aa"))
    return jobs


def claim_decoding(spec: DecodingSpec, out: str, *, create: bool = True) -> None:
    """Make ``out`` this study's directory, or refuse one holding another file's results (``runner.claim_dir``)."""
    ident = {"fingerprint": spec.fingerprint, "file": spec.path, "name": spec.name, "kind": "decoding",
             "seeds": list(spec.seeds), "aa": spec.aa,
             "arms": {n: {"flat": a.flat} for n, a in spec.arms.items()}}

    def refuse(old: dict) -> AblationSpecError:
        return AblationSpecError(f"--out {out}: holds the results of a different ablation file ({old.get('file')}, "
                                 f"name {old.get('name')!r}): use a fresh --out")

    claim_dir(out, "ablation.json", ident, refuse, create=create)


class _Model:
    """The study's model, loaded on first use, and its drafters (one per drafter and K)."""

    def __init__(self, spec: DecodingSpec):
        self.spec, self.loaded, self.drafters = spec, None, {}
        self.warmed: set[str] = set()  # the decoding settings (in effect) that ran in this process

    def first_time(self, d: dict) -> bool:
        """True the first time settings ``d`` run in this process (their programs are not compiled yet)."""
        key = canonical({k: v for k, v in d.items() if k not in inert(d)})
        new = key not in self.warmed
        self.warmed.add(key)
        return new

    def get(self):
        if self.loaded is None:
            from k3jax.checkpoint.source import load_model

            m = self.spec.model
            self.loaded = load_model(ckpt=m["ckpt"], preset=m["preset"], dtype=m["dtype"])
        return self.loaded

    def drafter(self, d: dict):
        key = (d["drafter"], d["draft_tokens"])
        if key not in self.drafters:
            cfg, run, params = self.get()
            src = self.spec.drafters[d["drafter"]] or d["drafter"]        # a checked directory, or random / self
            self.drafters[key] = make_drafter(src, params, cfg, run, K=d["draft_tokens"],
                                              dtype=self.spec.model["dtype"])
        return self.drafters[key]


def run_job(spec: DecodingSpec, out: str, job: Job, model: _Model, log) -> dict:
    """Generate for one (arm, seed) in every category; its result record (written to result.json)."""
    arm = spec.runs[job.run_id]
    d = decoding_of(arm)
    cfg, run, params = model.get()
    drafter = model.drafter(d) if d["draft"] else None
    sampling = Sampling(greedy=d["greedy"], temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"])
    t0 = time.perf_counter()
    cats, warm = {}, model.first_time(d)
    for i, c in enumerate(spec.prompts["categories"]):    # equal shapes: a warm-up on the first category does
        cats[c] = measure(params, cfg, run, spec.tokens[c], drafter=drafter,
                          max_new_tokens=spec.prompts["max_new_tokens"], sampling=sampling, seed=job.seed,
                          rollback=d["rollback"], warmup=warm and i == 0)
        acc = cats[c]["acceptance_length"]
        log(f"[{job.label}] {c}: " + (f"{acc:.2f} tokens per verify, " if acc is not None else "")
            + f"{cats[c]['timing']['tokens_per_s']} tokens/s")
    rec = {"key": sha256({"flat": arm.flat, "seed": job.seed, "tag": job.tag}), "run": job.run_id, "seed": job.seed,
           "tag": job.tag, "categories": cats, "timing": {"wall_s": time.perf_counter() - t0}}
    write_json(os.path.join(job.dir(out), "result.json"), rec)
    return rec


def _by_seed(records: dict, run_id: str, tag: str = "") -> dict:
    return {job.seed: r for job, r in records.items() if job.run_id == run_id and job.tag == tag}


def _figure(ms: list[dict], key: str) -> dict | None:
    vals = [m[key] for m in ms]
    return None if any(v is None for v in vals) else mean_std(vals)


def _arm_block(spec: DecodingSpec, arm, recs: dict, base_recs: dict) -> dict:
    cats = {}
    for c in spec.prompts["categories"]:
        ms = [recs[s]["categories"][c] for s in spec.seeds]
        bs = [base_recs[s]["categories"][c] for s in spec.seeds]
        tps, base_tps = _figure([m["timing"] for m in ms], "tokens_per_s"), _figure([b["timing"] for b in bs],
                                                                                      "tokens_per_s")
        cats[c] = {"acceptance_length": _figure(ms, "acceptance_length"),
                   "target_forwards_per_token": _figure(ms, "target_forwards_per_token"),
                   "rows_equal_base": float(np.mean([rows_equal(m["tokens"], b["tokens"]) for m, b in zip(ms, bs)])),
                   "timing": {"tokens_per_s": tps,
                              "tokens_per_s_over_base": None if tps is None or base_tps is None
                              else tps["mean"] / base_tps["mean"]}}
    d, b = decoding_of(arm), decoding_of(spec.base)
    return {"run": arm.run_id, "factor": arm.factor, "level": arm.level,
            "decoding": {k: v for k, v in d.items() if k not in inert(d)},
            "changes": {k: [b[k], v] for k, v in d.items() if v != b[k]}, "categories": cats}


def assemble(spec: DecodingSpec, records: dict) -> dict:
    """results.json's content (less its top-level ``timing``) from every run's record ({Job: result.json})."""
    base_recs = _by_seed(records, "base")
    arms = {n: _arm_block(spec, a, _by_seed(records, a.run_id), base_recs) for n, a in spec.arms.items()}
    aa = {"repeat": spec.aa["repeat"], "identical": None}
    if spec.aa["repeat"]:
        again = _by_seed(records, "base", "aa")
        arms["base~aa"] = _arm_block(spec, spec.base, again, base_recs) | {"level": "aa"}
        aa["identical"] = all(again[s]["categories"][c]["tokens"] == base_recs[s]["categories"][c]["tokens"]
                              for s in spec.seeds for c in spec.prompts["categories"])
    factors = {f.name: {"keys": list(f.keys), "base_level": f.base_level,
                        "levels": {lv: {"arm": n} for lv, n in f.levels.items()}} for f in spec.factors}
    m = spec.model
    return {"schema": SCHEMA,
            "spec": {"name": spec.name, "description": spec.description, "file": os.path.basename(spec.path),
                     "fingerprint": spec.fingerprint, "seeds": list(spec.seeds), "model": m["source"],
                     "dtype": m["dtype"], "prompts": {k: (list(v) if isinstance(v, tuple) else v)
                                                      for k, v in spec.prompts.items()}},
            "arms": arms, "factors": factors, "aa": aa}


def run_decoding(spec: DecodingSpec, out: str, *, progress: bool | None = None, log=None,
                 report_only: bool = False) -> dict:
    """Run (or resume) every (arm, seed) of ``spec`` in ``out``, then write results.json and results.md; the
    results. ``report_only``: run nothing; ``IncompleteError`` names the runs missing from ``out``."""
    t0 = time.perf_counter()
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    claim_decoding(spec, out, create=not report_only)
    jobs = decoding_grid(spec)
    records, missing = collect(spec, out, jobs)
    if missing and report_only:
        raise IncompleteError(f"--out {out}: {len(missing)} of {len(jobs)} runs missing, so no report: "
                              f"{', '.join(j.label for j in missing)}")
    model = _Model(spec)
    for job in missing:
        records[job] = run_job(spec, out, job, model, say)
    records = {j: records[j] for j in jobs}
    results = assemble(spec, records)
    results["timing"] = {"this_invocation_s": time.perf_counter() - t0,
                         "runs_wall_s": sum(r["timing"]["wall_s"] for r in records.values())}
    write_json(os.path.join(out, "results.json"), results)
    write_text(os.path.join(out, "results.md"), decoding_markdown(results))
    return results


# --------------------------------------------------------------------------------------------------- the tables

def _pm(ms: dict | None, fmt: str) -> str:
    if ms is None:
        return "-"
    return f"{ms['mean']:{fmt}}" + (f" ± {ms['std']:{fmt}}" if ms["std"] is not None else "")


def decoding_markdown(r: dict) -> str:
    """results.md's text: per arm and category the figures, the A/A line and each arm's one changed key."""
    s, p = r["spec"], r["spec"]["prompts"]
    out = [f"# Decoding study `{s['name']}`", "", *([s["description"], ""] if s["description"] else []),
           f"File `{s['file']}` (fingerprint `{s['fingerprint'][:12]}`); model {s['model']} ({s['dtype']}); seeds "
           f"{s['seeds']}; {p['count']} prompts x {p['length']} tokens per category, {p['max_new_tokens']} new tokens "
           "per row. Acceptance: tokens emitted per row and target verify; target forwards per emitted token (a "
           "verify reads K + 1 tokens); tokens/s of the compiled steps (the first, compiling, step left out).", "",
           "| arm | category | acceptance length | target forwards / token | tokens/s | x base | rows = base |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for n, a in r["arms"].items():
        for c, x in a["categories"].items():
            ratio = x["timing"]["tokens_per_s_over_base"]
            out.append(f"| {n} | {c} | {_pm(x['acceptance_length'], '.2f')} | "
                       f"{_pm(x['target_forwards_per_token'], '.3f')} | {_pm(x['timing']['tokens_per_s'], '.1f')} | "
                       f"{'-' if ratio is None else f'{ratio:.3f}'} | {x['rows_equal_base']:.2f} |")
    out.append("")
    aa = r["aa"]
    if aa["repeat"]:
        noise = ", ".join(f"{c} {x['timing']['tokens_per_s_over_base']:.3f}"
                          for c, x in r["arms"]["base~aa"]["categories"].items()
                          if x["timing"]["tokens_per_s_over_base"] is not None)
        out.append(f"A/A (the base run again at each seed): tokens/s x base {noise or '-'}; its tokens "
                   + ("equal the base's." if aa["identical"] else "DIFFER from the base's."))
    else:
        out.append("No A/A arm: nothing shows how far tokens/s moves between two runs of the same settings.")
    out += ["", "Each arm changes one decoding setting of the base:", ""]
    for n, a in r["arms"].items():
        if n not in ("base", "base~aa"):
            out.append(f"- {n}: " + ", ".join(f"decoding.{k} {b!r} -> {v!r}" for k, (b, v) in a["changes"].items())
                       + " (in effect: " + ", ".join(f"{k}={v}" for k, v in a["decoding"].items()) + ")")
    return "\n".join(out) + "\n"


def failed_decoding_repeat(results: dict) -> dict | None:
    """The A/A run's record when its tokens differ from the base's (in the fields `k3 ablate` prints), else None."""
    aa = results["aa"]
    if not aa["repeat"] or aa["identical"]:
        return None
    return {"seed": results["spec"]["seeds"], "eval_loss": "generated tokens differ", "identical": False}


__all__ = ["SCHEMA", "assemble", "claim_decoding", "decoding_grid", "decoding_markdown", "failed_decoding_repeat",
           "run_decoding", "run_job"]
