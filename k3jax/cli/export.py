"""`k3 export OUT` — write params in the official K3 checkpoint layout (byte-exact container, index, config).

Either re-export a checkpoint (``--from DIR``: loaded, then written back; byte-identical for an official-layout
input), or export freshly initialised params of a preset (``--preset``). ``--from``'s MXFP4 experts are copied
byte for byte, so a QAT-trained model's export keeps the grid it trained on (its rule, docs/numerics.md §10.7);
float experts are packed with the compressed-tensors "even" scale rule. A training checkpoint exports with
``k3 train --ckpt-dir DIR --export OUT`` (the finished run again), on the rule recorded with it.

    k3 export out/ --preset k3-mini --seed 0
    k3 export out2/ --from out/ --manifest
    k3 export merged/ --from base/ --merge-adapter adapter/ --heldout chat_heldout.jsonl --json

``--merge-adapter DIR`` writes the base with a LoRA adapter (PEFT's layout) merged in: W + (alpha / r) A B, routed
experts re-quantized to MXFP4 (k3jax/checkpoint/merge.py reports, per layer and stack, how much of each delta the
grid keeps), then reloads what it wrote and compares it with the base + adapter: logits on ``--tokens`` (default:
4 rows of 64 random ids) and, with ``--heldout`` chat data, the loss on the assistant's tokens
(k3jax/train/merged_export.py).

As N processes of one ``jax.distributed`` job (``--coordinator HOST:PORT --num-processes N --process-id I``, or
``bash scripts/multiprocess.sh N k3 export ...``): ``--from``'s routed experts are split over every process's
devices (each process reads only its experts' bytes) and each process writes the tensors it holds into OUT
(k3jax/checkpoint/save_dist.py); the bytes are one process's. ``--merge-adapter`` runs in one process.
"""

from __future__ import annotations

import argparse
import json

import jax

from k3jax.checkpoint.atomic import check_out_dir
from k3jax.checkpoint.leaves import default_mesh
from k3jax.checkpoint.load import load
from k3jax.checkpoint.save import save
from k3jax.checkpoint.source import replicated
from k3jax.cli.args import add_distributed, add_strict_config, checkpoint_arg, preset_arg, preset_help
from k3jax.config import get_preset
from k3jax.errors import InputError
from k3jax.model import init_params
from k3jax.train.merged_export import export_merged


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write params as an official-layout safetensors checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", metavar="OUT", help="output directory (written atomically)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="src", type=checkpoint_arg, metavar="DIR",
                     help="checkpoint directory to load and re-export")
    src.add_argument("--preset", type=preset_arg, metavar="NAME",
                     help=preset_help("export freshly initialised params of this preset"))
    p.add_argument("--seed", type=int, default=0, help="init seed for --preset (default 0)")
    p.add_argument("--expert-format", choices=("mxfp4", "bf16"), default=None,
                   help="how the routed experts are stored (default: as the config says; --from's MXFP4 experts are "
                        "copied byte for byte)")
    p.add_argument("--manifest", action="store_true", help="also write SHA256SUMS")
    p.add_argument("--overwrite", action="store_true", help="replace OUT when it exists and is not empty")
    add_strict_config(p, "--from")
    p.add_argument("--merge-adapter", default=None, metavar="DIR",
                   help="merge this LoRA adapter (PEFT layout) into --from's weights before writing")
    p.add_argument("--tokens", default=None, help="with --merge-adapter: token file (.npy) to compare logits on")
    p.add_argument("--heldout", default=None, help="with --merge-adapter: chat JSONL whose answer-token loss is "
                   "compared (merged checkpoint vs base + adapter)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_distributed(p)
    p.set_defaults(func=run)


def _check_out(args) -> None:
    """OUT checked before anything is loaded: an existing non-empty directory only with --overwrite (exit 2)."""
    check_out_dir(args.out, overwrite=args.overwrite, flag="OUT", hint="pass --overwrite")


def run(args) -> int:
    if args.merge_adapter:
        return _merge(args)
    if args.tokens or args.heldout:
        raise InputError("--tokens and --heldout compare a merged adapter: give --merge-adapter")
    _check_out(args)
    if args.src:
        # keep experts packed: exporting them again is then a byte copy, not a re-quantization. The experts are split
        # over the "expert" axis of every device of the job (load's default), the rest whole on each device.
        cfg, params = load(args.src, keep_experts_packed=args.expert_format in (None, "mxfp4"),
                           strict_config=args.strict_config)
    else:
        cfg = get_preset(args.preset)
        # a job of several processes draws it whole on every device (global arrays: save writes each tensor once)
        on = {"out_shardings": replicated(default_mesh())} if jax.process_count() > 1 else {}
        params = jax.jit(init_params, static_argnums=0, **on)(cfg, jax.random.key(args.seed))
    if args.expert_format:
        cfg = cfg.replace(expert_format=args.expert_format)
    r = save(params, cfg, args.out, overwrite=args.overwrite, manifest=args.manifest, progress=True)
    print(f"wrote {r['dir']}: {len(r['files'])} shards, {r['total_size']:,} payload bytes")
    return 0


def _merge(args) -> int:
    if jax.process_count() > 1:
        raise InputError(f"--merge-adapter runs in one process (this job has {jax.process_count()}): drop "
                         "--coordinator / --num-processes / --process-id")
    if not args.src:
        raise InputError("--merge-adapter merges into a checkpoint: give --from BASE")
    if args.expert_format == "bf16":
        raise InputError("--merge-adapter re-quantizes the experts as the base stores them; drop --expert-format")
    _check_out(args)
    result = export_merged(args.src, args.merge_adapter, args.out, tokens=args.tokens, heldout=args.heldout,
                           overwrite=args.overwrite, manifest=args.manifest, strict_config=args.strict_config)
    out = result.summary
    if args.json:
        print(json.dumps(out | {"tensors": result.tensors}))
    else:
        print(f"wrote {out['dir']}: the base with {args.merge_adapter} merged ({len(result.files)} shards)")
        s = out["requantization"]
        if s:
            print(f"experts re-quantized: {s['expert_tensors']} stacks, share of the delta kept on the MXFP4 grid "
                  f"{s['delta_kept_mean']:.3f} mean ({s['delta_kept_min']:.3f} min), {s['moved_mean']:.1%} of "
                  f"weights moved, re-quantization error <= {s['requant_rel_max']:.2e} rel-RMS")
        print(f"logits, merged vs base + adapter: {out['logits_rel_rms_merged_vs_adapter']:.2e} rel-RMS (base vs "
              f"base + adapter: {out['logits_rel_rms_base_vs_adapter']:.2e})")
        if args.heldout:
            h = out["heldout_answer_nats"]
            kept = out["adapter_gain_kept"]
            print(f"held-out answer loss: base {h['base']:.4f}, base + adapter {h['adapter']:.4f}, merged "
                  f"{h['merged']:.4f} nats" + ("" if kept is None else f" ({kept:.1%} of the adapter's gain kept)"))
    return 0
