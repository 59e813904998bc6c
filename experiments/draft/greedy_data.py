"""The shipped k3-mini's own greedy continuations, as training text for its draft.

A draft is used on the contexts speculative decoding shows it: a prompt followed by the target's own greedy output.
The shipped draft was first trained on the k3-mini's training text alone (teacher forcing: 2.16 accepted tokens per
block on held-out text, yet 2.00 per verify when the k3-mini writes the continuation; experiments/LOG.md, session 26).
This script writes the other half of the data — the target's continuations — as the EAGLE / DSpark recipes do
(they train on responses the target regenerated for their prompts):

* prompts: windows of ``--prompt-len`` bytes at random positions of the k3-mini's *training* split (the first 95% of
  its corpus; `k3 bench spec` draws its prompts from the held-out 5%, so no bench prompt is seen here), and a
  ``--shuffled`` share of windows whose bytes are permuted per row (the hard prompts' form, also from the training
  split);
* continuations: ``--new`` greedy tokens of the shipped k3-mini, its MXFP4 experts dequantized (the same values);
* output: one ``{"text": prompt + continuation}`` JSONL line per row (a document each); rows whose bytes are not
  UTF-8 that decodes and re-encodes to the same bytes are dropped and counted (a text document is UTF-8).

    .venv/bin/python experiments/draft/greedy_data.py OUT.jsonl [--rows 4096] [--batch 128] [--seed 1]

Then `k3 tokenize --data OUT.jsonl --out SHARDS --seq-len PROMPT_LEN+NEW` cuts the document stream into rows of that
length (a separator between documents shifts each row a token against its document; the segment ids keep every
document's attention, state and anchors to itself), and `k3 train --draft-for k3jax/assets/k3-mini-stdlib --data
SHARDS ...` trains on them (train_k3mini_draft_greedy.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax.numpy as jnp
import numpy as np

from k3jax.checkpoint import load
from k3jax.checkpoint.source import default_ckpt
from k3jax.config import default_run
from k3jax.model.generate import Sampling, generate
from k3jax.train import data as tdata
from k3jax.train.settings import CORPUS_BYTES, HELDOUT_FRAC


def prompts(train: np.ndarray, *, rows: int, length: int, shuffled: float, seed: int) -> np.ndarray:
    """int32 [rows, length]: random windows of ``train``; the last ``shuffled`` share with bytes permuted per row."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, train.size - length, size=rows)
    w = np.stack([train[s:s + length] for s in starts]).astype(np.int32)
    for i in range(rows - int(round(shuffled * rows)), rows):
        w[i] = rng.permutation(w[i])
    return w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--shuffled", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    ckpt = default_ckpt()
    cfg, params = load(ckpt, dtype=jnp.float32, progress=False, keep_experts_packed=False)
    run = default_run(cfg)
    train = tdata.split(tdata.load_corpus(None, max_bytes=CORPUS_BYTES), HELDOUT_FRAC)[0]
    p = prompts(train, rows=a.rows, length=a.prompt_len, shuffled=a.shuffled, seed=a.seed)
    kept = dropped = 0
    t0 = time.perf_counter()
    with open(a.out, "w") as f:
        for i in range(0, a.rows, a.batch):
            g = generate(params, p[i:i + a.batch], cfg, run, max_new_tokens=a.new, sampling=Sampling(greedy=True))
            for prompt, cont in zip(p[i:i + a.batch], np.asarray(g.tokens)):
                raw = bytes(np.concatenate([prompt, cont]).astype(np.uint8).tolist())
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    dropped += 1
                    continue
                if text.encode("utf-8") != raw:
                    dropped += 1
                    continue
                f.write(json.dumps({"text": text}) + "\n")
                kept += 1
            print(f"{i + a.batch}/{a.rows} rows, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(json.dumps({"out": a.out, "rows_kept": kept, "rows_dropped_not_utf8": dropped, "checkpoint": ckpt,
                      "prompt_len": a.prompt_len, "new": a.new, "shuffled": a.shuffled, "seed": a.seed,
                      "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
