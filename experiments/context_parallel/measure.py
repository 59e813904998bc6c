"""The figures of experiments/LOG.md "2026-12-05 (session 20)" (context parallelism) that the tests bound but do not
print. Run from the repo root (it sets 8 simulated CPU devices itself):

    .venv/bin/python experiments/context_parallel/measure.py equality context=8 1 64       # mesh, B, T [--preset]
    .venv/bin/python experiments/context_parallel/measure.py compiled                       # k3-mini forward figures
    .venv/bin/python experiments/context_parallel/measure.py combine                        # ppermute vs gather

equality: logits rel-RMS and the worst gradient leaves vs one device (fp32, the preset's run settings); compiled:
per-device loop-corrected HLO FLOPs and temp bytes of k3-mini's forward, one device vs context = 8, T = 1024 / 2048
(the test test_compiled_flops_and_temp_slope_split_eight_ways asserts the bounds on these); combine: collectives
and temp bytes of k3-mini's train-step gradient at context = 8 under each state combine.
"""

import argparse
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from k3jax.config import default_run, get_preset  # noqa: E402
from k3jax.model import abstract_params, forward, init_params, lm_loss  # noqa: E402
from k3jax.plan.hlo_cost import program_stats  # noqa: E402
from k3jax.pytree import path_str  # noqa: E402
from k3jax.sharding.context_parallel import ContextParallel  # noqa: E402
from k3jax.sharding.mesh import make_mesh  # noqa: E402
from k3jax.sharding.placement import default_strategy, expert_dispatch, parse_mesh  # noqa: E402
from k3jax.sharding.rules import param_shardings  # noqa: E402
from k3jax.testing import rel_rms  # noqa: E402


def equality(mesh: str, B: int, T: int, preset: str):
    cfg = get_preset(preset)
    run = default_run(cfg)
    params = init_params(cfg, jax.random.key(0))
    tok = jax.random.randint(jax.random.key(1), (B, T + 1), 0, cfg.vocab_size)
    shape = {a: n for a, n in parse_mesh(mesh).items() if n > 1}
    strategy = default_strategy(shape)
    m = make_mesh(shape)
    d = expert_dispatch(strategy, m, batch=B)
    placed = jax.device_put(params, param_shardings(cfg, strategy, m))
    grad = lambda dispatch: jax.jit(jax.grad(  # noqa: E731
        lambda p, t: lm_loss(p, t[:, :-1], t[:, 1:], cfg, run, dispatch=dispatch)))
    ref = jax.jit(lambda p, t: forward(p, t, cfg, run))(params, tok[:, :-1])
    out = jax.jit(lambda p, t: forward(p, t, cfg, run, dispatch=d))(placed, tok[:, :-1])
    g1, gc = grad(None)(params, tok), grad(d)(placed, tok)
    errs = sorted(((rel_rms(a, b), path_str(p)) for (p, a), b in
                   zip(jax.tree_util.tree_leaves_with_path(gc), jax.tree.leaves(g1), strict=True)), reverse=True)
    print(f"{preset} mesh {mesh} ({strategy}), B={B} T={T}: sequence over {d.context.seq_axes}; logits rel-RMS "
          f"{rel_rms(out, ref):.2e}; worst gradient leaves: " + ", ".join(f"{n} {e:.2e}" for e, n in errs[:3]))


def _stats(fn, args):
    c = jax.jit(fn).lower(*args).compile()
    return program_stats(c.as_text()), c.memory_analysis().temp_size_in_bytes


def _abstract(cfg, run, cp, T):
    p, tok = abstract_params(cfg, run), jax.ShapeDtypeStruct((1, T), jnp.int32)
    if cp is not None:
        rep = NamedSharding(cp.mesh, PartitionSpec())
        p = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), p)
        tok = jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=rep)
    return p, tok


def compiled():
    cfg = get_preset("k3-mini")
    run = default_run(cfg)
    cp = ContextParallel(make_mesh({"context": 8}), batch=1)
    temps = {}
    for T in (1024, 2048):
        row = []
        for d in (None, cp):
            st, temp = _stats(lambda p, t, d=d: forward(p, t, cfg, run, dispatch=d), _abstract(cfg, run, d, T))
            row.append((st.flops, temp, st.unknown_trip_counts))
        temps[T] = (row[0][1], row[1][1])
        print(f"T={T}: one device {row[0][0]:.3e} FLOPs, temp {row[0][1] / 1e6:.1f} MB; context 8 per device "
              f"{row[1][0]:.3e} FLOPs ({row[1][0] / (row[0][0] / 8):.2f}x one eighth), temp {row[1][1] / 1e6:.1f} MB; "
              f"loops of unknown trip count {row[0][2]} / {row[1][2]}")
    one, eight = ((temps[2048][i] - temps[1024][i]) / 1024 for i in (0, 1))
    print(f"temp slope: one device {one / 1e3:.1f} KB/token, context 8 {eight / 1e3:.1f} KB/token "
          f"({eight / (one / 8):.2f}x one eighth)")


def combine():
    cfg = get_preset("k3-mini")
    run = default_run(cfg)
    for how in ("ppermute", "gather"):
        cp = ContextParallel(make_mesh({"context": 8}), batch=1, combine=how)
        p, tok = _abstract(cfg, run, cp, 1025)
        st, temp = _stats(jax.grad(lambda p, t, cp=cp: lm_loss(p, t[:, :-1], t[:, 1:], cfg, run, dispatch=cp)),
                          (p, tok))
        coll = ", ".join(f"{k} {v['count']} / {v['bytes'] / 1e6:.2f} MB" for k, v in sorted(st.collectives.items()))
        print(f"{how}: {coll}; temp {temp / 1e6:.1f} MB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("equality")
    e.add_argument("mesh")
    e.add_argument("B", type=int)
    e.add_argument("T", type=int)
    e.add_argument("--preset", default="k3-tiny")
    sub.add_parser("compiled")
    sub.add_parser("combine")
    a = ap.parse_args()
    if a.what == "equality":
        equality(a.mesh, a.B, a.T, a.preset)
    else:
        globals()[a.what]()
