"""GPU check + benchmark for the chunked-KDA Pallas kernel (Triton backend). Prints one JSON object on stdout.

    python -m k3jax.bench.gpu_kda               # from the repo root; ~2-4 minutes on one H200
    python -m k3jax.bench.gpu_kda --max-seq 16384 --heads 32    # shorter

1. Compiles ``kda_chunk(..., interpret=False)`` and checks it (forward, both gates; gradients through the jnp
   VJP) against the XLA chunked path at a small size (rel_rms <= 1e-4: XLA may use TF32 for its f32 matmuls, the
   kernel uses IEEE fp32 dots).
2. Times Pallas vs XLA chunked forward (jit, warm, median of --repeats) at T = 8192 .. --max-seq, H = --heads
   (96), B = 1, K = V = 128, f32 inputs, K3 safe gate; reports ms, tokens/s and achieved TFLOP/s with the formula
   in k3jax/bench/kda.py. Stops early once --budget-s seconds have passed.
Exit status: 0 if every check passed, 1 on any error or failed check (the JSON says which), 2 if no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.bench.common import time_median
from k3jax.bench.kda import FLOP_FORMULA, chunked_flops
from k3jax.ops import kda
from k3jax.testing import rel_rms

FWD_TOL = 1e-4  # kernel (IEEE fp32 dots) vs XLA chunked (may use TF32): forward output and state
GRAD_TOL = 1e-3  # the same comparison for the gradients through the jnp VJP


def inputs(key, B, T, H, K, V, gate):
    ks = jax.random.split(key, 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (B, T, H, K)))
    k = unit(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    raw = jax.random.normal(ks[3], (B, T, H, K))
    g = -5.0 * jax.nn.sigmoid(4.0 * raw) if gate == "safe" else -jax.nn.softplus(2.0 * raw)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    h0 = jax.random.normal(ks[5], (B, H, K, V))
    return q, k, v, g, beta, h0


def check_correctness(out: dict, block_v: int) -> bool:
    """Kernel vs XLA chunked at a small size: forward for both gates with an initial state, and gradients."""
    from pallas_kernels.kda import kda_chunk  # the GPU kernel: imported inside the try, its failure lands in the JSON

    ok = True
    for gate, lb in (("safe", -5.0), ("softplus", None)):
        q, k, v, g, beta, h0 = inputs(jax.random.PRNGKey(0), 2, 300, 4, 128, 128, gate)
        t0 = time.perf_counter()
        o_p, s_p = jax.jit(lambda *a, lb=lb: kda_chunk(*a[:5], initial_state=a[5], gate_lower_bound=lb,
                                                       block_v=block_v, interpret=False))(q, k, v, g, beta, h0)
        jax.block_until_ready(o_p)
        compile_s = time.perf_counter() - t0
        with jax.default_matmul_precision("highest"):
            o_x, s_x = jax.jit(lambda *a, lb=lb: kda.kda_chunked(*a[:5], initial_state=a[5],
                                                                 gate_lower_bound=lb))(q, k, v, g, beta, h0)
        e_o, e_s = rel_rms(o_p, o_x), rel_rms(s_p, s_x)
        good = e_o <= FWD_TOL and e_s <= FWD_TOL and bool(np.isfinite(np.asarray(o_p)).all())
        ok &= good
        out["checks"][f"fwd_{gate}"] = {"rel_rms_o": e_o, "rel_rms_state": e_s, "ok": good,
                                        "first_call_s": compile_s}
    q, k, v, g, beta, h0 = inputs(jax.random.PRNGKey(1), 1, 128, 2, 128, 128, "safe")
    loss = lambda fn: (lambda *a: jnp.sum(fn(*a, gate_lower_bound=-5.0)[0] ** 2))  # noqa: E731
    pal = lambda *a, **kw: kda_chunk(*a, block_v=block_v, interpret=False, **kw)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        gp = jax.jit(jax.grad(loss(pal), argnums=range(5)))(q, k, v, g, beta)
        gx = jax.jit(jax.grad(loss(kda.kda_chunked), argnums=range(5)))(q, k, v, g, beta)
    errs = {n: rel_rms(a, b) for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), gp, gx)}
    out["checks"]["grads_safe"] = {**errs, "ok": max(errs.values()) <= GRAD_TOL}
    return ok and out["checks"]["grads_safe"]["ok"]


def time_pallas_vs_xla(out: dict, args, t_start: float) -> None:
    """Pallas vs XLA chunked forward at T = 8192, 16384, ... up to --max-seq, until --budget-s has passed."""
    from pallas_kernels.kda import kda_chunk  # the GPU kernel: imported inside the try, its failure lands in the JSON

    H, K = args.heads, 128
    out["flop_formula"] = FLOP_FORMULA
    pal_f = jax.jit(lambda *a: kda_chunk(*a, gate_lower_bound=-5.0, block_v=args.block_v, interpret=False))
    xla_f = jax.jit(lambda *a: kda.kda_chunked(*a, gate_lower_bound=-5.0))
    T = 8192
    while T <= args.max_seq:
        if time.perf_counter() - t_start > args.budget_s:
            out["timings"]["stopped_early_at_T"] = T
            break
        x = inputs(jax.random.PRNGKey(T), 1, T, H, K, K, "safe")[:5]
        row = {}
        for name, f in (("pallas", pal_f), ("xla_chunked", xla_f)):
            try:
                s = time_median(f, *x, reps=args.repeats)
                row[f"{name}_ms"] = 1e3 * s
                row[f"{name}_tflops_per_s"] = chunked_flops(T, H, K, K, 64) / s / 1e12
                row[f"{name}_tokens_per_s"] = T / s
            except Exception as e:  # noqa: BLE001 - e.g. XLA OOM at the largest T; record and go on
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "pallas_ms" in row and "xla_chunked_ms" in row:
            row["pallas_speedup_vs_xla"] = row["xla_chunked_ms"] / row["pallas_ms"]
        out["timings"][f"T{T}_H{H}"] = row
        del x
        T *= 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--max-seq", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--block-v", type=int, default=64)
    args = ap.parse_args()
    out = {"name": "kda_gpu_bench", "jax": jax.__version__, "backend": jax.default_backend(),
           "device": str(jax.devices()[0]), "checks": {}, "timings": {}, "ok": False}
    if jax.default_backend() != "gpu":
        out["error"] = "no GPU backend"
        print(json.dumps(out))
        return 2
    t_start = time.perf_counter()
    try:
        ok = check_correctness(out, args.block_v)
        time_pallas_vs_xla(out, args, t_start)
        out["ok"] = bool(ok)
        out["elapsed_s"] = time.perf_counter() - t_start
        print(json.dumps(out))
        return 0 if ok else 1
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-4000:]
        print(json.dumps(out))
        return 1


if __name__ == "__main__":
    sys.exit(main())
