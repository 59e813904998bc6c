"""`k3 train` — pre-train or QAT fine-tune a K3-family model on byte-level text (docs/model.md §8, §9;
docs/numerics.md §10.7).

    k3 train --preset k3-mini --steps 300 --ckpt-dir runs/mini --metrics runs/mini.jsonl      # stdlib corpus
    k3 train --init exported/ --qat weights+acts --steps 50 --export runs/qat-export          # QAT fine-tune
    k3 train --preset k3-tiny --steps 5 --batch 4 --seq-len 32 --max-bytes 200000             # seconds-scale CPU
    k3 train --preset k3-mini --mesh data=2,expert=4 --steps 20 --batch 8                     # expert-parallel

Re-running the same command with the same --ckpt-dir resumes exactly (bit-identical parameters); re-running a
finished run says so and exits 0. Changed settings (--steps too: it sets the LR schedule's length) are refused
unless --fork. SIGTERM saves a checkpoint and exits 0; Ctrl-C saves one and exits 130 (twice: at once, unsaved).
--export DIR is checked before any compute (an existing non-empty DIR only with --overwrite) and written whole or
not at all. Bad input exits 2 before any compute; N non-finite steps in a row exit 1.
"""

from __future__ import annotations

import argparse
import sys

from k3jax.config import QAT_MODES, REMAT_POLICIES
from k3jax.train.settings import TrainConfig


def add_parser(sub) -> None:
    from k3jax.cli.source import checkpoint_arg, preset_arg, preset_help

    d = TrainConfig()  # every default below is the run's own (k3jax/train/settings.py)
    p = sub.add_parser("train", help="train / QAT fine-tune with per-head Muon, QK-Clip and Quantile Balancing",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model")
    src.add_argument("--preset", default=None, type=preset_arg, metavar="NAME",
                     help=preset_help(f"start from scratch with this preset (default {d.preset})"))
    src.add_argument("--init", default=None, type=checkpoint_arg, metavar="DIR",
                     help="start from this checkpoint directory (its config must match --preset when both are "
                          "given); the run's own checkpoints are --ckpt-dir")
    src.add_argument("--strict-config", action="store_true", help="unknown keys in --init's config.json are errors")
    src.add_argument("--qat", choices=QAT_MODES, default=d.qat,
                     help=f"quantization-aware training: fake-quantize to MXFP4 the routed experts' weights, or "
                          f"weights and activations ({', '.join(QAT_MODES)}; default {d.qat})")
    src.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default=d.compute_dtype,
                     help="matmul operand dtype; master params and optimizer state stay fp32")
    src.add_argument("--layer-stack", choices=("loop", "scan"), default=d.layer_stack,
                     help="the repeating layer group unrolled, or one lax.scan (compile time flat in depth; equal "
                          "up to reduction order)")
    src.add_argument("--remat", choices=REMAT_POLICIES, default=d.remat,
                     help="per-layer activation checkpointing: none, full (keep only each layer's inputs) or a "
                          "jax.checkpoint_policies name; the same math, less activation memory, more recompute")
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps to train for (default {d.steps})")
    run.add_argument("--batch", type=int, default=d.batch, help="global sequences per optimizer step")
    run.add_argument("--micro-batches", type=int, default=d.micro_batches,
                     help="gradient-accumulation micro-batches per step")
    run.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per sequence (default {d.seq_len})")
    run.add_argument("--lr", type=float, default=d.lr,
                     help=f"peak learning rate of the cosine schedule, after a 1%% linear warm-up (default {d.lr})")
    run.add_argument("--optimizer", choices=("per_head", "full", "adamw"), default=None,
                     help="per_head (Muon per head, the default), full, or adamw (the default with --lora)")
    run.add_argument("--opt-state-dtype", default=d.opt_state_dtype,
                     help="dtype the optimizer's moments are stored in (float32 default, bfloat16); master weights "
                          "and the update's arithmetic stay float32")
    run.add_argument("--muon-layout", choices=("auto", "layer", "owner"), default=d.muon_layout,
                     help="where Muon's Newton-Schulz runs: owner (each block whole on one device of the mesh), "
                          "layer (one layer at a time, where the rules put it); auto: owner on > 1 device")
    run.add_argument("--balance", choices=("qb", "sign", "aux", "off"), default=d.balance,
                     help="expert balancing: Quantile Balancing (K3), DeepSeek sign rule, auxiliary loss, none")
    run.add_argument("--qb-ema", type=float, default=d.qb_ema,
                     help="QB only: bias = centre(rho * bias + (1 - rho) * b-hat), an EMA of the per-step target "
                          "(docs/model.md §8.2; default 0 = plain QB)")
    run.add_argument("--no-qk-clip", action="store_true",
                     help="turn QK-Clip off (by default each MLA head whose max attention logit exceeds --qk-tau has "
                          "its query/key weights scaled back after the step)")
    run.add_argument("--qk-tau", type=float, default=d.qk_tau,
                     help=f"QK-Clip's threshold tau on a head's max attention logit (default {d.qk_tau:g})")
    run.add_argument("--seed", type=int, default=d.seed,
                     help=f"seed of the initial parameters and the data order (default {d.seed})")
    run.add_argument("--devices", type=int, default=None, help="data-parallel devices (default: all); "
                     "the same as --mesh data=N")
    run.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                     help="device mesh over data, fsdp, expert, context, tensor (e.g. data=2,expert=4); parameters, "
                          "optimizer state and batches are placed by the sharding rules; context=N splits each "
                          "sequence N ways (--seq-len a multiple of N, >= 3 tokens per shard)")
    run.add_argument("--lora", default=None, metavar="rank=R,alpha=A,targets=T+T",
                     help="train LoRA adapters only, over the frozen base (targets: attn, shared, dense, experts; "
                          "default rank=16,alpha=32,targets=attn+shared+experts); an MXFP4 --init keeps its routed "
                          "experts packed (QLoRA); --export writes the adapters in PEFT's layout")
    run.add_argument("--frozen-experts", action="store_true",
                     help="keep --init's routed experts as their MXFP4 bytes, frozen (run by the grouped MXFP4 "
                          "matmul); attention, router, shared experts and norms train")
    run.add_argument("--strategy", default=None, metavar="NAME",
                     help="sharding rules column: single, fsdp, ep, ep_tp, fsdp_ep_tp (default: from the mesh "
                          "axes, e.g. data+expert -> ep)")
    dat = p.add_argument_group("data")
    dat.add_argument("--data", nargs="*", default=(), help="text files, JSONL of {\"text\": ...} lines, or chat "
                     "JSONL of {\"messages\": [{\"role\": ..., \"content\": ...}, ...]} lines (rendered by the "
                     "--init checkpoint's chat template, or the byte presets' built-in one; loss on assistant "
                     "tokens only) (default: the Python stdlib sources); each file, line or conversation is a "
                     "document")
    dat.add_argument("--no-packing-masks", action="store_true",
                     help="let KDA, its conv and MLA run across document boundaries in a packed sequence (the "
                          "behaviour before document masks, for ablations); by default each document is mixed on "
                          "its own and no prediction crosses a boundary")
    dat.add_argument("--max-bytes", type=int, default=d.max_bytes,
                     help=f"read at most this many bytes of --data (default {d.max_bytes:,})")
    dat.add_argument("--heldout-frac", type=float, default=d.heldout_frac,
                     help=f"fraction of the corpus, at its end, held out for the evaluation (default {d.heldout_frac})")
    dat.add_argument("--eval-every", type=int, default=d.eval_every,
                     help=f"score the held-out data every this many steps, and at the last (default {d.eval_every})")
    dat.add_argument("--eval-at-start", action="store_true", help="also score the initial parameters (step 0)")
    out = p.add_argument_group("output")
    out.add_argument("--ckpt-dir", default=None, metavar="DIR",
                     help="this run's directory of orbax checkpoints (resumes from the latest one); a checkpoint to "
                          "start from is --init")
    out.add_argument("--ckpt-every", type=int, default=d.ckpt_every,
                     help=f"save a checkpoint in --ckpt-dir every this many steps, and at the last "
                          f"(default {d.ckpt_every})")
    out.add_argument("--keep", type=int, default=d.keep,
                     help=f"checkpoints kept in --ckpt-dir, the latest ones (default {d.keep})")
    out.add_argument("--metrics", default=None, help="metrics JSONL file (appended)")
    out.add_argument("--export", default=None, help="write the final model in the official layout here")
    out.add_argument("--fork", action="store_true", help="resume from --ckpt-dir even if settings differ "
                     "(e.g. switch --qat on from a checkpoint of a QAT-off run)")
    out.add_argument("--max-bad-steps", type=int, default=d.max_bad_steps,
                     help="stop after this many non-finite steps in a row")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="a progress bar on stderr (default: when stderr is a terminal)")
    out.add_argument("--overwrite", action="store_true",
                     help="replace --export's directory when it exists and is not empty (else refused before any "
                          "compute); it is replaced only once the new export is complete")
    out.add_argument("--log-every", type=int, default=d.log_every, metavar="N",
                     help=f"without a progress bar (stderr not a terminal, or --no-progress): print step, loss, "
                          f"tokens/s and eta to stderr every N steps (default {d.log_every}; 0: never)")
    p.set_defaults(func=run_cli)


def parse_lora(text: str):
    """``--lora "rank=16,alpha=32,targets=attn+shared+experts"`` → LoRAConfig (any subset of the keys; a bad key or
    value is a ConfigError naming it: exit 2)."""
    from k3jax.config import ConfigError, LoRAConfig

    kw: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, val = part.partition("=")
        if not eq or key not in ("rank", "alpha", "targets", "dropout"):
            raise ConfigError(f"--lora {part!r}: expected rank=, alpha=, targets= or dropout=")
        try:
            kw[key] = (tuple(v for v in val.split("+") if v) if key == "targets" else
                       int(val) if key == "rank" else float(val))
        except ValueError:
            raise ConfigError(f"--lora {key}: not a number: {val!r}") from None
    return LoRAConfig(**kw)


def train_config(args) -> TrainConfig:
    """The run's settings from `k3 train`'s parsed flags."""
    lora = None if args.lora is None else parse_lora(args.lora)
    return TrainConfig(
        preset=args.preset or (None if args.init else TrainConfig.preset), init=args.init, steps=args.steps,
        batch=args.batch, micro_batches=args.micro_batches, seq_len=args.seq_len, lr=args.lr,
        optimizer=args.optimizer or ("adamw" if lora else TrainConfig.optimizer),
        opt_state_dtype=args.opt_state_dtype, muon_layout=args.muon_layout, qat=args.qat,
        compute_dtype=args.compute_dtype,
        layer_stack=args.layer_stack, remat=args.remat,
        balance=args.balance, qb_ema=args.qb_ema, qk_clip=not args.no_qk_clip, qk_tau=args.qk_tau, seed=args.seed,
        data=tuple(args.data), packing_masks=not args.no_packing_masks,
        max_bytes=args.max_bytes, heldout_frac=args.heldout_frac, eval_every=args.eval_every,
        ckpt_dir=args.ckpt_dir, ckpt_every=args.ckpt_every, keep=args.keep, metrics=args.metrics,
        export=args.export, fork=args.fork, max_bad_steps=args.max_bad_steps, devices=args.devices,
        mesh=args.mesh, strategy=args.strategy, frozen_experts=args.frozen_experts, eval_at_start=args.eval_at_start,
        progress=args.progress, strict_config=args.strict_config, lora=lora, overwrite=args.overwrite,
        log_every=args.log_every)


def run_cli(args) -> int:
    from k3jax.train.loop import TrainingStoppedError, train

    tc = train_config(args)
    try:
        s = train(tc, sigint=True, need_params=False)
    except TrainingStoppedError as e:
        print(f"k3 train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the loop, or a second one in it: no traceback
        print("k3 train: interrupted (the last checkpoint saved in --ckpt-dir, if any, is intact)", file=sys.stderr)
        return 130
    print(summary_line(s))
    return 130 if s["stopped"] == "sigint" else 0


def summary_line(s: dict) -> str:
    """The final stdout line of a run's summary (``k3jax.train.loop.train``), also when it took no step."""
    if s["final_loss"] is None:
        head = f"step {s['step']}: " + ("the run was already complete; no step taken" if s.get("complete")
                                         else "no step taken")
    else:
        head = f"step {s['step']}: loss {s['final_loss']:.4f}"
    ev = s["final_eval_loss"]
    return (head + (f", held-out loss {ev:.4f}" if ev is not None else "")
            + f" (held-out unigram entropy {s['heldout_unigram_entropy']:.4f} nats)"
            + (f"; stopped by {s['stopped']}" if s["stopped"] else ""))
