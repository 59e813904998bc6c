"""`k3 ablate` — controlled ablations: every arm of an ablation file at every seed as a resumable `k3 train` run,
the one-factor guarantee checked before any compute, paired statistics against the base and an A/A noise floor.

    k3 ablate experiments/ablations/attn_res.toml --out runs/attn_res     # the grid (resumes), then the tables
    k3 ablate experiments/ablations/latent_moe.toml --check               # resolve and check only: arms, diffs
    k3 ablate experiments/smoke.toml --out /tmp/smoke                     # 2 arms x 2 seeds x 3 steps: minutes, CPU
    k3 ablate experiments/ablations/scaling.toml --out runs/scaling       # a scaling study: >= 4 budgets, fits,
                                                                          # compute multipliers, tuned baselines
    k3 ablate experiments/smoke.toml --out /tmp/smoke --worker 0/2 &      # one study over 2 processes (or N
    k3 ablate experiments/smoke.toml --out /tmp/smoke --worker 1/2        # machines) sharing one --out: each
    k3 ablate experiments/smoke.toml --out /tmp/smoke --report-only       # trains its share; then the report
    k3 ablate experiments/ablations/speculative.toml --out runs/spec      # a decoding study: one model, arms that
                                                                          # differ in decoding settings (a draft on
                                                                          # or off, K, rollback, sampler); no --worker

The file format (a scaling study's [scaling], `tune` and `calibration` too) is in k3jax/ablate/parse.py; the work in
the k3jax/ablate package; the output (results.json's schema) in k3jax/analysis/ablate_report.py (a study's:
k3jax/analysis/scaling_report.py). Re-running the same command continues a killed grid where it stopped; finished
runs are not redone, and the results equal an uninterrupted run's. With --worker I/N a process trains only its
share of the runs (k3jax/ablate/share.py: run k of each phase goes to worker (k + h(phase)) mod N), writes the
files the runs share only if it owns them, waits for the other workers where the study needs their results (a
budget's tuning before its grid), and reports nothing; `k3 ablate FILE --out DIR` then reports (training whatever is
still missing), --report-only reports without training. Exit 0 (also when SIGTERM stopped the grid: re-run to
continue); 1 when the determinism repeat of the A/A arm differs, when --report-only finds runs missing (it names
them) or when a worker's --wait-timeout runs out; 2 on bad input, before any training: a --worker that is not I/N
with 0 <= I < N, an unknown key, an arm that differs outside its factor's declaration (the diff is printed), a
`holds` value off by more than its tolerance, a level that changes nothing, seeds or a budget that are not positive
integers, an --out holding another file's results; in a scaling study also fewer than 4 budgets, budgets not
increasing in compute or spanning under 8x, a tuned setting that is also a factor's key, a calibration factor with
other keys or a k that is not a whole number of steps at every budget.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    p.add_argument("--json", action="store_true", help="print results.json (with --check: the resolved arms; with "
                                                       "--worker: its runs) as one JSON object on stdout")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr (default: when stderr is a terminal)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache, so an arm compiles once for all its seeds and a resumed "
                        "grid compiles nothing (default: OUT/compile_cache, a worker's OUT/compile_cache/worker-I: "
                        "JAX writes it in place, so processes do not share one; 'off' disables it)")
    p.add_argument("--worker", default=None, metavar="I/N",
                   help="train only worker I's share of the runs, N workers sharing --out (0 <= I < N); report with "
                        "`k3 ablate FILE --out DIR` once every worker is done")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: report the runs in --out (written by --worker processes); exit 1 naming the "
                        "runs that are missing")
    p.add_argument("--wait-timeout", type=float, default=None, metavar="SECONDS",
                   help="with --worker: give up (exit 1) after waiting this long for other workers' runs or files "
                        "(default: wait as long as it takes; a re-run continues)")
    p.set_defaults(func=run_cli)


def _enable_compile_cache(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))


def _share(args) -> ablate.Share | None:
    """--worker, --report-only and --wait-timeout checked together (before the file is loaded)."""
    if args.wait_timeout is not None and (args.worker is None or not args.wait_timeout > 0):
        raise InputError(f"--wait-timeout {args.wait_timeout:g}: " + ("a positive number of seconds" if args.worker
                                                                      else "applies to --worker I/N only"))
    if args.worker is None:
        return None
    if args.report_only:
        raise InputError("--worker with --report-only: a worker trains its share and reports nothing; report with "
                         "--report-only alone once every worker is done")
    return dataclasses.replace(ablate.parse_worker(args.worker), timeout_s=args.wait_timeout)


def _run_worker(spec, args, share: ablate.Share) -> int:
    done = ablate.run_share(spec, args.out, share, progress=args.progress)
    if done is None:
        print(f"k3 ablate: worker {share.label} stopped by SIGTERM; re-run the same command to continue ({args.out})",
              file=sys.stderr)
        return 0
    if args.json:
        print(json.dumps(done, sort_keys=True))
    else:
        n = sum(map(len, done["phases"].values()))
        each = "" if list(done["phases"]) == ["."] else " (" + ", ".join(
            f"{p}: {len(r)}" for p, r in done["phases"].items()) + ")"
        print(f"worker {share.label}: its {n} runs are finished in {args.out}{each}; once every worker is done, "
              f"`k3 ablate {args.spec} --out {args.out}` reports (--report-only: without training what is missing)")
    return 0


def run_cli(args) -> int:
    share = _share(args)
    spec = ablate.load(args.spec)
    scaling = isinstance(spec, ablate.Study)
    if args.check:
        print(json.dumps(ablate.resolved(spec), default=list) if args.json else ablate.describe(spec))
        return 0
    if not args.out:
        raise InputError("--out DIR is required (or --check to only resolve the file)")
    ablate.claim(spec, args.out, create=not args.report_only)
    if args.compile_cache != "off" and not args.report_only:
        # JAX writes its cache files in place, not atomically: each worker gets its own cache by default
        default = os.path.join(args.out, "compile_cache", *([f"worker-{share.index}"] if share else []))
        _enable_compile_cache(args.compile_cache or default)
    try:
        if share is not None:
            return _run_worker(spec, args, share)
        results = ablate.run(spec, args.out, progress=args.progress, report_only=args.report_only)
    except ablate.IncompleteError as e:
        print(f"k3 ablate: {e}", file=sys.stderr)
        return 1
    if results is None:
        print(f"k3 ablate: stopped by SIGTERM; re-run the same command to continue ({args.out})", file=sys.stderr)
        return 0
    if args.json:
        print(json.dumps(results, sort_keys=True))
    else:
        print(ablate.markdown(spec, results), end="")
        figure = "scaling.png" if scaling else None if isinstance(spec, ablate.DecodingSpec) else "curves.png"
        print(f"wrote {os.path.join(args.out, 'results.json')}, results.md" + (f", {figure}" if figure else ""))
    bad = ablate.failed_repeats(spec, results)
    for b, rep in bad.items():
        print(f"k3 ablate: the base at seed {rep['seed']} run twice differs{f' at budget {b}' if b else ''}: "
              f"{rep['eval_loss']}", file=sys.stderr)
    return 1 if bad else 0
