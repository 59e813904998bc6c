"""`k3 ablate` — controlled ablations: every arm of an ablation file at every seed as a resumable `k3 train` run,
the one-factor guarantee checked before any compute, paired statistics against the base and an A/A noise floor.

    k3 ablate experiments/ablations/attn_res.toml --out runs/attn_res     # the grid (resumes), then the tables
    k3 ablate experiments/ablations/latent_moe.toml --check               # resolve and check only: arms, diffs
    k3 ablate experiments/smoke.toml --out /tmp/smoke                     # 2 arms x 2 seeds x 3 steps: minutes, CPU
    k3 ablate experiments/ablations/scaling.toml --out runs/scaling       # a scaling study: >= 4 budgets, fits,
                                                                          # compute multipliers, tuned baselines

The file format (a scaling study's [scaling], `tune` and `calibration` too) is in k3jax/ablate/parse.py; the work in
the k3jax/ablate package; the output (results.json's schema) in k3jax/analysis/ablate_report.py (a study's:
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

import jax

from k3jax import ablate
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


def _enable_compile_cache(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))


def run_cli(args) -> int:
    spec = ablate.load(args.spec)
    scaling = isinstance(spec, ablate.Study)
    if args.check:
        print(json.dumps(ablate.resolved(spec), default=list) if args.json else ablate.describe(spec))
        return 0
    if not args.out:
        raise InputError("--out DIR is required (or --check to only resolve the file)")
    ablate.claim(spec, args.out)
    if args.compile_cache != "off":
        _enable_compile_cache(args.compile_cache or os.path.join(args.out, "compile_cache"))
    results = ablate.run(spec, args.out, progress=args.progress)
    if results is None:
        print(f"k3 ablate: stopped by SIGTERM; re-run the same command to continue ({args.out})", file=sys.stderr)
        return 0
    if args.json:
        print(json.dumps(results, sort_keys=True))
    else:
        print(ablate.markdown(spec, results), end="")
        print(f"wrote {os.path.join(args.out, 'results.json')}, results.md, "
              f"{'scaling.png' if scaling else 'curves.png'}")
    bad = ablate.failed_repeats(spec, results)
    for b, rep in bad.items():
        print(f"k3 ablate: the base at seed {rep['seed']} run twice differs{f' at budget {b}' if b else ''}: "
              f"{rep['eval_loss']}", file=sys.stderr)
    return 1 if bad else 0
