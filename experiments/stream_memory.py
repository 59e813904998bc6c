"""Peak memory of streaming training batches from shards does not grow with the corpus (k3jax/train/stream.py).

For each size N (MB of text, i.e. N million byte tokens): a synthetic corpus is written to disk as it is made (random
lines of the stdlib sources, a seed per file, 64 MB files: one document each), tokenized by `write_shards` in a child
process (its time and peak RSS: the writer streams too), then a second child opens the shards as a run does
(manifest, sizes and sha256 of every file) and reads the batches of ``--steps`` random steps (batch 16 x 128 tokens,
the train defaults; positions over ten epochs, so rows anywhere in any file) and reports its peak RSS
(``resource.getrusage`` ru_maxrss). Data are deleted after each size.

    .venv/bin/python experiments/stream_memory.py --mb 200 2048           # the LOG figures
    .venv/bin/python experiments/stream_memory.py --mb 4 16 --steps 20    # a minute: the same JSON, tiny
    .venv/bin/python experiments/stream_memory.py --mb 200 2048 --group-size 1   # grain's advice: grows with N

Prints one JSON object: per size the corpus bytes, the time to generate and to tokenize (s per MB), the shards' bytes
and files, the tokenizer's and the reader's peak RSS, and the reader's RSS after its imports (jax, grain: the same at
every size).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from k3jax.train.shards import WRITER_OPTIONS

FILE_MB = 64


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def generate(out_dir: str, mb: int, seed: int = 0) -> int:
    """``mb`` MB of text in files of FILE_MB MB, written block by block (never all in memory)."""
    from k3jax.data import stdlib_documents

    lines = b"".join(stdlib_documents(16 << 20)).split(b"\n")
    lines = [x + b"\n" for x in lines if x.strip()]
    total, i = mb * 1_000_000, 0
    while total > 0:
        rng = np.random.default_rng([seed, i])
        left = min(total, FILE_MB * 1_000_000)
        with open(os.path.join(out_dir, f"part-{i:05d}.txt"), "wb") as f:
            while left > 0:
                block = b"".join(lines[j] for j in rng.integers(0, len(lines), 20_000))[:left]
                f.write(block)
                left -= len(block)
        total -= min(total, FILE_MB * 1_000_000)
        i += 1
    return sum(os.path.getsize(os.path.join(out_dir, p)) for p in os.listdir(out_dir))


def tokenize_child(corpus: str, out: str, seq_len: int, group_size: int | None) -> None:
    from k3jax.tokenizer import ByteTokenizer
    from k3jax.train import shards
    from k3jax.train.shards import write_shards

    if group_size is not None:  # the comparison with grain's recommended group size 1
        shards.WRITER_OPTIONS = f"group_size:{group_size},snappy"

    t0 = time.perf_counter()
    paths = sorted(os.path.join(corpus, p) for p in os.listdir(corpus))
    m = write_shards(paths, out, seq_len=seq_len, tokenizer=ByteTokenizer())
    print(json.dumps({"tokenize_s": time.perf_counter() - t0, "tokenize_peak_rss_mb": _rss_mb(),
                      "train_rows": m["splits"]["train"]["rows"], "files": len(m["files"]),
                      "shard_bytes": sum(f["bytes"] for f in m["files"])}))


def read_child(shards: str, steps: int, batch: int, seq_len: int, verify: bool) -> None:
    from k3jax.train.shards import BYTES_IDENTITY
    from k3jax.train.stream import open_shards

    after_imports = _rss_mb()
    t0 = time.perf_counter()
    data = open_shards(shards, seq_len=seq_len, tokenizer_identity=BYTES_IDENTITY, verify=verify)
    t_open = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    tokens = 0
    for step in rng.integers(0, 10 * data.num_rows // batch, steps):
        tokens += int(data.batch(seed=0, step=int(step), batch=batch, seq_len=seq_len)["tokens"].size)
    print(json.dumps({"read_rss_after_imports_mb": after_imports, "read_peak_rss_mb": _rss_mb(),
                      "open_s": t_open, "read_s": time.perf_counter() - t0, "tokens_read": tokens}))


def _child(*args) -> dict:
    out = subprocess.run([sys.executable, __file__, *map(str, args)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, nargs="+", default=[200, 2048], help="corpus sizes, MB of text")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--no-verify", action="store_true", help="open without hashing the shards")
    p.add_argument("--workdir", default=None, help="where the data go (default: a temporary directory in /tmp)")
    p.add_argument("--group-size", type=int, default=None,
                   help="ArrayRecord group size of the shards (default: the writer's, 16; 1 is grain's advice)")
    p.add_argument("--tokenize", nargs=2, metavar=("CORPUS", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--read", metavar="SHARDS", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.tokenize:
        return tokenize_child(*a.tokenize, a.seq_len, a.group_size)
    if a.read:
        return read_child(a.read, a.steps, a.batch, a.seq_len, not a.no_verify)
    results = []
    for mb in a.mb:
        work = tempfile.mkdtemp(prefix="stream-memory-", dir=a.workdir)
        need = 7 * mb * 1_000_000  # the text and ~5x its size in shards (int32 rows, snappy)
        if shutil.disk_usage(work).free < need:
            shutil.rmtree(work)
            raise SystemExit(f"{work}: needs {need / 1e9:.1f} GB free for {mb} MB of text")
        try:
            corpus, shards = os.path.join(work, "corpus"), os.path.join(work, "shards")
            os.makedirs(corpus)
            t0 = time.perf_counter()
            size = generate(corpus, mb)
            rec = {"mb": mb, "corpus_bytes": size, "generate_s": time.perf_counter() - t0}
            print(f"{mb} MB: generated in {rec['generate_s']:.0f} s; tokenizing ...", file=sys.stderr)
            rec |= _child("--tokenize", corpus, shards, "--seq-len", a.seq_len,
                          *([] if a.group_size is None else ["--group-size", a.group_size]))
            rec["tokenize_s_per_mb"] = rec["tokenize_s"] / (size / 1e6)
            print(f"{mb} MB: tokenized in {rec['tokenize_s']:.0f} s; reading ...", file=sys.stderr)
            rec |= _child("--read", shards, "--steps", a.steps, "--batch", a.batch, "--seq-len", a.seq_len,
                          *(["--no-verify"] if a.no_verify else []))
            print(json.dumps(rec), file=sys.stderr)
            results.append(rec)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    peaks = [r["read_peak_rss_mb"] for r in results]
    print(json.dumps({"steps": a.steps, "batch": a.batch, "seq_len": a.seq_len, "verify": not a.no_verify,
                      "group_size": a.group_size or WRITER_OPTIONS,
                      "sizes": results, "read_peak_rss_spread_mb": max(peaks) - min(peaks)}, indent=1))


if __name__ == "__main__":
    main()
