"""GPU check and benchmark for the MXFP4 matmul kernels: compile (interpret=False), compare with the jnp reference,
time against a bf16 matmul and the XLA dequant-fused matmul. Prints one JSON object; exits 1 on any error or failed
check, 2 when no GPU is present. Takes well under 3 minutes on one H200.

    python -m k3jax.bench.gpu_mxfp4            # from the repository root
    python -m k3jax.bench.gpu_mxfp4 --quick    # correctness + decode shapes only
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
from k3jax.quant import mxfp4_pack, mxfp4_unpack
from k3jax.testing import TOL, rel_rms
from pallas_kernels.mxfp4_matmul import mxfp4_gmm, mxfp4_matmul
from pallas_kernels.mxfp4_matmul.reference import mxfp4_gmm_reference, mxfp4_matmul_reference

K3_K, K3_N = 3584, 3072  # expert w1/w3: torch [3072, 3584]


def timed(f, *args, reps=20) -> float:
    return time_median(f, *args, reps=reps)


def weights(key, shape):
    return mxfp4_pack(jax.random.normal(key, shape, jnp.float32) * 0.05)


def check_correctness(out: dict) -> bool:
    ok = True
    k = jax.random.split(jax.random.key(0), 4)
    packed, scale = weights(k[0], (256, 512))
    for dtype, tol in ((jnp.float32, TOL["fp32_vs_fp64"]), (jnp.bfloat16, TOL["bf16"])):
        for M in (1, 16, 45):
            x = jax.random.normal(k[1], (M, 512)).astype(dtype)
            y = jax.jit(lambda x: mxfp4_matmul(x, packed, scale, schedule="loop", block_n=64, block_k=128))(x)
            err = rel_rms(y, mxfp4_matmul_reference(x, packed, scale))
            out[f"dense_{jnp.dtype(dtype).name}_M{M}_rel_rms"] = err
            ok &= err <= tol
    P, S = weights(k[2], (4, 128, 256))
    gs = jnp.array([5, 0, 40, 19], jnp.int32)
    x = jax.random.normal(k[3], (70, 256))
    y = jax.jit(lambda x: mxfp4_gmm(x, P, S, gs, block_n=64, block_k=128))(x)
    out["grouped_f32_rel_rms"] = err = rel_rms(y, mxfp4_gmm_reference(x, P, S, gs))
    ok &= err <= TOL["fp32_vs_fp64"] and bool(np.all(np.asarray(y)[64:] == 0))
    dx = jax.jit(jax.grad(lambda x: jnp.sum(mxfp4_gmm(x, P, S, gs, block_n=64, block_k=128) ** 2)))(x)
    dx_ref = jax.grad(lambda x: jnp.sum(mxfp4_gmm_reference(x, P, S, gs) ** 2))(x)
    out["grouped_dx_rel_rms"] = err = rel_rms(dx, dx_ref)
    ok &= err <= TOL["fp32_vs_fp64"]
    return ok


def bench(out: dict, quick: bool) -> None:
    k = jax.random.split(jax.random.key(1), 2)
    packed, scale = weights(k[0], (K3_N, K3_K))
    w_bf16 = mxfp4_unpack(packed, scale, jnp.bfloat16)
    wbytes = packed.nbytes + scale.nbytes
    bf_mm = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype))
    xla_mm = jax.jit(lambda x, p, s: jnp.dot(x, mxfp4_unpack(p, s, jnp.bfloat16).T,
                                             preferred_element_type=jnp.float32).astype(x.dtype))
    shapes = [(1, 16, 128, 256), (16, 16, 128, 256), (16, 16, 64, 512)]
    if not quick:
        shapes += [(2048, 64, 128, 128), (2048, 128, 128, 64)]
    for M, bm, bn, bk in shapes:
        x = jax.random.normal(k[1], (M, K3_K)).astype(jnp.bfloat16)
        kern = jax.jit(lambda x, p, s, bm=bm, bn=bn, bk=bk: mxfp4_matmul(x, p, s, schedule="loop", block_m=bm,
                                                                         block_n=bn, block_k=bk))
        row = {"M": M, "block_m": bm, "block_n": bn, "block_k": bk}
        try:
            row["rel_rms_vs_ref"] = rel_rms(kern(x, packed, scale), mxfp4_matmul_reference(x, packed, scale))
            row["pallas_ms"] = 1e3 * timed(kern, x, packed, scale)
        except Exception as e:  # keep timing the other configs; the error is reported and fails the run
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["bf16_ms"] = 1e3 * timed(bf_mm, x, w_bf16)
        row["xla_dequant_ms"] = 1e3 * timed(xla_mm, x, packed, scale)
        if "pallas_ms" in row:
            row["pallas_over_bf16"] = row["pallas_ms"] / row["bf16_ms"]
            row["pallas_weight_GBps"] = wbytes / (row["pallas_ms"] * 1e-3) / 1e9
            row["pallas_TFLOPs"] = 2 * M * K3_N * K3_K / (row["pallas_ms"] * 1e-3) / 1e12
        row["bf16_weight_GBps"] = w_bf16.nbytes / (row["bf16_ms"] * 1e-3) / 1e9
        out.setdefault("timings", []).append(row)
        print(json.dumps(row), file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    out = {"jax": jax.__version__, "backend": jax.default_backend(),
           "device": jax.devices()[0].device_kind, "errors": []}
    if jax.default_backend() != "gpu":
        out["errors"].append("no GPU backend")
        print(json.dumps(out))
        return 2
    t0 = time.perf_counter()
    ok = True
    try:
        ok = check_correctness(out)
        out["correct"] = ok
    except Exception as e:
        ok = False
        out["errors"].append(f"correctness: {type(e).__name__}: {e}"[:2000])
        traceback.print_exc()
    try:
        bench(out, args.quick)
    except Exception as e:
        out["errors"].append(f"bench: {type(e).__name__}: {e}"[:2000])
        traceback.print_exc()
    ok &= not out["errors"] and all("error" not in r for r in out.get("timings", []))
    out["wall_s"] = time.perf_counter() - t0
    out["ok"] = bool(ok)
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
