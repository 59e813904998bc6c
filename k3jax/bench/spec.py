"""`k3 bench spec --json` — speculative decoding on the shipped k3-mini with its shipped draft: tokens emitted per
target verify on easy and hard prompts, and the wall-clock speed of greedy generation with the draft over without it,
measured side by side in one run (k3jax/draft/speculative.py; the measurement is k3jax/draft/measure.py's).

    k3 bench spec --json                 # 8 prompts x 64 tokens per category, 64 new tokens, K = 7: ~4 min on a
                                         # shared 2-core CPU, mostly compiles (the prefill, decode and verify programs)
    k3 bench spec --json --draft DRAFT/  # another draft for the checkpoint (`k3 train --draft-for`)
    k3 bench spec --json --preset k3-tiny --draft DRAFT/ --smoke-size     # the test's size

The draft is ``draft/`` inside the checkpoint directory (the shipped k3-mini's: k3jax/assets/k3-mini-stdlib/draft)
unless ``--draft DIR`` names one; without either the bench exits 2 saying that no shipped draft exists. The prompt
categories are measure.py's: ``low_entropy`` (Python source from the held-out split of the k3-mini's data) and
``high_entropy`` (the same windows, bytes shuffled per row). Every category runs once without and once with the
draft on the same prompts (one batch of ``--prompts`` rows), greedy, every row to ``--max-new-tokens``.

``ratios``:

- ``acceptance_length_low_entropy``, ``acceptance_length_high_entropy``: mean tokens emitted per row and target
  verify at K = ``--draft-tokens`` (1 .. K + 1: the accepted drafted tokens plus the target's own next one);
- ``tokens_per_s_on_over_off``: wall tokens/s of greedy generation with the draft over without it, over both
  categories (per category: ``..._low_entropy``, ``..._high_entropy``); compiles excluded: each mode first runs once
  untimed on the first category (every category has the same shapes, so that compiles all of it), and the figure is
  the tokens/s of the decode (verify) steps after the first (``k3jax.model.generate``'s ``decode_tokens_per_s``;
  ``categories.*.*.timing.compile_s`` says whether a timed run still compiled anything);
- ``target_forwards_per_token_low_entropy`` / ``_high_entropy``: row-forwards of the target per emitted token with
  the draft (1 without one); a verify forward reads K + 1 tokens, so it costs more than a decode step, which is why
  the wall-clock ratio is measured rather than inferred.

``exactness`` gives, per category, the fraction of rows whose greedy tokens with the draft equal those without it
(1.0 expected; a near-tie of logits can flip one at the ~1e-6 by which a verify piece differs from single steps).
No target is checked: the bench always exits 0 once it ran.
"""

from __future__ import annotations

import sys
import time

import jax

from k3jax.checkpoint.source import default_ckpt, load_model, model_config, require_checkpoint
from k3jax.config import get_preset
from k3jax.draft.measure import CATEGORIES, draft_source, make_drafter, measure, prompt_set, rows_equal, tokens_sha256
from k3jax.draft.speculative import ROLLBACKS
from k3jax.errors import InputError
from k3jax.model import count_params
from k3jax.model.generate import Sampling

DEFAULTS = {"prompts": 8, "prompt_len": 64, "max_new_tokens": 64, "draft_tokens": 7}
SMOKE = {"prompts": 2, "prompt_len": 8, "max_new_tokens": 12, "draft_tokens": 3}


def add_arguments(parser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--ckpt", default=None, metavar="DIR", help="target checkpoint (default: the shipped k3-mini)")
    src.add_argument("--preset", default=None, metavar="NAME", help="a preset at random init (seed 0) as the target "
                                                                   "(needs --draft: a preset has no shipped draft)")
    parser.add_argument("--draft", default=None, metavar="DIR",
                        help="the draft (default: draft/ inside the checkpoint directory); 'random' (a draft at "
                             "random init) and 'self' (the target drafting for itself) are plumbing checks")
    parser.add_argument("--prompts", type=int, default=None, help=f"prompts per category (default "
                                                                  f"{DEFAULTS['prompts']}; one batch)")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help=f"tokens per prompt (default {DEFAULTS['prompt_len']})")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"tokens generated per row (default {DEFAULTS['max_new_tokens']}; at least "
                             "2 (K + 1) + 1, so a fully accepting draft still has compiled verify steps to time)")
    parser.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                        help=f"tokens drafted per verify (default {DEFAULTS['draft_tokens']}; <= the draft's block "
                             "size)")
    parser.add_argument("--rollback", default="copy", choices=ROLLBACKS, help="KDA state rollback (default copy)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and compute")
    parser.add_argument("--smoke-size", action="store_true",
                        help="tiny defaults for tests: " + ", ".join(f"{k.replace('_', '-')} {v}"
                                                                     for k, v in SMOKE.items()))


def settings(args) -> dict:
    """The sizes: the flags given, else --smoke-size's or the defaults; checked."""
    base = SMOKE if args.smoke_size else DEFAULTS
    s = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    for k, v in s.items():
        if v < 1:
            raise InputError(f"--{k.replace('_', '-')} must be >= 1, got {v}")
    if s["prompt_len"] < 2:
        raise InputError(f"--prompt-len must be >= 2, got {s['prompt_len']}")
    least = 2 * (s["draft_tokens"] + 1) + 1
    if s["max_new_tokens"] < least:
        raise InputError(f"--max-new-tokens {s['max_new_tokens']}: at least 2 (K + 1) + 1 = {least} at "
                         f"--draft-tokens {s['draft_tokens']}, so that compiled verify steps are timed")
    return s


def _rate(ms: list[dict]) -> float | None:
    """Tokens/s of the timed (compiled) steps of several measurements together."""
    if any(m["timing"]["tokens_per_s"] is None for m in ms):
        return None
    return sum(m["timing"]["timed_tokens"] for m in ms) / sum(m["timing"]["timed_s"] for m in ms)


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def run(args) -> dict:
    s = settings(args)
    K = s["draft_tokens"]
    t_start = time.perf_counter()
    log = lambda msg: print(f"[spec {time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    # 1. the target's architecture and the draft, checked before any weight is read
    ckpt = None if args.preset else require_checkpoint(args.ckpt) if args.ckpt else default_ckpt()
    if args.preset is None and ckpt is None:
        raise InputError("no --ckpt given and no shipped k3-mini in this install")
    cfg = get_preset(args.preset) if args.preset else model_config(ckpt=ckpt, preset=None)
    source = args.draft if args.draft is not None else "shipped"
    draft_dir = draft_source(source, cfg, ckpt=ckpt, K=K, where="--draft" if args.draft else "k3 bench spec")
    prompts = {c: prompt_set(c, count=s["prompts"], length=s["prompt_len"], vocab=cfg.vocab_size)
               for c in CATEGORIES}
    # 2. the model, the draft, then per category: without the draft, with it (same prompts, same limits)
    cfg, run_cfg, params = load_model(ckpt=ckpt, preset=args.preset, dtype=args.dtype)
    drafter = make_drafter(draft_dir or source, params, cfg, run_cfg, K=K, dtype=args.dtype)
    greedy = Sampling(greedy=True)
    got = {}
    for i, c in enumerate(CATEGORIES):              # the categories' shapes are equal: the first one warms up
        off = measure(params, cfg, run_cfg, prompts[c], max_new_tokens=s["max_new_tokens"], sampling=greedy,
                      warmup=i == 0)
        on = measure(params, cfg, run_cfg, prompts[c], drafter=drafter, max_new_tokens=s["max_new_tokens"],
                     sampling=greedy, rollback=args.rollback, warmup=i == 0)
        got[c] = {"off": off, "on": on}
        log(f"{c}: {on['acceptance_length']:.2f} tokens per verify; tokens/s {off['timing']['tokens_per_s']} "
            f"without the draft, {on['timing']['tokens_per_s']} with it")
    # 3. figures
    ratios = {"tokens_per_s_on_over_off": _ratio(_rate([got[c]["on"] for c in CATEGORIES]),
                                                 _rate([got[c]["off"] for c in CATEGORIES]))}
    for c in CATEGORIES:
        on, off = got[c]["on"], got[c]["off"]
        ratios[f"acceptance_length_{c}"] = on["acceptance_length"]
        ratios[f"target_forwards_per_token_{c}"] = on["target_forwards_per_token"]
        ratios[f"tokens_per_s_on_over_off_{c}"] = _ratio(on["timing"]["tokens_per_s"], off["timing"]["tokens_per_s"])
    exact = {c: rows_equal(got[c]["on"]["tokens"], got[c]["off"]["tokens"]) for c in CATEGORIES}
    for c in CATEGORIES:
        for m in got[c].values():
            del m["tokens"]                                 # the sha256 stays; the ids are long and say little
    wall = time.perf_counter() - t_start
    log(f"done in {wall:.0f}s: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items() if v is not None))
    return {
        "name": "spec",
        "config": {"ckpt": ckpt, "preset": cfg.name if args.preset else None, "params": count_params(params),
                   "dtype": args.dtype, "draft": draft_dir or source, "draft_tokens": K, "rollback": args.rollback,
                   "sampling": "greedy", "prompts": s["prompts"], "prompt_len": s["prompt_len"],
                   "max_new_tokens": s["max_new_tokens"],
                   "prompt_sha256": {c: tokens_sha256(p) for c, p in prompts.items()},
                   "timed": "decode / verify steps after the first, after an untimed warm-up run per mode",
                   "backend": jax.default_backend(), "devices": jax.device_count(), "jax": jax.__version__},
        "categories": got,
        "ratios": ratios,
        "exactness": {"rows_equal_without_draft": exact},
        "wall_s": wall,
    }


__all__ = ["DEFAULTS", "SMOKE", "add_arguments", "run", "settings"]
