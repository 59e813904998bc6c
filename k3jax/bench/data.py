"""`k3 bench data --json`: does the shard loader keep ahead of training? The stdlib corpus tokenized into shards
(k3jax/train/shards.py) in a temporary directory, then, in the same run, the rows per second one of ``--processes``
processes reads (``ShardData.batch`` with its share of the rows, consecutive steps) against the rows per second the
compiled train step consumes (``k3jax.bench.train``: the full jitted step on one process of this machine, so the
whole global batch; a conservative rate, since each process of a real job needs only its share).

    k3 bench data --json                       # k3-mini, the train defaults (batch 16 x 128 tokens), 4 MiB corpus
    k3 bench data --json --preset k3-tiny --layers 2 --batch 4 --seq-len 32 --steps 50 --reps 1   # the test's size

``ratios``: ``loader_over_step`` = loader rows/s over step rows/s (target >= 5: ``ok``), ``tokenize_mb_per_s``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from k3jax.bench import train as train_bench
from k3jax.data import stdlib_files
from k3jax.tokenizer import ByteTokenizer
from k3jax.train.settings import CORPUS_BYTES, TrainConfig
from k3jax.train.shards import BYTES_IDENTITY, write_shards
from k3jax.train.stream import open_shards

TARGET = 5.0  # loader rows/s over step rows/s


def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="k3-mini")
    parser.add_argument("--layers", type=int, default=None, help="truncate the preset (as `k3 bench train --layers`)")
    parser.add_argument("--batch", type=int, default=TrainConfig.batch, help="global rows per step")
    parser.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    parser.add_argument("--processes", type=int, default=2, help="the loader reads batch / processes rows a step")
    parser.add_argument("--steps", type=int, default=200, help="consecutive steps the loader reads")
    parser.add_argument("--corpus-bytes", type=int, default=CORPUS_BYTES)
    parser.add_argument("--reps", type=int, default=2, help="timed train steps")


def _corpus(limit: int) -> list[str]:
    """Stdlib sources in order, enough of them for ``limit`` bytes."""
    out, n = [], 0
    for p in stdlib_files():
        out.append(p)
        n += os.path.getsize(p)
        if n >= limit:
            break
    return out


def run(args) -> dict:
    B, T, P = args.batch, args.seq_len, args.processes
    share = np.arange(B // P)  # process 0's rows of each global batch
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        m = write_shards(_corpus(args.corpus_bytes), os.path.join(tmp, "shards"), seq_len=T, tokenizer=ByteTokenizer(),
                         max_bytes=args.corpus_bytes)
        t_tok = time.perf_counter() - t0
        data = open_shards(os.path.join(tmp, "shards"), seq_len=T, tokenizer_identity=BYTES_IDENTITY)
        data.batch(seed=0, step=0, batch=B, seq_len=T, rows=share)  # readers opened, first pages read
        t0 = time.perf_counter()
        for s in range(1, args.steps + 1):
            data.batch(seed=0, step=s, batch=B, seq_len=T, rows=share)
        t_load = time.perf_counter() - t0
    loader = args.steps * share.size / t_load
    print(f"tokenized {m['corpus']['bytes'] / 1e6:.1f} MB in {t_tok:.2f} s; loader {loader:,.0f} rows/s "
          f"({share.size} of {B} rows a step)", file=sys.stderr)
    step = train_bench.run(argparse.Namespace(quick=False, preset=args.preset, layers=args.layers, batch=B, seq_len=T,
                                              reps=args.reps, qat="off", compute_dtype="float32"))
    consumed = B / step["times"]["step_s"]
    ratio = loader / consumed
    print(f"train step {consumed:,.1f} rows/s: loader / step = {ratio:,.0f} (target >= {TARGET:g})", file=sys.stderr)
    return {
        "name": "data",
        "device": step["device"],
        "backend": step["backend"],
        "shape": {"preset": args.preset, "layers": args.layers, "batch": B, "seq_len": T, "processes": P,
                  "rows_read_per_step": int(share.size),
                  "loader_steps": args.steps, "corpus_bytes": m["corpus"]["bytes"],
                  "train_rows": m["splits"]["train"]["rows"], "shard_files": len(m["files"]),
                  "shard_bytes": sum(f["bytes"] for f in m["files"]), "reps": args.reps},
        "times": {"tokenize_s": t_tok, "loader_s": t_load, "loader_step_s": t_load / args.steps,
                  "train_step_s": step["times"]["step_s"]},
        "rows_per_s": {"loader": loader, "train_step": consumed},
        "targets": {"loader_over_step": TARGET},
        "ok": bool(ratio >= TARGET),
        "ratios": {"loader_over_step": ratio, "tokenize_mb_per_s": m["corpus"]["bytes"] / 1e6 / t_tok},
    }
