"""The results of a scaling study (`k3 ablate` with ``[scaling]``): loss-vs-compute fits per series, each factor
level's effective compute multiplier with bootstrap intervals, the tuning curves; ``results.json`` (schema below),
``results.md`` and ``scaling.png``.

    results = assemble(meta, pts, tuning, form="auto", reps=1000)   # pts: k3jax.ablate.study.points(...)
    write_all(results, "runs/scaling")

results.json (wall-clock figures sit under ``timing`` keys only, as in ``k3jax.analysis.ablate_report``)::

    schema     "k3jax.scaling/2"
    spec       {name, description, file, fingerprint, seeds, budgets: [{name, tokens, width, flops}], bootstrap}
    series     {key: {points: [{budget, run, tokens, flops, reported_flops, settings, loss: {per_seed, n, mean, std}}],
                      fit: {form, E, A, alpha, c0, weights (normalized, 1 / bootstrap variance), ci95: {E, alpha}},
                      fit_top: {form, budgets, alpha, A, ci95: {alpha}}}}    # the largest budgets' local fit
    scaling    {form, why, window, local_form,
                multipliers: {factor: {level: {estimate, ci95, reference, at_flops, curve: {flops, estimate, ci95}}}},
                aa: {estimate, ci95} | null}      # the calibration level's entry also has "true": k
    tuning     {factor: {level: {budget: {candidates: [{values, loss}], chosen}}}}
    repeat     {budget: the A/A determinism repeat of that budget's grid (ablate_report's aa.repeat) | null}
    timing     {this_invocation_s, runs_wall_s, runs}      (added by `k3 ablate`, k3jax.ablate.report.run_scaling)

A multiplier is the compute the reference series' fitted curve needs to reach the level's fitted held-out loss at
the largest common budget, divided by the compute the level spent there (the calibration level: the base's compute,
by construction). Both curves there are local fits: the power law on the ``window`` budgets nearest the compared
compute (``LOCAL_WINDOW``; the curve form takes at each compute the window nearest it), since a loss curve over an
8x range of early training is not one power law (the first budgets sit in the warmup); the fit over every budget is
reported beside them. Curve against curve, not a measured point against a curve: a point against a curve adds the
reference fit's residual at that budget, which moved the A/A arm off 1 in the smoke study (LOG, session 14). Above 1
it reads the reference curve beyond its largest point (an extrapolation of the fitted
form); inf (JSON null, "unbounded") means the reference curve never reaches that loss. The curve form uses both
fitted curves over the reference's compute range. Intervals are percentile bootstraps: seeds and held-out windows
drawn with replacement, the same draws for every series and budget (paired seeds, shared windows), every curve refitted
per draw.
"""

from __future__ import annotations

import json
import os

import numpy as np

from k3jax.analysis.ablate_report import save_figure, write_text
from k3jax.analysis.paired import mean_std
from k3jax.analysis.scaling_fit import (
    bootstrap_weights,
    compute_for,
    finite_or_none,
    fit_many,
    identified,
    loss_at,
    multiplier,
    percentile_ci,
)

SCHEMA = "k3jax.scaling/2"
CURVE_POINTS = 9
SATURATING_MIN_BUDGETS = 5
# Budgets per local power-law fit of the multipliers: the fewest it fits with a degree of freedom left. In the shipped
# study the base's log-log slope per doubling was 0.16 over its first (16-step, warmup-dominated) budget and 0.29,
# 0.29 after; a fit over all four budgets (α 0.244) read the calibration arm (true 1.5) as 1.74 [1.66, 1.84], the
# budgets nearest the compared compute as 1.53 [1.46, 1.61] (experiments/LOG.md, session 16)
LOCAL_WINDOW = 3


def _col(fit: dict) -> dict:
    """A batched fit's arrays as columns [B, 1], to broadcast against compute grids [K]."""
    return {k: (v[:, None] if isinstance(v, np.ndarray) else v) for k, v in fit.items()}


def _arrays(pts: dict) -> tuple[dict, dict]:
    """({series: window losses [J, S, W]}, {series: reported compute [J]}), checking every series has one point per
    budget with the same seed and window counts."""
    series = pts["series"]
    wl, comp = {}, {}
    shape = None
    for key, ps in series.items():
        a = np.asarray([p["window_losses"] for p in ps], np.float64)
        if a.ndim != 3:
            raise ValueError(f"scaling report: series {key!r} has ragged window losses")
        if shape is None:
            shape = a.shape
        if a.shape != shape:
            raise ValueError(f"scaling report: series {key!r} has window losses of shape {a.shape} (budgets, seeds, "
                             f"windows), the base has {shape}")
        wl[key], comp[key] = a, np.asarray([p["reported_flops"] for p in ps], np.float64)
    return wl, comp


def choose_form(asked: str, comp: dict, point_loss: dict, weights: dict) -> tuple[str, str]:
    """The study-wide form: "auto" is the saturating form only with >= SATURATING_MIN_BUDGETS budgets (with 4, its 3
    parameters leave one degree of freedom: E follows the noise of the smallest budgets, measured in the LOG) and
    when every series identifies E; otherwise the power law."""
    if asked != "auto":
        return asked, f"fit = {asked!r} in [scaling]"
    n = len(next(iter(comp.values())))
    if n < SATURATING_MIN_BUDGETS:
        return "power", (f"auto: {n} budgets leave the 3-parameter form one degree of freedom, too few to identify E "
                         f"(it takes >= {SATURATING_MIN_BUDGETS}): L = A·C^(−α) for every series")
    for key in comp:
        ok, why = identified(comp[key], point_loss[key], weights[key])
        if not ok:
            return "power", f"auto: series {key!r} does not identify E ({why}): L = A·C^(−α) for every series"
    return "saturating", "auto: every series identifies E: L = E + A·C^(−α)"


def _nearest_window(comp: np.ndarray, c: float, w: int) -> int:
    """The start of the ``w`` consecutive budgets whose log-compute centre is nearest ``c``."""
    centres = [np.log(comp[s:s + w]).mean() for s in range(comp.size - w + 1)]
    return int(np.argmin(np.abs(np.asarray(centres) - np.log(c))))


def _multiplier_entry(ref, arm, comp_arm, comp_ref, w: int) -> dict:
    """ref / arm: (fits, bootstrap fits), one per window of ``w`` consecutive budgets (``assemble``)."""
    grid = np.geomspace(comp_ref[0], comp_ref[-1], CURVE_POINTS)
    top = comp_arm[-1]
    (ref_fit, ref_boot), (arm_fit, arm_boot) = ref[-1], arm[-1]            # the largest budgets' window
    est = float(multiplier(ref_fit, loss_at(arm_fit, top), top)[0])
    boot = multiplier(ref_boot, loss_at(arm_boot, top), top)
    curve, curve_boot = [], []
    for g in grid:
        s = _nearest_window(comp_ref, g, w)
        (rf, rb), (af, ab) = ref[s], arm[s]
        curve.append(float((compute_for(rf, loss_at(af, g)) / g)[0]))
        curve_boot.append(compute_for(rb, loss_at(ab, g)) / g)                            # [B]
    return {"estimate": finite_or_none(est), "ci95": finite_or_none(percentile_ci(boot)),
            "at_flops": float(comp_arm[-1]),
            "curve": {"flops": [float(c) for c in grid], "estimate": finite_or_none(curve),
                      "ci95": [finite_or_none(percentile_ci(b)) for b in curve_boot]}}


def assemble(meta: dict, pts: dict, tuning: dict, *, form: str, reps: int, seed: int = 0,
             window: int | None = None) -> dict:
    """results.json's content (less ``timing``). ``meta``: {name, description, file, fingerprint, seeds, budgets};
    ``pts``: ``ablate.study.points``; ``tuning``: {budget: ``ablate.study.pick``'s table}; ``window``: budgets
    per local fit of the multipliers, in the study's form (None: ``LOCAL_WINDOW`` for the power law; every budget
    for the saturating form, whose E already bends the curve)."""
    wl, comp = _arrays(pts)
    _, S, W = next(iter(wl.values())).shape
    ws, ww = bootstrap_weights(S, W, reps, seed)
    point = {k: a.mean(axis=(1, 2)) for k, a in wl.items()}
    boot = {k: np.einsum("bs,jsw,bw->bj", ws, a, ww) for k, a in wl.items()}  # [reps, J]
    # each point weighted by 1 / its bootstrap variance (seeds and windows), floored at a 1e-4 relative std so that
    # no point's weight is unbounded
    weights = {k: 1.0 / np.maximum(boot[k].var(axis=0), (1e-4 * point[k]) ** 2) for k in wl}
    form, why = choose_form(form, comp, point, weights)
    fits = {k: fit_many(comp[k], point[k][None], form, weights[k]) for k in wl}
    boots = {k: fit_many(comp[k], boot[k], form, weights[k]) for k in wl}
    J = next(iter(comp.values())).size
    w = min(J if window is None and form == "saturating" else window or LOCAL_WINDOW, J)
    if w < 3:
        raise ValueError(f"scaling report: a local fit needs >= 3 budgets, window = {window}")
    lform = form
    local = {k: [(fits[k], boots[k])] if w == J else
             [(fit_many(comp[k][s:s + w], point[k][None, s:s + w], lform, weights[k][s:s + w]),
               fit_many(comp[k][s:s + w], boot[k][:, s:s + w], lform, weights[k][s:s + w])) for s in range(J - w + 1)]
             for k in wl}
    top = [b["name"] for b in meta["budgets"][J - w:]] if meta.get("budgets") else None

    series = {}
    for key, ps in pts["series"].items():
        f = fits[key]
        series[key] = {
            "points": [{k: p[k] for k in ("budget", "run", "tokens", "flops", "reported_flops", "settings")}
                       | {"loss": mean_std(np.mean(p["window_losses"], axis=1))} for p in ps],
            "fit": {"form": form, "E": float(f["E"][0]), "A": float(f["A"][0]), "alpha": float(f["alpha"][0]),
                    "c0": f["c0"], "weights": [float(x) for x in weights[key] / weights[key].sum()],
                    "ci95": {"E": percentile_ci(boots[key]["E"]),
                             "alpha": percentile_ci(boots[key]["alpha"])}},
            "fit_top": {"form": lform, "budgets": top, "alpha": float(local[key][-1][0]["alpha"][0]),
                        "A": float(local[key][-1][0]["A"][0]),
                        "ci95": {"alpha": percentile_ci(local[key][-1][1]["alpha"])}}}

    def entry(ref, key):
        return _multiplier_entry(local[ref], local[key], comp[key], comp[ref], w)

    mult = {}
    for fname, fx in pts["factors"].items():
        mult[fname] = {}
        for level, key in fx["levels"].items():
            mult[fname][level] = {"reference": fx["reference"]} | entry(fx["reference"], key)
            if "true" in fx:
                mult[fname][level]["true"] = fx["true"]
    aa = None
    if "base~aa" in wl:
        e = entry("base", "base~aa")
        aa = {"estimate": e["estimate"], "ci95": e["ci95"]}
    by_factor: dict = {}
    for budget, table in tuning.items():
        for fname, levels in table.items():
            for level, t in levels.items():
                by_factor.setdefault(fname, {}).setdefault(level, {})[budget] = t
    return {"schema": SCHEMA, "spec": meta | {"bootstrap": reps}, "series": series,
            "scaling": {"form": form, "why": why, "window": w, "local_form": lform, "multipliers": mult, "aa": aa},
            "tuning": by_factor}


# ---------------------------------------------------------------------------------------------------- writing

def _m(x) -> str:
    return "unbounded" if x is None else f"{x:.3g}"


def _ci(ci) -> str:
    return f"[{_m(ci[0])}, {_m(ci[1])}]"


def _value(k: str, v) -> str:
    return f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"


def markdown(r: dict) -> str:
    s = r["spec"]
    names = [b["name"] for b in s["budgets"]]
    out = [f"# Scaling study `{s['name']}`", "", s["description"], "",
           f"File `{s['file']}` (fingerprint `{s['fingerprint'][:12]}`); seeds {s['seeds']}; {s['bootstrap']} "
           "bootstrap resamples of seeds and held-out windows. Compute is training FLOPs (6 · active matmul "
           "parameters + attention, per token, x tokens).", "",
           "| budget | tokens | width | base FLOPs |", "|---|---:|---:|---:|"]
    out += [f"| {b['name']} | {b['tokens']:,} | {b['width']:g} | {b['flops']:.3g} |" for b in s["budgets"]]
    out += ["", "Held-out loss (nats/token), mean ± std over seeds:", "",
            "| series | " + " | ".join(names) + " | fit: E | A | α [95%] | α, largest budgets [95%] |",
            "|---|" + "---:|" * (len(names) + 4)]
    for key, x in r["series"].items():
        f, t = x["fit"], x["fit_top"]
        cells = [f"{p['loss']['mean']:.4f}" + (f" ± {p['loss']['std']:.4f}" if p["loss"]["std"] is not None else "")
                 for p in x["points"]]
        out.append(f"| {key} | " + " | ".join(cells) + f" | {f['E']:.3f} | {f['A']:.3g} | {f['alpha']:.3f} "
                   f"[{f['ci95']['alpha'][0]:.3f}, {f['ci95']['alpha'][1]:.3f}] | {t['alpha']:.3f} "
                   f"[{t['ci95']['alpha'][0]:.3f}, {t['ci95']['alpha'][1]:.3f}] |")
    sc = r["scaling"]
    w = sc["window"]
    local = (f"both curves fitted on the {w} budgets nearest the compared compute ({sc['local_form']} law; at the "
             f"largest budget: {', '.join(next(iter(r['series'].values()))['fit_top']['budgets'] or [])})"
             if w < len(names) else "both curves fitted on every budget")
    out += ["", f"Fitted form: {sc['form']} ({sc['why']}).", "",
            "Effective compute multipliers (the compute the reference's curve needs for the level's fitted loss at the "
            f"largest budget / the level's compute; > 1: the level is worth more compute than it spends; {local}):",
            "",
            "| factor | level | reference | multiplier | 95% CI | over the range (smallest → largest budget) | true |",
            "|---|---|---|---:|---:|---|---:|"]
    for fname, levels in sc["multipliers"].items():
        for level, m in levels.items():
            c = m["curve"]["estimate"]
            true = f"{m['true']:g}" if "true" in m else ""
            out.append(f"| {fname} | {level} | {m['reference']} | {_m(m['estimate'])} | {_ci(m['ci95'])} | "
                       f"{_m(c[0])} → {_m(c[-1])} | {true} |")
    if sc["aa"] is not None:
        out += ["", f"A/A (the base at other seeds vs the base): multiplier {_m(sc['aa']['estimate'])}, 95% "
                    f"{_ci(sc['aa']['ci95'])}."]
    if r["tuning"]:
        out += ["", "Tuned settings each series ran with, per budget:", "",
                "| series | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for fname, levels in r["tuning"].items():
            for level in levels:
                keys = list(next(iter(levels[level].values()))["chosen"])
                pts = r["series"][f"{fname}={level}"]["points"]
                out.append(f"| {fname}={level} | " + " | ".join(", ".join(_value(k, p["settings"][k]) for k in keys)
                                                              for p in pts) + " |")
        out += ["", "Tuning (first seed, loss on the tuning windows, which the evaluation never scores; * = chosen):",
                "", "| factor | level | budget | candidates |", "|---|---|---|---|"]
        for fname, levels in r["tuning"].items():
            for level, budgets in levels.items():
                for b, t in budgets.items():
                    cand = "; ".join(("*" if c["values"] == t["chosen"] else "")
                                     + ", ".join(_value(k, v) for k, v in c["values"].items()) + f": {c['loss']:.4f}"
                                     for c in t["candidates"])
                    out.append(f"| {fname} | {level} | {b} | {cand} |")
    return "\n".join(out) + "\n"


def plot_scaling(r: dict, path: str) -> None:
    """Held-out loss vs compute (log-log), points mean ± std over seeds, fitted curves: one panel per factor (its
    reference and levels), plus the A/A arm beside the base in the first panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    facs = list(r["scaling"]["multipliers"].items())
    fig, axes = plt.subplots(1, max(1, len(facs)), figsize=(5.5 * max(1, len(facs)), 4.2), squeeze=False)
    for i, (ax, (fname, levels)) in enumerate(zip(axes[0], facs)):
        keys = [next(iter(levels.values()))["reference"]] + [f"{fname}={lv}" for lv in levels]
        if i == 0 and "base~aa" in r["series"]:
            keys.append("base~aa")
        for key in keys:
            x = r["series"][key]
            c = np.array([p["reported_flops"] for p in x["points"]])
            m = np.array([p["loss"]["mean"] for p in x["points"]])
            sd = np.array([p["loss"]["std"] or 0.0 for p in x["points"]])
            line = ax.errorbar(c, m, yerr=sd, fmt="o", ms=4, capsize=2, label=key)
            f = x["fit"]
            g = np.geomspace(c[0] / 1.2, c[-1] * 1.6, 64)
            ax.plot(g, f["E"] + f["A"] * np.exp(-f["alpha"] * np.log(g)), color=line[0].get_color(), lw=1,
                    linestyle="--" if key == "base~aa" else "-")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decade labels only: minor ones overlap
        ax.set_title(fname)
        ax.set_xlabel("training FLOPs")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{r['spec']['name']}: {r['scaling']['form']} fits; mean ± std over {len(r['spec']['seeds'])} seeds")
    save_figure(fig, path)


def write_all(results: dict, out: str) -> None:
    """results.json, results.md and scaling.png in ``out``, each written atomically; the table and the plot are made
    from the JSON as written (its keys sorted), so results.md is ``markdown(results.json)`` row for row."""
    text = json.dumps(results, indent=1, sort_keys=True) + "\n"
    results = json.loads(text)
    write_text(os.path.join(out, "results.json"), text)
    write_text(os.path.join(out, "results.md"), markdown(results))
    plot_scaling(results, os.path.join(out, "scaling.png"))


__all__ = ["SCHEMA", "assemble", "choose_form", "markdown", "plot_scaling", "write_all"]

