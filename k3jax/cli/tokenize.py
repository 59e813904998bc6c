"""`k3 tokenize` — pre-tokenize training data into shards (ArrayRecord files + manifest.json) that `k3 train --data
DIR` streams, each process reading only its rows of each batch (k3jax/train/shards.py, k3jax/train/stream.py).

    k3 tokenize --data experiments/sft/chat_train.jsonl --out shards/sft --preset k3-mini
    k3 tokenize --data a.txt b.jsonl --out shards/text --seq-len 256 --json
    k3 train --preset k3-mini --data shards/text --seq-len 256          # --seq-len as written

The rows are those the in-memory path makes from the same files (docs/cli.md §5): text cut into ``--seq-len + 1``
token rows at stride ``--seq-len``, chat conversations packed whole with assistant-only weights; the last
``--heldout-frac`` held out. Chat is rendered and tokenized with the model's chat template and tokenizer (``--ckpt``'s,
or bytes and the built-in template for ``--preset`` and the shipped k3-mini), and a run checks it uses the same.
``--out`` must be missing or empty unless ``--overwrite``; it is written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os

from k3jax.chat import template_for
from k3jax.checkpoint.atomic import check_out_dir
from k3jax.checkpoint.source import default_ckpt, model_config
from k3jax.cli.args import add_model_source
from k3jax.tokenizer import load_tokenizer
from k3jax.train.settings import HELDOUT_FRAC, TrainConfig
from k3jax.train.shards import data_kind, write_shards


def add_parser(sub) -> None:
    p = sub.add_parser("tokenize", help="pre-tokenize training data into shards for `k3 train --data DIR`",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help="text files, {\"text\": ...} JSONL or {\"messages\": [...]} chat JSONL (not mixed)")
    p.add_argument("--out", required=True, metavar="DIR", help="the shard directory to write")
    add_model_source(p, "tokenize for this preset's model (bytes, the built-in chat template)")
    p.add_argument("--seq-len", type=int, default=TrainConfig.seq_len, metavar="N",
                   help=f"tokens per training sequence; a row holds N + 1 (default {TrainConfig.seq_len})")
    p.add_argument("--max-bytes", type=int, default=None, metavar="N",
                   help="read at most N text bytes (chat: conversations until N tokens) (default: everything)")
    p.add_argument("--heldout-frac", type=float, default=HELDOUT_FRAC, metavar="F",
                   help=f"fraction of the corpus, at its end, held out for evaluation (default {HELDOUT_FRAC})")
    p.add_argument("--overwrite", action="store_true", help="replace --out when it exists and is not empty")
    p.add_argument("--json", action="store_true", help="print the manifest as one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    check_out_dir(args.out, overwrite=args.overwrite, flag="--out", hint="pass --overwrite")  # before any reading
    ckpt = None if args.preset else (args.ckpt or default_ckpt())
    cfg = model_config(ckpt=ckpt, preset=args.preset or ("k3-mini" if ckpt is None else None))
    tok = load_tokenizer(ckpt, max(cfg.vocab_size, 256))
    template = template_for(ckpt, tok) if data_kind(args.data) == "chat" else None
    m = write_shards(args.data, args.out, seq_len=args.seq_len, tokenizer=tok, template=template,
                     tokenizer_path=ckpt, max_bytes=args.max_bytes, heldout_frac=args.heldout_frac,
                     overwrite=args.overwrite)
    if args.json:
        print(json.dumps(m, sort_keys=True))
        return 0
    tr, he = m["splits"]["train"], m["splits"]["heldout"]
    print(f"{args.out}: {m['kind']}, {tr['rows']:,} training rows ({tr['tokens']:,} tokens) and {he['rows']:,} held "
          f"out ({he['tokens']:,} tokens) of {m['seq_len'] + 1} tokens, in {len(m['files'])} files "
          f"({sum(f['bytes'] for f in m['files']) / 1e6:.1f} MB) from {len(m['sources'])} source file(s) "
          f"({os.path.basename(os.path.abspath(args.out))}/manifest.json)")
    return 0
