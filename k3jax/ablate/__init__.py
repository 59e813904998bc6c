"""Controlled ablations (`k3 ablate`): an ablation file's arms resolved and checked against the one-factor guarantee
before any compute, every (arm, seed) run as a resumable `k3 train` run, paired statistics against the base with an
A/A noise floor; a scaling study runs the arms at several compute budgets and fits them.

    spec = load("experiments/ablations/attn_res.toml")     # a Spec (or a Study with [scaling]); no training
    results = run(spec, "runs/attn_res")                   # the grid (resumes), then results.json / .md / figures

One direction inside: ``spec`` (the types) ← ``parse`` (the file) ← ``resolve`` (arms, the one-factor check) ←
``same_init`` / ``runner`` (the runs) ← ``study`` (scaling) ← ``report`` (run, then the tables). The package sits
above ``k3jax.train`` and ``k3jax.analysis``.
"""

from k3jax.ablate.report import claim, describe, failed_repeats, markdown, resolved, run
from k3jax.ablate.resolve import load_spec
from k3jax.ablate.spec import AblationSpecError, Spec
from k3jax.ablate.study import Study, load, load_study

__all__ = ["AblationSpecError", "Spec", "Study", "claim", "describe", "failed_repeats", "load", "load_spec",
           "load_study", "markdown", "resolved", "run"]
