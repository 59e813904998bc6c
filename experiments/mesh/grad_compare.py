# ruff: noqa: E402, E501, E702, N812  (measurement scripts: environment set before the jax import)
"""Session-8 measurement script (experiments/LOG.md, session 8): run from the repo root with .venv/bin/python.
Run order for the gradient figures: grad_compare.py (writes /tmp/k3_mesh_g_*.npz), then grad_partition_floor.py and
grad_vs_float64.py."""
import os
import sys
import time

os.environ["JAX_PLATFORMS"]="cpu"
os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "train"))
import jax
import numpy as np
import test_mesh_train as T

from k3jax.pytree import path_str
from k3jax.testing import rel_rms

t=time.time()
_, g1 = T._first_grads(T.MINI.replace(devices=1))
g1 = {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(g1)}
np.savez("/tmp/k3_mesh_g_single.npz", **g1)
print("single", time.time()-t, flush=True)
for mesh, strat in [("data=2,expert=4","ep"), ("fsdp=2,expert=2,tensor=2","fsdp_ep_tp")]:
    _, g = T._first_grads(T.MINI.replace(mesh=mesh, strategy=strat))
    g = {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(g)}
    np.savez(f"/tmp/k3_mesh_g_{strat}.npz", **g)
    errs = sorted(((rel_rms(g[k], g1[k]), k) for k in g1), reverse=True)
    print(strat, time.time()-t, "worst:", [(f"{e:.2e}", k) for e, k in errs[:8]], flush=True)
    print(strat, "n > 1e-5:", sum(e > 1e-5 for e, _ in errs), "of", len(errs), flush=True)
