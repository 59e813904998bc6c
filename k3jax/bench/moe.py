"""`k3 bench moe --json`: MoE layer cost vs expert count, all-to-all bytes per token, EP on 8 simulated devices.

    k3 bench moe --json              # M = 8192 tokens, D = 512, latent P = 256, F = 128, top-k 4
    k3 bench moe --json --quick      # M = 256, D = 128, P = 64, F = 32: small shapes, seconds
    k3 bench moe --json --quick --tokens 64 --reps 1    # the test's size

(a) the MoE block's forward at E = 16, 64, 256 routed experts with the same tokens (M = 8192, so 128 routed rows per
    expert at E = 256), top-k and latent width. Useful FLOPs are identical; only the total parameter count grows.
    ``time_E256_over_E16`` is the model's default dispatch ("sorted": per-expert row tiles on CPU, see
    k3jax/ops/grouped_matmul.py); the ``lax.ragged_dot`` dispatch is timed beside it, because on XLA:CPU its cost
    grows linearly with the number of groups (docs/numerics.md §14.2).
(b) bytes per token moved by the EP dispatch all-to-all, read from the compiled HLO (all-to-all result shapes),
    vs the formula tokens × k × latent × bytes (what a ragged all-to-all moves), for worst-case buckets
    (capacity_factor −1, dropless) and capacity_factor 1.0.
(c) EP over 8 simulated devices (mesh data 2 × expert 4) vs the 1-device sorted path on the same problem:
    rel-RMS vs the dense reference and the time ratio (8 CPU "devices" share this host's cores, so the ratio is
    dispatch overhead, not a speed-up).

``ratios``: ``time_E256_over_E16``, ``time_E64_over_E16``, ``ragged_dot_time_E256_over_E16`` and, with 8 devices,
``ep_8dev_over_1dev``, ``ep_rel_rms``, ``a2a_bytes_over_formula_worst``, ``a2a_bytes_over_formula_cf1``.

The 8 CPU devices are requested here, before jax initializes its backend; if the backend is already up with fewer
devices, part (c) uses what there is and says so.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.bench.common import time_median  # noqa: E402
from k3jax.layers.moe import MoE  # noqa: E402
from k3jax.ops.activations import glu_activation  # noqa: E402
from k3jax.ops.grouped_matmul import experts_dense, experts_sorted  # noqa: E402
from k3jax.sharding.expert_parallel import ExpertParallel  # noqa: E402
from k3jax.sharding.mesh import make_mesh  # noqa: E402
from k3jax.testing import rel_rms  # noqa: E402


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats (smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="timed repeats (default 7, quick 2)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens M (default 8192, quick 256)")


_DT_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def all_to_all_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes per device entering all-to-alls in a compiled HLO module text, by element type (tuple results
    summed). Includes the 1/X of each buffer that stays on the sending device."""
    out: dict[str, int] = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*%?[\w.\-]+ = (.*?) all-to-all\(", line)
        if not m:
            continue
        for dt, dims in re.findall(r"([a-z]+[0-9]+)\[([0-9,]*)\]", m.group(1)):
            n = math.prod(int(d) for d in dims.split(",") if d)
            out[dt] = out.get(dt, 0) + _DT_BYTES.get(dt, 4) * n
    return out


def _layer_vs_experts(x, *, D, Pl, F, K, reps):
    """(a) the MoE block's forward at E = 16, 64, 256: the default dispatch and lax.ragged_dot side by side."""
    layer_times, ragged_times, ragged_err = {}, {}, {}
    for E in (16, 64, 256):
        gdef, p = nnx.split(MoE(d=D, num_experts=E, expert_hidden=F, num_shared=0, latent=Pl, latent_norm=True,
                                rngs=nnx.Rngs(params=jax.random.key(E))))
        f = jax.jit(lambda p, x, gdef=gdef: nnx.merge(gdef, p)(x, top_k=K, act="situ", dispatch="sorted")[0])
        layer_times[E] = time_median(f, p, x, reps=reps)
        fr = jax.jit(lambda p, x, gdef=gdef: nnx.merge(gdef, p)(x, top_k=K, act="situ", dispatch="ragged")[0])
        ragged_times[E] = time_median(fr, p, x, reps=min(reps, 2))
        ragged_err[E] = rel_rms(f(p, x), fr(p, x))
        print(f"(a) E={E}: MoE block sorted {layer_times[E] * 1e3:.2f} ms, ragged_dot {ragged_times[E] * 1e3:.2f} ms "
              f"(rel-RMS {ragged_err[E]:.1e}; {E * 3 * Pl * F / 1e6:.2f}M expert params, "
              f"active {K * 3 * Pl * F / 1e6:.2f}M/token)", file=sys.stderr)
    return layer_times, ragged_times, ragged_err


def _ep_problem(M, *, Pl, F, K, E=16):
    ks = jax.random.split(jax.random.key(1), 6)
    z = jax.random.normal(ks[0], (M, Pl), jnp.float32)
    w1 = 0.1 * jax.random.normal(ks[1], (E, Pl, F))
    w3 = 0.1 * jax.random.normal(ks[2], (E, Pl, F))
    w2 = 0.1 * jax.random.normal(ks[3], (E, F, Pl))
    ids = jax.lax.top_k(jax.random.normal(ks[4], (M, E)), K)[1].astype(jnp.int32)
    wts = jax.nn.softmax(jax.random.normal(ks[5], (M, K)))
    return z, ids, wts, w1, w3, w2


def _ep_and_all_to_all(args6, ref, act, *, M, formula, reps, t1):
    """(b) all-to-all bytes per token from the compiled HLO, per capacity factor; (c) EP on data 2 × expert 4."""
    mesh = make_mesh({"data": 2, "expert": 4})
    a2a, ep_out = {}, {}
    for cf in (-1.0, 1.0):
        ep = ExpertParallel(mesh, "ep", capacity_factor=cf)
        f = jax.jit(lambda *a, ep=ep: ep.dispatch(*a, act))
        by_type = all_to_all_bytes(f.lower(*args6).compile().as_text())
        m_local = M / 8
        # f32: latent rows out (dispatch) + expert outputs back (combine); s32: the local-expert-id buckets
        per_tok = by_type.get("f32", 0) / 2 / m_local
        ids_tok = by_type.get("s32", 0) / m_local
        a2a[f"cf{cf:g}"] = {"latent_bytes_per_token_each_way": per_tok, "id_bytes_per_token": ids_tok,
                            "over_formula": per_tok / formula}
        if cf == -1.0:
            y, dropped = f(*args6)
            t8 = time_median(f, *args6, reps=reps)
            err = rel_rms(y, ref)
            ep_out = {"devices": 8, "mesh": "data2 x expert4", "rel_rms_vs_dense": err, "dropped": int(dropped),
                      "time_8dev_s": t8, "time_1dev_s": t1}
            print(f"(c) EP 8 dev {t8 * 1e3:.2f} ms vs 1 dev {t1 * 1e3:.2f} ms, rel-RMS {err:.2e}", file=sys.stderr)
        print(f"(b) cf={cf:g}: {per_tok:.0f} B/token each way (+{ids_tok:.0f} B ids) vs formula {formula} B "
              f"({per_tok / formula:.2f}x)", file=sys.stderr)
    return a2a, ep_out


def run(args) -> dict:
    quick = getattr(args, "quick", False)
    reps = args.reps or (2 if quick else 7)
    M = args.tokens or (256 if quick else 8192)
    D, Pl, F, K = (128, 64, 32, 4) if quick else (512, 256, 128, 4)
    act = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
    x = jax.random.normal(jax.random.key(0), (1, M, D), jnp.float32)
    layer_times, ragged_times, ragged_err = _layer_vs_experts(x, D=D, Pl=Pl, F=F, K=K, reps=reps)

    # (b) + (c) EP dispatch on a data 2 × expert 4 mesh, E = 16 experts
    ndev = jax.device_count()
    args6 = _ep_problem(M, Pl=Pl, F=F, K=K)
    ref = experts_dense(*args6, act)
    single = jax.jit(lambda *a: experts_sorted(*a, act))
    t1 = time_median(single, *args6, reps=reps)
    formula = K * Pl * 4  # bytes per token one way: k copies of the latent row, f32
    out = {"name": "moe", "quick": quick, "devices": ndev, "shape": dict(M=M, D=D, P=Pl, F=F, k=K),
           "layer_forward_s": {f"E{e}": t for e, t in layer_times.items()},
           "layer_forward_ragged_dot_s": {f"E{e}": t for e, t in ragged_times.items()},
           "sorted_rel_rms_vs_ragged_dot": {f"E{e}": t for e, t in ragged_err.items()}}
    a2a = {}
    if ndev >= 8:
        a2a, out["ep"] = _ep_and_all_to_all(args6, ref, act, M=M, formula=formula, reps=reps, t1=t1)
    else:
        out["ep"] = {"skipped": f"only {ndev} devices (backend initialized before the bench set 8)"}
    out["all_to_all"] = {"formula_bytes_per_token": formula, **a2a}
    ratios = {"time_E256_over_E16": layer_times[256] / layer_times[16],
              "time_E64_over_E16": layer_times[64] / layer_times[16],
              "ragged_dot_time_E256_over_E16": ragged_times[256] / ragged_times[16]}
    if "time_8dev_s" in out["ep"]:
        ratios["ep_8dev_over_1dev"] = out["ep"]["time_8dev_s"] / t1
        ratios["ep_rel_rms"] = out["ep"]["rel_rms_vs_dense"]
        ratios["a2a_bytes_over_formula_worst"] = a2a["cf-1"]["over_formula"]
        ratios["a2a_bytes_over_formula_cf1"] = a2a["cf1"]["over_formula"]
    out["ratios"] = ratios
    out["targets"] = {"time_E256_over_E16": 1.5}
    return out
