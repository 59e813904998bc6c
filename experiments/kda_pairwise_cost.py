"""The chunked KDA core with K3's bounded-gate factorisation vs exact pairwise in-sub-chunk decays (what the cached
prefill uses, layers/kda.py ``_aligned``): median ms of 5 runs, T = 4096, k3-mini's heads (N = 6, K = V = 64), fp32,
interleaved so load hits both.

    python experiments/kda_pairwise_cost.py        # experiments/LOG.md, 2026-12-02
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.kda.chunked import kda_chunked

B, T, N, K = 1, 4096, 6, 64
r = np.random.default_rng(0)
q = jnp.asarray(r.standard_normal((B, T, N, K)), jnp.float32)
g = jnp.asarray(-5 * r.random((B, T, N, K)), jnp.float32)
beta = jnp.asarray(r.random((B, T, N)), jnp.float32)
fns = {lb: jax.jit(lambda q, k, v, g, b, lb=lb: kda_chunked(q, k, v, g, b, gate_lower_bound=lb)[0])
       for lb in (-5.0, None)}
times = {lb: [] for lb in fns}
for f in fns.values():
    f(q, q / 8, q, g, beta).block_until_ready()
for _ in range(5):
    for lb, f in fns.items():
        t0 = time.perf_counter()
        f(q, q / 8, q, g, beta).block_until_ready()
        times[lb].append(time.perf_counter() - t0)
med = {lb: float(np.median(t)) * 1e3 for lb, t in times.items()}
print(f"bounded {med[-5.0]:.1f} ms, pairwise {med[None]:.1f} ms, pairwise / bounded {med[None] / med[-5.0]:.2f}")
