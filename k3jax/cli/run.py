"""`k3 run` — the main job: a K3-family model on text it has not seen.

By default the trained k3-mini shipped with the package (``k3jax/assets/k3-mini-stdlib``): its held-out loss in
bits per byte on the tail of the standard-library corpus that training held out (the split of `k3 train`'s
defaults), a short greedy sample of its own text from a fixed prompt (decoded through the hybrid KDA-state +
MLA-latent cache, as `k3 generate` does), and its per-layer routing summary over the held-out bytes, with the
routing figures written to ``--plots`` (default: a new temporary directory). ``--preset NAME`` runs a random init of
a preset instead; ``--ckpt DIR`` any checkpoint.

The standard-library corpus is the running Python's own, so it differs between machines: the held-out figure comes
with the sha256 of the bytes scored and that Python's version (``heldout_text`` in --json), and two machines' figures
compare when these agree. What the run is doing goes to stderr as it goes — each phase (load, compile, scoring, the
sample, routing, plots) with its seconds, bars on a terminal —; stdout gets the results alone.

    k3 run                                   # the shipped k3-mini: held-out bits/byte + sample + routing + plots
    k3 run --preset k3-mini --json           # a random init, for comparison
    k3 run --prompt "class Queue:" --max-new-tokens 120 --no-plots
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

from k3jax.analysis import collect as ac
from k3jax.checkpoint.source import default_ckpt, load_model
from k3jax.cli.args import add_kernels, add_model_source, kernel_run
from k3jax.cli.route import write_plots
from k3jax.config import KDA_IMPLS, MOE_IMPLS
from k3jax.data import text_identity
from k3jax.errors import InputError
from k3jax.model import count_params
from k3jax.model.generate import generate
from k3jax.train import data as tdata
from k3jax.train.evaluate import heldout_loss, make_scorer, tiled_windows
from k3jax.train.settings import TrainConfig

# The sample's fixed prompt: the opening of a stdlib-style function, text the shipped model's corpus is made of.
SAMPLE_PROMPT = 'def read_lines(path, encoding="utf-8"):\n    """'


def add_parser(sub) -> None:
    d = TrainConfig()  # the shipped model was trained on `k3 train`'s default corpus and split
    p = sub.add_parser("run", help="held-out loss + routing summary of the shipped model (or a preset)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(p, "random init of this preset instead")
    held = p.add_mutually_exclusive_group()
    held.add_argument("--heldout-bytes", type=int, default=None, metavar="N", help="held-out bytes to score "
                      f"(default: the whole tail, {int(d.max_bytes * d.heldout_frac):,} bytes)")
    held.add_argument("--tokens", type=int, default=None, metavar="N",
                      help="deprecated spelling of --heldout-bytes (goes away in the next release)")
    p.add_argument("--route-tokens", type=int, default=32768, help="held-out bytes to route for the summary")
    p.add_argument("--seq-len", "--seq", dest="seq_len", type=int, default=64,
                   help="window length (the shipped model was trained at 64)")
    p.add_argument("--batch", type=int, default=16, help="windows per forward pass")
    p.add_argument("--seed", type=int, default=0, help="init seed for --preset")
    p.add_argument("--prompt", default=SAMPLE_PROMPT, help="the greedy sample's prompt (default: a stdlib-style "
                   "function opening)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="length of the greedy sample (0: no sample)")
    p.add_argument("--plots", default=None, metavar="DIR", help="routing figures (default: a new temp dir)")
    p.add_argument("--no-plots", action="store_true", help="write no routing figures")
    p.add_argument("--moe-impl", choices=MOE_IMPLS, default=None,
                   help="how the routed experts run (default: the model's run settings; the same math)")
    p.add_argument("--kda-impl", choices=KDA_IMPLS, default=None,
                   help="how Kimi Delta Attention runs (default: the model's run settings; the same math)")
    add_kernels(p, "--kda-impl")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _model(args):
    """(where the model came from, cfg, run settings, params): --preset, --ckpt or the shipped k3-mini."""
    ckpt = None if args.preset else args.ckpt or default_ckpt()
    if not args.preset and ckpt is None:
        raise InputError("no shipped model in this install: give --ckpt DIR or --preset NAME")
    cfg, settings, params = load_model(ckpt=ckpt, preset=args.preset, init_seed=args.seed)
    settings = kernel_run(args, settings, moe_impl=args.moe_impl, kda_impl=args.kda_impl)
    return (f"preset {cfg.name} (random init, seed {args.seed})" if args.preset else ckpt), cfg, settings, params


def _sample(args, cfg, settings, params) -> dict:
    """The greedy continuation of ``--prompt`` (bytes in, bytes out: the model is byte-level), its wall time with
    the prefill and decode-step compiles included, and its ``timing`` (``k3jax.model.generate``: compiles apart)."""
    prompt = np.frombuffer(args.prompt.encode("utf-8"), np.uint8).astype(np.int32)[None]
    out = generate(params, prompt, cfg, settings, max_new_tokens=args.max_new_tokens)
    ids = [int(x) for x in out.tokens[0] if x >= 0]
    return {"prompt": args.prompt, "tokens": ids, "text": bytes(ids).decode("utf-8", errors="replace"),
            "seconds_with_compile": out.timing["prefill_s"] + out.timing["decode_s"], "timing": out.timing}


class _Progress:
    """What `k3 run` is doing, on stderr as it goes (stdout keeps the results alone): each phase as it starts and
    its seconds when it ends; on a terminal the scoring and the routing also draw a tqdm bar."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.bars = sys.stderr.isatty()

    @contextlib.contextmanager
    def phase(self, what: str, *, bar: bool = False):
        """``with progress.phase("scoring") as note:`` — ``note["after"]`` is written after the seconds. A phase
        with a bar on a terminal gets its own lines: the bar sits between its start and its seconds."""
        lines = bar and self.bars
        print(f"k3 run: {what} ...", end="\n" if lines else "", file=sys.stderr, flush=True)
        t = time.perf_counter()
        note = {"after": ""}
        try:
            yield note
        except BaseException:
            if not lines:
                print(file=sys.stderr, flush=True)  # the error's message starts a line of its own
            raise
        took = f"{time.perf_counter() - t:.1f} s{note['after']}"
        print(f"k3 run: {what}: {took}" if lines else f" {took}", file=sys.stderr, flush=True)

    def done(self) -> None:
        print(f"k3 run: done in {time.perf_counter() - self.t0:.1f} s", file=sys.stderr, flush=True)


def _heldout_loss(progress, params, cfg, settings, tokens, *, seq_len: int, batch: int) -> tuple[float, int, float]:
    """(nats per byte, bytes scored, compile seconds): ``windowed_loss``'s figure, its scorer compiled ahead of
    time in a phase of its own and then run as that executable, batch by batch under a progress bar."""
    windows = tiled_windows(tokens, seq_len=seq_len)
    with progress.phase(f"compiling the scorer ({batch} windows of {seq_len} bytes)"):
        t = time.perf_counter()
        # heldout_loss pads a short last batch: every call has this shape
        score = make_scorer(cfg, settings).lower(params, np.zeros((batch, seq_len + 1), np.int32),
                                                 np.zeros((batch, seq_len), np.float32)).compile()
        compile_s = time.perf_counter() - t
    n = -(-len(windows.tokens) // batch)
    with (progress.phase(f"scoring {int(windows.mask.sum()):,} held-out bytes ({n} batches)", bar=True),
          tqdm(total=n, desc="score", unit="batch", file=sys.stderr, disable=not progress.bars) as bar):
        def ticking(params, tokens, mask):
            s = float(score(params, tokens, mask))
            bar.update(1)
            return s

        nats, scored = heldout_loss(params, windows, batch=batch, score=ticking)
    return nats, scored, compile_s


def run(args) -> int:
    progress = _Progress()
    if args.tokens is not None:  # the old spelling, read for one release (docs/cli.md §4)
        print("k3 run: warning: --tokens N is now --heldout-bytes N (--tokens names a token file everywhere else; "
              "the old spelling goes away in the next release)", file=sys.stderr)
        args.heldout_bytes = args.tokens
    if not args.prompt or args.max_new_tokens < 0:
        raise InputError(f"--prompt must be non-empty and --max-new-tokens >= 0 (got {args.prompt!r}, "
                         f"{args.max_new_tokens})")
    n_held = args.heldout_bytes
    if (n_held is not None and n_held < 2) or args.route_tokens < 2 or args.seq_len < 1 or args.batch < 1:
        raise InputError(f"--heldout-bytes and --route-tokens must be >= 2, --seq-len and --batch >= 1 (got "
                         f"{n_held}, {args.route_tokens}, {args.seq_len}, {args.batch})")
    with progress.phase("loading the model") as note:
        source, cfg, settings, params = _model(args)
        note["after"] = f" ({source}: {cfg.name})"
    if cfg.vocab_size < 256:
        raise InputError(f"{cfg.name!r} has vocab {cfg.vocab_size} < 256: byte-level text does not fit")
    with progress.phase("reading the held-out text") as note:
        d = TrainConfig()  # the shipped model was trained on `k3 train`'s default corpus and split
        _, held = tdata.split(tdata.load_corpus(None, max_bytes=d.max_bytes), d.heldout_frac)
        text = text_identity(held[:n_held])  # the scored bytes: their hash names them across machines
        note["after"] = f" (the Python {text['python']} standard library's tail, sha256 {text['sha256'][:12]}...)"
    t0 = time.perf_counter()
    nats, scored, compile_s = _heldout_loss(progress, params, cfg, settings, held[:n_held].astype("int32"),
                                            seq_len=args.seq_len, batch=max(args.batch, 32))
    eval_s = time.perf_counter() - t0
    sample = None
    if args.max_new_tokens:
        with progress.phase(f"greedy sample of {args.max_new_tokens} bytes") as note:
            sample = _sample(args, cfg, settings, params)
            t = sample["timing"]
            rate = f"; {t['decode_tokens_per_s']:.1f} bytes/s after compile" if t["decode_tokens_per_s"] else ""
            note["after"] = f" ({t['prefill_compile_s'] + t['decode_compile_s']:.1f} s of it compile{rate})"
    with progress.phase(f"routing {min(args.route_tokens, held.size):,} held-out bytes", bar=True):
        report, stats, kept = ac.collect(params, cfg, held[:args.route_tokens].astype("int32"), seq_len=args.seq_len,
                                         batch=args.batch, fields=("ids", "weights", "cutoff"),
                                         keep=not args.no_plots, run=settings, progress=progress.bars)
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
           "heldout_text": text, "eval_s": round(eval_s, 2), "eval_compile_s": round(compile_s, 2),
           "sample": sample, "routed_tokens": report["tokens"], "routing": routing}
    if not args.no_plots:
        plots = args.plots or tempfile.mkdtemp(prefix="k3-run-plots-")
        with progress.phase(f"writing the routing plots to {plots}"):
            report["source"] = source
            out["plots"] = write_plots(plots, report, stats, kept, cfg)
    progress.done()
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{source}: {cfg.name}, {out['params']:,} params")
    print(f"held-out loss {nats / math.log(2):.3f} bits/byte ({nats:.3f} nats) on {scored:,} bytes of the stdlib "
          f"tail that training holds out (unigram entropy {out['unigram_entropy_nats'] / math.log(2):.3f} "
          f"bits/byte); {eval_s:.1f} s")
    print(f"held-out text: the Python {text['python']} standard library, {text['bytes']:,} bytes, sha256 "
          f"{text['sha256']} (figures from two machines compare when these agree)")
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
