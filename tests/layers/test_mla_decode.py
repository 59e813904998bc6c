"""MLA decode (docs/model.md §5.2): 256 steps of the absorbed form equal the materialized form and the training forward,
in every MLA layer of k3-mini (its initial weights), per step; the per-layer report is printed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import default_run, get_preset
from k3jax.layers.mla import MLA
from k3jax.model.functional import init_params
from k3jax.model.layout import layer_view
from k3jax.testing import TOL, rel_rms

STEPS = 256


@pytest.mark.slow
def test_absorbed_equals_materialized_over_256_steps_every_layer():
    cfg = get_preset("k3-mini")
    run = default_run(cfg)
    params = init_params(cfg, jax.random.key(0), run)
    blk = nnx.eval_shape(lambda: MLA(d=cfg.hidden_size, num_heads=cfg.mla_num_heads, q_lora_rank=cfg.q_lora_rank,
                                     kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                                     qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                                     output_gate=cfg.mla_output_gate, rngs=nnx.Rngs(0)))
    gdef = nnx.graphdef(blk)
    B = 2
    cache0 = {"c_kv": jnp.zeros((B, STEPS, cfg.kv_lora_rank)), "k_rope": jnp.zeros((B, STEPS, cfg.qk_rope_head_dim))}
    kw = dict(norm_eps=cfg.mla_norm_eps, block_size=run.mla_block_size)

    @jax.jit
    def decode(p, xs, absorbed_flag):
        mla = nnx.merge(gdef, p)

        def step(carry, x_t):
            cache, t = carry
            y, cache = mla.extend(x_t[:, None], cache, start=jnp.full((B,), t), lengths=jnp.ones((B,), jnp.int32),
                                  absorbed=absorbed_flag, **kw)
            return (cache, t + 1), y[:, 0]

        _, ys = jax.lax.scan(step, (cache0, jnp.int32(0)), jnp.swapaxes(xs, 0, 1))
        return jnp.swapaxes(ys, 0, 1)

    decode = jax.jit(decode.__wrapped__, static_argnums=2)
    forward = jax.jit(lambda p, xs: nnx.merge(gdef, p)(xs, **kw)[0])
    report = []
    for l in cfg.mla_layers:
        p = layer_view(params, cfg, l)["mla"]
        xs = jax.random.normal(jax.random.key(l), (B, STEPS, cfg.hidden_size))
        ab, mat, full = decode(p, xs, True), decode(p, xs, False), forward(p, xs)
        per_step = [rel_rms(ab[:, t], mat[:, t]) for t in range(STEPS)]
        report.append((l, max(per_step), rel_rms(ab, mat), rel_rms(ab, full), rel_rms(mat, full)))
    print("\nlayer  worst step abs/mat  all abs/mat  abs/forward  mat/forward")
    for l, worst, allv, af, mf in report:
        print(f"{l:5d}  {worst:17.2e}  {allv:11.2e}  {af:11.2e}  {mf:11.2e}")
    assert all(r[1] <= TOL["fp32_vs_fp64"] for r in report), report
    assert all(max(r[3], r[4]) <= TOL["fp32_vs_fp64"] for r in report), report
    assert np.isfinite([r[1:] for r in report]).all()
