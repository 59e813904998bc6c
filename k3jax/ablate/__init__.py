"""Controlled ablations (`k3 ablate`): an ablation file's arms resolved and checked against the one-factor guarantee
before any compute, every (arm, seed) run as a resumable `k3 train` run, paired statistics against the base with an
A/A noise floor; a scaling study runs the arms at several compute budgets and fits them.

    spec = load("experiments/ablations/attn_res.toml")     # a Spec (or a Study with [scaling]); no training
    spec = load("experiments/ablations/speculative.toml")  # a DecodingSpec (kind = "decoding"): decoding settings
    results = run(spec, "runs/attn_res")                   # the grid (resumes), then results.json / .md / figures
    run_share(spec, "runs/attn_res", parse_worker("1/4"))  # worker 1 of 4 sharing the directory: its runs only
    results = run(spec, "runs/attn_res", report_only=True)  # after the workers: the report, or IncompleteError

One direction inside: ``spec`` (the types) ← ``parse`` (the file) ← ``resolve`` (arms, the one-factor check) ←
``same_init`` / ``share`` (workers) ← ``runner`` (the runs) ← ``study`` (scaling) ← ``report`` (run, then the
tables); a decoding study: ``decoding`` (the file, its arms) ← ``decoding_run`` (runs and tables), both on the
ablation types, run directories and fingerprints above. The package sits above ``k3jax.train`` and ``k3jax.analysis``.
"""

from k3jax.ablate.decoding import DecodingSpec, load_decoding
from k3jax.ablate.report import claim, describe, failed_repeats, markdown, resolved, run, run_share
from k3jax.ablate.resolve import load_spec
from k3jax.ablate.share import IncompleteError, Share, parse_worker
from k3jax.ablate.spec import AblationSpecError, Spec
from k3jax.ablate.study import Study, load, load_study

__all__ = ["AblationSpecError", "DecodingSpec", "IncompleteError", "Share", "Spec", "Study", "claim", "describe",
           "failed_repeats", "load", "load_decoding", "load_spec", "load_study", "markdown", "parse_worker", "resolved",
           "run", "run_share"]
