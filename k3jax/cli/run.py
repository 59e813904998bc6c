"""`k3 run` — the main job: a K3-family model on text it has not seen.

By default the trained k3-mini shipped with the package (``k3jax/assets/k3-mini-stdlib``): its held-out loss in
bits per byte on the tail of the standard-library corpus that training held out (the split of `k3 train`'s
defaults), a short greedy sample of its own text from a fixed prompt (decoded through the hybrid KDA-state +
MLA-latent cache, as `k3 generate` does), and its per-layer routing summary over the held-out bytes, with the
routing figures written to ``--plots`` (default: a new temporary directory). ``--preset NAME`` runs a random init of
a preset instead; ``--ckpt DIR`` any checkpoint.

    k3 run                                   # the shipped k3-mini: held-out bits/byte + sample + routing + plots
    k3 run --preset k3-mini --json           # a random init, for comparison
    k3 run --prompt "class Queue:" --max-new-tokens 120 --no-plots
"""

from __future__ import annotations

import json
import math
import tempfile
import time

from k3jax.config import KDA_IMPLS, MOE_IMPLS
from k3jax.errors import InputError

# The sample's fixed prompt: the opening of a stdlib-style function, text the shipped model's corpus is made of.
SAMPLE_PROMPT = 'def read_lines(path, encoding="utf-8"):\n    """'


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="held-out loss + routing summary of the shipped model (or a preset)",
                       description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ckpt", help="checkpoint directory (default: the shipped k3-mini)")
    src.add_argument("--preset", help="random init of this preset instead")
    p.add_argument("--tokens", type=int, default=None, help="held-out bytes to score (default: the whole tail, "
                   "209,715 bytes)")
    p.add_argument("--route-tokens", type=int, default=32768, help="held-out bytes to route for the summary")
    p.add_argument("--seq-len", "--seq", dest="seq_len", type=int, default=64,
                   help="window length (the shipped model was trained at 64)")
    p.add_argument("--batch", type=int, default=16, help="windows per forward pass")
    p.add_argument("--seed", type=int, default=0, help="init seed for --preset")
    p.add_argument("--prompt", default=SAMPLE_PROMPT, help="the greedy sample's prompt (default: a stdlib-style "
                   "function opening)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="length of the greedy sample (0: no sample)")
    p.add_argument("--plots", default=None, metavar="DIR", help="routing figures (default: a new temp dir)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--moe-impl", choices=MOE_IMPLS, default=None)
    p.add_argument("--kda-impl", choices=KDA_IMPLS, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _model(args):
    """(where the model came from, cfg, run settings, params): --preset, --ckpt or the shipped k3-mini."""
    from k3jax.cli.source import default_ckpt, load_model

    over = {k: v for k, v in (("moe_impl", args.moe_impl), ("kda_impl", args.kda_impl)) if v}
    ckpt = None if args.preset else args.ckpt or default_ckpt()
    if not args.preset and ckpt is None:
        raise InputError("no shipped model in this install: give --ckpt DIR or --preset NAME")
    cfg, settings, params = load_model(ckpt=ckpt, preset=args.preset, init_seed=args.seed, run_overrides=over)
    return (f"preset {cfg.name} (random init, seed {args.seed})" if args.preset else ckpt), cfg, settings, params


def _sample(args, cfg, settings, params) -> dict:
    """The greedy continuation of ``--prompt`` (bytes in, bytes out: the model is byte-level) and its wall time,
    the prefill and decode-step compiles included."""
    import numpy as np

    from k3jax.model.generate import generate

    prompt = np.frombuffer(args.prompt.encode("utf-8"), np.uint8).astype(np.int32)[None]
    out = generate(params, prompt, cfg, settings, max_new_tokens=args.max_new_tokens)
    ids = [int(x) for x in out.tokens[0] if x >= 0]
    return {"prompt": args.prompt, "tokens": ids, "text": bytes(ids).decode("utf-8", errors="replace"),
            "seconds_with_compile": out.timing["prefill_s"] + out.timing["decode_s"]}


def run(args) -> int:
    from k3jax.analysis import collect as ac
    from k3jax.model import count_params
    from k3jax.train import data as tdata
    from k3jax.train.evaluate import windowed_loss
    from k3jax.train.settings import TrainConfig

    if not args.prompt or args.max_new_tokens < 0:
        raise InputError(f"--prompt must be non-empty and --max-new-tokens >= 0 (got {args.prompt!r}, "
                         f"{args.max_new_tokens})")
    if (args.tokens is not None and args.tokens < 2) or args.route_tokens < 2 or args.seq_len < 1 or args.batch < 1:
        raise InputError(f"--tokens and --route-tokens must be >= 2, --seq-len and --batch >= 1 (got {args.tokens}, "
                         f"{args.route_tokens}, {args.seq_len}, {args.batch})")
    source, cfg, settings, params = _model(args)
    if cfg.vocab_size < 256:
        raise InputError(f"{cfg.name!r} has vocab {cfg.vocab_size} < 256: byte-level text does not fit")
    d = TrainConfig()  # the shipped model was trained on `k3 train`'s default corpus and split
    _, held = tdata.split(tdata.load_corpus(None, max_bytes=d.max_bytes), d.heldout_frac)
    t0 = time.perf_counter()
    nats, scored = windowed_loss(params, cfg, held[:args.tokens].astype("int32"), seq_len=args.seq_len,
                                 batch=max(args.batch, 32), run=settings)
    eval_s = time.perf_counter() - t0
    sample = _sample(args, cfg, settings, params) if args.max_new_tokens else None
    report, stats, kept = ac.collect(params, cfg, held[:args.route_tokens].astype("int32"), seq_len=args.seq_len,
                                     batch=args.batch,
                                     fields=("ids", "weights", "cutoff"), keep=not args.no_plots, run=settings)
    routing = []
    for d in report["layers"]:
        l = d["layer"]
        r = {k: d[k] for k in ("layer", "max_over_mean_load", "maxvio", "load_cv", "experts_unused",
                               "load_entropy_bits", "max_entropy_bits")}
        r["token_specialization"] = d["token_specialization"]["mean"]
        if kept is not None:
            m = kept["mask"]
            r["top1_weight_mean"] = float(kept[l]["weights"][m][:, 0].mean())
            r["cutoff_mean"] = float(kept[l]["cutoff"][m].mean())
        routing.append(r)
    out = {"model": source, "config": cfg.name, "params": count_params(params),
           "heldout_tokens_scored": scored, "heldout_nats_per_byte": nats,
           "heldout_bits_per_byte": nats / math.log(2), "unigram_entropy_nats": tdata.unigram_entropy(held),
           "eval_s": round(eval_s, 2), "sample": sample, "routed_tokens": report["tokens"], "routing": routing}
    if not args.no_plots:
        from k3jax.cli.route import write_plots

        plots = args.plots or tempfile.mkdtemp(prefix="k3-run-plots-")
        report["source"] = source
        out["plots"] = write_plots(plots, report, stats, kept, cfg)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{source}: {cfg.name}, {out['params']:,} params")
    print(f"held-out loss {nats / math.log(2):.3f} bits/byte ({nats:.3f} nats) on {scored:,} bytes of the stdlib "
          f"tail that training holds out (unigram entropy {out['unigram_entropy_nats'] / math.log(2):.3f} "
          f"bits/byte); {eval_s:.1f} s")
    if sample is not None:
        print(f"greedy sample, {len(sample['tokens'])} new bytes decoded through the KDA-state + MLA-latent cache "
              f"({sample['seconds_with_compile']:.1f} s with its compiles):")
        print("    " + (sample["prompt"] + sample["text"]).replace("\n", "\n    "))
    print(f"routing over the first {report['tokens']:,} held-out bytes:")
    print("layer  max/mean  cv     unused  entropy/max bits  token spec  top-1 weight  mean cutoff")
    for r in routing:
        print(f"{r['layer']:5d}  {r['max_over_mean_load']:8.2f}  {r['load_cv']:.3f}  {r['experts_unused']:6d}  "
              f"{r['load_entropy_bits']:6.2f}/{r['max_entropy_bits']:.2f}       {r['token_specialization']:.3f}"
              + (f"       {r['top1_weight_mean']:.3f}        {r['cutoff_mean']:.3f}" if "cutoff_mean" in r else ""))
    if "plots" in out:
        print(f"routing plots in {plots}: {', '.join(p.rsplit('/', 1)[-1] for p in out['plots'])}")
    return 0
