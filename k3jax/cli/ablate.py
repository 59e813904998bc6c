"""`k3 ablate` — controlled ablations: every arm of an ablation file at every seed as a resumable `k3 train` run,
the one-factor guarantee checked before any compute, paired statistics against the base and an A/A noise floor.

    k3 ablate experiments/ablations/attn_res.toml --out runs/attn_res     # the grid (resumes), then the tables
    k3 ablate experiments/ablations/latent_moe.toml --check               # resolve and check only: arms, diffs
    k3 ablate experiments/smoke.toml --out /tmp/smoke                     # 2 arms x 2 seeds x 3 steps: minutes, CPU
    k3 ablate experiments/ablations/scaling.toml --out runs/scaling       # a scaling study: >= 4 budgets, fits,
                                                                          # compute multipliers, tuned baselines

The file format is in k3jax/train/ablate_spec.py (a scaling study's [scaling], `tune` and `calibration`:
k3jax/train/ablate_scaling.py); the output (results.json's schema) in k3jax/analysis/ablate_report.py (a study's:
k3jax/analysis/scaling_report.py). Re-running the same command continues a killed grid where it stopped; finished
runs are not redone, and the results equal an uninterrupted run's. Exit 0 (also when SIGTERM stopped the grid: re-run
to continue); 1 when the determinism repeat of the A/A arm differs; 2 on bad input, before any training: an unknown
key, an arm that differs outside its factor's declaration (the diff is printed), a `holds` value off by more than
its tolerance, a level that changes nothing, seeds or a budget that are not positive integers, an --out holding
another file's results; in a scaling study also fewer than 4 budgets, budgets not increasing in compute or spanning
under 8x, a tuned setting that is also a factor's key, a calibration factor with other keys or a k that is not a
whole number of steps at every budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from k3jax.errors import InputError


def add_parser(sub) -> None:
    p = sub.add_parser("ablate", help="controlled ablations: one-factor arms x paired seeds, with a noise floor",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="FILE.toml", help="the ablation file")
    p.add_argument("--out", default=None, help="output directory (required unless --check); resumes what is there")
    p.add_argument("--check", action="store_true", help="resolve and check the file, print its arms; train nothing")
    p.add_argument("--json", action="store_true", help="print results.json (with --check: the resolved arms) as one "
                                                       "JSON object on stdout")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr (default: when stderr is a terminal)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache, so an arm compiles once for all its seeds and a resumed "
                        "grid compiles nothing (default: OUT/compile_cache; 'off' disables it)")
    p.set_defaults(func=run_cli)


def ablate(spec, out: str, *, progress: bool | None = None, log=None) -> dict | None:
    """Run (or resume) ``spec``'s grid in ``out`` and write results.json, results.md and curves.png. Returns the
    results, or None when SIGTERM stopped the grid."""
    from k3jax.analysis.ablate_report import assemble, write_all
    from k3jax.train.ablate import run_grid

    t0 = time.perf_counter()
    done = run_grid(spec, out, progress=progress, log=log)
    if done is None:
        return None
    records, init = done
    results = assemble(spec, records, init)
    results["timing"] = {"this_invocation_s": time.perf_counter() - t0,
                         "runs_wall_s": sum(r["timing"]["wall_s"] for r in records.values())}
    write_all(results, out)
    return results


def study(st, out: str, *, progress: bool | None = None, log=None) -> dict | None:
    """Run (or resume) the scaling study ``st`` in ``out``: each budget's tuning runs and grid (each budget's
    directory gets its own results.json/md, curves.png), then the fits and multipliers (results.json, results.md,
    scaling.png in ``out``). Returns the results, or None when SIGTERM stopped it."""
    from k3jax.analysis import ablate_report, scaling_report
    from k3jax.train.ablate_scaling import points, run_flops, run_study

    t0 = time.perf_counter()
    done = run_study(st, out, progress=progress, log=log)
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
    if any(d["budget"].tuning is not None for d in done):
        from k3jax.train.ablate import _read_json

        for d in done:
            for job in d["budget"].tune_jobs:
                wall.append(_read_json(os.path.join(job.dir(os.path.join(out, "tune", d["budget"].name)),
                                                    "result.json"))["timing"]["wall_s"])
    results["repeat"] = repeats  # per budget: the A/A determinism repeat (None: the file asks for none)
    results["timing"] = {"this_invocation_s": time.perf_counter() - t0, "runs_wall_s": sum(wall), "runs": len(wall)}
    scaling_report.write_all(results, out)
    return results


def _describe_study(st) -> str:
    from k3jax.train.ablate_scaling import run_flops

    runs = 0
    lines = [f"{st.path}: scaling study {st.name!r}, {len(st.budgets)} budgets, fit {st.fit!r}, "
             f"{st.bootstrap} bootstrap resamples, fingerprint {st.fingerprint[:12]}"]
    for b in st.budgets:
        from k3jax.train.ablate import grid

        n = len(grid(b.spec)) + len(b.tune_jobs)
        runs += n
        lines.append(f"budget {b.name}: {b.spec.base.derived['tokens']:,} tokens, width {b.width:g}, base "
                     f"{run_flops(b.spec.base):.3g} FLOPs; {n} runs ({len(b.tune_jobs)} tuning)")
    lines.append(f"{runs} runs in all (tuned levels that pick another value run once more at each seed)")
    lines.append(f"budget {st.budgets[-1].name}'s arms:")
    lines.append(_describe(st.budgets[-1].spec))
    return "\n".join(lines)


def _describe(spec) -> str:
    from k3jax.train.ablate_check import format_diff

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


def _enable_compile_cache(path: str) -> None:
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))


def run_cli(args) -> int:
    from k3jax.train.ablate import claim_out
    from k3jax.train.ablate_scaling import Study, claim_study, load

    spec = load(args.spec)
    scaling = isinstance(spec, Study)
    if args.check:
        if args.json:
            def arms(s):
                return {n: {"run": a.run_id, "flat": a.flat, "derived": a.derived} for n, a in s.arms.items()}
            doc = ({"budgets": {b.name: {"arms": arms(b.spec), "tuning_runs": [j.run_id for j in b.tune_jobs]}
                                for b in spec.budgets}} if scaling else {"arms": arms(spec)})
            print(json.dumps({"fingerprint": spec.fingerprint} | doc, default=list))
        else:
            print(_describe_study(spec) if scaling else _describe(spec))
        return 0
    if not args.out:
        raise InputError("--out DIR is required (or --check to only resolve the file)")
    (claim_study if scaling else claim_out)(spec, args.out)
    if args.compile_cache != "off":
        _enable_compile_cache(args.compile_cache or os.path.join(args.out, "compile_cache"))
    results = (study if scaling else ablate)(spec, args.out, progress=args.progress)
    if results is None:
        print(f"k3 ablate: stopped by SIGTERM; re-run the same command to continue ({args.out})", file=sys.stderr)
        return 0
    if args.json:
        print(json.dumps(results, sort_keys=True))
    else:
        from k3jax.analysis import ablate_report, scaling_report

        print((scaling_report if scaling else ablate_report).markdown(results), end="")
        print(f"wrote {os.path.join(args.out, 'results.json')}, results.md, "
              f"{'scaling.png' if scaling else 'curves.png'}")
    repeats = results["repeat"] if scaling else {"": results["aa"]["repeat"]}
    bad = {b: rep for b, rep in repeats.items() if rep is not None and not rep["identical"]}
    for b, rep in bad.items():
        print(f"k3 ablate: the base at seed {rep['seed']} run twice differs{f' at budget {b}' if b else ''}: "
              f"{rep['eval_loss']}", file=sys.stderr)
    return 1 if bad else 0
