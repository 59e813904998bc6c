"""`k3 route` — routing analysis of a checkpoint or preset over a text (flags as in docs/cli.md).

    k3 route --ckpt DIR --text corpus.txt --json                  loads, balance, co-activation, specialization
    k3 route --preset k3-mini --text f.py --layers 1,2 --plots out/
    k3 route --ckpt DIR --static --json                            router/bias statistics only: reads 2 tensors/layer
    k3 route --ckpt A --compare B --text f.txt                     drift A -> B (router saturation, top-1 agreement)
    k3 route --ckpt A --adapter lora/ --compare A --text f.txt     drift of A with a PEFT LoRA adapter -> plain A

`--text` goes through the checkpoint's own tokenizer when its directory has one (`tiktoken.model`, docs/model.md §1.1a),
else bytes (the presets, the shipped k3-mini), and is one stream, cut into independent windows of `--seq-len`
tokens; so is a 1-D `--tokens` file [T]. A 2-D `--tokens` file, int32 [B, T], is B independent sequences, ragged
rows right-padded with -1 (as in `k3 logits` and `k3 generate`): each row is routed as its own sequence, as
the model's forward over the rows routes it, and padding is in no statistic; a row longer than `--seq-len` is cut
into windows of `--seq-len` (said once on stderr). `--max-tokens` keeps the first N real tokens, rows in order.
Bad input (an id < -1 or >= vocab, a row of only padding, -1 inside a row) exits 2 before any compute, naming the
row. Per-layer keys of `--json` match `k3 run`'s routing summary; `layer` is the 0-based decoder layer and `load`
the exact assignment counts. `--adapter DIR` applies a LoRA adapter in PEFT's layout (k3jax/checkpoint/peft.py) to the
model under analysis (not to `--compare`); a bad one exits 2 naming its file. Adapters never touch the router
tensors, so `--static` takes none. As N processes of one `jax.distributed` job (`--coordinator HOST:PORT
--num-processes N --process-id I`, or `bash scripts/multiprocess.sh N k3 route ...`) the windows are split over every
process's devices (`--mesh`, else `data` over all of them) and process 0 prints the report and writes the plots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from k3jax import distributed
from k3jax.analysis import collect as ac
from k3jax.analysis import metrics as am
from k3jax.analysis import plots as ap
from k3jax.analysis.static import static_router_analysis
from k3jax.checkpoint.host import peak_rss_bytes
from k3jax.checkpoint.source import default_ckpt, load_model, load_params, load_token_file
from k3jax.cli.args import (
    add_distributed,
    add_kernels,
    add_model_source,
    add_strict_config,
    checkpoint_arg,
    kernel_run,
    parse_mesh_arg,
)
from k3jax.config import architecture_diff, from_hf, get_preset
from k3jax.errors import InputError, int_list
from k3jax.sharding.context_parallel import ContextParallel
from k3jax.tokenizer import ByteTokenizer, load_tokenizer


def add_parser(sub) -> None:
    p = sub.add_parser("route", help="routing analysis: loads, co-activation, specialization, drift, static",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(p, "random init of this preset (see --seed)")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a LoRA adapter in PEFT's layout, applied to --ckpt / --preset (not to --compare)")
    txt = p.add_mutually_exclusive_group()
    txt.add_argument("--text", help="text file, routed as bytes")
    txt.add_argument("--tokens", help=".npy int32 [B, T]: B independent sequences, ragged rows right-padded with -1 "
                     "(a row longer than --seq-len is windowed); [T]: one stream, cut into --seq-len windows")
    p.add_argument("--max-tokens", type=int, default=None, help="route at most this many tokens (rows in order)")
    p.add_argument("--layers", default=None, help="comma-separated 0-based MoE layers (default: all)")
    p.add_argument("--seq-len", type=int, default=128,
                   help="window length: a stream's windows, and the longest a --tokens row is routed whole")
    p.add_argument("--batch", type=int, default=8, help="windows (sequences) per forward pass")
    p.add_argument("--mesh", default=None, help="e.g. data=8: windows sharded over the devices; context=4: each "
                   "window's sequence split over 4 devices (both: data=2,context=4)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype")
    p.add_argument("--seed", type=int, default=0, help="init seed for --preset")
    p.add_argument("--static", action="store_true", help="router/bias tensor statistics only (no forward pass)")
    p.add_argument("--compare", default=None, type=checkpoint_arg, metavar="DIR2",
                   help="second checkpoint: drift per layer")
    p.add_argument("--plots", default=None, metavar="DIR", help="write matplotlib figures and an HTML view here")
    add_strict_config(p)
    add_kernels(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_distributed(p)
    p.set_defaults(func=run)


def read_tokens(args, vocab: int) -> tuple[np.ndarray, object]:
    """(tokens, tokenizer): --text as a 1-D stream (through the checkpoint's tokenizer, or bytes); --tokens as
    ``load_token_file`` reads it, a [T] file as a 1-D stream and a [B, T] file as its rows, right-padded with -1
    (tokenizer None). Every check is here, before any compute."""
    if args.text:
        try:
            with open(args.text, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise InputError(f"--text {args.text}: {e.strerror}") from None
        if not raw:
            raise InputError(f"--text {args.text}: the file is empty")
        tok = load_tokenizer(args.ckpt, vocab)
        if isinstance(tok, ByteTokenizer):
            return np.frombuffer(raw, np.uint8).astype(np.int32), tok  # any bytes, UTF-8 or not
        try:
            return np.asarray(tok.encode(raw.decode("utf-8")), np.int32), tok
        except UnicodeDecodeError as e:
            raise InputError(f"--text {args.text}: not UTF-8 ({e})") from None
    rows = load_token_file(args.tokens, vocab)
    return (rows.tokens[0, : rows.lengths[0]] if rows.stream else rows.tokens), None


def _model(args, mesh):
    cfg, settings, params = load_model(ckpt=args.ckpt, preset=args.preset, dtype=args.dtype,
                                       strict_config=args.strict_config, init_seed=args.seed, adapter=args.adapter,
                                       mesh=mesh)
    return cfg, kernel_run(args, settings, mesh), params


def run(args) -> int:
    if not args.ckpt and not args.preset:
        args.ckpt = default_ckpt()
        if args.ckpt is None:
            raise InputError("give --ckpt DIR or --preset NAME (no shipped model in this install)")
    layers = None if args.layers is None else int_list(args.layers, "--layers")
    if args.static:
        if args.adapter:
            raise InputError("--adapter does not apply to --static: adapters never change the router tensors it reads")
        return _run_static(args, layers)
    if not args.text and not args.tokens:
        raise InputError("give --text FILE or --tokens FILE.npy (or --static)")
    if args.seq_len < 1 or args.batch < 1 or (args.max_tokens is not None and args.max_tokens < 1):
        raise InputError("--seq-len, --batch and --max-tokens must be >= 1")
    mesh = parse_mesh_arg(args.mesh)
    # everything the flags can get wrong is checked on the configs, before any weight is read
    cfg0 = get_preset(args.preset) if args.preset else from_hf(os.path.join(args.ckpt, "config.json"),
                                                               strict=args.strict_config)
    layers = ac.check_layers(cfg0, layers)
    tokens, tok = read_tokens(args, cfg0.vocab_size)
    if tokens.ndim == 2:
        n = ac.row_lengths(tokens, args.max_tokens)
        if (long := int((n > args.seq_len).sum())):
            print(f"k3 route: {long} of {len(n)} rows are longer than --seq-len {args.seq_len}: each is cut into "
                  f"windows of {args.seq_len} tokens, routed as independent sequences", file=sys.stderr)
    if mesh is not None and mesh.shape["context"] > 1 and tokens.ndim == 1:   # a stream's windows are --seq-len wide
        ContextParallel(mesh, "fsdp", batch=mesh.shape["data"]).check(args.seq_len, "--seq-len")
    if args.compare:
        diff = architecture_diff(from_hf(os.path.join(args.compare, "config.json")), cfg0)
        if diff:
            raise InputError(f"--compare {args.compare}: a different config (differs in {', '.join(diff)})")
    cfg, settings, params = _model(args, mesh)
    other = None
    if args.compare:
        _, other = load_params(args.compare, cfg=cfg, dtype=settings.param_dtype, mesh=mesh)
    report, stats, kept = ac.collect(params, cfg, tokens, layers=layers, seq_len=args.seq_len, batch=args.batch,
                                    max_tokens=args.max_tokens, mesh=mesh, keep=bool(args.plots), run=settings,
                                    compare_params=other, progress=not args.json and sys.stderr.isatty())
    report["source"] = args.ckpt or f"preset:{args.preset}"
    report["peak_rss_bytes"] = peak_rss_bytes()
    if args.plots:
        report["plots"] = write_plots(args.plots, report, stats, kept, cfg, tok) if distributed.is_main() else []
        distributed.barrier(f"k3 route: plots in {args.plots}")
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['source']}: {report['tokens']:,} tokens, {cfg.num_experts} experts, "
          f"top-{cfg.num_experts_per_token}")
    print("layer  max/mean  maxvio  cv     unused  entropy bits  token spec (k/E)  stickiness  "
          + ("drift sat/top1" if args.compare else ""))
    for d in report["layers"]:
        ts = d["token_specialization"]
        line = (f"{d['layer']:5d}  {d['max_over_mean_load']:8.2f}  {d['maxvio']:6.2f}  {d['load_cv']:.3f}  "
                f"{d['experts_unused']:6d}  {d['load_entropy_bits']:5.2f}/{d['max_entropy_bits']:.2f}    "
                f"{ts['mean']:.3f} ({ts['random_baseline']:.3f})     {d['stickiness']['set']:.3f}")
        if "drift" in d:
            line += f"       {d['drift']['saturation']:.3f}/{d['drift']['top1']:.3f}"
        print(line)
    for a in report["cross_layer_agreement"]:
        print(f"cross-layer agreement {a['layers'][0]}->{a['layers'][1]}: {a['agreement']:.3f}")
    if args.plots:
        print(f"plots: {', '.join(report['plots'])}")
    return 0


def write_plots(out_dir: str, report: dict, stats, kept, cfg, tok=None) -> list[str]:
    files = [ap.load_heatmap(report, os.path.join(out_dir, "load_heatmap.png")),
             ap.load_histogram(report, os.path.join(out_dir, "load_histogram.png"))]
    l0 = report["layers"][0]["layer"]
    files.append(ap.coactivation_heatmap(am.coactivation(stats.coact[0], stats.load[0]), l0,
                                        os.path.join(out_dir, f"coactivation_layer{l0}.png")))
    m = kept["mask"]
    shuffled = None
    if "byte_class_specialization" in report["layers"][0]:  # byte vocabularies: the label-shuffled baseline too
        shuffled = {d["layer"]: am.shuffled_baseline(kept["tokens"][m], kept[d["layer"]]["ids"][m], cfg.num_experts,
                                                     cfg.num_experts_per_token, seed=d["layer"])
                    for d in report["layers"]}
    files.append(ap.specialization_bars(report, os.path.join(out_dir, "specialization.png"), shuffled=shuffled))
    if any("drift" in d for d in report["layers"]):
        files.append(ap.drift_per_layer(report, os.path.join(out_dir, "drift.png")))
    decode = None
    if tok is not None and tok.name != "bytes":
        decode = lambda t: tok.token_bytes(t).decode("utf-8", errors="replace")  # noqa: E731
    files.append(ap.colored_text_html(kept["tokens"][m], kept[l0]["ids"][m, 0], cfg.num_experts,
                                     os.path.join(out_dir, f"top1_layer{l0}.html"), layer=l0, decode=decode))
    return files


def _run_static(args, layers) -> int:
    if not args.ckpt:
        raise InputError("--static reads a checkpoint's router tensors: give --ckpt DIR")
    cfg = from_hf(os.path.join(args.ckpt, "config.json"), strict=args.strict_config)
    rep = static_router_analysis(args.ckpt, layers, cfg=cfg)
    if args.plots:
        rep["plots"] = [ap.static_norms(rep, os.path.join(args.plots, "static_router.png"))] \
            if distributed.is_main() else []
        distributed.barrier(f"k3 route: plots in {args.plots}")
    if args.json:
        print(json.dumps(rep))
        return 0
    print(f"{args.ckpt}: static router analysis of {len(rep['layers'])} layers; read {rep['bytes_read']:,} tensor "
          f"bytes + {rep['header_bytes']:,} header bytes from {rep['shards_touched']} shards")
    print("layer  router norm mean±std   cos mean / max   bias min / max")
    for d in rep["layers"]:
        n, c, b = d["router_norm"], d["cosine"], d["bias"]
        print(f"{d['layer']:5d}  {n['mean']:9.4f}±{n['std']:.4f}   {c['mean']:+.3f} / {c['max']:+.3f}   "
              f"{b['min']:+.4f} / {b['max']:+.4f}")
    return 0
