"""`k3 train` — pre-train or QAT fine-tune a K3-family model on byte-level text (docs/model.md §8, §9;
docs/numerics.md §10.7).

    k3 train --preset k3-mini --steps 300 --ckpt-dir runs/mini --metrics runs/mini.jsonl      # stdlib corpus
    k3 train --init exported/ --qat weights+acts --steps 50 --export runs/qat-export          # QAT fine-tune
    k3 train --preset k3-tiny --steps 5 --batch 4 --seq-len 32 --max-bytes 200000             # seconds-scale CPU
    k3 train --preset k3-mini --mesh data=2,expert=4 --steps 20 --batch 8                     # expert-parallel
    k3 train --draft-for k3jax/assets/k3-mini-stdlib --steps 600 --batch 16 --seq-len 64 --export drafts/mini
    k3 train --draft-for CKPT --steps 2 --batch 2 --seq-len 16 --export /tmp/draft          # seconds-scale draft

Re-running the same command with the same --ckpt-dir resumes exactly (bit-identical parameters); re-running a
finished run says so and exits 0. Changed settings (--steps too: it sets the LR schedule's length) are refused
unless --fork. SIGTERM saves a checkpoint and exits 0; Ctrl-C saves one and exits 130 (twice: at once, unsaved).
--export DIR is checked before any compute (an existing non-empty DIR only with --overwrite) and written whole or
not at all. Bad input exits 2 before any compute; N non-finite steps in a row exit 1.

--draft-for CKPT trains a DSpark draft (k3jax/draft/) for that frozen target instead (k3jax.draft.train): a fresh
draft shaped by DraftConfig.for_target (--draft-layers, --draft-tokens) or --init DRAFT_DIR, AdamW over --lr's
warm-up + cosine schedule, on the same --data; --export writes it in the DSpark layout. Flags that set up a model
run (--preset, --qat, --lora, --mesh, --ckpt-dir, ...) are refused with it (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from k3jax.cli.args import add_distributed, add_strict_config, checkpoint_arg, preset_arg, preset_help
from k3jax.config.lora import PEFT_EXPERTS, parse_lora
from k3jax.errors import InputError
from k3jax.train.settings import TrainConfig

# The flags are generated from ``TrainConfig`` (k3jax/train/settings.py): each field's ``Setting`` gives its flag,
# group, choices, help and default, so a setting is declared once for the API, the command line and resumes.
_GROUPS = ("model", "run", "data", "output")  # `k3 train --help`'s order
# What the command line adds to a setting's declaration: --preset and --init checked as they are parsed, --lora
# parsed by ``parse_lora``; --preset and --optimizer resolved by ``train_config`` (an --init alone needs no preset,
# --lora defaults to AdamW).
_ARGPARSE = {"preset": {"type": preset_arg, "default": None}, "init": {"type": checkpoint_arg},
             "lora": {"type": None}, "optimizer": {"default": None}}


def _argument(f: dataclasses.Field, hint) -> tuple[list[str], dict]:
    """(flags, argparse keywords) of the TrainConfig field ``f`` (type hint ``hint``), from its ``Setting``."""
    s = f.metadata["setting"]
    text = s.help.format(default=f.default, choices=", ".join(s.choices)).replace("%", "%%")
    kw: dict = {"help": preset_help(text) if f.name == "preset" else text}
    if s.kind == "on":
        kw["action"] = "store_true"
    elif s.kind == "off":  # --no-NAME clears a setting that is on by default
        kw.update(action="store_false", dest=f.name)
    elif s.kind == "either":
        kw.update(action=argparse.BooleanOptionalAction, default=f.default)
    else:
        kw["default"] = f.default
        if s.kind == "many":
            kw["nargs"] = "*"
        base = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))  # X of "X | None"
        if base in (int, float):
            kw["type"] = base
        if s.choices:
            kw["choices"] = s.choices
        if s.metavar:
            kw["metavar"] = s.metavar
    kw.update(_ARGPARSE.get(f.name, {}))
    if kw.get("type", 0) is None:
        del kw["type"]
    return [s.flag if s.kind == "off" else f"--{f.name.replace('_', '-')}"], kw


def _flag_fields() -> list[dataclasses.Field]:
    """The TrainConfig fields with a `k3 train` flag, in declaration order."""
    return [f for f in dataclasses.fields(TrainConfig) if f.metadata["setting"].group]


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train / QAT fine-tune with per-head Muon, QK-Clip and Quantile Balancing",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = {g: p.add_argument_group(g) for g in _GROUPS}
    hints = typing.get_type_hints(TrainConfig)
    for f in _flag_fields():
        group = groups[f.metadata["setting"].group]
        if f.name == "strict_config":  # declared once for every command that reads a config.json
            add_strict_config(group, "--init")
            continue
        flags, kw = _argument(f, hints[f.name])
        if f.name == "lora":
            kw["help"] += _LORA_HELP
        group.add_argument(*flags, **kw)
    groups["output"].add_argument(
        "--adapter-experts", choices=PEFT_EXPERTS, default=None,
        help="with --lora --export: the routed experts' layout in the PEFT adapter. fused: PEFT target_parameters "
        "over transformers 5's 3-D mlp.experts.gate_up_proj / down_proj (w1 and w3 as one rank-2r block-diagonal "
        "adapter, rank_pattern / alpha_pattern), the only form transformers 5's KimiLinear has (there PEFT silently "
        "drops per-expert factors); per-expert: nn.Linear modules block_sparse_moe.experts.{e}.w1|w2|w3, the "
        "release's own modelling code; auto (default): fused on the Kimi-Linear layout, per-expert on K3's. "
        "--adapter loads either layout")
    d = p.add_argument_group("draft")
    d.add_argument("--draft-for", metavar="CKPT", type=checkpoint_arg,
                   help="train a DSpark draft for this frozen target checkpoint (--init: a draft to start from)")
    d.add_argument("--draft-layers", type=int, metavar="N", help="a fresh draft's layers (default: the target's "
                   "depth x 5/93, at least 1)")
    d.add_argument("--draft-tokens", type=int, metavar="K", help="tokens a fresh draft proposes per block "
                   "(default 7)")
    d.add_argument("--draft-anchors", type=int, metavar="N", help="blocks trained per row and step (default "
                   "2 x --seq-len / (K + 1))")
    d.add_argument("--target-dense", action="store_true", help="run the target's MXFP4 experts dequantized (the same "
                   "values, 7.5x their bytes; on CPU the packed experts' loop about doubles a draft step's time)")
    add_distributed(p)
    p.set_defaults(func=run_cli)


# what `k3 train --help` adds to --lora's own help (k3jax/train/settings.py)
_LORA_HELP = ("; dropout=P (0 <= P < 1, default 0): PEFT's LoRA dropout on the adapters' inputs in training steps "
              "(exported as lora_dropout; 0 in a fused-expert adapter, which PEFT refuses otherwise, the sidecar "
              "keeping P); experts_shared_a=true: one A [in, r] per routed-expert stack shared by its experts, B per "
              "expert (needs targets with experts). PEFT has no shared-A form, so --export expands A per expert "
              "(k3jax's k3jax_adapter.json records it: --adapter reloads it shared)")


def train_config(args) -> TrainConfig:
    """The run's settings from `k3 train`'s parsed flags."""
    kw = {f.name: getattr(args, f.name) for f in _flag_fields()}
    lora = None if args.lora is None else parse_lora(args.lora)
    if args.adapter_experts is not None:
        if lora is None or not args.export:
            raise InputError("--adapter-experts: only with --lora and --export (it picks the adapter's layout on disk)")
        lora = lora.replace(peft_experts=args.adapter_experts)
    kw.update(preset=args.preset or (None if args.init else TrainConfig.preset), data=tuple(args.data), lora=lora,
              optimizer=args.optimizer or ("adamw" if lora else TrainConfig.optimizer))
    return TrainConfig(**kw)


# TrainConfig fields a draft run reads (the rest set up a model run: given with --draft-for they exit 2)
_DRAFT_READS = {"init", "strict_config", "compute_dtype", "layer_stack", "kernels", "steps", "batch", "seq_len", "lr",
                "seed", "data", "packing_masks", "max_bytes", "heldout_frac", "eval_every", "eval_at_start",
                "metrics", "tensorboard", "export", "overwrite", "max_bad_steps", "log_every"}
_DRAFT_FLAGS = ("draft_layers", "draft_tokens", "draft_anchors", "target_dense")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def draft_args(args):
    """(TrainConfig, target, ``train_draft``'s keywords) of `k3 train --draft-for`, None without it; a flag a draft
    run does not read, or a draft flag without --draft-for, is an InputError naming it."""
    if args.draft_for is not None and args.adapter_experts is not None:
        raise InputError("--adapter-experts: not used by --draft-for (a draft has no LoRA adapter)")
    if args.draft_for is None:
        given = [n for n in _DRAFT_FLAGS if getattr(args, n) not in (None, False)]
        if given:
            raise InputError(f"{_flag(given[0])} needs --draft-for CKPT (the target the draft is trained for)")
        return None
    from k3jax.checkpoint.source import model_config  # jax: loaded when a draft run starts
    from k3jax.draft.config import DraftConfig
    from k3jax.draft.train import DraftSpec

    for f in _flag_fields():
        if f.name in _DRAFT_READS:
            continue
        value, default = getattr(args, f.name), _ARGPARSE.get(f.name, {}).get("default", f.default)
        if f.name == "optimizer" and value in (None, "adamw"):
            continue
        if (tuple(value) if isinstance(value, list) else value) != default:
            raise InputError(f"{f.metadata['setting'].flag or _flag(f.name)}: not used by --draft-for (a draft "
                             "trains with AdamW on one device, a fresh run; see `k3 train --help`)")
    if args.coordinator is not None or args.num_processes is not None:
        raise InputError(f"{'--coordinator' if args.coordinator else '--num-processes'}: not used by --draft-for (a "
                         "draft trains in one process)")
    for n in ("draft_layers", "draft_tokens", "draft_anchors"):
        if getattr(args, n) is not None and getattr(args, n) < 1:
            raise InputError(f"{_flag(n)} must be >= 1, got {getattr(args, n)}")
    shape = {"num_layers": args.draft_layers, "block_size": args.draft_tokens}
    if args.init and any(v is not None for v in shape.values()):
        n = "draft_layers" if args.draft_layers is not None else "draft_tokens"
        raise InputError(f"{_flag(n)}: the --init draft {args.init} fixes its own shape")
    kw = {f.name: getattr(args, f.name) for f in _flag_fields() if f.name in _DRAFT_READS}
    tc = TrainConfig(**kw | {"preset": None, "data": tuple(args.data), "optimizer": "adamw"})
    draft = None
    if not args.init:
        cfg = model_config(ckpt=args.draft_for, preset=None, strict_config=args.strict_config)
        draft = DraftConfig.for_target(cfg, **{k: v for k, v in shape.items() if v is not None})
    return tc, args.draft_for, {"draft": draft, "spec": DraftSpec(anchors=args.draft_anchors),
                                "packed_target": not args.target_dense}


def run_draft(tc, target, kw) -> int:
    """`k3 train --draft-for`: train, print the summary line; exit 1 on N non-finite steps in a row."""
    from k3jax.draft.train import train_draft
    from k3jax.train.loop import TrainingStoppedError

    try:
        s = train_draft(tc, target, **kw)
    except TrainingStoppedError as e:
        print(f"k3 train: {e}", file=sys.stderr)
        return 1
    ev = s["evals"][-1][1] if s["evals"] else None
    K = s["dcfg"].block_size
    print(f"step {s['step']}: draft loss {s['final_loss']:.4f}" + (
        f", held-out loss {ev['loss']:.4f} (KL {ev['kl']:.4f}), greedy accepted {ev['accept_len']:.3f} of {K} "
        "drafted tokens per block" if ev else "") + (f"; {s['steps_per_s']:.2f} steps/s" if s["steps_per_s"] else "")
        + (f"; draft written to {tc.export}" if tc.export else ""))
    return 0


def run_cli(args) -> int:
    # the loop (orbax, the model, the optimizer) loads when a run starts, not when `k3` builds its parsers
    drafted = draft_args(args)
    if drafted is not None:
        return run_draft(*drafted)
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
