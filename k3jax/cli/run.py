"""`k3 run` — the main job on a small preset: build the model, run a forward pass over real byte-level text
(the Python standard library's sources), report the loss, throughput and a per-layer routing summary.

    k3 run                                   # k3-mini, 4 × 256 tokens
    k3 run --preset k3-tiny --batch 2 --seq 64 --json
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="forward pass + routing summary on a small preset", description=__doc__)
    p.add_argument("--preset", default="k3-mini")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--moe-impl", choices=("sorted", "ragged", "tiled", "dense"), default=None)
    p.add_argument("--kda-impl", choices=("recurrent", "chunked", "pallas"), default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from k3jax.analysis import routing_summary
    from k3jax.config import get_preset
    from k3jax.data import stdlib_bytes
    from k3jax.model import count_params, forward, init_params

    if args.batch < 1 or args.seq < 2:
        raise ValueError(f"--batch must be >= 1 and --seq >= 2 (got {args.batch}, {args.seq})")
    over = {k: v for k, v in (("moe_impl", args.moe_impl), ("kda_impl", args.kda_impl)) if v}
    cfg = get_preset(args.preset, **over)
    if cfg.num_experts > 4096 or cfg.hidden_size > 4096:
        raise ValueError(f"preset {args.preset!r} is too large to run here; use `k3 plan --preset {args.preset}`")
    if cfg.vocab_size < 256:
        raise ValueError(f"preset {args.preset!r} has vocab {cfg.vocab_size} < 256: byte-level text does not fit")
    data = stdlib_bytes(args.batch * (args.seq + 1))
    toks = jnp.asarray(data.reshape(args.batch, args.seq + 1).astype(np.int32))
    params = init_params(cfg, jax.random.key(args.seed))
    fwd = jax.jit(lambda p, t: forward(p, t, cfg, return_aux=True))
    t0 = time.perf_counter()
    logits, aux = jax.block_until_ready(fwd(params, toks[:, :-1]))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, aux = jax.block_until_ready(fwd(params, toks[:, :-1]))
    step_s = time.perf_counter() - t0
    logp = jax.nn.log_softmax(logits, axis=-1)
    loss = float(-jnp.mean(jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1)))
    moe_layers = [l for l in range(cfg.num_layers) if cfg.is_moe(l)]
    out = {
        "preset": cfg.name,
        "params": count_params(params),
        "tokens": args.batch * args.seq,
        "loss_at_init": loss,
        "uniform_loss": float(np.log(cfg.vocab_size)),
        "logits_finite": bool(jnp.all(jnp.isfinite(logits))),
        "compile_s": round(compile_s, 3),
        "forward_s": round(step_s, 4),
        "tokens_per_s": round(args.batch * args.seq / step_s, 1),
        "routing": routing_summary(aux["routing"], cfg.num_experts, moe_layers),
        "mla_max_logit": [float(jnp.max(m)) for m in aux["mla_max_logit"]],
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{cfg.name}: {out['params']:,} params, {out['tokens']} tokens of stdlib text", file=sys.stdout)
    print(f"loss at init {loss:.4f} (uniform {out['uniform_loss']:.4f}); forward {step_s * 1e3:.1f} ms "
          f"({out['tokens_per_s']:.0f} tok/s; compile {compile_s:.1f} s)")
    print("layer  max/mean load  cv     unused  entropy/max bits  top-1 weight  mean cutoff")
    for r in out["routing"]:
        print(f"{r['layer']:5d}  {r['max_over_mean_load']:13.2f}  {r['load_cv']:.3f}  {r['experts_unused']:6d}  "
              f"{r['load_entropy_bits']:6.2f}/{r['max_entropy_bits']:.2f}       {r['top1_weight_mean']:.3f}        "
              f"{r['cutoff_mean']:.3f}")
    print("MLA max logit per layer:", ", ".join(f"{m:.2f}" for m in out["mla_max_logit"]))
    return 0
