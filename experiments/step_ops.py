# ruff: noqa: E401, E402, E702, I001  (measurement script: environment set before the jax import)
"""Session-9 measurement (experiments/LOG.md): StableHLO size of the optimizer update / train step at 12 and 92
layers (k3-micro width, scanned stack). Usage: .venv/bin/python experiments/<this file>"""
import os, re, collections, time
os.environ["JAX_PLATFORMS"]="cpu"
import jax, jax.numpy as jnp
from k3jax.bench.compile import k3_schedule, _abstract_params
from k3jax.config import get_preset, default_run
from k3jax.optim.optimizer import make_optimizer, OptimConfig
from k3jax.train.step import StepSpec, init_state, make_train_step
base = get_preset("k3-micro")
res = {}
for L in (12, 92):
    cfg = k3_schedule(base, L)
    run = default_run(cfg, layer_stack="scan", param_dtype="float32")
    p = _abstract_params(cfg, run)
    tx, _ = make_optimizer(p, OptimConfig(total_steps=1000))
    st = jax.eval_shape(lambda q, tx=tx: init_state(q, tx), p)
    step = make_train_step(cfg, run, tx, StepSpec())
    t = time.time()
    low = jax.jit(step).lower(st, jax.ShapeDtypeStruct((1, 1, 65), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32))
    txt = low.as_text()
    ops = collections.Counter(re.findall(r"= (?:\"?)(stablehlo\.[a-z_]+|func\.call|call)", txt))
    res[L] = ops
    print(L, "lines", txt.count("\n"), "lower", round(time.time()-t,1), flush=True)
for k in sorted(set(res[12]) | set(res[92]), key=lambda k: -(res[92][k]-res[12][k]))[:25]:
    print(f"{k:40s} {res[12][k]:8d} {res[92][k]:8d}")
