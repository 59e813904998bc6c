# ruff: noqa: E402, E501, E702, E731  (measurement scripts: environment set before the jax import)
"""Session-9 measurement (experiments/LOG.md): k3-mini one device vs a mesh, step by step — the one-step
difference from the SAME state (is the sharded update exact?) against the accumulated difference (does training
amplify it?). Usage: .venv/bin/python experiments/mesh/curve_diag.py [steps] [mesh] [TrainConfig overrides k=v]"""
import os
import sys

os.environ["JAX_PLATFORMS"]="cpu"; os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=8"
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.pytree import path_str
from k3jax.train import data as tdata
from k3jax.train.loop import build
from k3jax.train.settings import TrainConfig

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
mesh = sys.argv[2] if len(sys.argv) > 2 else "data=2,expert=4"
extra = dict(a.split("=",1) for a in sys.argv[3:])
tc = TrainConfig(preset="k3-mini", steps=20, batch=8, seq_len=32, max_bytes=100_000, eval_every=1000, progress=False, peak_flops=1e12, **extra)
A = build(tc.replace(devices=1), log=lambda m: None)
B = build(tc.replace(mesh=mesh), log=lambda m: None)
host = lambda s: jax.tree.map(np.asarray, s)
def rr(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a-b)**2)) / max(np.sqrt(np.mean(b**2)), 1e-30))
def worst(ta, tb, k=3):
    out = []
    for (p, x), y in zip(jax.tree_util.tree_leaves_with_path(ta), jax.tree.leaves(tb)):
        if np.asarray(x).dtype.kind == 'f':
            out.append((rr(x, y), path_str(p)))
    out.sort(reverse=True)
    return out[:k]
sa = host(A.state)
for step in range(STEPS):
    x = tdata.batch_at(A.train_toks, seed=tc.seed, step=step, batch=tc.batch, seq_len=tc.seq_len, vocab=A.vocab).reshape(1, tc.batch, tc.seq_len+1)
    p = jnp.float32(0.0)
    # single device from sa
    na, ma = A.step_fn(jax.device_put(sa, A.state_sh), jax.device_put(x, A.batch_sh), p)
    # mesh from the SAME state
    nb, mb = B.step_fn(jax.device_put(sa, B.state_sh), jax.device_put(x, B.batch_sh), p)
    na, nb = host(na), host(nb)
    # mesh continuing its own trajectory
    if step == 0:
        sb = host(B.state)
    nb2, mb2 = B.step_fn(jax.device_put(sb, B.state_sh), jax.device_put(x, B.batch_sh), p)
    nb2 = host(nb2)
    la, lb, lb2 = float(ma["ce"]), float(mb["ce"]), float(mb2["ce"])
    print(f"step {step+1}: loss single {la:.6f} mesh-same-state {lb:.6f} mesh-own {lb2:.6f} | own gap {abs(lb2-la)/la:.2e}")
    print("   one-step param diff (same input):", worst(na["params"], nb["params"]))
    print("   one-step opt diff (same input):", worst(na["opt"], nb["opt"], 2))
    print("   accumulated param diff:", worst(na["params"], nb2["params"], 2))
    sa, sb = na, nb2
    sys.stdout.flush()
