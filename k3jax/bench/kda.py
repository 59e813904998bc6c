"""`k3 bench kda` — KDA forward: recurrent scan vs chunked (XLA) vs Pallas-interpret, against an XLA matmul peak.

    k3 bench kda --json            # T in {1024, 4096, 16384}, H = 4, K = V = 128, B = 1 (a few minutes on CPU)
    k3 bench kda --json --quick    # smoke run: T = 256, H = 2, K = V = 64 (seconds)
    k3 bench kda --json --quick --seq 64 --heads 1 --head-dim 16 --chunk 16 --repeats 1   # the test's size

Every time is jit-compiled, warmed once, then the median of ``--repeats`` runs. Inputs follow the K3 safe gate
(g = -5 sigmoid(N(0, 1)), chunked path with gate_lower_bound = -5). FLOPs of the chunked algorithm, per head and
chunk of C tokens: 4 C^2 K (A_kk, A_qk) + C^2 (K + V) (unit-lower solve for W, U) + 6 C K V (W S, Q S, K^T Ṽ)
+ 2 C^2 V (A_qk Ṽ); i.e. per token and head 4 C K + C (K + V) + 6 K V + 2 C V.

``speedup_3x_needs_over_batched_matmul_rate_T*`` is the FLOP rate the chunked path would need for a 3x speedup
over the recurrence, divided by the rate of a batched [C, K] x [K, V] matmul (the algorithm's building block)
measured in the same run: above 1, a 3x speedup is out of reach for any implementation of this algorithm on the
machine that ran the bench.

``ratios`` (per T): ``chunked_speedup_vs_recurrent_T*``, ``chunked_fraction_of_matmul_peak_T*`` and
``speedup_3x_needs_over_batched_matmul_rate_T*``. Each ``results["T*"]`` also carries the correctness check of the
timed paths: ``chunked_rel_rms_vs_recurrent`` and (where Pallas ran) ``pallas_rel_rms_vs_chunked``, each the larger
rel-RMS of output and final state.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp

from k3jax.bench.common import matmul_peak_flops, time_median
from k3jax.ops import kda
from k3jax.ops.kda import SUB_CHUNK, kda_chunked
from k3jax.testing import rel_rms
from pallas_kernels.kda import kda_chunk

FLOP_FORMULA = ("per token per head: 4*C*K + C*(K+V) + 6*K*V + 2*C*V "
                "(A_kk + A_qk, unit-lower solve, W S + Q S + K^T V~, A_qk V~); C = chunk size")


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--seq", type=int, nargs="*", default=None, help="sequence lengths T")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None, help="K = V")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--pallas-max-seq", type=int, default=1024, help="Pallas interpret only up to this T")


def chunked_flops(T: int, H: int, K: int, V: int, C: int) -> float:
    return float(T * H * (4 * C * K + C * (K + V) + 6 * K * V + 2 * C * V))


@functools.partial(jax.jit, static_argnames=("chunk_size", "gate_lower_bound", "sub_chunk"))
def kda_chunked_jit(q, k, v, g, beta, initial_state=None, *, chunk_size=64, gate_lower_bound=None,
                    sub_chunk=SUB_CHUNK):
    """``k3jax.ops.kda.kda_chunked`` under jit with the default scale (moved here from ops/kda: a bench helper).

    q, k, g: [B, T, N, K]; v: [B, T, N, V]; beta: [B, T, N]; initial_state: [B, N, K, V] or None.
    """
    return kda_chunked(q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size,
                       gate_lower_bound=gate_lower_bound, sub_chunk=sub_chunk)


def _batched_matmul_rate(C, K, V, *, batch, reps):
    a = jax.random.normal(jax.random.key(2), (batch, C, K), jnp.float32)
    b = jax.random.normal(jax.random.key(3), (batch, K, V), jnp.float32)
    f = jax.jit(lambda a, b: jnp.einsum("bck,bkv->bcv", a, b))
    return 2.0 * batch * C * K * V / time_median(f, a, b, reps=reps)


def _inputs(key, B, T, H, K, V):
    ks = jax.random.split(key, 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (B, T, H, K)))
    k = unit(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    return q, k, v, g, beta


def _measure(fns: dict, x, *, reps: int, with_pallas: bool) -> dict:
    """Times of one input set, and the correctness check: rel-RMS of chunked vs recurrent and Pallas vs chunked,
    the larger of output and final state (both rungs run float32, so TOL["fp32_vs_fp64"] bounds them)."""
    r = {"recurrent_s": time_median(fns["recurrent"], *x, reps=reps),
         "chunked_s": time_median(fns["chunked"], *x, reps=reps)}
    rec, chk = fns["recurrent"](*x), fns["chunked"](*x)
    r["chunked_rel_rms_vs_recurrent"] = max(rel_rms(a, b) for a, b in zip(chk, rec))
    if with_pallas:
        r["pallas_interpret_s"] = time_median(fns["pallas"], *x, reps=max(1, reps // 2))
        r["pallas_rel_rms_vs_chunked"] = max(rel_rms(a, b) for a, b in zip(fns["pallas"](*x), chk))
    return r


def run(args) -> dict:
    quick = args.quick
    seqs = args.seq or ([256] if quick else [1024, 4096, 16384])
    H = args.heads or (2 if quick else 4)
    K = V = args.head_dim or (64 if quick else 128)
    C = args.chunk
    repeats = args.repeats or (2 if quick else 5)
    B = 1

    n = 512 if quick else 2048
    peak = matmul_peak_flops(n, jnp.float32, reps=repeats)
    print(f"matmul peak {peak / 1e9:.1f} GFLOP/s ({n}^3 f32)", file=sys.stderr)

    # The chunked algorithm is made of [C, K] x [K, V]-sized products batched over heads and chunks; their rate
    # in this run bounds what any chunked formulation can reach here (see the 3x feasibility figure below).
    bmm_rate = _batched_matmul_rate(C, K, V, batch=H * 16, reps=repeats)
    print(f"batched [{C},{K}]x[{K},{V}] x{H * 16}: {bmm_rate / 1e9:.1f} GFLOP/s", file=sys.stderr)

    fns = {"recurrent": jax.jit(lambda *x: kda.kda_recurrent(*x)),
           "chunked": jax.jit(lambda *x: kda.kda_chunked(*x, chunk_size=C, gate_lower_bound=-5.0)),
           "pallas": jax.jit(lambda *x: kda_chunk(*x, chunk_size=C, gate_lower_bound=-5.0, interpret=True))}
    results, ratios = {}, {}
    for T in seqs:
        x = _inputs(jax.random.PRNGKey(T), B, T, H, K, V)
        r = _measure(fns, x, reps=repeats, with_pallas=T <= args.pallas_max_seq)
        fl = chunked_flops(T, H, K, V, C)
        r["chunked_flops"] = fl
        r["chunked_gflops_per_s"] = fl / r["chunked_s"] / 1e9
        results[f"T{T}"] = r
        ratios[f"chunked_speedup_vs_recurrent_T{T}"] = r["recurrent_s"] / r["chunked_s"]
        ratios[f"chunked_fraction_of_matmul_peak_T{T}"] = fl / r["chunked_s"] / peak
        # FLOP/s the chunked path would need to be 3x faster than the recurrence, over the batched-matmul rate.
        ratios[f"speedup_3x_needs_over_batched_matmul_rate_T{T}"] = 3 * fl / r["recurrent_s"] / bmm_rate
        print(f"T={T}: {r}", file=sys.stderr)
    return {
        "name": "kda",
        "config": {"B": B, "H": H, "K": K, "V": V, "chunk": C, "seqs": seqs, "repeats": repeats,
                   "gate": "safe, lb = -5", "dtype": "float32", "backend": jax.default_backend(),
                   "devices": jax.device_count(), "jax": jax.__version__, "quick": quick},
        "matmul_peak_gflops_per_s": peak / 1e9,
        "matmul_peak_shape": [n, n, n],
        "batched_matmul_gflops_per_s": bmm_rate / 1e9,
        "batched_matmul_shape": [H * 16, C, K, V],
        "flop_formula": FLOP_FORMULA,
        "results": results,
        "ratios": ratios,
    }
