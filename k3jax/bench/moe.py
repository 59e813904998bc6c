"""`k3 bench moe --json`: MoE layer cost vs expert count, all-to-all bytes per token, EP on 8 simulated devices.

    k3 bench moe --json              # M = 2048 tokens, D = 512, latent P = 256, F = 128, top-k 4
    k3 bench moe --json --quick      # small shapes, seconds

(a) ``moe_layer`` forward (sorted dispatch, ``lax.ragged_dot``) at E = 16, 64, 256 routed experts with the same
    tokens, top-k and latent width. Useful FLOPs are identical; only the total parameter count grows. SPEC §14.2:
    XLA:CPU ragged_dot cost grows linearly with the number of groups, so ``time_E256_over_E16`` measures that.
(b) bytes per token moved by the EP dispatch all-to-all, read from the compiled HLO (all-to-all result shapes),
    vs the formula tokens × k × latent × bytes (what a ragged all-to-all moves), for worst-case buckets
    (capacity_factor −1, dropless) and capacity_factor 1.0.
(c) EP over 8 simulated devices (mesh data 2 × expert 4) vs the 1-device sorted path on the same problem:
    rel-RMS vs the dense reference and the time ratio (8 CPU "devices" share this host's cores, so the ratio is
    dispatch overhead, not a speed-up).

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

from k3jax.bench.common import time_median  # noqa: E402
from k3jax.layers.moe import moe_layer  # noqa: E402
from k3jax.model.params import init_moe  # noqa: E402
from k3jax.ops.activations import glu_activation  # noqa: E402
from k3jax.ops.grouped_matmul import experts_dense, experts_sorted, sort_by_expert  # noqa: E402
from k3jax.sharding.expert_parallel import ExpertParallel  # noqa: E402
from k3jax.sharding.mesh import make_mesh  # noqa: E402
from k3jax.testing import rel_rms  # noqa: E402


def experts_tiled(z_mp, ids_ma, weights_ma, w1_epf, w3_epf, w2_efp, act, *, act_quant=None, tile: int = 8):
    """Experimental grouped matmul whose work follows the routed rows, not the expert count (investigation for
    SPEC §14.2's linear-in-groups ragged_dot CPU cost): megablox-style (tile, group) visits over expert-sorted rows.
    Visits V = ceil(M·A / tile) + min(E, M·A) − 1 (static bound); only non-empty groups get visits. Each visit is a
    [tile, P] × [P, F] product with the visited group's weights gathered; rows outside the group are masked.
    Same contract as ``experts_sorted`` (forward only is benchmarked)."""
    assert act_quant is None
    M, A = ids_ma.shape
    E, Pd, _ = w1_epf.shape
    R = M * A
    nt = -(-R // tile)
    V = nt + min(E, R) - 1
    order, inverse, gs = sort_by_expert(ids_ma, E)
    xs = jnp.broadcast_to(z_mp[:, None, :], (M, A, Pd)).reshape(R, Pd)[order]
    xs = jnp.pad(xs, ((0, nt * tile - R), (0, 0))).reshape(nt, tile, Pd)
    offs = jnp.cumsum(gs) - gs
    ends = offs + gs
    first = offs // tile
    n_g = jnp.where(gs > 0, (ends - 1) // tile - first + 1, 0)
    cum = jnp.cumsum(n_g)
    v = jnp.arange(V)
    g_v = jnp.minimum(jnp.searchsorted(cum, v, side="right"), E - 1)
    t_v = jnp.clip(first[g_v] + v - (cum[g_v] - n_g[g_v]), 0, nt - 1)
    r = t_v[:, None] * tile + jnp.arange(tile)[None, :]
    mask = (r >= offs[g_v][:, None]) & (r < ends[g_v][:, None]) & (v < cum[-1])[:, None]
    xt = xs[t_v]
    g = jnp.einsum("vtp,vpf->vtf", xt, w1_epf[g_v])
    u = jnp.einsum("vtp,vpf->vtf", xt, w3_epf[g_v])
    h = jnp.where(mask[..., None], act(g, u), 0.0)
    y = jnp.einsum("vtf,vfp->vtp", h, w2_efp[g_v])
    ys = jnp.zeros((nt, tile, Pd), y.dtype).at[t_v].add(y).reshape(nt * tile, Pd)[:R]
    return jnp.einsum("map,ma->mp", ys[inverse].reshape(M, A, Pd), weights_ma.astype(ys.dtype))


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats (smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="timed repeats (default 7, quick 2)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens M (default 2048, quick 256)")


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


def run(args) -> dict:
    quick = getattr(args, "quick", False)
    reps = args.reps or (2 if quick else 7)
    M = args.tokens or (256 if quick else 2048)
    D, Pl, F, K = (128, 64, 32, 4) if quick else (512, 256, 128, 4)
    act = partial(glu_activation, act="situ", beta1=4.0, beta2=25.0)
    x = jax.random.normal(jax.random.key(0), (1, M, D), jnp.float32)

    # (a) layer forward vs E
    layer_times, tiled_times, tiled_err = {}, {}, {}
    for E in (16, 64, 256):
        p = init_moe(jax.random.key(E), d=D, num_experts=E, expert_hidden=F, num_shared=0, latent=Pl,
                     latent_norm=True)
        f = jax.jit(lambda p, x: moe_layer(p, x, top_k=K, act="situ", dispatch="sorted")[0])
        layer_times[E] = time_median(f, p, x, reps=reps)
        ft = jax.jit(lambda p, x: moe_layer(p, x, top_k=K, act="situ", dispatch=experts_tiled)[0])
        tiled_times[E] = time_median(ft, p, x, reps=reps)
        tiled_err[E] = rel_rms(ft(p, x), f(p, x))
        print(f"(a) E={E}: moe_layer sorted {layer_times[E] * 1e3:.2f} ms, tiled {tiled_times[E] * 1e3:.2f} ms "
              f"(rel-RMS {tiled_err[E]:.1e}; {E * 3 * Pl * F / 1e6:.2f}M expert params, "
              f"active {K * 3 * Pl * F / 1e6:.2f}M/token)", file=sys.stderr)

    # (b) + (c) EP dispatch on a data 2 × expert 4 mesh, E = 16 experts
    ndev = jax.device_count()
    E = 16
    ks = jax.random.split(jax.random.key(1), 6)
    z = jax.random.normal(ks[0], (M, Pl), jnp.float32)
    w1 = 0.1 * jax.random.normal(ks[1], (E, Pl, F))
    w3 = 0.1 * jax.random.normal(ks[2], (E, Pl, F))
    w2 = 0.1 * jax.random.normal(ks[3], (E, F, Pl))
    ids = jax.lax.top_k(jax.random.normal(ks[4], (M, E)), K)[1].astype(jnp.int32)
    wts = jax.nn.softmax(jax.random.normal(ks[5], (M, K)))
    args6 = (z, ids, wts, w1, w3, w2)
    ref = experts_dense(*args6, act)
    single = jax.jit(lambda *a: experts_sorted(*a, act))
    t1 = time_median(single, *args6, reps=reps)
    formula = K * Pl * 4  # bytes per token one way: k copies of the latent row, f32
    out = {"name": "moe", "quick": quick, "devices": ndev, "shape": dict(M=M, D=D, P=Pl, F=F, k=K),
           "layer_forward_s": {f"E{e}": t for e, t in layer_times.items()},
           "layer_forward_tiled_s": {f"E{e}": t for e, t in tiled_times.items()},
           "tiled_rel_rms_vs_sorted": {f"E{e}": t for e, t in tiled_err.items()}}
    a2a = {}
    if ndev >= 8:
        mesh = make_mesh({"data": 2, "expert": 4})
        for cf in (-1.0, 1.0):
            ep = ExpertParallel(mesh, "ep", capacity_factor=cf)
            f = jax.jit(lambda *a, ep=ep: ep.dispatch(*a, act))
            hlo = f.lower(*args6).compile().as_text()
            by_type = all_to_all_bytes(hlo)
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
                out["ep"] = {"devices": 8, "mesh": "data2 x expert4", "rel_rms_vs_dense": err,
                             "dropped": int(dropped), "time_8dev_s": t8, "time_1dev_s": t1}
                print(f"(c) EP 8 dev {t8 * 1e3:.2f} ms vs 1 dev {t1 * 1e3:.2f} ms, rel-RMS {err:.2e}",
                      file=sys.stderr)
            print(f"(b) cf={cf:g}: {per_tok:.0f} B/token each way (+{ids_tok:.0f} B ids) vs formula {formula} B "
                  f"({per_tok / formula:.2f}x)", file=sys.stderr)
    else:
        out["ep"] = {"skipped": f"only {ndev} devices (backend initialized before the bench set 8)"}
    out["all_to_all"] = {"formula_bytes_per_token": formula, **a2a}
    ratios = {"time_E256_over_E16": layer_times[256] / layer_times[16],
              "time_E64_over_E16": layer_times[64] / layer_times[16],
              "tiled_time_E256_over_E16": tiled_times[256] / tiled_times[16],
              "tiled_E256_over_sorted_E16": tiled_times[256] / layer_times[16]}
    if "time_8dev_s" in out.get("ep", {}):
        ratios["ep_8dev_over_1dev"] = out["ep"]["time_8dev_s"] / t1
        ratios["ep_rel_rms"] = out["ep"]["rel_rms_vs_dense"]
        ratios["a2a_bytes_over_formula_worst"] = a2a["cf-1"]["over_formula"]
        ratios["a2a_bytes_over_formula_cf1"] = a2a["cf1"]["over_formula"]
    out["ratios"] = ratios
    out["targets"] = {"time_E256_over_E16": 1.5}
    return out
