"""`k3 generate` — sample from a checkpoint (or a preset's random init) with the hybrid KDA + MLA cache.

    k3 generate --prompt "def fib(n):" --max-new-tokens 64                 # the shipped k3-mini, greedy
    k3 generate --ckpt DIR --prompt "Hello" --temperature 0.8 --top-p 0.9 --seed 1
    k3 generate --ckpt DIR --tokens prompts.npy --greedy --out gen.npy --logits-out logits.npy --json
    k3 generate --ckpt DIR --adapter lora/ --prompt "Hello"                   # with a PEFT LoRA adapter
    k3 generate --ckpt DIR --draft DRAFT/ --prompt "def fib(n):" --greedy     # speculative, the same tokens

``--tokens`` is an int32 [B, T] array of B independent prompts, ragged ones right-padded with -1 (as in `k3 route` and
`k3 logits`; a 1-D [T] file is one prompt); an id < -1 or >= vocab, a row of only padding or -1 inside a row exits 2
naming the row. ``--prompt`` text is encoded by the checkpoint's own tokenizer when its directory has one
(`tiktoken.model`, docs/model.md §1.1a), else UTF-8 bytes. ``--out`` gets the new tokens only, [B, N] int32, -1 after a
row's stop; ``--logits-out`` the float32 logits [B, N, V] each new token was drawn from (zeros after a stop). With
B = 1 the text streams to stdout as it decodes (B > 1: each row printed whole at the end); ``--json`` prints one object
instead. Same seed, same samples. A --stop id ends its row and is kept as the row's last token. Bad input exits 2
before any compute and writes no file; output files appear only once generation has finished. ``--adapter DIR``
applies a LoRA adapter in PEFT's layout (k3jax/checkpoint/peft.py) to the model; a bad one exits 2 naming its file.
``--draft DIR`` decodes speculatively with a draft model trained for this checkpoint (``k3 train --draft-for``;
k3jax/draft/speculative.py): each step the draft proposes ``--draft-tokens`` K tokens (default: its block size),
the model verifies them in one pass over K + 1 tokens and keeps what the acceptance rules keep — under greedy the
tokens greedy decoding gives without a draft, under sampling (any --temperature / --top-k / --top-p) exactly the
sampler's distribution. ``--rollback copy`` keeps the recurrent layers' state after every verified token,
``replay`` rebuilds it from smaller per-token records (the same values, less memory). A draft made for another model
(config hash, vocabulary, hidden size, tapped layers) exits 2 naming the field before any weight is read. The
streaming, --out and --logits-out work as without a draft (the logits are the model's, behind each emitted token);
--json adds the mean tokens emitted per verify (``acceptance_length``). Not with --mesh.
Timing goes to stderr (``timing`` in the --json object): the prefill's and the decode's compile seconds apart, and
the tokens/s of the decode steps after the first (compiled ones: the first step compiles).

``--mesh data=N,context=M`` runs on N·M devices as `k3 logits` does: rows over ``data`` (padded to a multiple of N
with copies of the last row, dropped from every output), and each prompt's prefill over ``context`` (prompts padded on
the right to a multiple of M shards of at least 3 tokens; k3jax/sharding/context_parallel.py); the cache keeps its
positions split over ``context`` and each decode step reads it there. Parameters stay whole on every device. Same
seed, same tokens on any mesh. As N processes of one ``jax.distributed`` job (``--coordinator HOST:PORT
--num-processes N --process-id I``, or ``bash scripts/multiprocess.sh N k3 generate ...``) the mesh spans every
process's devices (without ``--mesh``: ``data`` over all of them) and process 0 prints and writes the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import numpy as np

from k3jax import distributed
from k3jax.checkpoint.atomic import staged_file
from k3jax.checkpoint.source import default_ckpt, load_model, load_token_file, model_config, placed
from k3jax.cli.args import add_distributed, add_kernels, add_model_source, add_strict_config, kernel_run, parse_mesh_arg
from k3jax.draft.io import load_draft
from k3jax.draft.speculative import DSparkDrafter, generate_speculative
from k3jax.errors import InputError, int_list
from k3jax.model.generate import Sampling, generate
from k3jax.sharding.context_parallel import ContextParallel
from k3jax.sharding.placement import cache_shardings
from k3jax.tokenizer import TokenizerError, load_tokenizer

# docs/model.md §1.1 / the K3 release: 1,048,576-token context; config.json's max_position_embeddings wins when present.
DEFAULT_MAX_LEN = 1 << 20


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample new tokens with the KDA-state + MLA-latent cache",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(p, "random init of this preset (init seed 0)")
    p.add_argument("--adapter", default=None, metavar="DIR", help="a LoRA adapter in PEFT's layout to apply")
    inp = p.add_mutually_exclusive_group(required=True)
    inp.add_argument("--prompt", help="prompt text")
    inp.add_argument("--tokens", help=".npy int32 [B, T]: B independent prompts, ragged rows right-padded with -1; "
                     "[T]: one prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per row, at most (default 64)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="arg-max decoding (the default without --temperature)")
    mode.add_argument("--temperature", type=float, default=None,
                      help="sample from softmax(logits / T) instead of the arg-max (T > 0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches p (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--stop", default=None, help="comma-separated token ids that end a row, e.g. 163586,2")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype")
    p.add_argument("--max-len", type=int, default=None,
                   help="longest prompt + new tokens allowed (default: config.json's max_position_embeddings, "
                        f"else {DEFAULT_MAX_LEN})")
    p.add_argument("--out", help="write the new tokens [B, N] int32 here (.npy)")
    p.add_argument("--logits-out", help="write the logits [B, N, V] float32 here (.npy)")
    p.add_argument("--json", action="store_true", help="print one JSON object (tokens, text, stop_reason, timing)")
    p.add_argument("--mesh", default=None, help="e.g. data=8: rows over 8 devices; context=4: each prompt's prefill "
                   "split over 4 devices (both: data=2,context=4)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--draft", default=None, metavar="DIR", help="a draft model for this checkpoint (k3 train "
                      "--draft-for): decode speculatively, exactly (see above)")
    spec.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                      help="tokens the draft proposes per step, 1..its block size (default: the block size)")
    spec.add_argument("--rollback", default="copy", choices=("copy", "replay"),
                      help="how the recurrent state returns to the last accepted token: copy (keep every verified "
                           "token's state) or replay (rebuild it from per-token records; less memory)")
    add_strict_config(p)
    add_kernels(p)
    add_distributed(p)
    p.set_defaults(func=run)


def _stops(s: str | None, vocab: int) -> list[int]:
    if not s:
        return []
    out = int_list(s, "--stop")
    for v in out:
        if not 0 <= v < vocab:
            raise InputError(f"--stop: id {v} is outside the vocabulary [0, {vocab})")
    return out


def _prompts(args, tok, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompts [B, T] int32 right-padded with -1, lengths [B]) of --prompt or --tokens, checked before any compute."""
    if args.prompt is not None:
        if args.prompt == "":
            raise InputError("--prompt is empty")
        ids = tok.encode(args.prompt)
        if not ids:
            raise InputError("--prompt encodes to no tokens")
        return np.asarray(ids, np.int32)[None], np.array([len(ids)], np.int32)
    rows = load_token_file(args.tokens, vocab)
    return rows.tokens, rows.lengths


def _max_len(args, ckpt) -> int:
    if args.max_len is not None:
        return args.max_len
    if ckpt:
        try:
            with open(os.path.join(ckpt, "config.json")) as f:
                raw = json.load(f)
            tc = raw.get("text_config", raw)
            if isinstance(tc.get("max_position_embeddings"), int):
                return tc["max_position_embeddings"]
        except (OSError, ValueError):
            pass
    return DEFAULT_MAX_LEN


def _save(path: str, arr: np.ndarray) -> None:
    """Write atomically: a finished file or none (process 0 of a multi-process job)."""
    if distributed.is_main():
        with staged_file(path, suffix=".npy") as tmp:
            np.save(tmp, arr, allow_pickle=False)


def _on_mesh(mesh, prompts: np.ndarray, longest: int, max_new_tokens: int) -> tuple[np.ndarray, dict]:
    """(prompts padded to the mesh's split, ``generate``'s placement keywords: the cache's length, the prefill's
    dispatch, the cache's placement).

    Rows: a multiple of ``data``, the extra ones copies of the last row, dropped afterwards (greedy, they stop when it
    stops, so they never keep the loop going; sampled, they may run a few steps longer). No real row's tokens change:
    the partitionable threefry draws a row's bits from its own indices, whatever rows follow it. Prompt width:
    ``context`` shards of at least 3 tokens (padding -1: no row's prompt changes). The cache holds a multiple of
    ``context`` positions, the padded width at least, split over ``context``."""
    B, T = prompts.shape
    rows = -(-B // mesh.shape["data"]) * mesh.shape["data"]
    prompts = np.concatenate([prompts, np.repeat(prompts[-1:], rows - B, axis=0)])
    dispatch, n = None, 1
    if mesh.shape["context"] > 1:
        dispatch = ContextParallel(mesh, "fsdp", batch=rows)
        n = dispatch.n
        prompts = np.pad(prompts, ((0, 0), (0, max(-(-T // n), dispatch.min_shard) * n - T)), constant_values=-1)
    max_len = -(-max(longest + max_new_tokens, prompts.shape[1]) // n) * n

    def place_cache(cache):
        shardings = cache_shardings("fsdp", mesh, cache, context=dispatch)
        return jax.tree.map(placed, cache, shardings)

    return prompts, {"max_len": max_len, "dispatch": dispatch, "place_cache": place_cache}


def _load_draft(args, cfg, mesh):
    """(DraftModel, DraftConfig) of --draft, checked against the model's config first; None without --draft."""
    if args.draft is None:
        if args.draft_tokens is not None or args.rollback != "copy":
            flag = "--draft-tokens" if args.draft_tokens is not None else "--rollback"
            raise InputError(f"{flag} needs --draft DIR")
        return None
    if mesh is not None:
        raise InputError("--draft with --mesh: speculative decoding runs on one device here (not built for meshes)")
    if args.draft_tokens is not None and args.draft_tokens < 1:
        raise InputError(f"--draft-tokens must be >= 1, got {args.draft_tokens}")
    model, dcfg = load_draft(args.draft, target_cfg=cfg, dtype=args.dtype)
    if args.draft_tokens is not None and args.draft_tokens > dcfg.block_size:
        raise InputError(f"--draft-tokens {args.draft_tokens} exceeds the draft's block size {dcfg.block_size}")
    return model, dcfg


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = Sampling(greedy=args.temperature is None, temperature=args.temperature or 1.0, top_k=args.top_k,
                        top_p=args.top_p)
    for path in (args.out, args.logits_out):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise InputError(f"output directory of {path} does not exist")
    if not args.ckpt and not args.preset:
        args.ckpt = default_ckpt()
        if args.ckpt is None:
            raise InputError("give --ckpt DIR or --preset NAME (no shipped model in this install)")
    if args.ckpt and not os.path.isdir(args.ckpt):
        raise InputError(f"--ckpt {args.ckpt}: not a directory")
    # Everything about the request is checked against the architecture before any parameter is loaded.
    cfg = model_config(ckpt=args.ckpt, preset=args.preset, strict_config=args.strict_config)
    try:
        tok = load_tokenizer(args.ckpt, cfg.vocab_size)
    except TokenizerError as e:
        if args.prompt is not None:
            raise InputError(f"--prompt needs a tokenizer: {e}") from None
        tok = None                                     # ids in, ids out (e.g. a preset's 97-id vocabulary)
    prompts, n = _prompts(args, tok, cfg.vocab_size)
    limit = _max_len(args, args.ckpt)
    if int(n.max()) + args.max_new_tokens > limit:
        raise InputError(f"prompt of {int(n.max())} tokens + {args.max_new_tokens} new tokens exceeds the maximum "
                         f"length {limit} (--max-len)")
    stops = _stops(args.stop, cfg.vocab_size)
    mesh = parse_mesh_arg(args.mesh)
    draft = _load_draft(args, cfg, mesh)                   # its identity is checked before any weight is read
    cfg, run_cfg, params = load_model(ckpt=args.ckpt, preset=args.preset, dtype=args.dtype,
                                      strict_config=args.strict_config, adapter=args.adapter, mesh=mesh)
    run_cfg = kernel_run(args, run_cfg, mesh)
    B = prompts.shape[0]
    stream = B == 1 and not args.json and tok is not None
    text = (lambda ids: tok.decode(ids)) if tok is not None else (lambda ids: None)  # noqa: E731
    new_ids: list[int] = []
    printed = [""]

    def on_token(t, ids, done):
        if not stream or ids[0] < 0:
            return
        new_ids.append(int(ids[0]))
        so_far = tok.decode(new_ids)
        if so_far.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            return
        sys.stdout.write(so_far[len(printed[0]):])
        sys.stdout.flush()
        printed[0] = so_far

    if stream:
        sys.stdout.write(tok.decode(prompts[0, : n[0]].tolist()))
        sys.stdout.flush()
    padded, on_mesh = (prompts, {}) if mesh is None else _on_mesh(mesh, prompts, int(n.max()), args.max_new_tokens)
    if draft is not None:
        drafter = DSparkDrafter(*draft, params, cfg, run_cfg, K=args.draft_tokens)
        out = generate_speculative(params, padded, cfg, run_cfg, drafter=drafter, max_new_tokens=args.max_new_tokens,
                                   sampling=sampling, seed=args.seed, stop=stops, rollback_mode=args.rollback,
                                   on_token=on_token)
    else:
        out = generate(params, padded, cfg, run_cfg, max_new_tokens=args.max_new_tokens, sampling=sampling,
                       seed=args.seed, stop=stops, on_token=on_token, **on_mesh)
    out.tokens, out.logits, out.stop_reason = out.tokens[:B], out.logits[:B], out.stop_reason[:B]  # the mesh's extra
    rows = [[int(x) for x in r if x >= 0] for r in out.tokens]
    texts = [text(r) for r in rows]
    if args.out:
        _save(args.out, out.tokens.astype(np.int32))
    if args.logits_out:
        _save(args.logits_out, out.logits.astype(np.float32))
    distributed.barrier("k3 generate: outputs written")  # no process ends before they exist
    if args.json:
        print(json.dumps({"rows": [{"tokens": r, "text": s, "stop_reason": why, "prompt_tokens": int(k)}
                                   for r, s, why, k in zip(rows, texts, out.stop_reason, n, strict=True)],
                          "tokenizer": None if tok is None else tok.name,
                          "sampling": dataclasses.asdict(sampling) | {"seed": args.seed}, "timing": out.timing}))
    elif stream:
        sys.stdout.write(texts[0][len(printed[0]):] + "\n")
        sys.stdout.flush()
    else:
        for b, (s, why) in enumerate(zip(texts, out.stop_reason, strict=True)):
            shown = rows[b] if tok is None else text(prompts[b, : n[b]].tolist()) + s
            print(f"[{b}] ({why}) {shown}")
    t = out.timing  # compile times apart: the throughput is that of the compiled steps (model/generate.py)
    rate = (f"{t['decode_tokens_per_s']:.1f} tokens/s after compile" if t["decode_tokens_per_s"]
            else "tokens/s: - (needs 2 decode steps)")
    if draft is not None:
        rate += f"; {t['acceptance_length']:.2f} tokens per verify (draft of {t['draft_tokens']})"
    print(f"k3 generate: prefill {t['prefill_tokens']} tokens in {t['prefill_s']:.2f} s (compile "
          f"{t['prefill_compile_s']:.2f} s); {t['decode_steps']} decode steps in {t['decode_s']:.2f} s (compile "
          f"{t['decode_compile_s']:.2f} s, first step {t['first_step_s']:.2f} s); {rate}", file=sys.stderr)
    return 0
