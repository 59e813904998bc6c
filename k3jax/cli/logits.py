"""`k3 logits DIR --tokens IN.npy --out OUT.npy` — load a checkpoint and write float logits for given tokens.

IN.npy holds int32 token ids [B, T]: B independent sequences, ragged rows right-padded with -1 (as in `k3 route`
and `k3 generate`); a 1-D [T] file is one sequence. It is read with ``allow_pickle=False`` and checked before the
checkpoint is loaded: an id < -1 or >= vocab, a row of only padding or -1 inside a row exits 2 naming the row.
OUT.npy gets float32 [B, T, V] logits (a [T] file: [1, T, V]). The forward runs over the padded rows (padding as id
0; the model is causal, so a real position never sees the padding after it) and the logits at padding positions
are written as NaN, so that nobody mistakes them for values.

    k3 logits ckpt/ --tokens tokens.npy --out logits.npy --dtype float32
    k3 logits --ckpt ckpt/ --tokens tokens.npy --adapter lora/ --out logits.npy     # with a PEFT LoRA adapter

``--mesh data=N,context=M`` runs the forward on N·M devices: rows split over ``data`` (padded with empty rows to a
multiple of N) and each sequence over ``context`` (padded on the right to a multiple of M shards of at least 3
tokens; k3jax/sharding/context_parallel.py); parameters stay whole on every device. The logits equal one device's.

As N processes of one ``jax.distributed`` job (``--coordinator HOST:PORT --num-processes N --process-id I``, or
``bash scripts/multiprocess.sh N k3 logits ...``) the mesh spans every process's devices (without ``--mesh``:
``data`` over all of them); each process reads the checkpoint bytes of its own devices and process 0 writes OUT.

``--adapter DIR`` applies a LoRA adapter in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``,
k3jax/checkpoint/peft.py); it is checked against the checkpoint's config before any weight is read, and a bad one
exits 2 naming its file, with nothing written.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from k3jax import distributed
from k3jax.checkpoint.source import load_model, load_token_file, model_config, placed
from k3jax.cli.args import (
    add_checkpoint_dir,
    add_distributed,
    add_kernels,
    add_strict_config,
    checkpoint_dir,
    kernel_run,
    parse_mesh_arg,
)
from k3jax.config import default_run
from k3jax.model import forward
from k3jax.sharding.context_parallel import ContextParallel


def add_parser(sub) -> None:
    p = sub.add_parser("logits", help="load a checkpoint and compute logits for a token file", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_dir(p, "checkpoint directory")
    p.add_argument("--tokens", required=True,
                   help=".npy int32 [B, T]: B independent sequences, ragged rows right-padded with -1 (NaN logits "
                        "there); [T]: one sequence")
    p.add_argument("--out", required=True, help="output .npy path for logits [B, T, V] float32")
    p.add_argument("--adapter", default=None, metavar="DIR", help="a LoRA adapter in PEFT's layout to apply")
    p.add_argument("--mesh", default=None, help="e.g. context=4: each sequence split over 4 devices; data=2,context=4")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype")
    add_strict_config(p)
    add_kernels(p)
    add_distributed(p)
    p.set_defaults(func=run)


def run(args) -> int:
    ckpt = checkpoint_dir(args)
    mesh = parse_mesh_arg(args.mesh)
    rows = load_token_file(args.tokens, model_config(ckpt=ckpt, preset=None, strict_config=args.strict_config)
                           .vocab_size)                # checked before any weight is read
    cfg, settings, params = load_model(ckpt=ckpt, preset=None, dtype=args.dtype, strict_config=args.strict_config,
                                       adapter=args.adapter, mesh=mesh)
    # --dtype is the parameter dtype; compute as before
    run_cfg = kernel_run(args, default_run(cfg).replace(lora=settings.lora), mesh)
    mask = rows.mask
    tokens = np.where(mask, rows.tokens, 0)
    dispatch = None
    if mesh is not None:
        tokens, dispatch = _on_mesh(mesh, tokens)
    logits = jax.jit(lambda p, t: forward(p, t, cfg, run_cfg, dispatch=dispatch))(params, tokens)
    # every process takes part in gathering the rows the others hold; process 0 alone writes them
    logits = np.array(distributed.host_value(logits), np.float32)[: mask.shape[0], : mask.shape[1]]
    logits[~mask] = np.nan
    if distributed.is_main():
        np.save(args.out, logits, allow_pickle=False)
    distributed.barrier(f"k3 logits: wrote {args.out}")  # no process ends before OUT exists
    pad = f", NaN at {int((~mask).sum())} padding positions" if not mask.all() else ""
    lora = f", adapter {args.adapter} (rank {settings.lora.rank}, {'+'.join(settings.lora.targets)})" \
        if settings.lora else ""
    on = f", on mesh {args.mesh}" if mesh is not None else ""
    print(f"wrote {args.out}: logits {list(logits.shape)} float32{pad}{lora}{on}")
    return 0


def _on_mesh(mesh, tokens):
    """(tokens padded to the mesh's split and placed on it, the model's dispatch); every process holds the same
    host tokens and makes only its own devices' pieces."""
    rows = -(-tokens.shape[0] // mesh.shape["data"]) * mesh.shape["data"]
    dispatch, width = None, tokens.shape[1]
    if mesh.shape["context"] > 1:
        dispatch = ContextParallel(mesh, "fsdp", batch=rows)
        width = max(-(-width // dispatch.n), dispatch.min_shard) * dispatch.n
    tokens = np.pad(tokens, ((0, rows - tokens.shape[0]), (0, width - tokens.shape[1])))
    sharding = NamedSharding(mesh, PartitionSpec("data" if mesh.shape["data"] > 1 else None))
    return placed(tokens, sharding), dispatch
