"""The results of a `k3 ablate` grid: ``results.json`` (schema below), ``results.md`` (the tables) and
``curves.png`` (held-out loss vs step, mean ± std band over seeds, one panel per factor).

    results = assemble(spec, records, init)      # k3jax.ablate.runner.run_grid's output
    write_all(results, "runs/smoke")
    strip_timing(results)                         # what two runs of one file agree on bit for bit

results.json (every wall-clock figure sits under a ``timing`` key, at any depth; the rest is a deterministic
function of the file, so two runs of it agree bit for bit once ``strip_timing`` removed those)::

    schema        "k3jax.ablate/1"
    spec          {name, description, file, fingerprint, seeds, tokens, steps, eval_windows, eval_tokens_per_window}
    arms          {arm: {run, factor, level, seeds, params, active_params, tokens,
                         eval_loss: {per_seed, n, mean, std}, bits_per_byte: {...},       # final held-out loss
                         init: {from_base, own_leaves},    # fraction of params starting from the base's values
                         skipped_steps: {seed: [steps]},   # non-finite steps the loop skipped (empty: none)
                         curve: {step, mean, std},         # periodic held-out loss over seeds
                         timing: {tokens_per_s: {per_seed, n, mean, std}, wall_s: [per seed]}}}
                  the A/A arm is "base~aa" (the base at seed + offset) when the file asks for it
    factors       {factor: {keys, varies, holds, tolerance, base_level,
                            levels: {level: {arm,                                       # base level: just {arm}
                                             paired: {per_seed, n, mean, std, sem, half_width, ci95},
                                             bootstrap_ci95, delta_bits_per_byte: {mean, ci95},
                                             verdict, reason}}}}
    aa            {seed_offset, paired, bootstrap_ci95, floor, repeat: {seed, eval_loss: [a, b], identical}}
    timing        {this_invocation_s, runs_wall_s}

Differences are arm − base (a tuned factor's: arm − its own base level) in nats per token of the final held-out
loss, paired by seed (the same init and token stream); ``paired`` is a Student-t interval over seeds,
``bootstrap_ci95`` resamples the shared held-out windows (the per-window differences averaged over seeds;
``k3jax.analysis.paired``). bits/byte = nats / ln 2 (byte tokens).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from k3jax.analysis.paired import aa_floor, bootstrap_ci, mean_std, paired_t, verdict
from k3jax.checkpoint.atomic import staged_file

LN2 = math.log(2.0)
SCHEMA = "k3jax.ablate/1"


def _by_seed(records: dict, run_id: str, tag: str = "") -> dict:
    return {job.seed: r for job, r in records.items() if job.run_id == run_id and job.tag == tag}


def _curve(recs: list[dict]) -> dict:
    steps = recs[0]["curve"]["step"]
    ys = np.array([r["curve"]["eval_loss"] for r in recs if r["curve"]["step"] == steps], np.float64)
    return {"step": steps, "mean": [float(x) for x in ys.mean(0)] if len(ys) else [],
            "std": [float(x) for x in ys.std(0, ddof=1)] if len(ys) > 1 else None}


def _arm_block(arm, recs: dict, seeds, init: dict) -> dict:
    rs = [recs[s] for s in seeds]
    losses = [r["final_eval_loss"] for r in rs]
    tps = [r["timing"]["tokens_per_s"] for r in rs if r["timing"]["tokens_per_s"] is not None]
    return {"run": arm.run_id, "factor": arm.factor, "level": arm.level, "seeds": list(seeds),
            "params": arm.derived["params"], "active_params": arm.derived["active_params"],
            "tokens": arm.derived["tokens"], "eval_loss": mean_std(losses),
            "bits_per_byte": mean_std([x / LN2 for x in losses]),
            "init": {"from_base": init["from_base"] / init["params"], "own_leaves": init["own_leaves"]},
            "skipped_steps": {str(s): recs[s]["skipped_steps"] for s in seeds if recs[s]["skipped_steps"]},
            "curve": _curve(rs),
            "timing": {"tokens_per_s": mean_std(tps), "wall_s": [r["timing"]["wall_s"] for r in rs]}}


def _compare(arm_recs: dict, base_recs: dict, pairs, reps: int) -> dict:
    """Paired statistics of ``arm_recs[a] - base_recs[b]`` over the (a, b) seed pairs."""
    diffs = [arm_recs[a]["final_eval_loss"] - base_recs[b]["final_eval_loss"] for a, b in pairs]
    per_window = np.mean([np.subtract(arm_recs[a]["window_losses"], base_recs[b]["window_losses"])
                          for a, b in pairs], axis=0)
    p = paired_t(diffs)
    return {"paired": p, "bootstrap_ci95": bootstrap_ci(per_window, reps=reps, seed=0),
            "delta_bits_per_byte": {"mean": p["mean"] / LN2,
                                    "ci95": None if p["ci95"] is None else [x / LN2 for x in p["ci95"]]}}


def assemble(spec, records: dict, init_plan: dict) -> dict:
    """results.json's content (less its top-level ``timing``) from every run's record: ``records`` maps jobs
    (``.run_id``, ``.seed``, ``.tag``) to their result.json; ``init_plan`` maps run ids to ``init_summary``."""
    seeds = spec.seeds
    base_recs = _by_seed(records, "base")
    arms = {n: _arm_block(a, _by_seed(records, a.run_id), seeds, init_plan[a.run_id]) for n, a in spec.arms.items()}
    aa = {"seed_offset": spec.aa.get("seed_offset"), "paired": None, "bootstrap_ci95": None, "floor": None,
          "repeat": None}
    if spec.aa_seeds:
        arms["base~aa"] = dict(_arm_block(spec.base, base_recs, spec.aa_seeds, init_plan["base"]), level="aa")
        aa |= _compare(base_recs, base_recs, list(zip(spec.aa_seeds, seeds)), spec.bootstrap)
        aa.pop("delta_bits_per_byte")
        aa["floor"] = aa_floor(aa["paired"])
    if spec.aa.get("repeat"):
        s0 = seeds[0]
        again = _by_seed(records, "base", "repeat")[s0]
        first = base_recs[s0]
        same = all(first[k] == again[k] for k in ("final_eval_loss", "window_losses", "curve"))
        aa["repeat"] = {"seed": s0, "eval_loss": [first["final_eval_loss"], again["final_eval_loss"]],
                        "identical": same}
    factors = {}
    for f in spec.factors:
        levels = {}
        ref = f.levels[f.base_level]  # "base", or a tuned factor's own base level (a scaling study's)
        ref_recs = _by_seed(records, spec.arms[ref].run_id)
        for level, name in f.levels.items():
            if level == f.base_level:
                levels[level] = {"arm": ref}
                continue
            c = _compare(_by_seed(records, spec.arms[name].run_id), ref_recs, [(s, s) for s in seeds],
                         spec.bootstrap)
            word, why = verdict(c["paired"], c["bootstrap_ci95"], aa["floor"])
            levels[level] = {"arm": name, **c, "verdict": word, "reason": why}
        factors[f.name] = {"keys": list(f.keys), "varies": list(f.varies), "holds": list(f.holds),
                           "tolerance": f.tolerance, "base_level": f.base_level, "levels": levels}
    t = spec.base.train
    return {"schema": SCHEMA,
            "spec": {"name": spec.name, "description": spec.description, "file": os.path.basename(spec.path),
                     "fingerprint": spec.fingerprint, "seeds": list(seeds), "preset": spec.base.cfg.name,
                     "tokens": spec.base.derived["tokens"], "steps": t["steps"], "batch": t["batch"],
                     "seq_len": t["seq_len"], "eval_windows": len(base_recs[seeds[0]]["window_losses"])},
            "arms": arms, "factors": factors, "aa": aa}


# ---------------------------------------------------------------------------------------------------- writing

def _pm(ms: dict, fmt: str = ".4f") -> str:
    if ms["mean"] is None:
        return "-"
    return f"{ms['mean']:{fmt}}" + (f" ± {ms['std']:{fmt}}" if ms["std"] is not None else "")


def _ci(ci) -> str:
    return "-" if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"


def markdown(r: dict) -> str:
    s = r["spec"]
    out = [f"# Ablation `{s['name']}`", "", s["description"], "",
           f"File `{s['file']}` (fingerprint `{s['fingerprint'][:12]}`); base {s['preset']}; seeds {s['seeds']}; "
           f"{s['tokens']:,} training tokens per run ({s['steps']} steps x {s['batch']} x {s['seq_len']}); "
           f"final held-out loss over {s['eval_windows']} windows of {s['seq_len']} tokens, nats/token "
           f"(bits/byte = nats / ln 2).", "",
           "| arm | params | active | eval loss | bits/byte | tokens/s | init from base |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for n, a in r["arms"].items():
        out.append(f"| {n} | {a['params']:,} | {a['active_params']:,} | {_pm(a['eval_loss'])} | "
                   f"{_pm(a['bits_per_byte'])} | {_pm(a['timing']['tokens_per_s'], '.0f')} | "
                   f"{a['init']['from_base']:.3%} |")
    out += ["", "Paired differences, arm − base at the same seed (nats/token; negative = the arm is better):", "",
            "| factor | level | Δ mean ± std | paired-t 95% | window bootstrap 95% | Δ bits/byte | verdict |",
            "|---|---|---:|---:|---:|---:|---|"]
    for fn, f in r["factors"].items():
        for lv, x in f["levels"].items():
            if "paired" not in x:
                continue
            out.append(f"| {fn} | {lv} | {_pm(x['paired'])} | {_ci(x['paired']['ci95'])} | "
                       f"{_ci(x['bootstrap_ci95'])} | {x['delta_bits_per_byte']['mean']:+.4f} | {x['verdict']} |")
    aa = r["aa"]
    out.append("")
    if aa["paired"] is not None:
        out.append(f"A/A (the base at seed + {aa['seed_offset']} vs the base at seed): Δ {_pm(aa['paired'])}, "
                   f"paired-t 95% {_ci(aa['paired']['ci95'])}, bootstrap {_ci(aa['bootstrap_ci95'])}; noise floor "
                   + (f"{aa['floor']:.4f}" if aa["floor"] is not None else "- (needs >= 2 seeds)") + ".")
    else:
        out.append("No A/A arm: verdicts rest on the intervals alone.")
    if aa["repeat"] is not None:
        a, b = aa["repeat"]["eval_loss"]
        out.append(f"Determinism: the base at seed {aa['repeat']['seed']} twice: "
                   + ("bit-identical." if aa["repeat"]["identical"] else f"DIFFERS ({a!r} vs {b!r})."))
    out += ["", "Verdicts:", ""]
    out += [f"- {fn} = {lv}: {x['reason']}" for fn, f in r["factors"].items() for lv, x in f["levels"].items()
            if "reason" in x]
    return "\n".join(out) + "\n"


def plot_curves(r: dict, path: str) -> None:
    import matplotlib  # an optional dependency (the dev extra): needed only when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    facs = list(r["factors"].items())
    fig, axes = plt.subplots(1, len(facs), figsize=(5.5 * len(facs), 4), squeeze=False)
    for ax, (fn, f) in zip(axes[0], facs):
        names = [x["arm"] for x in f["levels"].values()] + (["base~aa"] if "base~aa" in r["arms"] else [])
        for n in names:
            c = r["arms"][n]["curve"]
            lv = {"base": f["base_level"], "base~aa": "A/A"}.get(n, r["arms"][n]["level"])
            line, = ax.plot(c["step"], c["mean"], marker=".", label=f"{lv}" + (" (base)" if n == "base" else ""),
                            linestyle="--" if n == "base~aa" else "-")
            if c["std"] is not None:
                lo, hi = np.subtract(c["mean"], c["std"]), np.add(c["mean"], c["std"])
                ax.fill_between(c["step"], lo, hi, color=line.get_color(), alpha=0.2)
        ax.set_title(fn)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.legend()
    fig.suptitle(f"{r['spec']['name']}: mean ± std over {len(r['spec']['seeds'])} seeds")
    save_figure(fig, path)


def save_figure(fig, path: str) -> None:
    """``fig`` as a PNG at ``path``, written atomically (a temporary file, a rename), then closed."""
    import matplotlib.pyplot as plt  # optional dependency, as in plot_curves

    fig.tight_layout()
    with staged_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def write_text(path: str, text: str) -> None:
    """``text`` at ``path``, written atomically (a temporary file, a rename)."""
    with staged_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def write_all(results: dict, out: str) -> None:
    """results.json, results.md and curves.png in ``out``, each written atomically."""
    write_text(os.path.join(out, "results.json"), json.dumps(results, indent=1, sort_keys=True) + "\n")
    write_text(os.path.join(out, "results.md"), markdown(results))
    plot_curves(results, os.path.join(out, "curves.png"))


def strip_timing(obj):
    """``obj`` without any ``timing`` key at any depth."""
    if isinstance(obj, dict):
        return {k: strip_timing(v) for k, v in obj.items() if k != "timing"}
    if isinstance(obj, list):
        return [strip_timing(v) for v in obj]
    return obj


__all__ = ["SCHEMA", "assemble", "markdown", "plot_curves", "save_figure", "strip_timing", "write_all", "write_text"]
