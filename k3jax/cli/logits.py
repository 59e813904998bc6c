"""`k3 logits DIR --tokens IN.npy --out OUT.npy` — load a checkpoint and write float logits for given tokens.

IN.npy holds integer token ids [B, T] (or [T]); it is read with ``allow_pickle=False``. OUT.npy gets [B, T, V].

    k3 logits ckpt/ --tokens tokens.npy --out logits.npy --dtype float32
"""

from __future__ import annotations

import numpy as np


def add_parser(sub) -> None:
    p = sub.add_parser("logits", help="load a checkpoint and compute logits for a token file", description=__doc__)
    p.add_argument("dir", nargs="?", help="checkpoint directory")
    p.add_argument("--ckpt", default=None, help="checkpoint directory (same as the positional DIR)")
    p.add_argument("--tokens", required=True, help=".npy of integer token ids [B, T] or [T]")
    p.add_argument("--out", required=True, help="output .npy path for logits [B, T, V]")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype")
    p.add_argument("--strict-config", action="store_true", help="unknown config keys are errors")
    p.set_defaults(func=run)


def read_tokens(path: str, vocab_size: int) -> np.ndarray:
    try:
        t = np.load(path, allow_pickle=False)
    except ValueError as e:  # object arrays need pickle: refused
        raise ValueError(f"{path}: cannot read tokens without unpickling ({e})") from None
    if not np.issubdtype(t.dtype, np.integer):
        raise ValueError(f"{path}: tokens must be integers, got dtype {t.dtype}")
    if t.ndim == 1:
        t = t[None]
    if t.ndim != 2 or t.shape[1] < 1:
        raise ValueError(f"{path}: tokens must have shape [B, T] or [T], got {list(t.shape)}")
    if t.size and (t.min() < 0 or t.max() >= vocab_size):
        raise ValueError(f"{path}: token ids must be in [0, {vocab_size}), got range [{t.min()}, {t.max()}]")
    return t.astype(np.int32)


def run(args) -> int:
    import jax

    from k3jax.checkpoint.load import load
    from k3jax.cli.inspect import checkpoint_dir
    from k3jax.model import forward

    cfg, params = load(checkpoint_dir(args), dtype=args.dtype, strict_config=args.strict_config)
    tokens = read_tokens(args.tokens, cfg.vocab_size)
    logits = jax.jit(lambda p, t: forward(p, t, cfg))(params, tokens)
    np.save(args.out, np.asarray(logits, np.float32), allow_pickle=False)
    print(f"wrote {args.out}: logits {list(logits.shape)} float32")
    return 0
