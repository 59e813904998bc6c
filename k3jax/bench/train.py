"""`k3 bench train --json`: training throughput (tokens/s) and MFU of the full jitted train step (per-head Muon,
QK-Clip, Quantile Balancing) on k3-mini, against an XLA matmul peak measured in the same run.

    k3 bench train --json              # k3-mini, batch 8 × 128 tokens, 3 timed steps
    k3 bench train --json --quick      # k3-tiny, batch 4 × 32 tokens (smoke test, CPU seconds)
    k3 bench train --json --quick --layers 2 --batch 2 --seq-len 16 --reps 1   # the test's size: KDA + MLA/MoE

``ratios``: ``mfu`` and ``tokens_per_s``. ``params`` is counted on the initialised tree (the test compares it with
``k3jax.model.count_params``); ``loss`` is the step's loss on the random batch.

MFU = flops_per_token · tokens/s / peak (k3jax.train.flops: 6 · active matmul params + attention); the peak is a
jitted n×n matmul in the compute dtype (``k3jax.train.flops.matmul_peak_flops``). Times are medians of warm steps.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.bench.common import matmul_peak_flops, time_median
from k3jax.config import QAT_MODES, default_run, get_preset
from k3jax.model import init_params
from k3jax.optim.optimizer import OptimConfig, make_optimizer
from k3jax.train.flops import flops_per_token
from k3jax.train.step import StepSpec, init_state, make_train_step


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="k3-tiny, small batch (smoke test)")
    parser.add_argument("--preset", default=None, help="default k3-mini (k3-tiny with --quick)")
    parser.add_argument("--layers", type=int, default=None,
                        help="truncate the preset to this many layers, the last one MLA (default: the preset's)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--qat", choices=QAT_MODES, default="off")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32")


def run(args) -> dict:
    quick = getattr(args, "quick", False)
    preset = args.preset or ("k3-tiny" if quick else "k3-mini")
    B = args.batch or (4 if quick else 8)
    T = args.seq_len or (32 if quick else 128)
    reps = args.reps or (2 if quick else 3)
    layers = {} if args.layers is None else {"num_layers": args.layers, "full_attn_layers": (args.layers,)}
    cfg = get_preset(preset, **layers)
    run = default_run(cfg, qat=args.qat, compute_dtype=args.compute_dtype)
    params = init_params(cfg, jax.random.key(0), run)
    tx, _ = make_optimizer(params, OptimConfig(total_steps=1000))
    state = init_state(params, tx)
    step = jax.jit(make_train_step(cfg, run, tx, StepSpec()))
    tokens = jax.random.randint(jax.random.key(1), (1, B, T + 1), 0, min(cfg.vocab_size, 256), jnp.int32)
    zero = jnp.float32(0.0)
    print(f"compiling the {preset} train step (B={B}, T={T}) ...", file=sys.stderr)
    t_step = time_median(lambda s: step(s, tokens, zero)[1]["loss"], state, reps=reps)  # state not donated: reusable
    tps = B * T / t_step
    loss = float(step(state, tokens, zero)[1]["loss"])  # the first step's loss: finite, about ln(vocab) at init
    fpt = flops_per_token(cfg, params, T)
    peak = matmul_peak_flops(dtype=jnp.dtype(args.compute_dtype))
    mfu = fpt * tps / peak
    print(f"{preset}: {t_step:.3f} s/step, {tps:,.0f} tokens/s, MFU {mfu:.3f} of a {peak / 1e9:.1f} GFLOP/s matmul",
          file=sys.stderr)
    return {
        "name": "train",
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "shape": {"preset": preset, "layers": cfg.num_layers, "batch": B, "seq_len": T, "quick": quick, "reps": reps,
                  "qat": args.qat, "compute_dtype": args.compute_dtype},
        "times": {"step_s": t_step},
        "loss": loss,
        "flops": {"per_token": fpt, "matmul_peak": peak, "achieved": fpt * tps},
        "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
        "ratios": {"mfu": mfu, "tokens_per_s": tps},
    }
