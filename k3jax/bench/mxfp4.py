"""`k3 bench mxfp4 --json`: MXFP4 storage cost and the XLA dequant-fused matmul vs a bf16 matmul on this host.

    k3 bench mxfp4 --json            # K3 expert shape: K = 3584, N = 3072; M in {1, 16, 2048}
    k3 bench mxfp4 --json --quick    # small shapes, seconds on a laptop CPU

bits per weight is measured on real packed arrays (uint8 codes + E8M0 scales); docs/numerics.md §10.4 says 4.25 (vs 16
for bf16): ``bytes`` is packed = N·K/2, scale = N·K/32, bf16 = 2·N·K. The MXFP4 path is jit(x @ mxfp4_unpack(packed,
scale, bf16)ᵀ), which XLA fuses on CPU; times are medians. Correctness check: ``times["M*"]["mxfp4_rel_rms_vs_f64"]`` is
the rel-RMS of that path vs x @ (dequantized weights)ᵀ in float64 (MXFP4 values are exact in bf16, so only the f32
accumulation differs). ``ratios``: ``bits_per_weight``, ``bits_per_weight_bf16``, ``time_mxfp4_over_bf16_M*``.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.bench.common import time_median
from k3jax.quant import mxfp4_pack, mxfp4_unpack
from k3jax.testing import rel_rms


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats (smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="timed repeats per shape (default 10, quick 2)")
    parser.add_argument("--prefill-m", type=int, default=None, help="rows of the prefill shape (default 2048)")


def run(args) -> dict:
    quick = getattr(args, "quick", False)
    K, N = (512, 384) if quick else (3584, 3072)
    reps = args.reps or (2 if quick else 10)
    prefill_m = args.prefill_m or (64 if quick else 2048)
    kw, kx = jax.random.split(jax.random.key(0))
    w = jax.random.normal(kw, (N, K), jnp.float32) * 0.02  # torch orientation [out, in]
    packed, scale = jax.block_until_ready(mxfp4_pack(w))
    w_bf16 = w.astype(jnp.bfloat16)
    bits = 8.0 * (packed.nbytes + scale.nbytes) / (N * K)
    bits_bf16 = 8.0 * w_bf16.nbytes / (N * K)

    mx_mm = jax.jit(lambda x, p, s: jnp.dot(x, mxfp4_unpack(p, s, jnp.bfloat16).T, preferred_element_type=jnp.float32))
    bf_mm = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32))
    w_f64 = np.asarray(mxfp4_unpack(packed, scale, jnp.float32), np.float64)
    times = {}
    for M in (1, 16, prefill_m):
        x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
        t_mx = time_median(mx_mm, x, packed, scale, reps=reps)
        t_bf = time_median(bf_mm, x, w_bf16, reps=reps)
        err = rel_rms(mx_mm(x, packed, scale), np.asarray(x, np.float64) @ w_f64.T)
        times[f"M{M}"] = {"mxfp4_s": t_mx, "bf16_s": t_bf, "mxfp4_rel_rms_vs_f64": err}
        print(f"M={M}: mxfp4 {t_mx * 1e3:.2f} ms, bf16 {t_bf * 1e3:.2f} ms", file=sys.stderr)
    ratios = {"bits_per_weight": bits, "bits_per_weight_bf16": bits_bf16}
    for m, t in times.items():
        ratios[f"time_mxfp4_over_bf16_{m}"] = t["mxfp4_s"] / t["bf16_s"]
    return {
        "name": "mxfp4",
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "shape": {"K": K, "N": N, "prefill_M": prefill_m, "quick": quick, "reps": reps},
        "bytes": {"packed": int(packed.nbytes), "scale": int(scale.nbytes), "bf16": int(w_bf16.nbytes)},
        "times": times,
        "ratios": ratios,
    }
