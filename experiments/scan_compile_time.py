"""Lower + compile time of the k3-mini-width train step (value_and_grad of the LM loss) at depth L, with the layer
stack unrolled ("loop") or scanned ("scan"); parameters as ShapeDtypeStructs, nothing allocated.

    python experiments/scan_compile_time.py 48 scan        # experiments/LOG.md, 2026-12-02
"""

import sys
import time

import jax
import jax.numpy as jnp

from k3jax.config import default_run, get_preset, k3_full_attn_layers
from k3jax.model.functional import init_params, lm_loss

L, stack = int(sys.argv[1]), sys.argv[2]
cfg = get_preset("k3-mini").replace(num_layers=L, full_attn_layers=k3_full_attn_layers(L), attn_res_block_size=12)
run = default_run(cfg).replace(layer_stack=stack)
params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), run))
toks = jax.ShapeDtypeStruct((1, 64), jnp.int32)
step = jax.jit(jax.value_and_grad(lambda p, t: lm_loss(p, t, t, cfg, run)))
t0 = time.perf_counter()
lowered = step.lower(params, toks)
t1 = time.perf_counter()
lowered.compile()
t2 = time.perf_counter()
print(f"L={L} {stack}: lower {t1 - t0:.1f}s compile {t2 - t1:.1f}s")
