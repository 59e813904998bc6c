"""Copy a checkpoint with every MoE selection bias (``e_score_correction_bias``) set to zero.

Used for the Quantile Balancing fine-tune experiment in LOG.md: start from trained weights whose router is far from
balanced at zero bias, then watch QB bring the per-layer max/mean expert load down during ``k3 train --init``.

    python experiments/qb_reset_bias.py SRC_DIR DST_DIR
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np


def main(src: str, dst: str) -> None:
    from k3jax.checkpoint import load, save
    from k3jax.optim import balance as bal
    from k3jax.sharding.mesh import make_mesh

    cfg, params = load(src, mesh=make_mesh({"expert": 1}, devices=jax.devices()[:1]), progress=False)
    b = bal.biases(params, cfg)
    print(f"{src}: {b.shape[0]} MoE layers, bias range per layer before reset "
          f"{np.round(np.asarray(jnp.max(b, -1) - jnp.min(b, -1)), 3).tolist()}")
    params = bal.set_biases(params, jnp.zeros_like(b), cfg)
    save(jax.device_get(params), cfg, dst)
    print(f"wrote {dst} with zero biases")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
