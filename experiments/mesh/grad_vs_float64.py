# ruff: noqa: E402, E501, E702, N812  (measurement scripts: environment set before the jax import)
"""Session-8 measurement script (experiments/LOG.md, session 8): run from the repo root with .venv/bin/python.
Run order for the gradient figures: grad_compare.py (writes /tmp/k3_mesh_g_*.npz), then grad_partition_floor.py and
grad_vs_float64.py."""
import os
import sys

os.environ["JAX_PLATFORMS"]="cpu"
os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=8"
import jax

jax.config.update("jax_enable_x64", True)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "train"))
import numpy as np
import test_mesh_train as T

from k3jax.config import default_run
from k3jax.pytree import path_str
from k3jax.testing import rel_rms
from k3jax.train import data as tdata
from k3jax.train.loop import build
from k3jax.train.settings import step_spec
from k3jax.train.step import make_loss

tc = T.MINI.replace(devices=1)
run = build(tc, log=lambda m: None)
tokens = tdata.batch_at(run.train_toks, seed=tc.seed, step=0, batch=tc.batch, seq_len=tc.seq_len, vocab=run.vocab)
s64 = default_run(run.cfg, qat="off", compute_dtype="float64", param_dtype="float64")
loss = make_loss(run.cfg, s64, step_spec(tc), None)
p64 = jax.tree.map(lambda x: np.asarray(x).astype(np.float64), run.state["params"])
g = jax.jit(jax.grad(lambda p, t: loss(p, t)[0]))(p64, tokens)
g = {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(g)}
np.savez("/tmp/k3_mesh_g_f64.npz", **g)
g1 = dict(np.load("/tmp/k3_mesh_g_single.npz"))
for name in ("single", "ep", "fsdp_ep_tp"):
    ge = dict(np.load(f"/tmp/k3_mesh_g_{name}.npz"))
    errs = sorted(((rel_rms(ge[k], g[k]), k) for k in g), reverse=True)
    print(name, "vs f64 worst:", [(f"{e:.2e}", k) for e, k in errs[:6]], "n>1e-5:", sum(e > 1e-5 for e, _ in errs))
ge = dict(np.load("/tmp/k3_mesh_g_fsdp_ep_tp.npz"))
for k in ("pre.3.attn_res.query", "groups.layers.0.kda.A_log", "pre.0.kda.f_b", "pre.0.kda.o_norm"):
    print(k, "single-vs-f64", f"{rel_rms(g1[k], g[k]):.2e}", "fet-vs-f64", f"{rel_rms(ge[k], g[k]):.2e}", "fet-vs-single", f"{rel_rms(ge[k], g1[k]):.2e}")
