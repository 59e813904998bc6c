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
import jax.numpy as jnp
import numpy as np
import test_mesh_train as T

from k3jax.pytree import path_str
from k3jax.testing import rel_rms
from k3jax.train import data as tdata
from k3jax.train.loop import build
from k3jax.train.settings import step_spec
from k3jax.train.step import make_loss

tc = T.MINI.replace(devices=1)
run = build(tc, log=lambda m: None)
tokens = tdata.batch_at(run.train_toks, seed=tc.seed, step=0, batch=tc.batch, seq_len=tc.seq_len, vocab=run.vocab)
loss = make_loss(run.cfg, run.settings, step_spec(tc), None)
gf = jax.grad(lambda p, t: loss(p, t)[0])
def split(p, t):  # the batch as 8 one-sequence gradients summed: the ep mesh's partition, on one device
    gs = jax.lax.map(lambda x: gf(p, x[None]), t)
    return jax.tree.map(lambda g: jnp.mean(g, 0), gs)
t0=time.time()
g = jax.jit(split)(run.state["params"], tokens)
print("split", time.time()-t0, flush=True)
g = {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(g)}
g1 = dict(np.load("/tmp/k3_mesh_g_single.npz")); ge = dict(np.load("/tmp/k3_mesh_g_ep.npz"))
errs = sorted(((rel_rms(g[k], g1[k]), rel_rms(ge[k], g1[k]), rel_rms(ge[k], g[k]), k) for k in g1), reverse=True)
print("split-vs-single worst:", [(f"{a:.2e}", f"ep {b:.2e}", f"ep-vs-split {c:.2e}", k) for a, b, c, k in errs[:10]])
print("n>1e-5 split:", sum(a > 1e-5 for a, *_ in errs), "ep:", sum(b > 1e-5 for _, b, *_ in errs))
eb = sorted(((b, a, k) for a, b, c, k in errs), reverse=True)[:8]
print("ep worst with split floor:", [(f"{b:.2e}", f"{a:.2e}", k) for b, a, k in eb])
