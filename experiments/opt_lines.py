# ruff: noqa: E401, E402, E702, I001  (measurement script: environment set before the jax import)
"""Session-9 measurement (experiments/LOG.md): StableHLO size of the optimizer update / train step at 12 and 92
layers (k3-micro width, scanned stack). Usage: .venv/bin/python experiments/<this file>"""
import os, time
os.environ["JAX_PLATFORMS"]="cpu"
import jax
from k3jax.bench.compile import k3_schedule, _abstract_params
from k3jax.config import get_preset, default_run
from k3jax.optim.optimizer import make_optimizer, OptimConfig
base = get_preset("k3-micro")
for L in (12, 92):
    cfg = k3_schedule(base, L)
    run = default_run(cfg, layer_stack="scan", param_dtype="float32")
    p = _abstract_params(cfg, run)
    tx, _ = make_optimizer(p, OptimConfig())
    st = jax.eval_shape(tx.init, p)
    t = time.time()
    low = jax.jit(tx.update).lower(p, st, p)
    t1 = time.time()
    n = low.as_text().count("\n")
    c = low.compile(); t2 = time.time()
    print(L, "lines", n, "lower", round(t1-t, 1), "compile", round(t2-t1, 1), flush=True)
