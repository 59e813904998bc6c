"""Measuring speculative decoding: the prompt categories, the drafters a measurement names, and one measured
generation. `k3 bench spec` (k3jax/bench/spec.py) and `k3 ablate`'s decoding studies (k3jax/ablate/decoding.py)
both measure through here: the two sit side by side in the package and do not import each other.

    prompts = prompt_set("low_entropy", count=8, length=64, vocab=cfg.vocab_size)      # int32 [8, 64]
    where = draft_source("shipped", cfg, ckpt=default_ckpt(), K=7, where="--draft")    # checked, no weight read
    drafter = make_drafter("shipped", params, cfg, run, K=7, ckpt=default_ckpt())
    m = measure(params, cfg, run, prompts, drafter=drafter, max_new_tokens=64)       # drafter None: no draft
    m["acceptance_length"], m["target_forwards_per_token"], m["timing"]["tokens_per_s"]

Prompt categories (byte-level models: a token is a byte, ``% vocab`` below 256 as in training):

* ``low_entropy``: Python source from the held-out split of the shipped k3-mini's data (the last 5% of the first
  4 MiB of the standard library's sources, ``k3jax.train.data``): evenly spaced windows, text the model predicts
  well, so a draft that learned the model should run far ahead.
* ``high_entropy``: the same windows with each row's bytes shuffled (the same byte counts, no structure): the model's
  next token is uncertain at first, so drafts are rejected more often. The continuation the target writes may settle
  into something predictable after a while; the category is about the prompt.

Drafters (a source string): ``"shipped"`` (the draft in ``draft/`` inside the checkpoint directory, the shipped
k3-mini's included once it has one), a draft directory, ``"random"`` (``DraftConfig.for_target`` at random init,
seed 0: a plumbing check with acceptance near 1) and ``"self"`` (``TargetDrafter``: the target drafts for itself,
acceptance K + 1 under greedy: the check that verification keeps what it should; not a speed figure).

Figures of one measurement (a batch of prompts, each row to ``max_new_tokens``, no stop ids): ``acceptance_length``
(mean tokens emitted per row and target verify; None without a draft), ``target_forwards_per_token`` (row-forwards
of the target per token emitted after the prefill's one: 1 without a draft, about 1 / acceptance with one, though a
verify forward is K + 1 tokens wide), and under ``timing`` the wall tokens/s of the compiled steps (the first decode
or verify step compiles and is left out: ``k3jax.model.generate``'s ``decode_tokens_per_s``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import time

import numpy as np

from k3jax.config import K3Config, RunConfig
from k3jax.draft.config import DraftConfig, check_target
from k3jax.draft.io import load_draft, read_draft_config
from k3jax.draft.speculative import DSparkDrafter, TargetDrafter, generate_speculative
from k3jax.errors import InputError
from k3jax.model.generate import Sampling, generate
from k3jax.train import data as tdata
from k3jax.train.evaluate import spaced_windows
from k3jax.train.settings import CORPUS_BYTES, HELDOUT_FRAC

CATEGORIES = ("low_entropy", "high_entropy")
BUILTIN_DRAFTERS = ("shipped", "random", "self")
DRAFT_SUBDIR = "draft"  # a checkpoint's own draft lives in this directory inside it
RANDOM_SEED = 0  # the "random" drafter's init
GREEDY = Sampling(greedy=True)


# ------------------------------------------------------------------------------------------------------ prompts

@functools.lru_cache(maxsize=1)
def heldout_bytes() -> np.ndarray:
    """uint8 [N]: the held-out split of the shipped k3-mini's corpus, split exactly as `k3 train` splits it."""
    return tdata.split(tdata.load_corpus(None, max_bytes=CORPUS_BYTES), HELDOUT_FRAC)[1]


def prompt_set(category: str, *, count: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    """int32 [count, length] prompts of ``category`` (module docstring); a pure function of its arguments and the
    running interpreter's standard library (``k3jax.data.text_identity``)."""
    if category not in CATEGORIES:
        raise InputError(f"prompt category {category!r}: one of {', '.join(CATEGORIES)}")
    if count < 1 or length < 2:
        raise InputError(f"prompts: need count >= 1 and length >= 2, got {count} x {length}")
    held = heldout_bytes()
    if count * length > held.size:
        raise InputError(f"prompts: {count} x {length} tokens exceed the {held.size:,} held-out bytes")
    w = spaced_windows(held, num=count, seq_len=length - 1, vocab=min(vocab, 256)).tokens.astype(np.int32)
    if category == "high_entropy":
        rng = np.random.default_rng(seed)
        w = np.stack([rng.permutation(row) for row in w])
    return w


def tokens_sha256(tokens) -> str:
    """sha256 of an int32 token array (the identity of a prompt set or of generated tokens)."""
    return hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------- drafters

def shipped_draft(ckpt: str | None) -> str | None:
    """The draft directory inside checkpoint ``ckpt`` (``draft/`` holding a config.json), or None."""
    if ckpt is None:
        return None
    d = os.path.join(ckpt, DRAFT_SUBDIR)
    return d if os.path.isfile(os.path.join(d, "config.json")) else None


def draft_source(source: str, cfg: K3Config, *, ckpt: str | None, K: int, where: str) -> str | None:
    """Check a drafter ``source`` for the target ``cfg`` before any weight is read: the directory it names (None for
    "random" / "self") after checking its config against the target and K against its block size; an InputError
    naming ``where`` otherwise."""
    if K < 1:
        raise InputError(f"{where}: draft tokens must be >= 1, got {K}")
    if source in ("random", "self"):
        return None
    if source == "shipped":
        d = shipped_draft(ckpt)
        if d is None:
            why = (f"{os.path.join(ckpt, DRAFT_SUBDIR)} holds no config.json" if ckpt
                   else "a preset at random init has none")
            raise InputError(f"{where}: no shipped draft ({why}); train one with `k3 train --draft-for CKPT "
                             "--export DIR` and name its directory")
    else:
        d = source
        if not os.path.isfile(os.path.join(d, "config.json")):
            raise InputError(f"{where}: {d}: not a draft directory (no config.json in it)")
    try:
        dcfg = read_draft_config(d)
        check_target(dcfg, cfg)
    except InputError as e:
        raise InputError(f"{where}: {e}") from e
    if K > dcfg.block_size:
        raise InputError(f"{where}: {K} draft tokens exceed the draft's block size {dcfg.block_size} ({d})")
    return d


def make_drafter(source: str, params, cfg: K3Config, run: RunConfig, *, K: int, ckpt: str | None = None,
                 dtype: str = "float32"):
    """The drafter ``source`` names (module docstring), proposing K tokens per step for the target (params, cfg)."""
    if source == "self":
        return TargetDrafter(params, cfg, run, K=K)
    if source == "random":
        from flax import nnx

        from k3jax.draft.network import DraftModel

        dcfg = DraftConfig.for_target(cfg, block_size=max(K, 7))
        return DSparkDrafter(DraftModel(dcfg, dtype=dtype, rngs=nnx.Rngs(RANDOM_SEED)), dcfg, params, cfg, run, K=K)
    d = draft_source(source, cfg, ckpt=ckpt, K=K, where="draft")
    model, dcfg = load_draft(d, target_cfg=cfg, dtype=dtype)
    return DSparkDrafter(model, dcfg, params, cfg, run, K=K)


# ------------------------------------------------------------------------------------------------ measurement

def measure(params, cfg: K3Config, run: RunConfig, prompts: np.ndarray, *, drafter=None, max_new_tokens: int,
            sampling: Sampling = GREEDY, seed: int = 0, rollback: str = "copy", warmup: bool = False) -> dict:
    """Generate from ``prompts`` [B, T] (every row to ``max_new_tokens``; no stop ids) with ``drafter`` (None: plain
    decoding) and return the figures (module docstring) with the tokens [B, N] as lists. Wall-clock figures sit under
    ``timing``; the rest is a deterministic function of the inputs (under greedy, equal with and without a draft up to
    near-ties: k3jax/draft/speculative.py). ``warmup``: generate once untimed first, so that whatever compiles after
    the first step (its programs for other shapes) is compiled before the timed run; ``timing.compile_s`` of the timed
    run says how much compiling it still saw."""
    def once():
        if drafter is None:
            return generate(params, prompts, cfg, run, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)
        return generate_speculative(params, prompts, cfg, run, drafter=drafter, max_new_tokens=max_new_tokens,
                                    sampling=sampling, seed=seed, rollback_mode=rollback)

    B = prompts.shape[0]
    warm_s = 0.0
    if warmup:
        t0 = time.perf_counter()
        once()
        warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = once()
    wall = time.perf_counter() - t0
    row_steps = None if drafter is None else int(sum(g.timing["accepted_histogram"]))
    t = g.timing
    emitted = int((g.tokens >= 0).sum())
    after_first = emitted - B                              # the prefill's token of each row needs no decode forward
    forwards = after_first if row_steps is None else row_steps
    rate = t["decode_tokens_per_s"]
    timed_s = t["decode_s"] - t["first_step_s"]
    return {"rows": B, "emitted_tokens": emitted, "decode_steps": t["decode_steps"],
            "acceptance_length": None if drafter is None else t["acceptance_length"],
            "accepted_histogram": None if drafter is None else t["accepted_histogram"],
            "target_forwards_per_token": forwards / after_first if after_first else None,
            "tokens": g.tokens.tolist(), "tokens_sha256": tokens_sha256(g.tokens),
            "timing": {"tokens_per_s": rate, "timed_s": timed_s,
                       "timed_tokens": None if rate is None else rate * timed_s,
                       "first_step_s": t["first_step_s"], "prefill_s": t["prefill_s"],
                       "compile_s": t["prefill_compile_s"] + t["decode_compile_s"], "wall_s": wall,
                       "warmup_s": warm_s}}


def rows_equal(a, b) -> float:
    """Fraction of rows of two [B, N] token lists that are equal."""
    a, b = np.asarray(a), np.asarray(b)
    return float(np.mean(np.all(a == b, axis=1)))


__all__ = ["BUILTIN_DRAFTERS", "CATEGORIES", "DRAFT_SUBDIR", "GREEDY", "draft_source", "heldout_bytes", "make_drafter",
           "measure", "prompt_set", "rows_equal", "shipped_draft", "tokens_sha256"]
