"""Quantile Balancing on a large pool of frozen router scores: the batch-size floor and QB's convergence speed.

Two commands (frozen weights of a checkpoint, stdlib corpus train split, 64-byte windows at seeded random starts):

  fit   route POOL windows with bias b, fit b on those fixed scores with the exact QB update (sort-based order
        statistic, docs/model.md §8.1) iterated INNER times per layer, re-route with the new b, and repeat OUTER
        times (re-routing matters: changing layer l's bias changes every later layer's inputs). Saves the final
        scores S [L, m, E] (routed with the final b) and b to NPZ.
            python experiments/qb_pool_sim.py fit CKPT OUT.npz [--windows 4096 --outer 4 --inner 40]

  sim   on the saved scores (no forward passes):
        A  floor: the fitted b applied to disjoint groups of windows of each size; per-layer max/mean load and the
           design effect (variance of each expert's load share across groups / the binomial variance of iid tokens).
        B  dynamics: QB from zero bias with batches of N windows drawn from the pool, bias = ρ·b + (1 − ρ)·b̂ for
           several ρ (0 = plain QB; ρ > 0 EMA; ρ < 0 over-relaxation). Approximation: each layer's scores stay the
           ones routed under the fitted b (the cross-layer re-routing effect is left out; qb_floor.py has it).
            python experiments/qb_pool_sim.py sim OUT.npz [--batches 64,256,512 --rhos 0,0.5,0.8,-0.3,-0.5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def qb_exact(s, b, k):
    """One exact QB update on fixed scores s [m, E] with bias b [E] (float64): the centred sort-based b̂ of
    k3jax.optim.qb.qb_bias_exact, with the cutoff α = the (k+1)-th largest s + b."""
    from k3jax.optim.qb import qb_bias_exact

    alpha = -np.partition(-(s + b), k, axis=1)[:, k]
    bh = qb_bias_exact(s, alpha, k)
    return bh - bh.mean()


def loads(s_all, b, k):
    """[L, E] expert loads of scores s_all [L, m, E] under biases b [L, E]."""
    E = s_all.shape[-1]
    out = []
    for l in range(s_all.shape[0]):
        ids = np.argpartition(-(s_all[l] + b[l]), k, axis=1)[:, :k]
        out.append(np.bincount(ids.ravel(), minlength=E))
    return np.array(out)


def ratio(ld):
    return ld.max(-1) / ld.mean(-1)


def cmd_fit(args) -> None:
    import jax
    import jax.numpy as jnp

    from k3jax.checkpoint import load
    from k3jax.model import forward
    from k3jax.optim import balance as bal
    from k3jax.sharding.mesh import make_mesh
    from k3jax.train import data as tdata

    cfg, params = load(args.ckpt, mesh=make_mesh({"expert": 1}, devices=jax.devices()[:1]), progress=False)
    E, k = cfg.num_experts, cfg.num_experts_per_token
    train, _ = tdata.split(tdata.load_corpus())

    @jax.jit
    def scores_of(p, tokens):
        _, aux = forward(p, tokens, cfg, return_aux=True)
        return jnp.stack([r.scores.reshape(-1, E) for r in aux["routing"]])

    starts = np.random.default_rng(args.seed).integers(0, len(train) - args.seq_len - 1, size=args.windows)
    toks = train[starts[:, None] + np.arange(args.seq_len)[None, :]].astype(np.int32)

    def pool(b):
        p = bal.set_biases(params, jnp.asarray(b, jnp.float32), cfg)
        t0 = time.time()
        s = np.concatenate([np.asarray(scores_of(p, jnp.asarray(toks[i:i + 256])))
                            for i in range(0, len(toks), 256)], axis=1)
        print(f"routed {s.shape[1]} tokens in {time.time() - t0:.0f} s", flush=True)
        return s

    b = np.zeros((len(bal.moe_layer_indices(cfg)), E))
    for o in range(args.outer):
        s = pool(b).astype(np.float64)
        before = ratio(loads(s, b, k))
        for l in range(len(b)):
            for _ in range(args.inner):
                b[l] = qb_exact(s[l], b[l], k)
        print(f"outer {o}: max/mean per layer routed with the previous b {np.round(before, 3).tolist()}, "
              f"after {args.inner} updates on these scores {np.round(ratio(loads(s, b, k)), 3).tolist()}", flush=True)
    s = pool(b)
    print(f"final (re-routed with the fitted b): {np.round(ratio(loads(s.astype(np.float64), b, k)), 3).tolist()}")
    np.savez(args.out, S=s, b=b, k=k, seq_len=args.seq_len)


def cmd_sim(args) -> None:
    d = np.load(args.npz)
    s, b_fit, k, T = d["S"].astype(np.float64), d["b"], int(d["k"]), int(d["seq_len"])
    L, m, E = s.shape
    W = m // T
    sw = s.reshape(L, W, T, E)
    p = k / E
    print(f"{args.npz}: {W} windows x {T} tokens, {L} MoE layers, {E} experts top-{k}")
    print("A. fitted bias on disjoint groups (mean of per-group median layer / worst layer; design effect per layer)")
    for nw in [64, 128, 256, 512, 1024]:
        g = W // nw
        if g < 2:
            continue
        lds = np.array([loads(sw[:, i * nw:(i + 1) * nw].reshape(L, -1, E), b_fit, k) for i in range(g)])
        R = ratio(lds)
        share = lds / lds.sum(-1, keepdims=True)
        deff = share.var(0).mean(-1) / (p * (1 - p) / (nw * T * k * k))
        print(f"  {nw * T:6d} tokens ({g:3d} groups): median {np.median(R, 1).mean():.3f}  "
              f"worst {R.max(1).mean():.3f}  "
              f"(step, layer) <= 1.2: {(R <= 1.2).mean():.2f}  all layers <= 1.2: {(R.max(1) <= 1.2).mean():.2f}  "
              f"design effect {np.round(deff, 1).tolist()}")
    print(f"B. QB from zero bias, {args.steps} steps, batches drawn from the pool (seed {args.seed})")
    for nw in [int(x) for x in args.batches.split(",")]:
        for rho in [float(x) for x in args.rhos.split(",")]:
            rng = np.random.default_rng(args.seed)
            b = np.zeros((L, E))
            rows = []
            for _ in range(args.steps):
                sb = sw[:, rng.choice(W, nw, replace=False)].reshape(L, -1, E)
                rows.append(ratio(loads(sb, b, k)))
                bh = np.stack([qb_exact(sb[l], b[l], k) for l in range(L)])
                b = rho * b + (1 - rho) * bh
                b -= b.mean(1, keepdims=True)
            R = np.array(rows)
            tail = R[args.steps * 3 // 5:]
            stays = next((t + 1 for t in range(args.steps) if (R[t:].max(1) <= 1.2).all()), None)
            marks = [t for t in (1, 2, 3, 5, 10, 15, 20, 30, 40, 50) if t <= args.steps]
            print(f"  {nw * T:6d} tokens rho {rho:+.1f}: steps {args.steps * 3 // 5 + 1}-{args.steps} median "
                  f"{np.median(tail, 1).mean():.3f} worst {tail.max(1).mean():.3f} (max {tail.max():.2f}), all layers "
                  f"<= 1.2 at {(tail.max(1) <= 1.2).mean():.2f} of them; every later step <= 1.2 from step {stays}; "
                  "worst layer at steps " + " ".join(f"{t}:{R[t - 1].max():.2f}" for t in marks))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit")
    f.add_argument("ckpt")
    f.add_argument("out")
    f.add_argument("--windows", type=int, default=4096)
    f.add_argument("--seq-len", type=int, default=64)
    f.add_argument("--outer", type=int, default=4)
    f.add_argument("--inner", type=int, default=40)
    f.add_argument("--seed", type=int, default=123)
    s = sub.add_parser("sim")
    s.add_argument("npz")
    s.add_argument("--batches", default="64,256,512", help="windows per step")
    s.add_argument("--rhos", default="0,0.5,0.8,-0.3,-0.5")
    s.add_argument("--steps", type=int, default=50)
    s.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cmd_fit(args) if args.cmd == "fit" else cmd_sim(args)


if __name__ == "__main__":
    main()
