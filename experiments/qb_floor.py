"""How balanced can one bias per step make a batch? Quantile Balancing vs an ideal fixed bias, on frozen weights.

With the weights frozen, the per-layer max/mean expert load of a training batch has two sources: the bias (how well
it fits the routing distribution) and the batch itself (which content the B windows happen to contain). This script
separates them for a checkpoint:

  ideal   the bias that QB converges to on a large pooled sample (``--fit-batches`` batches routed together,
          iterated ``--fit-iters`` times), meant as the best a single bias can do. With the defaults (65k tokens,
          30 iterations) it gave a higher floor than the converged fit of experiments/qb_pool_sim.py (LOG,
          session 3: worst layer 1.31 vs 1.21 at 4096 tokens), most likely because 30 updates do not converge
          the slowest layer.
  qb      plain QB as in training: each step's bias comes from the previous batch (starting from zero).
  ema     QB with an EMA of the target (``--ema``), same batches.

    python experiments/qb_floor.py CKPT_DIR [--batch 64 --seq-len 64 --steps 30 --ema 0.5 --modes ideal,qb,ema]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    from k3jax.checkpoint import load
    from k3jax.model import forward
    from k3jax.optim import balance as bal
    from k3jax.sharding.mesh import make_mesh
    from k3jax.train import data as tdata

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ema", type=float, default=0.5)
    p.add_argument("--fit-batches", type=int, default=16)
    p.add_argument("--fit-iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--modes", default="ideal,qb,ema", help="comma-separated subset of ideal,qb,ema")
    p.add_argument("--chunk", type=int, default=256, help="windows routed per forward (stats are summed)")
    args = p.parse_args()
    modes = args.modes.split(",")

    cfg, params = load(args.ckpt, mesh=make_mesh({"expert": 1}, devices=jax.devices()[:1]), progress=False)
    E, k = cfg.num_experts, cfg.num_experts_per_token
    train, _ = tdata.split(tdata.load_corpus())

    @jax.jit
    def route_stats(params, b_le, tokens):
        _, aux = forward(params, tokens, cfg, return_aux=True)
        return bal.micro_stats(aux["routing"], b_le, E, mode="qb")

    def batch(step):
        return jnp.asarray(tdata.batch_at(train, seed=args.seed, step=step, batch=args.batch,
                                          seq_len=args.seq_len)[:, :-1])

    def stats(b_le, tokens):
        p_b = bal.set_biases(params, b_le, cfg)
        parts = [route_stats(p_b, b_le, tokens[i:i + args.chunk]) for i in range(0, tokens.shape[0], args.chunk)]
        return jax.tree.map(lambda *a: sum(a), *parts)

    zero = jnp.zeros_like(bal.biases(params, cfg))
    # ideal: QB iterated on a pooled sample (statistics of several batches summed = one large step)
    fit = [batch(10_000 + i) for i in range(args.fit_batches)] if "ideal" in modes else []
    b_ideal = zero
    for _ in range(args.fit_iters if fit else 0):
        st = jax.tree.map(lambda *a: sum(a), *[stats(b_ideal, t) for t in fit])
        b_ideal = bal.new_biases(st, b_ideal, mode="qb", top_k=k)
    rows = {m: [] for m in ("ideal", "qb", "ema") if m in modes}
    b_qb, b_ema = zero, zero
    for s in range(args.steps):
        t = batch(s)
        if "ideal" in rows:
            rows["ideal"].append(np.asarray(bal.load_ratio(stats(b_ideal, t)["loads"])))
        if "qb" in rows:
            st = stats(b_qb, t)
            rows["qb"].append(np.asarray(bal.load_ratio(st["loads"])))
            b_qb = bal.new_biases(st, b_qb, mode="qb", top_k=k)
        if "ema" in rows:
            st = stats(b_ema, t)
            rows["ema"].append(np.asarray(bal.load_ratio(st["loads"])))
            b_ema = bal.new_biases(st, b_ema, mode="qb", top_k=k, qb_ema=args.ema)
    print(f"{args.ckpt}: batch {args.batch} x {args.seq_len} tokens, {E} experts top-{k}; per-layer max/mean load")
    print("step  " + "  ".join(f"{m:>19s}" for m in rows) + "   (median / worst layer)")
    for s in range(args.steps):
        print(f"{s + 1:4d}  " + "  ".join(f"{np.median(r[s]):9.2f} / {r[s].max():5.2f}" for r in rows.values()))
    last = slice(args.steps // 2, None)
    for m, r in rows.items():
        r = np.stack(r[last])
        print(f"{m:6s} steps {args.steps // 2 + 1}-{args.steps}: mean of per-step median layer "
              f"{np.median(r, 1).mean():.3f}, mean of per-step worst layer {r.max(1).mean():.3f}, "
              f"share of (step, layer) <= 1.2: {(r <= 1.2).mean():.2f}, steps with every layer <= 1.2: "
              f"{(r.max(1) <= 1.2).mean():.2f}; per-layer mean {np.round(r.mean(0), 3).tolist()}")


if __name__ == "__main__":
    main()
