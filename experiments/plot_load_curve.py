"""Plot the per-layer max/mean expert load of a `k3 train --metrics` JSONL (the QB curve the training issue asks for).

    python experiments/plot_load_curve.py experiments/runs/qb_scratch_32k.jsonl experiments/runs/qb_scratch_32k.png

Prints, per step, the median and worst layer and how many layers are <= the target, then writes the figure: one
thin line per MoE layer, the median and worst layer bold, and the target as a dashed line.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics")
    ap.add_argument("png")
    ap.add_argument("--target", type=float, default=1.2)
    args = ap.parse_args()
    steps, ratios = [], []
    with open(args.metrics) as f:
        for line in f:
            rec = json.loads(line)
            if "load_max_over_mean" in rec:
                steps.append(rec["step"])
                ratios.append(rec["load_max_over_mean"])
    if not steps:
        raise SystemExit(f"{args.metrics}: no record has load_max_over_mean")
    r = np.asarray(ratios)
    for s, row in zip(steps, r):
        print(f"{s:4d}  median {np.median(row):.3f}  worst {row.max():.3f}  layers <= {args.target}: "
              f"{int((row <= args.target).sum())}/{row.size}")
    ok = r.max(1) <= args.target
    first = next((s for s, o in zip(steps, ok) if o), None)
    print(f"first step with every layer <= {args.target}: {first}; such steps: {[s for s, o in zip(steps, ok) if o]}")

    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for layer in range(r.shape[1]):
        ax.plot(steps, r[:, layer], lw=0.7, alpha=0.5, color="tab:blue")
    ax.plot(steps, np.median(r, 1), lw=2, color="tab:green", label="median layer")
    ax.plot(steps, r.max(1), lw=2, color="tab:red", label="worst layer")
    ax.axhline(args.target, ls="--", color="k", lw=1, label=f"target {args.target}")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_yticks([1, 1.2, 1.5, 2, 3, 4, 6])
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean expert load")
    ax.set_title(args.metrics.rsplit("/", 1)[-1])
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=100)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
